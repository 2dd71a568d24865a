"""Nested deployment: what the nested package (``export_tiers(..., format="nested")``) costs
and saves against one self-contained file per tier, and what the adaptive runtime does under
changing CPU load.

Three parts (all by default; ``--bytes``, ``--tiers``, ``--adaptive`` run single ones):

1. **Bytes.** The demo run (``runs/demo``), ``resnet56/nefl-wd-aligned`` and
   ``mobilenet_v2/nefl-wd`` (random weights; INT8 calibrated on 64 seeded random-normal
   images, so their accuracy is not defined) are exported in both formats at FP32, INT8 and
   FP16 (``latency_runs=1``, plain channels). Per precision: the bytes of every tier as
   per-tier files, of the nested package (the shared file plus every entry's graph and
   tensors file of that precision; ``manifest.json`` in neither), of the full tier's own
   file, and the ratios. Acceptance: demo nested FP32 <= 1.15x the full tier's FP32 file.
2. **Per tier** (demo run, both formats, FP32 and INT8): max |logit difference| nested vs
   per-tier file and the accuracy of each on the run's digits test split; latency at batch 1
   and 32 of both formats' sessions timed in alternation in one run
   (``nefl_zoo.timing.interleaved_median_ms``; acceptance: nested within 5% of the file);
   session creation (a fresh ``TierRuntime(folder).session(label)``, median of several);
   the first result after a switch (every session created; the first ``run`` on a tier right
   after runs of its neighbour); resident memory (VmRSS, a fresh subprocess per case) with
   one tier vs every tier of a precision loaded.
3. **Adaptive vs static under changing load** (demo nested package, FP32 + INT8 entries): a
   fixed-rate request stream through ``TierRuntime.run`` with one onnxruntime thread, bound
   with its calibration to core 0, served in separate passes by the static choice
   (``select(latency_ms=deadline)``: the most accurate entry within the deadline at the
   latencies measured idle at start, on the same paced stream, at least 30 requests per entry)
   and by ``tier="adaptive"`` (``Deadline`` policy with its defaults unless given, and the same
   idle latencies), each pass over the same schedule of phases: idle, a busy loop on the
   stream's core, busy loops on both cores, idle, a matrix multiplication on each core, idle
   (each load process bound to its core; ``--order``: static, adaptive, adaptive, static by
   default, so that other jobs' load falls on both alike). The deadline is
   ``--deadline-factor`` x static's idle p95 latency (numpy's interpolated 95th percentile, not
   the device bench's nearest rank; a deadline static meets when idle). Two streams: batch 1
   every 5 ms (the deployment case; a 0.3 ms request finishes inside a time slice, so
   contention hardly slows it) and batch 128 every 100 ms (a 15 ms request, long enough that
   the scheduler shares its core with the load). Per phase and policy: deadline misses (the
   ``run`` call's time against the deadline, and from the request's scheduled time), mean
   accuracy of the entries served, static's entry's share, switches per minute, requests,
   and the CPU that this process, its load processes and everything else (other jobs,
   hypervisor steal) took.

Everything runs with one onnxruntime thread (2 shared cores; see the README section).

    .venv/bin/python benchmarks/bench_nested.py [--bytes] [--tiers] [--adaptive] [--quick] [--out FILE]
        [--phase-seconds 15] [--streams 1,128] [--order static,adaptive,adaptive,static] [--deadline-factor 1.25]
        [--percentile P] [--window N] [--headroom H] [--probe-after S] [--max-backoff B] [--recent N] [--min-speedup R]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench_quant import machine  # lscpu's model name, CPUs and SIMD flags: one description for both benchmarks
from nefl_zoo.manifest import Manifest
from nefl_zoo.runtime import Deadline, TierRuntime
from nefl_zoo.timing import interleaved_median_ms

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "runs" / "demo"
SPEC_SOURCES = ("resnet56/nefl-wd-aligned", "mobilenet_v2/nefl-wd")
PRECISIONS = ("fp32", "int8", "fp16")
TIER_PRECISIONS = ("fp32", "int8")  # parts 2 and 3
FORMATS = ("files", "nested")
CALIBRATION_IMAGES = 64  # random-normal images (seed 0) for the spec sources' INT8
BYTES_TARGET = 1.15  # demo nested FP32 <= 1.15x the full tier's FP32 file
LATENCY_TOLERANCE = 0.05  # nested within 5% of the per-tier file
INT8_ACCURACY_POINTS = 0.5  # INT8 nested within 0.5 points of INT8 file
LOAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "")}
BUSY = [sys.executable, "-c", "while True: pass"]
MATMUL = [sys.executable, "-c", "import numpy as np\na = np.ones((1024, 1024), np.float32)\nwhile True: a @ a"]


# ---------------------------------------------------------------- machine


def loadavg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


# ---------------------------------------------------------------- exports


@dataclass
class Export:
    folder: Path
    manifest: Manifest
    seconds: float
    warnings: list[str] = field(default_factory=list)


def export_both(source, name: str, workdir: Path, precisions, calibration) -> dict[str, Export]:
    """``source`` exported in both formats into ``workdir/name/{files,nested}``."""
    from nefl_zoo.export import export_tiers

    out = {}
    for fmt in FORMATS:
        folder = workdir / name.replace("/", "_") / fmt
        warnings: list[str] = []
        start = time.perf_counter()
        manifest = export_tiers(source, folder, precisions=precisions, format=fmt, latency_runs=1, threads=1,
                                calibration=calibration, warn=warnings.append)
        out[fmt] = Export(folder, manifest, time.perf_counter() - start, warnings)
    return out


class Exports:
    """The demo exports (both formats, all precisions), made once and shared by the parts."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self._demo: dict[str, Export] | None = None

    def demo(self) -> dict[str, Export]:
        if self._demo is None:
            from nefl_zoo.export import load_source

            self._demo = export_both(load_source(DEMO), "demo", self.workdir, PRECISIONS, None)
        return self._demo


def random_calibration(input_size) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((CALIBRATION_IMAGES, *input_size), dtype=np.float32)


# ---------------------------------------------------------------- part 1: bytes


def size(folder: Path, file: str) -> int:
    return (folder / file).stat().st_size


def package_bytes(exports: dict[str, Export]) -> list[dict]:
    """Per precision: total per-tier files, nested package total (and its shared file), full tier's file."""
    files, nested = exports["files"], exports["nested"]
    rows = []
    for precision in PRECISIONS:
        file_entries = [t for t in files.manifest.tiers if t.precision == precision]
        nested_entries = [t for t in nested.manifest.tiers if t.precision == precision]
        if not file_entries or not nested_entries:
            rows.append({"precision": precision, "missing": True})
            continue
        full = max(file_entries, key=lambda t: t.macs)
        shared = nested.manifest.shared[precision]
        assert shared.bytes == size(nested.folder, shared.file)
        for t in nested_entries:
            assert t.tensors.bytes == size(nested.folder, t.tensors.file)
        per_entry = sum(size(nested.folder, t.file) + t.tensors.bytes for t in nested_entries)
        rows.append({
            "precision": precision,
            "files": sum(size(files.folder, t.file) for t in file_entries),
            "nested": shared.bytes + per_entry,
            "shared": shared.bytes,
            "full": size(files.folder, full.file),
            "full_label": full.label,
            "entries": (len(file_entries), len(nested_entries)),
        })
    return rows


def bench_bytes(exports: Exports, quick: bool) -> dict:
    from nefl_zoo.export import load_source

    results = [("demo run (ResNet20, digits 16x16, trained)", exports.demo())]
    for spec in SPEC_SOURCES[:1] if quick else SPEC_SOURCES:
        source = load_source(spec)
        results.append((f"{spec} ({'x'.join(map(str, source.compiled.input_size))}, random weights)",
                        export_both(source, spec, exports.workdir, PRECISIONS, random_calibration(source.compiled.input_size))))
    return {"sources": [(name, exp, package_bytes(exp)) for name, exp in results], "quick": quick}


def bytes_markdown(result: dict) -> tuple[str, list[str]]:
    lines = [
        "| source | precision | tiers | per-tier files (bytes) | nested package (bytes) | of which shared | full tier's file "
        "| files / full | nested / full | nested / files |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for name, exp, rows in result["sources"]:
        for r in rows:
            if r.get("missing"):
                lines.append(f"| {name} | {r['precision']} | dropped | | | | | | | |")
                continue
            n_files, n_nested = r["entries"]
            tiers = str(n_files) if n_files == n_nested else f"{n_files} files / {n_nested} nested"
            lines.append(
                f"| {name} | {r['precision']} | {tiers} | {r['files']:,} | {r['nested']:,} | {r['shared']:,} | {r['full']:,} "
                f"({r['full_label']}) | {r['files'] / r['full']:.2f} | {r['nested'] / r['full']:.3f} | {r['nested'] / r['files']:.3f} |"
            )
    lines += ["", "Export time (s, both formats, " + ", ".join(PRECISIONS) + "): " + "; ".join(
        f"{name.split(' (')[0]}: files {exp['files'].seconds:.0f}, nested {exp['nested'].seconds:.0f}"
        for name, exp, _ in result["sources"])]
    warnings = [f"{name.split(' (')[0]} {fmt}: {w}" for name, exp, _ in result["sources"] for fmt in FORMATS for w in exp[fmt].warnings]
    if warnings:
        lines += ["", "Export warnings: " + "; ".join(warnings)]
    demo_fp32 = next(r for r in result["sources"][0][2] if r["precision"] == "fp32")
    ratio = demo_fp32["nested"] / demo_fp32["full"]
    verdicts.append(f"demo nested FP32 total = {ratio:.3f}x the full tier's FP32 file (target <= {BYTES_TARGET}): "
                    + ("MET" if ratio <= BYTES_TARGET else "NOT MET"))
    if result["quick"]:
        lines += ["", f"(--quick: {SPEC_SOURCES[1]} skipped)"]
    return "\n".join(lines), verdicts


# ---------------------------------------------------------------- part 2: per tier


def test_split():
    """The demo run's digits test split (normalised as the exporter feeds it)."""
    from nefl_zoo.export import load_source
    from nefl_zoo.export.data import load_run_images

    source = load_source(DEMO)
    run = load_run_images(source.data, source.compiled.input_size, 1)
    return run.test, run.labels


def logits_of(session, images: np.ndarray, chunk: int = 150) -> np.ndarray:
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: images[i:i + chunk]})[0] for i in range(0, len(images), chunk)])


RSS_SCRIPT = """
import json, sys
import numpy as np
def status():
    fields = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)
    return {k: int(fields[k].split()[0]) for k in ('VmRSS', 'VmHWM')}
from nefl_zoo.runtime import TierRuntime
base = status()
rt = TierRuntime(sys.argv[1], threads=1)
x = np.zeros((1, *rt.manifest.input.shape), np.float32)
for label in sys.argv[2:]:
    rt.run(x, tier=label)
print(json.dumps({'base': base, 'loaded': status(), 'torch': 'torch' in sys.modules}))
"""


def rss_kib(folder: Path, labels: list[str]) -> dict:
    """VmRSS/VmHWM (KiB) of a fresh process after importing the runtime and after creating
    (and running once) the sessions of ``labels``."""
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(folder), *labels], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_tiers(exports: Exports, quick: bool) -> dict:
    demo = exports.demo()
    images, labels = test_split()
    runtimes = {fmt: TierRuntime(demo[fmt].folder, threads=1) for fmt in FORMATS}
    entries = [t for t in demo["files"].manifest.tiers if t.precision in TIER_PRECISIONS]
    nested_labels = {t.label for t in demo["nested"].manifest.tiers}
    entries = [t for t in entries if t.label in nested_labels]
    rows = {t.label: {"entry": t} for t in entries}

    # agreement and accuracy on the test split
    for t in entries:
        out = {fmt: logits_of(runtimes[fmt].session(t.label), images) for fmt in FORMATS}
        row = rows[t.label]
        row["max_diff"] = float(np.abs(out["nested"].astype(np.float64) - out["files"]).max())
        for fmt in FORMATS:
            row[f"acc_{fmt}"] = float((out[fmt].argmax(1) == labels).mean())
            row[f"manifest_acc_{fmt}"] = demo[fmt].manifest.tier(t.label).accuracy

    # latency, both formats interleaved in one run
    rounds = {1: 40 if quick else 200, 32: 10 if quick else 50}
    calls = {1: 3, 32: 1}  # timed calls per session and round, each after one untimed call
    for batch, n in rounds.items():
        feed = {demo["files"].manifest.input.name: np.ascontiguousarray(images[:batch])}
        fns = {(fmt, t.label): (lambda s=runtimes[fmt].session(t.label): s.run(None, feed)) for t in entries for fmt in FORMATS}
        # one untimed call before each session's timed ones: the first run after another session
        # is slower (see the switch table), and it would favour whichever format runs second
        ms = interleaved_median_ms(fns, n, runs=calls[batch], warmup=1, warmup_rounds=5)
        for t in entries:
            rows[t.label][f"b{batch}"] = {fmt: ms[(fmt, t.label)] for fmt in FORMATS}

    # session creation: a fresh TierRuntime and the entry's session, formats alternating
    reps = 3 if quick else 7
    for t in entries:
        times = {fmt: ([], []) for fmt in FORMATS}
        for _ in range(reps):
            for fmt in FORMATS:
                start = time.perf_counter()
                rt = TierRuntime(demo[fmt].folder, threads=1)
                made = time.perf_counter()
                rt.session(t.label)
                end = time.perf_counter()
                times[fmt][0].append((end - start) * 1e3)
                times[fmt][1].append((end - made) * 1e3)
                del rt
        gc.collect()
        rows[t.label]["create"] = {fmt: (statistics.median(a), statistics.median(b)) for fmt, (a, b) in times.items()}

    # first result after a switch: every session created; neighbour runs, then the timed first run and a second
    x = np.ascontiguousarray(images[:1])
    for rt in runtimes.values():
        for t in entries:
            rt.session(t.label)
    reps = 10 if quick else 30
    by_precision = {p: [t for t in entries if t.precision == p] for p in TIER_PRECISIONS}
    for precision, tiers in by_precision.items():
        for i, t in enumerate(tiers):
            neighbour = tiers[i + 1] if i + 1 < len(tiers) else tiers[i - 1]
            first = {fmt: [] for fmt in FORMATS}
            second = {fmt: [] for fmt in FORMATS}
            for _ in range(reps):
                for fmt in FORMATS:
                    rt = runtimes[fmt]
                    for _ in range(3):
                        rt.run(x, tier=neighbour.label)
                    start = time.perf_counter()
                    rt.run(x, tier=t.label)
                    mid = time.perf_counter()
                    rt.run(x, tier=t.label)
                    end = time.perf_counter()
                    first[fmt].append((mid - start) * 1e3)
                    second[fmt].append((end - mid) * 1e3)
            rows[t.label]["switch"] = {fmt: (statistics.median(first[fmt]), statistics.median(second[fmt])) for fmt in FORMATS}
            rows[t.label]["switch_from"] = neighbour.label

    # resident memory, a fresh process per case
    memory = []
    for precision, tiers in by_precision.items():
        full = max(tiers, key=lambda t: t.macs).label
        for fmt in FORMATS:
            one = rss_kib(demo[fmt].folder, [full])
            every = rss_kib(demo[fmt].folder, [t.label for t in tiers])
            memory.append({"precision": precision, "format": fmt, "full": full, "one": one, "all": every, "n": len(tiers)})
    return {"rows": rows, "memory": memory, "rounds": rounds, "calls": calls, "test": len(images)}


def tiers_markdown(result: dict) -> tuple[str, list[str]]:
    rows, rounds = result["rows"], result["rounds"]
    lines = [
        f"Agreement and latency (logits and accuracy on the {result['test']} test images; latency: median of "
        f"{rounds[1]} rounds at batch 1 and {rounds[32]} at batch 32, every session of both formats timed in turn, each "
        f"time one untimed call then the median of {result['calls'][1]} (batch 1) / {result['calls'][32]} (batch 32) timed ones):",
        "",
        "| tier | precision | max abs logit diff, nested vs file | accuracy, file | accuracy, nested | Δ (points) "
        "| batch 1 ms, file | batch 1 ms, nested | nested / file | batch 32 ms, file | batch 32 ms, nested | nested / file |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    worst_ratio = {1: (0.0, ""), 32: (0.0, "")}
    worst_points = (0.0, "")
    for label, r in rows.items():
        t = r["entry"]
        delta = 100 * (r["acc_nested"] - r["acc_files"])
        ratios = {b: r[f"b{b}"]["nested"] / r[f"b{b}"]["files"] for b in (1, 32)}
        for b, q in ratios.items():
            if abs(q - 1) > abs(worst_ratio[b][0] - 1) or not worst_ratio[b][1]:
                worst_ratio[b] = (q, label)
        if t.precision == "int8" and abs(delta) >= abs(worst_points[0]):
            worst_points = (delta, label)
        lines.append(
            f"| {t.name} | {t.precision} | {r['max_diff']:.3g} | {100 * r['acc_files']:.2f}% | {100 * r['acc_nested']:.2f}% "
            f"| {delta:+.2f} | {r['b1']['files']:.3f} | {r['b1']['nested']:.3f} | {ratios[1]:.3f} | {r['b32']['files']:.2f} "
            f"| {r['b32']['nested']:.2f} | {ratios[32]:.3f} |"
        )
    lines += [
        "",
        "Session creation and switching (ms; creation: a fresh `TierRuntime(folder, threads=1)` and `.session(label)`, "
        "median of several, formats alternating, the part after the constructor in brackets; switch: with every "
        "session created, the first `run` at batch 1 right after three runs of the neighbouring tier, and the run after it):",
        "",
        "| tier | precision | create, file | create, nested | nested / file | first run after switch, file | second run, file "
        "| first run after switch, nested | second run, nested | switched from |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        t = r["entry"]
        cf, cn = r["create"]["files"], r["create"]["nested"]
        sf, sn = r["switch"]["files"], r["switch"]["nested"]
        lines.append(
            f"| {t.name} | {t.precision} | {cf[0]:.1f} ({cf[1]:.1f}) | {cn[0]:.1f} ({cn[1]:.1f}) | {cn[0] / cf[0]:.2f} "
            f"| {sf[0]:.3f} | {sf[1]:.3f} | {sn[0]:.3f} | {sn[1]:.3f} | {r['switch_from']} |"
        )
    lines += [
        "",
        "Resident memory (MiB; VmRSS of a fresh process after creating and running once the sessions named, "
        "minus VmRSS after `import nefl_zoo.runtime`; peak VmHWM in brackets; torch never imported):",
        "",
        "| precision | format | after import | one tier loaded | every tier loaded | every / one |",
        "|---|---|---|---|---|---|",
    ]
    for m in result["memory"]:
        one = (m["one"]["loaded"]["VmRSS"] - m["one"]["base"]["VmRSS"]) / 1024
        every = (m["all"]["loaded"]["VmRSS"] - m["all"]["base"]["VmRSS"]) / 1024
        lines.append(
            f"| {m['precision']} | {m['format']} | {m['one']['base']['VmRSS'] / 1024:.1f} | {one:.1f} ({m['full']}; "
            f"peak {m['one']['loaded']['VmHWM'] / 1024:.1f}) | {every:.1f} ({m['n']} tiers; peak {m['all']['loaded']['VmHWM'] / 1024:.1f}) "
            f"| {every / one:.2f} |"
        )
        if m["one"]["torch"] or m["all"]["torch"]:
            lines.append("(torch was imported by the runtime process)")
    for b in (1, 32):
        q, label = worst_ratio[b]
        verdicts.append(f"latency nested / file at batch {b}: worst {q:.3f} ({label}); within {LATENCY_TOLERANCE:.0%}: "
                        + ("MET" if all(abs(r[f'b{b}']['nested'] / r[f'b{b}']['files'] - 1) <= LATENCY_TOLERANCE for r in rows.values()) else "NOT MET"))
    delta, label = worst_points
    verdicts.append(f"INT8 nested vs INT8 file accuracy: largest difference {delta:+.2f} points ({label}); within "
                    f"{INT8_ACCURACY_POINTS} points: " + ("MET" if abs(delta) <= INT8_ACCURACY_POINTS else "NOT MET"))
    return "\n".join(lines), verdicts


# ---------------------------------------------------------------- part 3: adaptive vs static


@dataclass(frozen=True)
class Phase:
    """A phase of load: ``command`` run once per core in ``cores``, bound to that core."""

    name: str
    command: list[str] | None
    cores: tuple[int, ...]

    @property
    def loaded(self) -> bool:
        return bool(self.cores)


STREAM_CORE = 0  # the request stream runs on this core; "1 busy core" loads it
PHASES = (
    Phase("idle", None, ()),
    Phase("1 busy core", BUSY, (STREAM_CORE,)),
    Phase("2 busy cores", BUSY, (0, 1)),
    Phase("idle", None, ()),
    Phase("2 matmul cores", MATMUL, (0, 1)),
    Phase("idle", None, ()),
)
STREAMS = ((1, 0.005), (128, 0.100))  # (batch, seconds between requests)


def paced_latencies(rt: TierRuntime, labels: list[str], x: np.ndarray, interval: float, rounds: int) -> dict[str, list[float]]:
    """The ms of each ``rt.run(x, tier=label)`` for each label on the same paced stream as the
    benchmark (one request every ``interval`` seconds, the labels in turn): an entry's
    latency between sleeps, not in a tight loop (after a sleep it is slower)."""
    times = {label: [] for label in labels}
    next_at = time.perf_counter()
    for _ in range(rounds):
        for label in labels:
            next_at += interval
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            start = time.perf_counter()
            rt.run(x, tier=label)
            times[label].append((time.perf_counter() - start) * 1e3)
    return times


def stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        p.terminate()
    for p in processes:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    processes.clear()


def stream(rt: TierRuntime, tier: str, x: np.ndarray, interval: float, phases, seconds: float) -> dict:
    """Requests every ``interval`` s through ``rt.run(x, tier=tier)`` over ``phases`` of
    ``seconds`` each, the load processes of each phase started at its start and stopped at its
    end. Per request: phase, start delay after its scheduled time, ms of the call, ms from the
    scheduled time to the result, label. Per phase: the CPU time of all cores (/proc/stat), of
    this process and of its load processes, so what other jobs took is known."""
    records = []
    bounds = []
    processes: list[subprocess.Popen] = []
    tick = os.sysconf("SC_CLK_TCK")
    gc.collect()
    try:
        t0 = time.perf_counter()
        i = 0
        for k, phase in enumerate(phases):
            begin = t0 + k * seconds
            ticks, times = cpu_ticks(), os.times()
            processes += [subprocess.Popen(phase.command, env=LOAD_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           preexec_fn=lambda core=core: os.sched_setaffinity(0, {core}))
                          for core in phase.cores]
            while True:
                i += 1
                at = t0 + i * interval
                if at >= begin + seconds:
                    i -= 1
                    break
                delay = at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                start = time.perf_counter()
                rt.run(x, tier=tier)
                end = time.perf_counter()
                records.append((k, (start - at) * 1e3, (end - start) * 1e3, (end - at) * 1e3, rt.last_label))
            stop(processes)
            busy, total = cpu_ticks()
            after = os.times()
            elapsed = after.elapsed - times.elapsed
            own = after.user + after.system - times.user - times.system
            children = after.children_user + after.children_system - times.children_user - times.children_system
            bounds.append({
                "begin": begin, "end": begin + seconds,
                "cpu_busy": (busy - ticks[0]) / max(1, total - ticks[1]) * (os.cpu_count() or 1),  # cores
                "own": own / elapsed, "load_processes": children / elapsed,
                "others": max(0.0, (busy - ticks[0]) / tick - own - children) / elapsed,
            })
    finally:
        stop(processes)
    return {"records": records, "bounds": bounds}


def phase_stats(runs: list[dict], deadline: float, static_label: str, accuracy: dict[str, float], phases) -> list[dict]:
    """Per phase, over every pass of one policy (``runs``: each a :func:`stream` result with
    its ``switches``): misses, latency, accuracy and entries served, switches per minute and
    CPU use; ``per_pass`` keeps each pass's miss rate."""
    out = []
    for k, phase in enumerate(phases):
        recs = [r for run in runs for r in run["records"] if r[0] == k]
        bounds = [run["bounds"][k] for run in runs]
        call = np.array([r[2] for r in recs])
        response = np.array([r[3] for r in recs])
        lag = np.array([r[1] for r in recs])
        served = [r[4] for r in recs]
        n_switch = sum(1 for run, b in zip(runs, bounds) for sw in run["switches"] if b["begin"] <= sw.at < b["end"])
        per_pass = [float(np.mean([r[2] > deadline for r in run["records"] if r[0] == k])) for run in runs]
        mean = lambda key: float(np.mean([b[key] for b in bounds]))  # noqa: E731
        out.append({
            "phase": phase.name, "loaded": phase.loaded, "requests": len(recs),
            "miss": float((call > deadline).mean()), "per_pass": per_pass,
            "miss_response": float((response > deadline).mean()),
            "p50": float(np.median(call)), "p95": float(np.percentile(call, 95)),
            "lag_p95": float(np.percentile(lag, 95)),
            "accuracy": float(np.mean([accuracy[label] for label in served])),
            "static_share": served.count(static_label) / max(1, len(served)),
            "served": {label: served.count(label) for label in dict.fromkeys(served)},
            "switches_per_min": n_switch * 60 / sum(b["end"] - b["begin"] for b in bounds),
            "cpu_busy": mean("cpu_busy"), "own": mean("own"), "load_processes": mean("load_processes"), "others": mean("others"),
            "others_per_pass": [b["others"] for b in bounds],
        })
    return out


def bench_adaptive(exports: Exports, args) -> dict:
    demo = exports.demo()
    folder = demo["nested"].folder
    images, _ = test_split()
    seconds = 2.0 if args.quick else args.phase_seconds
    given = dict(percentile=args.percentile, window=args.window, headroom=args.headroom, probe_after_s=args.probe_after,
                 max_backoff=args.max_backoff, recent=args.recent, min_speedup=args.min_speedup)
    settings = {name: value for name, value in given.items() if value is not None}
    defaults = {name: getattr(Deadline(ms=1.0), name) for name in given}
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {STREAM_CORE})  # the stream, its calibration and onnxruntime's one thread
    try:
        scenarios = streams_adaptive(folder, images, seconds, settings, args)
    finally:
        os.sched_setaffinity(0, affinity)
    return {"scenarios": scenarios, "settings": {**defaults, **settings}, "given": sorted(settings), "seconds": seconds,
            "factor": args.deadline_factor, "order": args.order}


def streams_adaptive(folder: Path, images: np.ndarray, seconds: float, settings: dict, args) -> list[dict]:
    """Part 3 for each stream of ``args.streams`` (see :func:`bench_adaptive`)."""
    scenarios = []
    for batch, interval in [(b, i) for b, i in STREAMS if b in args.streams]:
        x = np.ascontiguousarray(images[:batch])
        probe = TierRuntime(folder, threads=1)
        labels = [t.label for t in probe.entries(list(TIER_PRECISIONS))]
        accuracy = {t.label: t.accuracy for t in probe.entries(list(TIER_PRECISIONS))}
        for label in labels:
            probe.run(x, tier=label)  # sessions created, one warm-up run each
        rounds = 3 if args.quick else max(30, int(10.0 / (interval * len(labels))))  # >= 30 requests per entry
        ticks, times = cpu_ticks(), os.times()
        samples = paced_latencies(probe, labels, x, interval, rounds)
        idle = {label: statistics.median(t) for label, t in samples.items()}
        idle_p95 = {label: float(np.percentile(t, 95)) for label, t in samples.items()}
        after, busy = os.times(), cpu_ticks()[0]
        idle_others = max(0.0, (busy - ticks[0]) / os.sysconf("SC_CLK_TCK") - (after.user + after.system - times.user - times.system)) / (after.elapsed - times.elapsed)
        best = probe.select(precisions=list(TIER_PRECISIONS)).label  # the most accurate entry, no budget
        deadline = args.deadline_factor * idle_p95[best]  # a deadline the static choice meets when idle
        static = probe.select(latency_ms=deadline, precisions=list(TIER_PRECISIONS), latencies=idle,
                              latency_source="idle on the paced stream").label
        del probe
        runs: dict[str, list[dict]] = {"static": [], "adaptive": []}
        ladder, loads = None, []
        for policy in args.order:
            if policy == "static":
                rt = TierRuntime(folder, threads=1)
                rt.run(x, tier=static)
                tier = static
            else:
                rt = TierRuntime(folder, threads=1, policy=Deadline(ms=deadline, **settings),
                                 precisions=list(TIER_PRECISIONS), latencies=idle)
                tier, ladder = "adaptive", rt.adaptive.ladder
            load_before = loadavg()
            run = stream(rt, tier, x, interval, PHASES, seconds)
            run["switches"] = list(rt.adaptive.switches) if rt.adaptive is not None else []
            runs[policy].append(run)
            loads.append(f"{policy} {load_before} -> {loadavg()}")
            del rt
        results = {policy: {"phases": phase_stats(r, deadline, static, accuracy, PHASES)} for policy, r in runs.items() if r}
        if runs["adaptive"]:
            first = runs["adaptive"][0]
            results["adaptive"]["switches"] = [(sw.at - first["bounds"][0]["begin"], sw.from_label, sw.to_label, sw.reason)
                                               for sw in first["switches"]]
            results["adaptive"]["ladder"] = ladder
        scenarios.append({"batch": batch, "interval": interval, "idle": idle, "idle_p95": idle_p95, "best": best, "deadline": deadline,
                          "static": static, "results": results, "accuracy": accuracy, "rounds": rounds,
                          "idle_others": idle_others, "loads": loads})
    return scenarios


def adaptive_markdown(result: dict) -> tuple[str, list[str]]:
    s0 = result["settings"]
    lines = [
        f"Policy: `Deadline({', '.join(['ms=deadline'] + [f'{k}={s0[k]:g}' for k in result['given']])})`, the other settings "
        f"Deadline's defaults ({', '.join(f'{k}={v:g}' for k, v in s0.items() if k not in result['given'])}). Stream and "
        f"calibration bound to core {STREAM_CORE}; each load process bound to its core. Deadline = "
        f"{result['factor']:g} x static's entry's idle p95 latency on the paced stream; phases of {result['seconds']:g} s; passes in the "
        f"order {', '.join(result['order'])} (each policy's figures are over its passes; per pass in brackets).",
        "",
    ]
    verdicts = []
    for sc in result["scenarios"]:
        acc = sc["accuracy"]
        lines += [
            f"#### Batch {sc['batch']}, one request every {sc['interval'] * 1e3:g} ms",
            "",
            "Idle latency of every entry on the paced stream (ms, median / p95 of " + str(sc["rounds"]) + " requests each; accuracy): "
            + ", ".join(f"{label} {ms:.3f} / {sc['idle_p95'][label]:.3f} ({100 * acc[label]:.2f}%)" for label, ms in sc["idle"].items())
            + f"; other jobs meanwhile: {sc['idle_others']:.2f} cores.",
            f"Static entry: **{sc['static']}**; deadline **{sc['deadline']:.3f} ms**; adaptive ladder: "
            f"{' -> '.join(sc['results']['adaptive']['ladder']) if 'adaptive' in sc['results'] else '(no adaptive pass)'}.",
            "",
            "| phase | policy | requests | miss rate (call > deadline; per pass) | miss rate from scheduled arrival | call ms p50 / p95 "
            "| start delay p95 ms | mean accuracy served | static's entry served | switches / min | entries served "
            "| CPU (cores): all / stream / load processes / other jobs and steal (per pass) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        stat, adap = (sc["results"].get(policy, {}).get("phases") for policy in ("static", "adaptive"))
        for k in range(len(PHASES)):
            for policy, p in (("static", stat[k] if stat else None), ("adaptive", adap[k] if adap else None)):
                if p is None:
                    continue
                top = sorted(p["served"].items(), key=lambda kv: -kv[1])
                served = ", ".join(f"{label} {n}" for label, n in top[:3]) + (f", {len(top) - 3} more" if len(top) > 3 else "")
                lines.append(
                    f"| {k + 1}. {p['phase']} | {policy} | {p['requests']} | {100 * p['miss']:.1f}% ({', '.join(f'{100 * m:.1f}%' for m in p['per_pass'])}) | {100 * p['miss_response']:.1f}% "
                    f"| {p['p50']:.3f} / {p['p95']:.3f} | {p['lag_p95']:.2f} | {100 * p['accuracy']:.2f}% | {100 * p['static_share']:.1f}% "
                    f"| {p['switches_per_min']:.1f} | {served} | {p['cpu_busy']:.2f} / {p['own']:.2f} / {p['load_processes']:.2f} / {p['others']:.2f} "
                    f"({', '.join(f'{o:.2f}' for o in p['others_per_pass'])}) |"
                )
        lines += ["", f"Load average per pass (before -> after): {'; '.join(sc['loads'])}."]
        switches = sc["results"].get("adaptive", {}).get("switches")
        if switches:
            shown = switches[:12]
            lines += ["", f"Adaptive switches of its first pass ({len(switches)}; s from the stream's start): "
                      + "; ".join(f"{at:.1f} s {a} -> {b} ({why})" for at, a, b, why in shown)
                      + (" ..." if len(switches) > len(shown) else "")]
        lines.append("")
        if not (stat and adap):
            continue
        ok_adaptive = all(p["miss"] <= 0.05 for p in adap)
        ok_static = all(p["miss"] > 0.5 for p in stat if p["loaded"])
        ok_idle = all(p["static_share"] >= 0.95 for p in adap if not p["loaded"])
        name = f"batch {sc['batch']} every {sc['interval'] * 1e3:g} ms"
        verdicts += [
            f"{name}: adaptive misses <= 5% in every phase: " + ("MET" if ok_adaptive else "NOT MET")
            + " (" + ", ".join(f"{100 * p['miss']:.1f}%" for p in adap) + ")",
            f"{name}: static misses the majority in every loaded phase: " + ("MET" if ok_static else "NOT MET")
            + " (" + ", ".join(f"{p['phase']} {100 * p['miss']:.1f}%" for p in stat if p["loaded"]) + ")",
            f"{name}: adaptive serves static's entry >= 95% in idle phases: " + ("MET" if ok_idle else "NOT MET")
            + " (" + ", ".join(f"{100 * p['static_share']:.1f}%" for p in adap if not p["loaded"]) + ")",
        ]
    return "\n".join(lines), verdicts


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", action="store_true", help="part 1: package bytes")
    parser.add_argument("--tiers", action="store_true", help="part 2: per-tier agreement, latency, sessions, memory")
    parser.add_argument("--adaptive", action="store_true", help="part 3: adaptive vs static under changing load")
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer rounds, 2 s phases, no mobilenet_v2")
    parser.add_argument("--phase-seconds", type=float, default=15.0, help="part 3: seconds per phase")
    parser.add_argument("--streams", type=lambda v: [int(b) for b in v.split(",")], default=[b for b, _ in STREAMS],
                        help="part 3: the streams to run, by batch (1: every 5 ms, 128: every 100 ms)")
    parser.add_argument("--order", type=lambda v: v.split(","), default=["static", "adaptive", "adaptive", "static"],
                        help="part 3: the passes, in order (ABBA by default, so that other jobs' load falls on both alike)")
    parser.add_argument("--deadline-factor", type=float, default=1.25, help="part 3: deadline / static entry's idle p95 latency")
    # the policy's settings: Deadline's defaults unless given
    parser.add_argument("--percentile", type=float)
    parser.add_argument("--window", type=int)
    parser.add_argument("--headroom", type=float)
    parser.add_argument("--probe-after", type=float)
    parser.add_argument("--max-backoff", type=float)
    parser.add_argument("--recent", type=int)
    parser.add_argument("--min-speedup", type=float)
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    args = parser.parse_args()
    parts = [p for p in ("bytes", "tiers", "adaptive") if getattr(args, p)] or ["bytes", "tiers", "adaptive"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    command = "benchmarks/bench_nested.py " + " ".join(sys.argv[1:])
    sections, verdicts = [], []
    start, load_before = time.time(), loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        exports = Exports(Path(tmp))
        for part in parts:
            part_start, part_load = time.time(), loadavg()
            if part == "bytes":
                text, v = bytes_markdown(bench_bytes(exports, args.quick))
                title = "Bytes per precision"
            elif part == "tiers":
                text, v = tiers_markdown(bench_tiers(exports, args.quick))
                title = "Per tier: nested vs per-tier files (demo run)"
            else:
                text, v = adaptive_markdown(bench_adaptive(exports, args))
                title = "Adaptive vs static under changing load (demo nested package, FP32 + INT8)"
            section = (f"### {title}\n\n{text}\n\n(part wall time {time.time() - part_start:.0f} s; load average "
                       f"before {part_load}, after {loadavg()})\n")
            print(section, flush=True)
            sections.append(section)
            verdicts += v
    header = (f"`.venv/bin/python {command.strip()}`; CPU: {machine()}; onnxruntime {ort.__version__}, "
              f"CPUExecutionProvider, 1 thread. Load average (`uptime`) before {load_before}, after {loadavg()}; "
              f"wall time {time.time() - start:.0f} s.\n")
    summary = "Acceptance:\n\n" + "\n".join(f"- {v}" for v in verdicts) + "\n"
    print(header)
    print(summary)
    if args.out:
        args.out.write_text(header + "\n" + "\n".join(sections) + "\n" + summary)


if __name__ == "__main__":
    main()

"""Nested deployment: what the nested model (``export_tiers(..., format="nested")``: one
standard ONNX file per precision, ``nested.PREC.onnx``, holding every tier behind an int64
``tier`` input) costs and saves against one self-contained file per tier, and what the adaptive
runtime does under changing CPU load.

Five parts (all by default; ``--bytes``, ``--tiers``, ``--adaptive``, ``--sources``, ``--mobile`` run single ones):

1. **Bytes.** The demo run (``runs/demo``; skipped with a note when absent, never trained
   here), ``resnet56/nefl-wd-aligned``, ``mobilenet_v2/nefl-wd``, one automatically nested
   timm CNN (``timm:resnet18``, 3x32x32, three tiers) and one nested ViT (the zoo's
   ``vit_tiny_16`` at 3x32x32 with ``vit_b_16/nefl-w``'s tiers), the last four with random
   weights (seed 0; INT8 calibrated on 64 seeded random-normal images), exported in both
   formats at FP32, INT8 and FP16 (``latency_runs=1``, plain channels). Per precision: the
   bytes of the nested file, of the full tier's own file (the per-tier export) and of every
   per-tier file together, the ratios, and how many tier graphs the nested file stores (one
   model-local function per structure of tier). Acceptance: nested FP32 <= 1.10x the full tier's
   FP32 file, nested INT8 <= 1.25x the full tier's INT8 file (every source).
2. **Per tier** (the demo run when present, else ``resnet56/nefl-wd-aligned``; both formats,
   FP32 and INT8): max |logit difference| and top-1 agreement nested vs per-tier file (and the
   accuracy of each on the run's digits test split for the demo; random-normal images
   otherwise); latency at batch 1 and 32 of both formats' sessions timed in alternation in one
   run (``nefl_zoo.timing.interleaved_median_ms``; three sessions of every file, each its own
   ``TierRuntime``, the median over them: one session's figure moves by up to ~4% with where its
   weights lie in memory), and in Node (onnxruntime-node from ``web/node_modules``, when
   installed) one session per file timed in alternation by a small script; session creation (a fresh ``TierRuntime(folder).session(label)``: the nested file's
   one session against each tier's file); the first result after a tier switch (every session
   created; the first ``run`` on a tier right after runs of its neighbour); resident memory
   (VmRSS, a fresh subprocess per case) of one nested session serving every tier vs one
   full-tier session (target <= 1.3x) and vs every per-tier session.
3. **Adaptive vs static under changing load** (the demo's nested export, FP32 + INT8 entries;
   skipped without the demo run: it needs its accuracies and test images): a
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
4. **The other sources** (``resnet56/nefl-wd-aligned``, ``mobilenet_v2/nefl-wd``, the timm
   CNN and the ViT of part 1, random-normal images): part 2's tables but agreement (latency in
   Python and Node, session creation, the first run after a switch, resident memory), the
   latency rounds sized so that each batch takes about 40 s per source. Acceptance for parts 2
   and 4: every tier's nested latency <= 1.10x its own file's, at batch 1 and 32.
5. **Mobile format and low-memory mode** (the demo run when present and the four sources of
   part 4): the nested model in onnxruntime's ORT format (``nefl-zoo convert-ort``, compact and
   folded) against each tier's own ``.ort`` file (bytes, latency), and ``TierRuntime(...,
   low_memory=True)`` against the default (latency per tier, resident memory against one
   full-tier session, also in Node); see ``benchmarks/nested_mobile.py``. Acceptance: compact
   ``.ort`` <= 1.3x the full tier's own ``.ort`` and each tier within 1.15x its own ``.ort`` at
   batch 1 and 32.

Everything runs with one onnxruntime thread (2 shared cores; see docs/benchmarks/nested.md). The
results go to ``--json`` (default ``benchmarks/results/nested.json``) as well as stdout
(markdown tables; ``--out`` writes them to a file too).

    .venv/bin/python benchmarks/bench_nested.py [--bytes] [--tiers] [--adaptive] [--sources] [--mobile] [--quick] [--out FILE] [--json FILE]
        [--phase-seconds 15] [--streams 1,128] [--order static,adaptive,adaptive,static] [--deadline-factor 1.25]
        [--percentile P] [--window N] [--headroom H] [--probe-after S] [--max-backoff B] [--recent N] [--min-speedup R]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

import publish
from bench_quant import machine  # lscpu's model name, CPUs and SIMD flags: one description for both benchmarks
from nefl_zoo.manifest import Manifest
from nefl_zoo.runtime import Deadline, TierRuntime
from nefl_zoo.timing import interleaved_median_ms, median_ms

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "runs" / "demo"
WEB = ROOT / "web"
RESULTS = ROOT / "benchmarks" / "results" / "nested.json"
SPEC_SOURCES = ("resnet56/nefl-wd-aligned", "mobilenet_v2/nefl-wd")
TIER_FALLBACK = "resnet56/nefl-wd-aligned"  # part 2's source without the demo run
# sources built here from a spec (random weights): an automatically nested timm CNN and a ViT
TIMM_CNN = {
    "model": "timm:resnet18", "model_args": {"num_classes": 10, "img_size": 32},
    "tiers": [{"name": "g0.25", "gamma_w": 0.25, "steps": [[1, 0], [1], [1], [1]]},
              {"name": "g0.5", "gamma_w": 0.5}, {"name": "g1"}],
}
VIT_SPEC = "vit_b_16/nefl-w"  # its tiers (width 0.5, 0.75, 1), on the zoo's ViT-Ti/16 at 32 px
VIT_MODEL = {"model": "vit_tiny_16", "model_args": {"num_classes": 10, "img_size": 32}}
PRECISIONS = ("fp32", "int8", "fp16")
TIER_PRECISIONS = ("fp32", "int8")  # parts 2 and 3
FORMATS = ("files", "nested")
PARTS = ("bytes", "tiers", "adaptive", "sources", "mobile")  # parts 1-5, in the order they run
CALIBRATION_IMAGES = 64  # random-normal images (seed 0) for the spec sources' INT8
BYTES_TARGET = {"fp32": 1.10, "int8": 1.25}  # nested file <= this x the full tier's own file
MEMORY_TARGET = 1.3  # one nested session serving every tier <= this x one full-tier session
LATENCY_TARGET = 1.10  # each tier, nested <= this x its own file, at batch 1 and 32
CALLS = {1: 3, 32: 1}  # timed calls per session and round in the latency tables, each after one untimed call
SESSIONS = 3  # sessions of every file in the latency tables (one session's figure moves by up to ~4%)
RANDOM_IMAGES = 256  # part 2's images without the demo run
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
    load: str = ""  # load average before -> after


def export_both(source, name: str, workdir: Path, precisions, calibration) -> dict[str, Export]:
    """``source`` exported in both formats into ``workdir/name/{files,nested}``."""
    from nefl_zoo.export import export_tiers

    from nefl_zoo.export.verify import ExportError

    out = {}
    for fmt in FORMATS:
        folder = workdir / name.replace("/", "_").replace(":", "_") / fmt
        warnings: list[str] = []
        before = loadavg()
        start = time.perf_counter()
        wanted = list(precisions)
        while True:
            try:
                manifest = export_tiers(source, folder, precisions=wanted, format=fmt, latency_runs=1, threads=1,
                                        calibration=calibration, warn=warnings.append)
                break
            except ExportError as exc:  # e.g. a nested FP16 tier outside the FP32 tolerance: export the rest
                failed = [p for p in wanted if p != "fp32" and f":{p}" in str(exc)]
                if not failed:
                    raise
                warnings.append(f"EXPORT FAILED with {failed[0]} ({exc}); exported again without it")
                wanted.remove(failed[0])
                shutil.rmtree(folder, ignore_errors=True)
        out[fmt] = Export(folder, manifest, time.perf_counter() - start, warnings, f"{before} -> {loadavg()}")
    return out


def random_calibration(input_size) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((CALIBRATION_IMAGES, *input_size), dtype=np.float32)


def spec_source(spec: dict, description: str):
    """An :class:`ExportSource` of a spec given as data, with random (seed 0) weights."""
    import torch

    from nefl_zoo.export import ExportSource
    from nefl_zoo.slim import compile_spec
    from nefl_zoo.spec import parse_spec

    compiled = compile_spec(parse_spec(spec))
    torch.manual_seed(0)
    return ExportSource(compiled, compiled.init_global_state(compiled.create_global_model()), description)


def vit_spec() -> dict:
    from nefl_zoo.spec import resolve_spec_path
    from nefl_zoo.userfiles import read_yaml

    spec = dict(read_yaml(resolve_spec_path(VIT_SPEC)))
    return {**spec, **VIT_MODEL}


class Exports:
    """Every source's exports (both formats, all precisions), made once and shared by the parts."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.made: dict[str, tuple[str, dict[str, Export]]] = {}

    def get(self, key: str) -> tuple[str, dict[str, Export]]:
        """(description, exports) of ``demo``, a shipped spec name, ``timm`` or ``vit``."""
        if key not in self.made:
            from nefl_zoo.export import load_source

            if key == "demo":
                source, name = load_source(DEMO), "demo run (ResNet20, digits 16x16, trained)"
                calibration = None
            else:
                if key == "timm":
                    source = spec_source(TIMM_CNN, "timm:resnet18 nested automatically")
                    name = f"{TIMM_CNN['model']} (automatic nesting, 3 tiers"
                elif key == "vit":
                    source = spec_source(vit_spec(), f"vit_tiny_16 with {VIT_SPEC}'s tiers")
                    name = f"vit_tiny_16 ({VIT_SPEC}'s tiers"
                else:
                    source, name = load_source(key), f"{key} ("
                name += f"{', ' if not name.endswith('(') else ''}{'x'.join(map(str, source.compiled.input_size))}, random weights)"
                calibration = random_calibration(source.compiled.input_size)
            self.made[key] = (name, export_both(source, key, self.workdir, PRECISIONS, calibration))
        return self.made[key]


# ---------------------------------------------------------------- part 1: bytes


def size(folder: Path, file: str) -> int:
    return (folder / file).stat().st_size


def tier_graphs(path: Path) -> int:
    """How many tier graphs a nested file stores: its model-local functions, one per structure."""
    import onnx

    return len(onnx.load(path).functions)


def nested_bytes(exports: dict[str, Export]) -> list[dict]:
    """Per precision: every per-tier file, the nested file, the full tier's own file."""
    files, nested = exports["files"], exports["nested"]
    rows = []
    for precision in PRECISIONS:
        file_entries = [t for t in files.manifest.tiers if t.precision == precision]
        nested_entries = [t for t in nested.manifest.tiers if t.precision == precision]
        if not file_entries or not nested_entries:
            rows.append({"precision": precision, "missing": True})
            continue
        (nested_file,) = {t.file for t in nested_entries}  # one file holds every tier of a precision
        full = max(file_entries, key=lambda t: t.macs)
        largest = max(files.manifest.tiers, key=lambda t: t.macs).name  # the full tier, at any precision
        nested_full = max(nested_entries, key=lambda t: t.macs)
        rows.append({
            "precision": precision,
            "files": sum(size(files.folder, t.file) for t in file_entries),
            "nested": size(nested.folder, nested_file),
            "nested_file": nested_file,
            "full": size(files.folder, full.file),
            "full_label": full.label,
            "full_shipped": full.name == largest,  # False: the exporter dropped the full tier at this precision
            "full_name": largest,
            # the nested manifest's weights_mb: the tier's own per-tier file, as the exporter sized it
            "nested_manifest_full": round(nested_full.weights_mb * 2**20),
            "graphs": tier_graphs(nested.folder / nested_file),
            "entries": (len(file_entries), len(nested_entries)),
        })
    return rows


def bench_bytes(exports: Exports, quick: bool) -> dict:
    keys = (["demo"] if DEMO.is_dir() else []) + list(SPEC_SOURCES[:1] if quick else SPEC_SOURCES) + ["timm", "vit"]
    sources = []
    for key in keys:
        name, exp = exports.get(key)
        sources.append({"key": key, "name": name, "rows": nested_bytes(exp),
                        "seconds": {fmt: exp[fmt].seconds for fmt in FORMATS},
                        "load": {fmt: exp[fmt].load for fmt in FORMATS},
                        "warnings": [f"{fmt}: {w}" for fmt in FORMATS for w in exp[fmt].warnings]})
    notes = [] if DEMO.is_dir() else [f"no demo run at {DEMO.relative_to(ROOT)} (made by `make demo`): skipped"]
    if quick:
        notes.append(f"--quick: {SPEC_SOURCES[1]} skipped")
    return {"sources": sources, "notes": notes, "quick": quick}


def bytes_markdown(result: dict) -> tuple[str, list[str]]:
    lines = [
        "| source | precision | tiers | nested file (bytes) | full tier's own file (bytes) | every per-tier file (bytes) "
        "| nested / full | target | tier graphs stored | nested / every file | every file / full |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for src in result["sources"]:
        name = src["name"]
        for r in src["rows"]:
            if r.get("missing"):
                lines.append(f"| {name} | {r['precision']} | dropped | | | | | | | | |")
                continue
            n_files, n_nested = r["entries"]
            tiers = str(n_files) if n_files == n_nested else f"{n_files} files / {n_nested} nested"
            ratio = r["nested"] / r["full"]
            target = BYTES_TARGET.get(r["precision"])
            if target and not r["full_shipped"]:
                mark = f"n/a: {r['full_name']} not shipped at {r['precision']}"
                verdicts.append(f"{name.split(' (')[0]}: nested {r['precision'].upper()} = {ratio:.3f}x its largest shipped "
                                f"tier's file ({r['full_label']}); not comparable with the target: the exporter dropped "
                                f"{r['full_name']}:{r['precision']}")
                target = None
            else:
                mark = f"<= {target:.2f} {'MET' if ratio <= target else 'NOT MET'}" if target else "-"
            lines.append(
                f"| {name} | {r['precision']} | {tiers} | {r['nested']:,} | {r['full']:,} ({r['full_label']}) | {r['files']:,} "
                f"| {ratio:.3f} | {mark} | {r['graphs']} | {r['nested'] / r['files']:.3f} | {r['files'] / r['full']:.2f} |"
            )
            if target:
                verdicts.append(f"{name.split(' (')[0]}: nested {r['precision'].upper()} = {ratio:.3f}x the full tier's file "
                                f"(target <= {target:.2f}): " + ("MET" if ratio <= target else "NOT MET"))
    lines += ["", "Export time (s, fp32 + int8 + fp16; load average before -> after): " + "; ".join(
        f"{src['name'].split(' (')[0]}: files {src['seconds']['files']:.0f} ({src['load']['files']}), "
        f"nested {src['seconds']['nested']:.0f} ({src['load']['nested']})" for src in result["sources"])]
    warnings = [f"{src['name'].split(' (')[0]} {w}" for src in result["sources"] for w in src["warnings"]]
    if warnings:
        lines += ["", "Export warnings: " + "; ".join(warnings)]
    for note in result["notes"]:
        lines += ["", f"({note})"]
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


NODE_SCRIPT = r"""
// Times session.run of onnxruntime-node: every case (a nested file with its tier input, or a
// per-tier file) in turn per round, one untimed run then the median of `calls` timed ones.
const fs = require('fs');
const path = require('path');
const { createRequire } = require('module');
const [, , webDir, specPath] = process.argv;
const requireWeb = createRequire(path.join(webDir, 'package.json'));
const ort = requireWeb('onnxruntime-node');
const median = (a) => { const s = [...a].sort((x, y) => x - y); const m = s.length >> 1; return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2; };
async function main() {
  const spec = JSON.parse(fs.readFileSync(specPath, 'utf8'));
  const options = { intraOpNumThreads: 1, interOpNumThreads: 1, executionMode: 'sequential', graphOptimizationLevel: 'all' };
  const sessions = {};
  for (const c of spec.cases) if (!sessions[c.file]) sessions[c.file] = await ort.InferenceSession.create(c.file, options);
  const out = { version: requireWeb('onnxruntime-node/package.json').version, ms: {} };
  for (const { batch, rounds, calls, warmup_rounds } of spec.batches) {
    const size = batch * spec.shape.reduce((a, b) => a * b, 1);
    const data = new Float32Array(size);
    for (let i = 0; i < size; i++) data[i] = Math.sin(i * 0.37);
    const input = new ort.Tensor('float32', data, [batch, ...spec.shape]);
    const feeds = spec.cases.map((c) => {
      const feed = { [spec.input]: input };
      if (c.tier !== null) feed.tier = new ort.Tensor('int64', BigInt64Array.from([BigInt(c.tier)]), []);
      return feed;
    });
    const times = spec.cases.map(() => []);
    for (let r = 0; r < warmup_rounds + rounds; r++) {
      for (let k = 0; k < spec.cases.length; k++) {
        const session = sessions[spec.cases[k].file];
        await session.run(feeds[k]);
        const t = [];
        for (let j = 0; j < calls; j++) {
          const start = process.hrtime.bigint();
          await session.run(feeds[k]);
          t.push(Number(process.hrtime.bigint() - start) / 1e6);
        }
        if (r >= warmup_rounds) times[k].push(median(t));
      }
    }
    out.ms[batch] = Object.fromEntries(spec.cases.map((c, k) => [c.key, median(times[k])]));
  }
  console.log(JSON.stringify(out));
}
main().catch((e) => { console.error(e); process.exit(1); });
"""


def node_latency(exports: dict[str, Export], entries, rounds: dict[int, int]) -> dict:
    """onnxruntime-node's ms per (format, label) and batch, or ``{"skipped": why}``."""
    node = shutil.which("node")
    if not node:
        return {"skipped": "node is not installed"}
    if not (WEB / "node_modules" / "onnxruntime-node").is_dir():
        return {"skipped": "web/node_modules/onnxruntime-node is absent (`cd web && npm ci`)"}
    manifest = exports["nested"].manifest
    cases = []
    for t in entries:
        for fmt in FORMATS:
            entry = exports[fmt].manifest.tier(t.label)
            cases.append({"key": f"{fmt}|{t.label}", "file": str(exports[fmt].folder / entry.file), "tier": entry.index})
    spec = {"input": manifest.input.name, "shape": manifest.input.shape, "cases": cases,
            "batches": [{"batch": b, "rounds": n, "calls": CALLS[b], "warmup_rounds": 5} for b, n in rounds.items()]}
    with tempfile.TemporaryDirectory() as tmp:
        script, spec_path = Path(tmp) / "time_tiers.cjs", Path(tmp) / "spec.json"
        script.write_text(NODE_SCRIPT)
        spec_path.write_text(json.dumps(spec))
        before = loadavg()
        done = subprocess.run([node, str(script), str(WEB), str(spec_path)], capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        return {"skipped": f"node failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:300]}"}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    ms = {int(b): {tuple(key.split("|", 1)): v for key, v in per.items()} for b, per in out["ms"].items()}
    return {"version": out["version"], "ms": ms, "load": f"{before} -> {loadavg()}"}


def nested_entries(exp: dict[str, Export]) -> list:
    """The per-tier files' FP32 and INT8 entries that the nested export also holds."""
    nested = {t.label for t in exp["nested"].manifest.tiers}
    return [t for t in exp["files"].manifest.tiers if t.precision in TIER_PRECISIONS and t.label in nested]


def sessions_of(quick: bool) -> int:
    """Sessions of every file in the latency tables (two in a quick run)."""
    return 2 if quick else SESSIONS


def latency_rows(exp: dict[str, Export], entries, images: np.ndarray, rounds: dict[int, int], sessions: int) -> dict:
    """Per tier and batch, ms of both formats' sessions (``TierRuntime(folder).session(label)``)
    in Python, ``sessions`` sessions of each file (its own ``TierRuntime``) timed in turn with
    every other (:func:`interleaved_median_ms`; each session one untimed call, then the median of
    :data:`CALLS` timed ones), the median over the sessions, and onnxruntime-node's (one session
    per file, half the rounds). Sessions of one file differ by up to ~4% at batch 1 (where the
    memory of their weights lies), hence several."""
    runtimes = [{fmt: TierRuntime(exp[fmt].folder, threads=1) for fmt in FORMATS} for _ in range(sessions)]
    rows = {t.label: {} for t in entries}
    load = {}
    for batch, n in rounds.items():
        feed = {exp["files"].manifest.input.name: np.ascontiguousarray(images[:batch])}
        fns = {(fmt, t.label, k): (lambda s=rt[fmt].session(t.label): s.run(None, feed))
               for k, rt in enumerate(runtimes) for t in entries for fmt in FORMATS}
        before = loadavg()
        ms = interleaved_median_ms(fns, n, runs=CALLS[batch], warmup=1, warmup_rounds=5 if batch == 1 else 1)
        load[batch] = f"{before} -> {loadavg()}"
        for t in entries:
            per_session = {fmt: [ms[(fmt, t.label, k)] for k in range(sessions)] for fmt in FORMATS}
            rows[t.label][f"b{batch}"] = {fmt: statistics.median(v) for fmt, v in per_session.items()}
            rows[t.label][f"b{batch}_sessions"] = per_session
    del runtimes
    gc.collect()
    node = node_latency(exp, entries, {b: max(n // 2, 3) for b, n in rounds.items()})
    if "ms" in node:
        for t in entries:
            for batch in rounds:
                rows[t.label][f"node_b{batch}"] = {fmt: node["ms"][batch][(fmt, t.label)] for fmt in FORMATS}
        node["ms"] = {b: {f"{fmt}|{label}": v for (fmt, label), v in per.items()} for b, per in node["ms"].items()}
    return {"rows": rows, "node": node, "load": load, "sessions": sessions}


def bench_tiers(exports: Exports, quick: bool) -> dict:
    demo = DEMO.is_dir()
    name, exp = exports.get("demo" if demo else TIER_FALLBACK)
    if demo:
        images, labels = test_split()
    else:
        shape = exp["nested"].manifest.input.shape
        images, labels = np.random.default_rng(1).standard_normal((RANDOM_IMAGES, *shape), dtype=np.float32), None
    runtimes = {fmt: TierRuntime(exp[fmt].folder, threads=1) for fmt in FORMATS}
    entries = nested_entries(exp)
    agreement = {t.label: {} for t in entries}  # (and accuracy on the demo's test split)
    for t in entries:
        out = {fmt: logits_of(runtimes[fmt].session(t.label), images) for fmt in FORMATS}
        row = agreement[t.label]
        row["max_diff"] = float(np.abs(out["nested"].astype(np.float64) - out["files"]).max())
        row["top1_agreement"] = float((out["nested"].argmax(1) == out["files"].argmax(1)).mean())
        for fmt in FORMATS:
            row[f"acc_{fmt}"] = None if labels is None else float((out[fmt].argmax(1) == labels).mean())
    del runtimes
    result = deployment(exp, entries, images, {1: 40 if quick else 200, 32: 10 if quick else 40}, quick)
    for label, row in result["rows"].items():
        row.update(agreement[label])
    return {"source": name, "demo": demo, "images": len(images), **result}


def deployment(exp: dict[str, Export], entries, images: np.ndarray, rounds: dict[int, int], quick: bool) -> dict:
    """Both formats of one source, per tier: latency (:func:`latency_rows`), session creation, the
    first run after a tier switch, and per precision the resident memory of one nested session
    serving every tier against one full-tier session and every per-tier session."""
    latency = latency_rows(exp, entries, images, rounds, sessions_of(quick))
    rows = {t.label: {"name": t.name, "precision": t.precision, **latency["rows"][t.label]} for t in entries}

    # session creation: a fresh TierRuntime and one session; per precision the nested file's
    # (which serves every tier) and each tier's own file, in turn
    reps = 3 if quick else 7
    by_precision = {p: tiers for p in TIER_PRECISIONS if (tiers := [t for t in entries if t.precision == p])}
    create: dict[tuple[str, str], list[float]] = {}
    create_load = loadavg()
    for _ in range(reps):
        for precision, tiers in by_precision.items():
            cases = [("nested", tiers[-1].label, precision)] + [("files", t.label, t.label) for t in tiers]
            for fmt, label, key in cases:
                start = time.perf_counter()
                rt = TierRuntime(exp[fmt].folder, threads=1)
                rt.session(label)
                create.setdefault((fmt, key), []).append((time.perf_counter() - start) * 1e3)
                del rt
                gc.collect()
    create_ms = {key: statistics.median(v) for key, v in create.items()}
    for t in entries:
        rows[t.label]["create"] = {"files": create_ms[("files", t.label)], "nested": create_ms[("nested", t.precision)]}
    create_load += f" -> {loadavg()}"

    # first result after a switch: every session created; neighbour runs, then the timed first run and a second
    x = np.ascontiguousarray(images[:1])
    runtimes = {fmt: TierRuntime(exp[fmt].folder, threads=1) for fmt in FORMATS}
    for rt in runtimes.values():
        for t in entries:
            rt.session(t.label)
    reps = 10 if quick else 30
    switch_load = loadavg()
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
    switch_load += f" -> {loadavg()}"
    del runtimes
    gc.collect()

    # resident memory, a fresh process per case
    memory = []
    memory_load = loadavg()
    for precision, tiers in by_precision.items():
        full = max(tiers, key=lambda t: t.macs).label
        every = [t.label for t in tiers]
        memory.append({
            "precision": precision, "full": full, "n": len(tiers),
            "files_full": rss_kib(exp["files"].folder, [full]),
            "files_every": rss_kib(exp["files"].folder, every),
            "nested_every": rss_kib(exp["nested"].folder, every),
        })
    memory_load += f" -> {loadavg()}"
    return {"rows": rows, "memory": memory, "rounds": rounds, "calls": CALLS, "sessions": latency["sessions"],
            "node": latency["node"],
            "load": {"latency": latency["load"], "create": create_load, "switch": switch_load, "memory": memory_load}}


def latency_text(rounds: dict, calls: dict, sessions: int, load: dict, node: dict) -> str:
    """How a latency table was measured."""
    node_text = (f" Node: onnxruntime-node {node['version']} (web/node_modules), 1 intra-op thread, the same files, one "
                 f"session each, {max(rounds[1] // 2, 3)} / {max(rounds[32] // 2, 3)} rounds at batch 1 / 32, every case "
                 f"in turn (its own run; load {node['load']})." if "ms" in node else f" Node: not measured ({node['skipped']}).")
    return (f"Latency (Python onnxruntime {ort.__version__}, 1 intra-op thread; {sessions} sessions of every file, each "
            f"its own `TierRuntime`, all of both formats timed in turn, {rounds[1]} rounds at batch 1 and {rounds[32]} at "
            f"batch 32, each time one untimed call then the median of {calls[1]} (batch 1) / {calls[32]} (batch 32) timed "
            f"ones; the table gives the median over the rounds, then over the sessions; load average {load[1]} (batch 1), "
            f"{load[32]} (batch 32)).{node_text}")


def latency_table(rows: dict, has_node: bool) -> list[str]:
    """Markdown rows: per tier, batch 1 and 32 ms of both formats and their ratio (and Node's)."""
    head = ("| tier | precision | batch 1 ms, file | batch 1 ms, nested | nested / file | batch 32 ms, file "
            "| batch 32 ms, nested | nested / file |")
    head += " Node b1 ms, file / nested | Node b32 ms, file / nested |" if has_node else ""
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows.values():
        ratio = {b: r[f"b{b}"]["nested"] / r[f"b{b}"]["files"] for b in (1, 32)}
        line = (f"| {r['name']} | {r['precision']} | {r['b1']['files']:.3f} | {r['b1']['nested']:.3f} | {ratio[1]:.3f} "
                f"| {r['b32']['files']:.2f} | {r['b32']['nested']:.2f} | {ratio[32]:.3f} |")
        if has_node:
            line += (f" {r['node_b1']['files']:.3f} / {r['node_b1']['nested']:.3f} "
                     f"| {r['node_b32']['files']:.2f} / {r['node_b32']['nested']:.2f} |")
        lines.append(line)
    return lines


def latency_verdicts(rows: dict, source: str) -> list[str]:
    """Per batch: nested / file per precision (min-max) and the slowest tier against the target."""
    verdicts = []
    for b in (1, 32):
        ratio = {label: r[f"b{b}"]["nested"] / r[f"b{b}"]["files"] for label, r in rows.items()}
        spans = [f"{p} {min(q):.2f}-{max(q):.2f}" for p in TIER_PRECISIONS
                 if (q := [ratio[label] for label, r in rows.items() if r["precision"] == p])]
        slowest = max(ratio, key=ratio.get)
        verdicts.append(f"{source}latency nested / file at batch {b} (Python): {', '.join(spans)}; slowest "
                        f"{ratio[slowest]:.3f} ({slowest}; target <= {LATENCY_TARGET:.2f}): "
                        + ("MET" if ratio[slowest] <= LATENCY_TARGET else "NOT MET"))
    return verdicts


def tiers_markdown(result: dict) -> tuple[str, list[str]]:
    rows, demo = result["rows"], result["demo"]
    what = (f"logits and accuracy on the demo run's {result['images']} test images" if demo else
            f"logits on {result['images']} seeded random-normal images (random weights: no accuracy)")
    lines = [
        f"Source: {result['source']}. Agreement ({what}):",
        "",
        "| tier | precision | max abs logit diff, nested vs file | top-1 agreement |"
        + (" accuracy, file | accuracy, nested |" if demo else ""),
        "|---|---|---|---|" + ("---|---|" if demo else ""),
    ]
    for label, r in rows.items():
        line = f"| {r['name']} | {r['precision']} | {r['max_diff']:.3g} | {100 * r['top1_agreement']:.2f}% |"
        if demo:
            line += f" {100 * r['acc_files']:.2f}% | {100 * r['acc_nested']:.2f}% |"
        lines.append(line)
    text, verdicts = deployment_markdown(result)
    return "\n".join(lines) + "\n\n" + text, verdicts


def deployment_markdown(result: dict) -> tuple[str, list[str]]:
    """The tables of :func:`deployment`: latency, session creation and switching, memory."""
    rows, node = result["rows"], result["node"]
    lines = [latency_text(result["rounds"], result["calls"], result["sessions"], result["load"]["latency"], node), "",
             *latency_table(rows, "ms" in node)]
    lines += [
        "",
        f"Session creation and switching (ms; creation: a fresh `TierRuntime(folder, threads=1)` and `.session(label)`, "
        f"median of several, cases in turn, load {result['load']['create']}: for the nested format the one session of "
        f"the precision's file, which serves every tier; switch: with every session created, the first `run` at batch 1 "
        f"right after three runs of the neighbouring tier, and the run after it, load {result['load']['switch']}):",
        "",
        "| tier | precision | create, file | create, nested (every tier) | nested / file | first run after switch, file "
        "| second run, file | first run after switch, nested | second run, nested | switched from |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        cf, cn = r["create"]["files"], r["create"]["nested"]
        sf, sn = r["switch"]["files"], r["switch"]["nested"]
        lines.append(
            f"| {r['name']} | {r['precision']} | {cf:.1f} | {cn:.1f} | {cn / cf:.2f} "
            f"| {sf[0]:.3f} | {sf[1]:.3f} | {sn[0]:.3f} | {sn[1]:.3f} | {r['switch_from']} |"
        )
    lines += [
        "",
        f"Resident memory (MiB; VmRSS of a fresh process after creating the sessions named and running each tier once, "
        f"minus VmRSS after `import nefl_zoo.runtime`; peak VmHWM in brackets; load {result['load']['memory']}):",
        "",
        "| precision | after import | one full-tier file session | every per-tier file session | one nested session, every tier "
        f"| nested / full-tier session (target <= {MEMORY_TARGET}) | nested / every file session |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for m in result["memory"]:
        mib = {case: (m[case]["loaded"]["VmRSS"] - m[case]["base"]["VmRSS"]) / 1024 for case in ("files_full", "files_every", "nested_every")}
        peak = {case: m[case]["loaded"]["VmHWM"] / 1024 for case in mib}
        ratio = mib["nested_every"] / mib["files_full"]
        lines.append(
            f"| {m['precision']} | {m['files_full']['base']['VmRSS'] / 1024:.1f} | {mib['files_full']:.1f} ({m['full']}; peak "
            f"{peak['files_full']:.1f}) | {mib['files_every']:.1f} ({m['n']} sessions; peak {peak['files_every']:.1f}) "
            f"| {mib['nested_every']:.1f} (peak {peak['nested_every']:.1f}) | {ratio:.2f} "
            f"{'MET' if ratio <= MEMORY_TARGET else 'NOT MET'} | {mib['nested_every'] / mib['files_every']:.2f} |"
        )
        if any(m[case]["torch"] for case in mib):
            lines.append("(torch was imported by the runtime process)")
        verdicts.append(f"{result['source'].split(' (')[0]}: resident memory, {m['precision']}: one nested session serving every tier = {ratio:.2f}x one "
                        f"full-tier session (target <= {MEMORY_TARGET}): " + ("MET" if ratio <= MEMORY_TARGET else
                        "NOT MET (onnxruntime folds each tier's slices of the shared weights into constants at session "
                        "creation, so every tier's weights are resident)"))
    verdicts += latency_verdicts(rows, f"{result['source'].split(' (')[0]}: ")
    return "\n".join(lines), verdicts


def bench_sources(exports: Exports, quick: bool) -> dict:
    """Part 2's latency, sessions and memory (:func:`deployment`) on the sources beside the demo
    run (random-normal images), the latency rounds sized so that each batch takes about
    ``budget`` seconds per source."""
    keys = list(SPEC_SOURCES[:1] if quick else SPEC_SOURCES) + ["timm", "vit"]
    budget = 5.0 if quick else 40.0
    sources = []
    for key in keys:
        name, exp = exports.get(key)
        entries = nested_entries(exp)
        shape = exp["nested"].manifest.input.shape
        images = np.random.default_rng(1).standard_normal((32, *shape), dtype=np.float32)
        full = TierRuntime(exp["files"].folder, threads=1).session(max(entries, key=lambda t: t.macs).label)
        cases = len(entries) * len(FORMATS) * sessions_of(quick)
        rounds = {}
        for batch, most in ((1, 200), (32, 40)):
            feed = {exp["files"].manifest.input.name: images[:batch]}
            ms = statistics.median(median_ms(lambda: full.run(None, feed), 1) for _ in range(3))
            rounds[batch] = int(min(most, max(5, budget * 1e3 / (cases * (CALLS[batch] + 1) * ms))))
        del full
        sources.append({"key": key, "source": name, **deployment(exp, entries, images, rounds, quick)})
    return {"sources": sources, "quick": quick}


def sources_markdown(result: dict) -> tuple[str, list[str]]:
    texts, verdicts = [], []
    for src in result["sources"]:
        text, v = deployment_markdown(src)
        texts.append(f"#### {src['source']}\n\n{text}")
        verdicts += v
    return "\n\n".join(texts), verdicts


def bench_mobile(exports: Exports, quick: bool) -> dict:
    """Part 5 (``nested_mobile.py``) on the demo run when present and the sources of part 4."""
    from nested_mobile import mobile

    keys = (["demo"] if DEMO.is_dir() else []) + list(SPEC_SOURCES[:1] if quick else SPEC_SOURCES) + ["timm", "vit"]
    sources = []
    for key in keys:
        name, exp = exports.get(key)
        with tempfile.TemporaryDirectory() as tmp:
            sources.append({"key": key, "source": name, **mobile(exp, nested_entries(exp), Path(tmp), WEB, 5.0 if quick else 30.0)})
    return {"sources": sources, "quick": quick}


def mobile_markdown(result: dict) -> tuple[str, list[str]]:
    from nested_mobile import mobile_markdown as source_markdown

    texts, verdicts = [], []
    for src in result["sources"]:
        text, v = source_markdown(src)
        texts.append(text)
        verdicts += v
    return "\n\n".join(texts), verdicts


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


def bench_adaptive(exports: Exports, args) -> dict | None:
    """Part 3 on the demo's nested export; ``None`` without the demo run (its accuracies and
    test images are what the policy and the static choice rank and serve)."""
    if not DEMO.is_dir():
        return None
    _, demo = exports.get("demo")
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


def adaptive_markdown(result: dict | None) -> tuple[str, list[str]]:
    if result is None:
        return (f"Skipped: no demo run at {DEMO.relative_to(ROOT)} (made by `make demo`; this benchmark never trains); "
                "part 3 serves the demo's nested export and ranks its entries by their measured accuracy."), []
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


def _jsonable(value):
    """``json.dumps``'s fallback: numpy scalars and arrays, paths, dataclasses."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return {k: getattr(value, k) for k in value.__dataclass_fields__}
    raise TypeError(f"not JSON: {type(value).__name__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", action="store_true", help="part 1: bytes of the nested file vs per-tier files")
    parser.add_argument("--tiers", action="store_true", help="part 2: per-tier agreement, latency, sessions, memory")
    parser.add_argument("--sources", action="store_true", help="part 4: part 2's latency, sessions and memory on the other sources")
    parser.add_argument("--adaptive", action="store_true", help="part 3: adaptive vs static under changing load")
    parser.add_argument("--mobile", action="store_true", help="part 5: the ORT format and the low-memory mode")
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
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"the results as JSON (default {RESULTS.relative_to(ROOT)})")
    args = parser.parse_args()
    parts = [p for p in PARTS if getattr(args, p)] or list(PARTS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    command = "benchmarks/bench_nested.py " + " ".join(sys.argv[1:])
    sections, verdicts = [], []
    start, load_before = time.time(), loadavg()
    record: dict = {"command": f".venv/bin/python {command.strip()}", "machine": machine(), "onnxruntime": ort.__version__,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_before": load_before, "parts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        exports = Exports(Path(tmp))
        for part in parts:
            part_start, part_load = time.time(), loadavg()
            if part == "bytes":
                result = bench_bytes(exports, args.quick)
                text, v = bytes_markdown(result)
                title = "Bytes per precision"
            elif part == "tiers":
                result = bench_tiers(exports, args.quick)
                text, v = tiers_markdown(result)
                title = "Per tier: nested vs per-tier files"
            elif part == "sources":
                result = bench_sources(exports, args.quick)
                text, v = sources_markdown(result)
                title = "The other sources: latency, sessions and memory"
            elif part == "mobile":
                result = bench_mobile(exports, args.quick)
                text, v = mobile_markdown(result)
                title = "The ORT format and the low-memory mode"
            else:
                result = bench_adaptive(exports, args)
                text, v = adaptive_markdown(result)
                title = "Adaptive vs static under changing load (demo nested export, FP32 + INT8)"
            section = (f"### {title}\n\n{text}\n\n(part wall time {time.time() - part_start:.0f} s; load average "
                       f"before {part_load}, after {loadavg()})\n")
            print(section, flush=True)
            sections.append(section)
            verdicts += v
            record["parts"][part] = {"result": result, "verdicts": v, "seconds": time.time() - part_start,
                                     "load": f"{part_load} -> {loadavg()}", "tables": publish.parse_tables(text)}
    header = (f"`.venv/bin/python {command.strip()}`; CPU: {machine()}; onnxruntime {ort.__version__}, "
              f"CPUExecutionProvider, 1 thread. Load average (`uptime`) before {load_before}, after {loadavg()}; "
              f"wall time {time.time() - start:.0f} s.\n")
    summary = "Acceptance:\n\n" + "\n".join(f"- {v}" for v in verdicts) + "\n"
    print(header)
    print(summary)
    record.update(load_after=loadavg(), seconds=time.time() - start, verdicts=verdicts)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        if args.json.exists():  # the parts not run now stay as they were (part 3: transcribed runs)
            old = json.loads(args.json.read_text())
            record["parts"] = {**old.get("parts", {}), **record["parts"]}
            if "adaptive" not in parts and old.get("runs"):
                record["runs"] = old["runs"]
        args.json.write_text(json.dumps(record, indent=1, default=_jsonable) + "\n")
        print(f"results: {args.json}")
        if args.json == RESULTS and {"bytes", "tiers"} <= set(record["parts"]):
            print(f"figure: {publish.figure('nested')}")
    if args.out:
        args.out.write_text(header + "\n" + "\n".join(sections) + "\n" + summary)


if __name__ == "__main__":
    publish.run("nested", main, capture=False)

"""Part 5 of ``bench_nested.py`` (``--mobile``): the nested model in onnxruntime's ORT format
(``nefl-zoo convert-ort``, both styles) against each tier's own ``.ort`` file, and the runtime's
low-memory mode against its default.

Per source (the demo run when present, ``resnet56/nefl-wd-aligned``, ``mobilenet_v2/nefl-wd``, the
timm ResNet18 and the ViT of part 1, exported by part 1's code):

* **Bytes** per precision: the compact and the folded ``.ort`` file of the nested model
  (``--target-platform arm``, the converter's default) against the full tier's own ``.ort`` file
  (its per-tier ``.onnx`` file saved as onnxruntime's converter saves it: every optimization,
  no NCHWc). Target: compact <= 1.3x.
* **Latency** per tier (FP32 and INT8, batch 1 and 32, Python onnxruntime, one thread, one
  session per file, every case timed in turn in one run): the tier's own ``.ort`` file, the
  compact and the folded nested ``.ort`` (target: <= 1.15x the own ``.ort``), and the nested
  ``.onnx`` through ``TierRuntime`` by default and with ``low_memory=True``.
* **Memory** (VmRSS of a fresh process after creating the session and running each tier once,
  minus VmRSS after the imports): one full-tier session of its own ``.onnx`` file (the reference)
  and of its own ``.ort``; one nested session serving every tier: ``.onnx`` by default, ``.onnx``
  low-memory, compact ``.ort``, folded ``.ort``; and in Node (onnxruntime-node, when installed)
  ``loadNestedModel`` by default and with ``lowMemory``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from nefl_zoo.export.mobile import convert_to_ort, ort_filename, save_ort
from nefl_zoo.runtime import TierRuntime
from nefl_zoo.runtime.session import session_options
from nefl_zoo.timing import interleaved_median_ms, median_ms

BYTES_TARGET = 1.3  # compact nested .ort <= this x the full tier's own .ort
LATENCY_TARGET = 1.15  # each tier's nested .ort <= this x its own .ort, at batch 1 and 32
STYLES = ("compact", "folded")
CASES = ("own", "compact", "folded", "onnx", "low")  # the latency table's columns, by file
CALLS = {1: 3, 32: 1}


def loadavg() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def ort_files(exp: dict, workdir: Path) -> dict:
    """The nested model's ``.ort`` files in both styles and each per-tier file's own ``.ort``."""
    nested, files = exp["nested"], exp["files"]
    out = {}
    for style in STYLES:
        out[style] = {f.precision: workdir / style / f.file for f in convert_to_ort(nested.folder, workdir / style, style)}
    own = workdir / "own"
    own.mkdir(parents=True, exist_ok=True)
    out["own"] = {}
    for entry in files.manifest.tiers:
        path = own / ort_filename(entry.file)
        save_ort((files.folder / entry.file).read_bytes(), path, "folded", "arm")
        out["own"][entry.label] = path
    return out


def ort_bytes(exp: dict, paths: dict) -> list[dict]:
    rows = []
    for precision, compact in paths["compact"].items():
        entries = [t for t in exp["files"].manifest.tiers if t.precision == precision]
        if not entries:
            continue
        full = max(entries, key=lambda t: t.macs)
        rows.append({
            "precision": precision, "onnx": (exp["nested"].folder / f"nested.{precision}.onnx").stat().st_size,
            "compact": compact.stat().st_size, "folded": paths["folded"][precision].stat().st_size,
            "own_full": paths["own"][full.label].stat().st_size, "full_label": full.label,
            "own_every": sum(paths["own"][t.label].stat().st_size for t in entries),
        })
    return rows


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), session_options(1), providers=["CPUExecutionProvider"])


def ort_latency(exp: dict, paths: dict, entries, budget: float) -> dict:
    """Per tier and batch, ms of every case of :data:`CASES`, timed in turn; rounds sized so
    that each batch takes about ``budget`` seconds."""
    nested = exp["nested"].manifest
    runtimes = {"onnx": TierRuntime(exp["nested"].folder, threads=1),
                "low": TierRuntime(exp["nested"].folder, threads=1, low_memory=True)}
    styles = {style: {p: _session(path) for p, path in paths[style].items()} for style in STYLES}
    sessions = {}
    for t in entries:
        index = np.array(nested.tier(t.label).index, np.int64)
        sessions[("own", t.label)] = (_session(paths["own"][t.label]), None)
        for style in STYLES:
            sessions[(style, t.label)] = (styles[style][t.precision], index)
        for mode, rt in runtimes.items():
            sessions[(mode, t.label)] = (rt.session(t.label), None)
    shape = nested.input.shape
    images = np.random.default_rng(1).standard_normal((32, *shape), dtype=np.float32)
    full = max(entries, key=lambda t: t.macs)
    rows = {t.label: {"name": t.name, "precision": t.precision} for t in entries}
    load = {}
    for batch in (1, 32):
        feed = {nested.input.name: np.ascontiguousarray(images[:batch])}

        def call(key, feed=feed):
            session, index = sessions[key]
            return session.run(None, feed if index is None else {**feed, "tier": index})

        ms_full = statistics.median(median_ms(lambda: call(("low", full.label)), 1) for _ in range(3))
        rounds = int(min(200 if batch == 1 else 40, max(5, budget * 1e3 / (len(sessions) * (CALLS[batch] + 1) * ms_full))))
        before = loadavg()
        ms = interleaved_median_ms({key: (lambda key=key: call(key)) for key in sessions}, rounds, runs=CALLS[batch],
                                   warmup=1, warmup_rounds=3)
        load[batch] = {"load": f"{before} -> {loadavg()}", "rounds": rounds}
        for t in entries:
            rows[t.label][f"b{batch}"] = {case: ms[(case, t.label)] for case in CASES}
    return {"rows": rows, "load": load}


RSS_SCRIPT = """
import json, sys
import numpy as np
import onnxruntime as ort
from nefl_zoo.runtime import TierRuntime
from nefl_zoo.runtime.session import session_options
def status():
    fields = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)
    return {k: int(fields[k].split()[0]) for k in ('VmRSS', 'VmHWM')}
spec = json.loads(sys.argv[1])
base = status()
x = np.zeros((1, *spec['shape']), np.float32)
if spec['kind'] == 'runtime':
    rt = TierRuntime(spec['path'], threads=1, low_memory=spec['low_memory'])
    for label in spec['labels']:
        rt.run(x, tier=label)
else:
    s = ort.InferenceSession(spec['path'], session_options(1), providers=['CPUExecutionProvider'])
    for tier in spec['tiers']:
        s.run(None, {'input': x} if tier is None else {'input': x, 'tier': np.array(tier, np.int64)})
print(json.dumps({'base': base, 'loaded': status()}))
"""

NODE_RSS = r"""
const fs = require('fs');
const path = require('path');
const { createRequire } = require('module');
const [, , webDir, file, lowMemory] = process.argv;
const requireWeb = createRequire(path.join(webDir, 'package.json'));
const ort = requireWeb('onnxruntime-node');
(async () => {
  const { loadNestedModel } = await import(path.join(webDir, 'lib', 'nested.mjs'));
  global.gc && global.gc();
  const base = process.memoryUsage().rss;
  const bytes = fs.readFileSync(file);
  const model = await loadNestedModel(ort, bytes, { lowMemory: lowMemory === '1', sessionOptions: { intraOpNumThreads: 1 } });
  const size = model.metadata.input.shape.reduce((a, b) => a * b, 1);
  for (const t of model.tiers) await model.run(t.index, new Float32Array(size), 1);
  console.log(JSON.stringify({ base_kib: base / 1024, loaded_kib: process.memoryUsage().rss / 1024 }));
})().catch((e) => { console.error(e); process.exit(1); });
"""


def rss(spec: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, json.dumps(spec)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def node_rss(web: Path, file: Path, low_memory: bool) -> dict | None:
    node = shutil.which("node")
    if not node or not (web / "node_modules" / "onnxruntime-node").is_dir():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rss.cjs"
        script.write_text(NODE_RSS)
        done = subprocess.run([node, str(script), str(web), str(file), "1" if low_memory else "0"], capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory(exp: dict, paths: dict, entries, web: Path) -> list[dict]:
    """Per precision, the resident memory of each case (see the module docstring), in MiB over
    the process's after the imports."""
    shape = exp["nested"].manifest.input.shape
    out = []
    for precision in sorted({t.precision for t in entries}, key=["fp32", "int8"].index):
        tiers = [t for t in entries if t.precision == precision]
        full = max(tiers, key=lambda t: t.macs)
        every = [t.label for t in tiers]
        indices = [exp["nested"].manifest.tier(label).index for label in every]
        runtime = lambda folder, labels, low=False: {"kind": "runtime", "path": str(folder), "labels": labels,  # noqa: E731
                                                     "low_memory": low, "shape": shape}
        cases = {
            "file": runtime(exp["files"].folder, [full.label]),
            "own_ort": {"kind": "file", "path": str(paths["own"][full.label]), "tiers": [None], "shape": shape},
            "onnx": runtime(exp["nested"].folder, every),
            "low": runtime(exp["nested"].folder, every, True),
            **{style: {"kind": "file", "path": str(paths[style][precision]), "tiers": indices, "shape": shape} for style in STYLES},
        }
        mib = {}
        for case, spec in cases.items():
            r = rss(spec)
            mib[case] = (r["loaded"]["VmRSS"] - r["base"]["VmRSS"]) / 1024
        row = {"precision": precision, "full": full.label, "mib": mib, "node": {}}
        nested_file = exp["nested"].folder / exp["nested"].manifest.tier(full.label).file
        for mode in (False, True):
            r = node_rss(web, nested_file, mode)
            if r is not None and "error" not in r:
                row["node"]["low" if mode else "onnx"] = (r["loaded_kib"] - r["base_kib"]) / 1024
            elif r is not None:
                row["node_error"] = r["error"]
        out.append(row)
    return out


def mobile(exp: dict, entries, workdir: Path, web: Path, budget: float) -> dict:
    """Part 5 for one source (see the module docstring)."""
    before = loadavg()
    paths = ort_files(exp, workdir)
    result = {"bytes": ort_bytes(exp, paths), "convert_load": f"{before} -> {loadavg()}"}
    result.update(ort_latency(exp, paths, entries, budget))
    before = loadavg()
    result["memory"] = memory(exp, paths, entries, web)
    result["memory_load"] = f"{before} -> {loadavg()}"
    return result


def mobile_markdown(src: dict) -> tuple[str, list[str]]:
    """The tables of one source's part 5 and its verdicts."""
    name = src["source"].split(" (")[0]
    lines = [
        f"#### {src['source']}", "",
        "Bytes (`--target-platform arm`, as onnxruntime's converter by default; the own `.ort` files are each tier's "
        f"per-tier `.onnx` file saved as that converter saves it; load {src['convert_load']}):", "",
        "| precision | nested .onnx | compact .ort | folded .ort | full tier's own .ort | compact / own full | folded / own full "
        f"| every tier's own .ort | target compact <= {BYTES_TARGET} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for r in src["bytes"]:
        ratio = r["compact"] / r["own_full"]
        lines.append(f"| {r['precision']} | {r['onnx']:,} | {r['compact']:,} | {r['folded']:,} | {r['own_full']:,} ({r['full_label']}) "
                     f"| {ratio:.3f} | {r['folded'] / r['own_full']:.3f} | {r['own_every']:,} | {'MET' if ratio <= BYTES_TARGET else 'NOT MET'} |")
        verdicts.append(f"{name}: compact .ort {r['precision'].upper()} = {ratio:.3f}x the full tier's own .ort (target <= "
                        f"{BYTES_TARGET}): {'MET' if ratio <= BYTES_TARGET else 'NOT MET'}; folded {r['folded'] / r['own_full']:.3f}x")
    load = src["load"]
    lines += [
        "", f"Latency (ms, Python onnxruntime {ort.__version__}, 1 thread, one session per file, every case timed in turn; "
        f"each time one untimed call then the median of {CALLS[1]} (batch 1) / {CALLS[32]} (batch 32); {load[1]['rounds']} / "
        f"{load[32]['rounds']} rounds, load {load[1]['load']} (batch 1), {load[32]['load']} (batch 32)). own: the tier's own "
        "`.ort`; compact, folded: the nested `.ort` files, over own; nested: the nested `.onnx` through `TierRuntime`, "
        "low-memory over default:", "",
        "| tier | precision | b1 own ms | b1 compact / own | b1 folded / own | b1 nested ms | b1 low-memory / default "
        "| b32 own ms | b32 compact / own | b32 folded / own | b32 nested ms | b32 low-memory / default |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in src["rows"].values():
        cells = []
        for b in (1, 32):
            m = r[f"b{b}"]
            cells += [f"{m['own']:.3f}", f"{m['compact'] / m['own']:.3f}", f"{m['folded'] / m['own']:.3f}", f"{m['onnx']:.3f}",
                      f"{m['low'] / m['onnx']:.3f}"]
        lines.append(f"| {r['name']} | {r['precision']} | " + " | ".join(cells) + " |")
    for style in STYLES:
        for b in (1, 32):
            spans = []
            for precision in ("fp32", "int8"):
                q = [r[f"b{b}"][style] / r[f"b{b}"]["own"] for r in src["rows"].values() if r["precision"] == precision]
                if q:
                    spans.append(f"{precision} {min(q):.2f}-{max(q):.2f}")
            worst = max(r[f"b{b}"][style] / r[f"b{b}"]["own"] for r in src["rows"].values())
            verdicts.append(f"{name}: {style} .ort / own .ort at batch {b}: {', '.join(spans)} (target <= {LATENCY_TARGET}): "
                            + ("MET" if worst <= LATENCY_TARGET else "NOT MET"))
    for b in (1, 32):
        spans = [f"{p} {min(q):.2f}-{max(q):.2f}" for p in ("fp32", "int8")
                 if (q := [r[f"b{b}"]["low"] / r[f"b{b}"]["onnx"] for r in src["rows"].values() if r["precision"] == p])]
        verdicts.append(f"{name}: low-memory / default latency at batch {b}: {', '.join(spans)}")
    lines += [
        "", f"Resident memory (MiB over the process's after its imports; a fresh process per case, each tier run once; load "
        f"{src['memory_load']}); ratios against one full-tier session of its own `.onnx` file:", "",
        "| precision | one full-tier session (.onnx) | full tier's own .ort | nested .onnx, every tier | low-memory | compact .ort "
        "| folded .ort | low-memory / full tier | compact / full tier | Node: nested / low-memory |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in src["memory"]:
        mib, ref = m["mib"], m["mib"]["file"]
        node = m["node"]
        node_cell = f"{node['onnx']:.1f} / {node['low']:.1f}" if len(node) == 2 else m.get("node_error", "not measured")
        lines.append(f"| {m['precision']} | {ref:.1f} ({m['full']}) | {mib['own_ort']:.1f} | {mib['onnx']:.1f} ({mib['onnx'] / ref:.2f}x) "
                     f"| {mib['low']:.1f} | {mib['compact']:.1f} | {mib['folded']:.1f} ({mib['folded'] / ref:.2f}x) "
                     f"| {mib['low'] / ref:.2f} | {mib['compact'] / ref:.2f} | {node_cell} |")
        verdicts.append(f"{name}: memory {m['precision']}: one nested session serving every tier {mib['onnx'] / ref:.2f}x one "
                        f"full-tier session by default, {mib['low'] / ref:.2f}x low-memory, {mib['compact'] / ref:.2f}x compact .ort")
    return "\n".join(lines), verdicts

"""The explanation pages' figures, drawn from the code they explain.

Usage: python tools/docs_figures.py [NAME ...]   (default: every figure)

Each figure is one function of :data:`FIGURES` and is drawn from what the library computes or
writes: a compiled spec's slice maps, a nested ONNX file as exported, one training round, the
package's declared layers, a nested torchvision model, the adaptive policy on a load trace. The
run store's commit sequence and the chain of checks are drawn from the order the code takes.
The PNGs go to ``docs/explanations/img/NAME.png`` (the pages show them; commit them).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "explanations" / "img"
DPI = 100
TIER_COLORS = ["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974"]  # g0.2 .. g1
INK, FAINT, SHARED = "#333333", "#e8e8e8", "#dd8452"


def box(ax, x, y, w, h, text, color="white", edge=INK, size=9, weight="normal", dashed=False):
    """A rounded box centred on (x, y) with ``text`` inside."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.05",
                                facecolor=color, edgecolor=edge, linewidth=1, linestyle="--" if dashed else "-"))
    ax.text(x, y, text, ha="center", va="center", fontsize=size, weight=weight, color=INK)


def arrow(ax, start, end, color=INK, style="-|>", dashed=False, rad=0.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color=color, linewidth=1,
                                 linestyle="--" if dashed else "-", connectionstyle=f"arc3,rad={rad}"))


def _tool(name: str):
    """The module ``tools/NAME.py``."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def canvas(width: float, height: float):
    fig, ax = plt.subplots(figsize=(width, height), dpi=DPI)
    ax.set(xlim=(0, width), ylim=(0, height))
    ax.axis("off")
    return fig, ax


# ---- the slice map ------------------------------------------------------------------------------
def slice_map():
    """resnet20/nefl-wd: one conv weight's region per tier, and every tier's blocks and widths."""
    import nefl_zoo as nz

    compiled = nz.compile_spec(nz.load_spec(ROOT / "specs/resnet20/nefl-wd.yaml"))
    names = list(compiled.tiers)
    key = "layer2.1.conv1.weight"
    full = compiled.full_shapes[key]
    fig, (grid, blocks) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=DPI, gridspec_kw={"width_ratios": [1, 1.3]})
    removed = []
    for n, name in reversed(list(enumerate(names))):
        entry = compiled[name].slice_map.get(key)
        if entry is None:
            removed.append(name)
            continue
        rows, cols = entry.shape[:2]
        grid.add_patch(Rectangle((0, full[0] - rows), cols, rows, facecolor=TIER_COLORS[n], edgecolor="white",
                                 linewidth=1.5, label=f"{name}: {rows}x{cols}"))
    grid.set(xlim=(0, full[1]), ylim=(0, full[0]), aspect="equal", xticks=[0, full[1]], yticks=[0, full[0]],
             xlabel="input channels", ylabel="output channels")
    grid.set_yticklabels([str(full[0]), "0"])
    grid.set_title(f"{key}\n(global shape {full[0]}x{full[1]}x3x3)", fontsize=9)
    handles, labels = grid.get_legend_handles_labels()
    note = f"\n{', '.join(removed)}: block removed" if removed else ""
    grid.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1),
                title=f"region per tier{note}", title_fontsize=8, frameon=False)
    depths = defaultdict(int)  # blocks per stage, from the model's step keys
    for stage, block in compiled.step_keys.values():
        depths[stage] = max(depths[stage], block + 1)
    for n, name in enumerate(names):
        tier = compiled[name]
        for (stage, b) in compiled.step_keys.values():
            x = stage * 3.4 + b
            conv = f"layer{stage + 1}.{b}.conv1.weight"
            if conv not in tier.slice_map:  # removed: step size 0
                blocks.add_patch(Rectangle((x, n), 0.9, 0.8, facecolor="white", edgecolor="#999999", linestyle=":"))
                continue
            width = tier.slice_map[conv].shape[0] / compiled.full_shapes[conv][0]
            blocks.add_patch(Rectangle((x, n), 0.9, 0.8, facecolor=FAINT, edgecolor="none"))
            blocks.add_patch(Rectangle((x, n), 0.9, 0.8 * width, facecolor=TIER_COLORS[n], edgecolor="none"))
    blocks.set(xlim=(-0.2, 3.4 * len(depths)), ylim=(-0.3, len(names)), yticks=[n + 0.4 for n in range(len(names))],
               xticks=[s * 3.4 + 1.45 for s in range(len(depths))])
    blocks.set_yticklabels(names)
    blocks.set_xticklabels([f"stage {s + 1}" for s in range(len(depths))])
    blocks.tick_params(length=0)
    for side in blocks.spines.values():
        side.set_visible(False)
    blocks.set_title("each tier's residual blocks: the coloured height is the share\nof channels kept; "
                     "a dotted box is a removed block", fontsize=9)
    fig.suptitle("resnet20/nefl-wd: every tier is a slice of one global model", fontsize=10)
    fig.tight_layout()
    return fig


# ---- the nested ONNX model ----------------------------------------------------------------------
def nested_onnx():
    """resnet20/nefl-wd exported as one nested FP32 file: the If tree, each branch's cuts of the
    shared tensors and the tier graph (ONNX function) it calls."""
    import onnx
    from onnx import numpy_helper

    from nefl_zoo.export import export_tiers, load_source

    with tempfile.TemporaryDirectory() as folder:
        export_tiers(load_source("resnet20/nefl-wd"), folder, format="nested", latency_runs=1)
        model = onnx.load(Path(folder) / "nested.fp32.onnx")
    shared = model.graph.initializer
    shared_mb = sum(numpy_helper.to_array(t).nbytes for t in shared) / 1e6
    meta = json.loads(next(p.value for p in model.metadata_props if p.key == "nefl_zoo.nested"))
    names = [t["name"] for t in meta["tiers"]]
    leaves, ifs = [], []  # (ops, function called) per branch; (depth, first, split, last) per If

    def walk(graph, depth: int) -> tuple[int, int]:
        node = next((n for n in graph.node if n.op_type == "If"), None)
        if node is None:
            ops = defaultdict(int)
            for n in graph.node:
                ops[n.op_type] += 1
            leaves.append((ops, next(n.op_type for n in graph.node if n.domain == "nefl_zoo.tier")))
            return len(leaves) - 1, len(leaves)
        first, split = walk(next(a.g for a in node.attribute if a.name == "then_branch"), depth + 1)
        last = walk(next(a.g for a in node.attribute if a.name == "else_branch"), depth + 1)[1]
        ifs.append((depth, first, split, last))
        return first, last

    walk(model.graph, 0)
    fig, ax = canvas(9.6, 4.8)
    row = {n: 3.6 - n * 0.69 for n in range(len(leaves))}
    centre = {}  # (first, last) -> (x, y) of its If node, or of the branch for one tier
    for n in range(len(leaves)):
        centre[(n, n + 1)] = (5.35, row[n])
    for depth, first, split, last in sorted(ifs, reverse=True):  # deepest first
        x, y = 1.9 + depth * 1.05, (centre[(first, split)][1] + centre[(split, last)][1]) / 2
        centre[(first, last)] = (x, y)
        box(ax, x, y, 0.85, 0.42, f"If\ntier < {split}", size=7.5)
        for child in ((first, split), (split, last)):
            cx, cy = centre[child]
            arrow(ax, (x + 0.43, y), (cx - (0.85 if child[1] - child[0] == 1 else 0.43), cy))
    root = centre[(0, len(leaves))]
    box(ax, 0.6, root[1] + 0.45, 1.0, 0.5, "input\n[N, C, H, W]", size=7.5)
    box(ax, 0.6, root[1] - 0.45, 1.0, 0.5, "tier\nint64", size=7.5)
    arrow(ax, (1.1, root[1] + 0.45), (root[0] - 0.43, root[1] + 0.1))
    arrow(ax, (1.1, root[1] - 0.45), (root[0] - 0.43, root[1] - 0.1))
    box(ax, 5.35, 4.5, 4.1, 0.4, f"{len(shared)} shared tensors, each stored once: {shared_mb:.2f} MB",
        color=SHARED, size=8, weight="bold")
    arrow(ax, (5.35, 4.3), (5.35, row[0] + 0.27), color=SHARED)
    ax.text(5.45, (4.3 + row[0] + 0.27) / 2, "every branch cuts its tier's weights out of them", fontsize=7.5,
            color=SHARED, va="center")
    for n, (ops, function) in enumerate(leaves):
        y = row[n]
        cuts = ", ".join(f"{ops[op]} {op}" for op in ("Slice", "Gather", "Mul", "Pad") if ops.get(op))
        box(ax, 5.35, y, 1.7, 0.5, f"branch {names[n]}\n{cuts}", color=FAINT, size=7.5)
        box(ax, 7.3, y, 1.45, 0.42, f"{function}()", color=TIER_COLORS[n % len(TIER_COLORS)], size=7.5)
        arrow(ax, (6.2, y), (6.57, y))
        arrow(ax, (8.03, y), (8.75, 1.9), color="#999999")
    box(ax, 9.1, 1.9, 0.7, 0.45, "logits", size=8)
    ax.text(0.1, 0.12, f"nested.fp32.onnx of resnet20/nefl-wd: {len(leaves)} tiers. Each branch cuts its tier's "
            "weights out of the shared tensors\n(Slice, and Mul by folded BatchNorm factors) and calls its "
            f"tier graph, a function stored once per distinct structure ({len(model.functions)} here).",
            fontsize=8, color=INK)
    return fig


# ---- a NeFL round -------------------------------------------------------------------------------
def nefl_round():
    """Round 1 of specs/train/digits-quick.yaml with 10 clients, all sampled: the tier each client
    trained and the elements it was sent (from the run's metrics record), then
    how many of the round's updates hold each output channel of one layer (from the tiers'
    slice maps): NeFedAvg's divisor."""
    from nefl_zoo.fl.config import load_config
    from nefl_zoo.fl.engine import train
    from nefl_zoo.slim import compile_spec

    config = load_config(ROOT / "specs/train/digits-quick.yaml",
                         ["rounds=1", "clients.num_clients=10", "clients.fraction=1.0", "train.local_epochs=1"])
    with tempfile.TemporaryDirectory() as folder:
        train(config, folder)
        record = json.loads((Path(folder) / "metrics.jsonl").read_text().splitlines()[0])
    compiled = compile_spec(config.submodel_spec())
    names = list(compiled.tiers)
    elements = {name: compiled[name].slice_map.numel() for name in names}
    total = sum(t.numel() for t in compiled.init_global_state().values())
    clients = sorted(record["per_client"].items(), key=lambda item: int(item[0]))
    key = "layer3.2.conv2.weight"
    full = compiled.full_shapes[key][0]
    holders = [sum(compiled[c["tier"]].slice_map[key].shape[0] > channel for _, c in clients) for channel in range(full)]

    fig = plt.figure(figsize=(9.6, 4.6), dpi=DPI)
    top = fig.add_axes((0.0, 0.42, 1.0, 0.58))
    top.set(xlim=(0, 9.6), ylim=(0, 2.7))
    top.axis("off")
    box(top, 4.8, 2.35, 5.4, 0.5, f"server: the global state, {total:,} elements\n(shared tensors once, "
        "and each tier's step sizes and BatchNorm)", color=SHARED, size=8)
    width = 9.6 / len(clients)
    for n, (client, sent) in enumerate(clients):
        x = width * (n + 0.5)
        colour = TIER_COLORS[names.index(sent["tier"])]
        box(top, x, 0.75, width - 0.12, 0.75, f"client {client}\n{sent['tier']}\n"
            f"{elements[sent['tier']]:,}", color=colour, size=7.5)
        arrow(top, (4.8 + (x - 4.8) * 0.5 - 0.05, 2.08), (x - 0.1, 1.14), color=INK)
        arrow(top, (x + 0.1, 1.14), (4.8 + (x - 4.8) * 0.5 + 0.05, 2.08), color="#999999", dashed=True)
    top.text(0.05, 1.75, "down: the slice of its tier\n(elements below)", fontsize=7.5, color=INK)
    top.text(9.55, 1.75, "up: the trained slice\n(dashed)", fontsize=7.5, color="#777777", ha="right")
    bottom = fig.add_axes((0.08, 0.1, 0.88, 0.26))
    bottom.step(range(full + 1), holders + holders[-1:], where="post", color=INK)
    bottom.fill_between(range(full + 1), holders + holders[-1:], step="post", color=FAINT)
    bottom.set(xlim=(0, full), ylim=(0, len(clients) + 0.5), xlabel=f"output channel of {key}",
               ylabel="updates", yticks=range(0, len(clients) + 1, 5))
    bottom.set_title("NeFedAvg: each element is averaged over the updates that hold it "
                     "(narrow tiers keep the first channels)", fontsize=9)
    return fig


# ---- the package layers -------------------------------------------------------------------------
ROW_WIDTH = 5  # parts per row of the figure, at most


def architecture():
    """The parts of the package on their layers, each with its job, as declared in
    ``[tool.nefl-zoo.structure]`` of ``pyproject.toml`` (the test suite holds the code to that
    table). The PNG records the table's fingerprint, so a figure older than the table is found."""
    structure = _tool("structure")
    layout = structure.read_layout(ROOT / "pyproject.toml")
    parts = layout.parts
    row: dict[str, int] = {}
    for name, part in parts.items():  # lowest first: the lowest row above its imports with room
        row[name] = 1 + max((row[i] for i in part.imports), default=-1)
        while sum(r == row[name] for r in row.values()) > ROW_WIDTH:
            row[name] += 1
    below: dict[str, set[str]] = {}
    for name, part in parts.items():
        below[name] = set().union(*({i} | below[i] for i in part.imports))
    drawn = [(a, b) for a in parts for b in parts[a].imports  # an import implied by a longer chain is not drawn
             if not any(b in below[c] for c in parts[a].imports if c != b)]
    height = 0.72
    where: dict[str, tuple[float, float]] = {}
    for n in range(max(row.values()) + 1):  # bottom up, each part near the parts it imports
        names = [name for name in parts if row[name] == n]
        targets = {name: [where[b][0] for a, b in drawn if a == name] for name in names}
        names.sort(key=lambda name: sum(targets[name]) / len(targets[name]) if targets[name] else 4.8)
        for k, name in enumerate(names):
            where[name] = (9.6 * (k + 0.5) / len(names), 0.75 + n * height)
    fig, ax = canvas(9.6, 0.75 + height * max(row.values()) + 0.4)
    fig.subplots_adjust(0, 0, 1, 1)
    for source, target in drawn:
        (x0, y0), (x1, y1) = where[source], where[target]
        ax.plot([x0, x1], [y0 - 0.25, y1 + 0.25], color="#aaaaaa", linewidth=0.9, zorder=0)
    width = 9.6 / ROW_WIDTH - 0.15
    for name, (x, y) in where.items():
        colour = "#dbe9f6" if name == "runtime" else (SHARED if name == structure.CLI else "white")
        box(ax, x, y, width, 0.5, "", color=colour)
        ax.text(x, y + 0.13, name, ha="center", va="center", fontsize=8, weight="bold", color=INK)
        ax.text(x, y - 0.07, "\n".join(textwrap.wrap(parts[name].job, 34)), ha="center", va="center",
                fontsize=6.5, color=INK, linespacing=1.1)
    ax.text(0.05, 0.3, "Each part sits above the parts it imports (a grey line; an import implied by a longer chain "
            "is not drawn): at module level or inside a\nfunction, no import goes up. The command line (orange) "
            "imports what a command needs when it runs; the runtime (blue) needs no torch.", fontsize=7.5,
            va="center")
    fig.png_metadata = {"nefl_zoo.layers": structure.fingerprint(layout)}  # saved into the PNG by main()
    return fig


# ---- automatic nesting --------------------------------------------------------------------------
def automatic_nesting():
    """torchvision's DenseNet-121, nested automatically: which of the classifier's 1,024 inputs
    (a concatenation of every dense layer's output) each tier keeps."""
    import nefl_zoo as nz

    gammas = (0.25, 0.5, 0.75, 1.0)
    spec = nz.parse_spec({"model": "torchvision:densenet121", "model_args": {"num_classes": 10, "img_size": 64},
                          "tiers": [{"name": f"g{g:g}", "gamma_w": g} for g in gammas]})
    compiled = nz.compile_spec(spec)
    key = "classifier.weight"
    full = compiled.full_shapes[key][1]
    fig, ax = plt.subplots(figsize=(9.6, 2.6), dpi=DPI)
    for n, name in enumerate(compiled.tiers):
        index = compiled[name].slice_map[key].index[1]
        kept = list(range(full))[index] if isinstance(index, slice) else index.tolist()
        ax.add_patch(Rectangle((0, n), full, 0.7, facecolor=FAINT, edgecolor="none"))
        for start, stop in _runs(kept):
            ax.add_patch(Rectangle((start, n), stop - start, 0.7, facecolor=TIER_COLORS[n], edgecolor="none"))
        ax.text(full + 8, n + 0.35, f"{len(kept)} of {full} kept", va="center", fontsize=8)
    ax.set(xlim=(0, full + 110), ylim=(-0.2, len(compiled.tiers)), xlabel="input position of the classifier",
           yticks=[n + 0.35 for n in range(len(compiled.tiers))])
    ax.set_yticklabels([f"γ_W = {g:g}" for g in gammas])
    ax.set_xticks(range(0, full + 1, 128))
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.set_title("torchvision:densenet121: each concatenated block keeps its first channels, so a tier's "
                 "inputs are not a prefix", fontsize=9)
    fig.tight_layout()
    return fig


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted integers as (start, stop) pairs."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([value, value + 1])
    return [(a, b) for a, b in runs]


# ---- the adaptive policy ------------------------------------------------------------------------
def adaptive_policy():
    """The deadline policy on two load traces of the recorded set: the latency of each request
    and the tier that served it."""
    traces = _tool("policy_traces")
    CASES, run_case = traces.CASES, traces.run_case
    shown = {"sudden_slowdown_miss": "the load doubles at 1 s", "load_ends_probe_up": "a 3x load ends at 2 s"}
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.2), dpi=DPI, sharey=True)
    for ax, case in zip(axes, [c for c in CASES if c["name"] in shown]):
        result = run_case(case)
        labels = [c["label"] for c in case["candidates"]]
        served = [s for s in result["steps"] if s["op"] == "observe"]
        for n, label in enumerate(labels):
            points = [(s["at"], s["ms"]) for s in served if s["label"] == label]
            if points:
                ax.scatter(*zip(*points), s=14, color=TIER_COLORS[n], label=label, zorder=3)
        ax.axhline(case["deadline"]["ms"], color=INK, linestyle="--", linewidth=1)
        ax.text(0, case["deadline"]["ms"] + 0.4, f"deadline {case['deadline']['ms']:g} ms", fontsize=8)
        for switch in result["switches"]:
            ax.axvline(switch["at"], color="#bbbbbb", linewidth=0.8, zorder=0)
        ax.set(xlabel="time (s)", title=shown[case["name"]])
        ax.title.set_fontsize(9)
    axes[0].set_ylabel("latency of the request (ms)")
    axes[1].legend(title="tier served", fontsize=8, title_fontsize=8, loc="upper right")
    fig.suptitle("The policy steps down when the load makes the served tier miss, and probes back up "
                 "when it ends (grey: a switch)", fontsize=9)
    fig.tight_layout()
    return fig


# ---- the run store ------------------------------------------------------------------------------
KILLS = [  # crash points of a 4-round run that checkpoints every 2 rounds, in the order it reaches them
    ("log:jsonl:3", "round 3's record\nappended"), ("log:jsonl:4", "round 4's record\nappended"),
    ("save:partial:2", "new global state\nwritten"), ("save:before-commit:2", "new files\nfsynced"),
    ("before-rename:checkpoint.json:2", "new pointer\nfsynced"), ("save:committed:2", "pointer renamed:\ncommitted"),
    ("publish:global.safetensors:2", "global.safetensors\nre-linked"), ("save:published:2", "old generation\nnot yet deleted"),
    ("summary", "summary.json\nnot written"),
]


def run_store():
    """A 4-round training run (checkpoint every 2 rounds) killed at each crash point of its
    second checkpoint, one process per kill: the metrics records on disk when it died, and the
    round its committed checkpoint holds (where ``--resume`` continues)."""
    import os
    import subprocess

    found = []
    for point, _ in KILLS:
        with tempfile.TemporaryDirectory() as folder:
            run = Path(folder) / "run"
            done = subprocess.run(
                [sys.executable, "-c", "from nefl_zoo_cli.app import main; main()", "train", str(ROOT / "specs/train/digits-quick.yaml"),
                 "--out", str(run), "--quiet", "--threads", "1", "--set", "rounds=4", "--set", "checkpoint_every=2",
                 "--set", "clients.num_clients=4", "--set", "train.local_epochs=1", "--set", "eval.every=4"],
                env={**os.environ, "NEFL_ZOO_CRASH_AT": point}, capture_output=True, text=True)
            assert done.returncode == 99, f"{point}: exit {done.returncode}\n{done.stderr}"
            pointer = run / "checkpoint.json"
            committed = json.loads(pointer.read_text())["round"] if pointer.exists() else 0
            records = len((run / "metrics.jsonl").read_text().splitlines())
            found.append((records, committed))
            print(f"  killed at {point}: {records} records on disk, checkpoint of round {committed}")
    fig, ax = plt.subplots(figsize=(9.6, 3.4), dpi=DPI)
    x = range(len(KILLS))
    ax.bar(x, [r for r, _ in found], width=0.6, color=FAINT, label="metrics records on disk at the kill")
    ax.step(x, [c for _, c in found], where="mid", color=TIER_COLORS[0], marker="o", linewidth=2,
            label="round of the committed checkpoint: --resume continues from it")
    commit = next(n for n, (_, c) in enumerate(found) if c == 4)
    ax.axvline(commit - 0.5, color=SHARED, linestyle="--")
    ax.text(commit - 0.45, 4.45, "the commit point: checkpoint.json renamed", color=SHARED, fontsize=8)
    ax.set(ylim=(0, 5), xticks=list(x), ylabel="round")
    ax.set_xticklabels([label for _, label in KILLS], fontsize=7)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("A run killed at each crash point of its round-4 checkpoint (one process per kill)", fontsize=9)
    fig.tight_layout()
    return fig


# ---- guarantees ---------------------------------------------------------------------------------
CHECKS = [  # (stage, what it checks before it uses its input, what it commits), in the order files travel
    ("nefl-zoo train", "a resume: every file that\ncheckpoint.json names", "checkpoint.json: each file\nof the checkpoint, sha256"),
    ("nefl-zoo export", "the committed checkpoint:\nsha256s, spec.yaml", "verified ONNX files, then\nmanifest.json with sha256s"),
    ("the runtime", "path inside the folder, size,\nsha256, no external data", "the checked bytes,\nto onnxruntime"),
    ("onnxruntime", "(never opens the path)", "your logits"),
]


def guarantees():
    """The chain of checks a model's files pass, from a training run to onnxruntime."""
    fig, ax = canvas(9.6, 2.7)
    width = 8.4 / len(CHECKS)
    ax.text(0.05, 1.3, "checks\nbefore use", fontsize=8, va="center", weight="bold")
    ax.text(0.05, 0.45, "commits or\npasses on", fontsize=8, va="center", weight="bold")
    for n, (stage, checks, commits) in enumerate(CHECKS):
        x = 1.2 + width * (n + 0.5)
        box(ax, x, 2.05, width - 0.4, 0.45, stage, color=SHARED if n == 0 else "#dbe9f6", size=9, weight="bold")
        box(ax, x, 1.3, width - 0.4, 0.6, checks, size=7.5)
        box(ax, x, 0.45, width - 0.4, 0.6, commits, color=FAINT, size=7.5)
        if n:
            arrow(ax, (x - width + (width - 0.4) / 2, 2.05), (x - (width - 0.4) / 2, 2.05))
    ax.text(0.05, 2.55, "What is hashed is what runs: each step trusts only what the step before it committed, "
            "and checks it before use.", fontsize=8.5, va="center")
    return fig

FIGURES: dict[str, Callable[[], plt.Figure]] = {
    "slice-map": slice_map,
    "nested-onnx": nested_onnx,
    "nefl-round": nefl_round,
    "architecture": architecture,
    "automatic-nesting": automatic_nesting,
    "adaptive-policy": adaptive_policy,
    "run-store": run_store,
    "guarantees": guarantees,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", choices=[[], *FIGURES], help="figures to draw (default: all)")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.names or FIGURES:
        fig = FIGURES[name]()
        path = OUT / f"{name}.png"
        fig.savefig(path, dpi=DPI, metadata=getattr(fig, "png_metadata", None))
        plt.close(fig)
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

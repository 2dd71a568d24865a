"""The figure of every benchmark, drawn from its results JSON alone (:mod:`publish` saves it).

``FIGURES[NAME](results) -> matplotlib Figure``. Most results are the tables a script printed,
as printed (``runs[*].tables``: columns and rows of cells); :func:`markdown_tables.find_table` picks the
latest table by words of its title or columns and :func:`markdown_tables.number` reads a cell. clock,
device_classes, robust, secagg and nested write structured JSON of their own.
"""

from __future__ import annotations

import re
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from markdown_tables import column, find_table, number, tables  # noqa: E402


def _figure(panels: int, width: float = 5.0, height: float = 3.6):
    fig, axes = plt.subplots(1, panels, figsize=(width * panels, height), squeeze=False)
    return fig, list(axes[0])


def _done(fig, axes, title: str):
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _numbers(cells: list[str]) -> list[float]:
    return [number(c) if number(c) is not None else np.nan for c in cells]


def _std(cell: str) -> float:
    """The ± part of ``"85.48 ± 4.94"`` (0 when absent)."""
    match = re.search(r"±\s*([\d.]+)", cell)
    return float(match.group(1)) if match else 0.0


def _hbars(ax, labels: list[str], series: dict[str, tuple[list[float], list[float]]]):
    """Horizontal grouped bars: ``series`` label -> (values, errors)."""
    y = np.arange(len(labels))
    height = 0.8 / len(series)
    for i, (name, (values, errors)) in enumerate(series.items()):
        ax.barh(y + i * height - 0.4 + height / 2, values, height, xerr=errors, label=name, capsize=2)
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()


def _bars(ax, labels: list[str], series: dict[str, list[float]], rotate: int = 0):
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=name)
    ax.set_xticks(x, labels, fontsize=7, rotation=rotate, ha="right" if rotate else "center")


def slim(data: dict):
    t = find_table(data, "slim latency ratio", "masked latency ratio")
    fig, axes = _figure(2)
    specs = column(t, "spec")
    for ax, kind in zip(axes, ("slim", "masked")):
        for spec in dict.fromkeys(specs):
            rows = [i for i, s in enumerate(specs) if s == spec]
            macs = _numbers([column(t, "MACs ratio")[i] for i in rows])
            lat = _numbers([column(t, f"{kind} latency ratio")[i] for i in rows])
            ax.plot(macs, lat, marker="o", label=spec)
        ax.plot([0, 1.05], [0, 1.05], color="grey", lw=1)
        ax.plot([0, 1.05], [0, 1.3 * 1.05], color="grey", lw=1, ls="--", label="1.3 x MACs ratio")
        ax.set(title=f"{kind} execution", xlabel="MACs ratio (tier / full)", ylabel="latency ratio (tier / full)", ylim=(0, 1.2))
    axes[0].legend(fontsize=7)
    return _done(fig, axes, "Slim modules vs masked execution (CPU, batch 64)")


def fl(data: dict):
    over = find_table(data, "engine (s)", "plain loops (s)")
    mem = find_table(data, "extra peak RSS")
    fig, axes = _figure(2)
    _bars(axes[0], column(over, "round"), {"engine": _numbers(column(over, "engine (s)")),
                                           "plain PyTorch loops": _numbers(column(over, "plain loops (s)"))})
    axes[0].set(title="one round of digits-quick", xlabel="round", ylabel="seconds")
    axes[0].legend(fontsize=8)
    axes[1].bar(column(mem, "tier"), _numbers(column(mem, "extra peak RSS")))
    axes[1].set(title="peak memory of local training (ResNet18)", xlabel="tier", ylabel="extra peak RSS (MiB)")
    return _done(fig, axes, "Training engine overhead")


def compare(data: dict):
    fig, axes = _figure(2, 5.5, 4.2)
    parts = (("IID", "Convergent comparison, IID", "iid:"), ("Dirichlet", "Convergent comparison, Dirichlet", "noniid:"))
    for ax, (name, title, section) in zip(axes, parts):  # as transcribed, or as bench_compare.py prints its parts
        t = find_table(data, "Worst (running)", where=lambda t: title in t["title"] or t.get("section", "").startswith(section))
        series = {bn: (_numbers(column(t, f"Worst ({bn})")), [_std(c) for c in column(t, f"Worst ({bn})")])
                  for bn in ("running", "recompute")}
        _hbars(ax, column(t, "Method"), series)
        ax.set(title=f"{name}: worst-case submodel", xlabel="top-1 accuracy (%), mean ± std over seeds", xlim=(40, 100))
    axes[0].legend(fontsize=7, title="BN statistics", title_fontsize=7)
    return _done(fig, axes, "NeFL paper's Table 1 on digits (ResNet20, 40 rounds, 3 seeds)")


def fedlps(data: dict):
    levels = find_table(data, "predictor params", "share of the unpruned")
    acc = find_table(data, "backbone", "digits0-4")
    fig, axes = _figure(2)
    x = column(levels, "level")
    axes[0].plot(x, _numbers(column(levels, "share of the unpruned")), marker="o", label="predictor parameters (%)")
    axes[0].plot(x, [100 * v for v in _numbers(column(levels, "vs one full model"))], marker="s", label="MACs vs one model per task (%)")
    axes[0].set(title="cost per pruning level", xlabel="level", ylabel="% of the unpruned")
    axes[0].legend(fontsize=7)
    labels = [f"{b.split(' (')[0]}, {bn.split(' (')[0]}" for b, bn in zip(column(acc, "backbone"), column(acc, "BN statistics"))]
    tasks = [c for c in acc["columns"] if c.startswith("digits")]
    _hbars(axes[1], labels, {task: (_numbers(column(acc, task)), [_std(c) for c in column(acc, task)]) for task in tasks})
    axes[1].set(title="accuracy per task (2 seeds)", xlabel="top-1 accuracy (%)")
    axes[1].legend(fontsize=7)
    return _done(fig, axes, "FedLPS on digits")


def flower(data: dict):
    t = find_table(data, "engine", "per round (s), per pass")
    fig, axes = _figure(2, 5.5, 4.0)
    labels = [re.sub(r" \(.*", "", e).replace("deployment, 20 SuperNodes, ", "deploy: ") for e in column(t, "engine")]
    labels = [lab.replace("a ClientApp process per message", "process per message") for lab in labels]
    means = _numbers(column(t, "mean"))
    axes[0].barh(labels, means)
    for y, value in enumerate(means):
        axes[0].annotate(f"{value:.2f}", (value, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    axes[0].set(title="time per round (mean of 2 passes)", xlabel="seconds", xlim=(0, 1.15 * max(means)))
    axes[0].invert_yaxis()
    startup = [np.mean([float(v) for v in c.split(",")]) for c in column(t, "start-up")]
    axes[1].barh(labels, startup)
    axes[1].set(title="start-up (mean of 2 passes)", xlabel="seconds")
    axes[1].invert_yaxis()
    for ax in axes:
        ax.tick_params(axis="y", labelsize=7)
    return _done(fig, axes, "Flower engines on digits-quick (20 clients, 10 a round)")


def export(data: dict):
    t = find_table(data, "ORT ms", "eager ms")
    fig, axes = _figure(2)
    specs = column(t, "spec")
    for ax, col, title in zip(axes, ("latency ratio / MACs ratio", "latency ratio / MACs ratio, padded"),
                              ("plain export", "channels padded to 8")):
        for spec in dict.fromkeys(specs):
            rows = [i for i, s in enumerate(specs) if s == spec]
            ax.plot([number(column(t, "gamma")[i]) for i in rows],
                    [number(t["rows"][i][t["columns"].index(col)]) for i in rows], marker="o", label=spec)
        ax.axhline(1.3, color="grey", ls="--", lw=1, label="target 1.3")
        ax.set(title=title, xlabel="gamma", ylabel="latency ratio / MACs ratio (onnxruntime)", ylim=(0.8, 2.0))
    axes[0].legend(fontsize=7)
    return _done(fig, axes, "ONNX tiers on onnxruntime (batch 64)")


def latency(data: dict):
    t = find_table(data, "ORT latency ratio / MACs ratio")
    fig, axes = _figure(2)
    specs, batches = column(t, "spec"), column(t, "batch")
    for ax, batch in zip(axes, dict.fromkeys(batches)):
        for spec in dict.fromkeys(specs):
            rows = [i for i, (s, b) in enumerate(zip(specs, batches)) if s == spec and b == batch]
            ax.plot([number(column(t, "MACs ratio")[i]) for i in rows], [number(column(t, "ORT latency ratio")[i]) for i in rows],
                    marker="o" if "aligned" in spec else "x", ls="-" if "aligned" in spec else ":", label=spec)
        ax.axhline(1.15, color="grey", ls="--", lw=1)
        ax.set(title=f"batch {batch}", xlabel="MACs ratio", ylabel="ORT latency ratio / MACs ratio", ylim=(0, 2.8))
    axes[0].legend(fontsize=6, ncol=2)
    return _done(fig, axes, "Aligned widths (o, solid) vs the paper's widths (x, dotted) on onnxruntime")


def cli(data: dict):
    t = find_table(data, "command s", "MACs cache")
    fig, axes = _figure(1, 7, 3.4)
    labels = [f"{c.strip('`').replace('nefl-zoo ', '')} ({cache})" for c, cache in zip(column(t, "command"), column(t, "MACs cache"))]
    _hbars(axes[0], labels, {"command": (_numbers(column(t, "command s")), [0] * len(labels)),
                             "python -c 'import torch'": (_numbers(column(t, "import torch")), [0] * len(labels))})
    axes[0].set(xlabel="wall seconds (median of pairs)")
    axes[0].legend(fontsize=8)
    return _done(fig, axes, "CLI wall time against a bare import torch")


def quant(data: dict):
    t = find_table(data, "bytes / FP32", where=lambda t: "demo" in (t["title"] + t.get("section", "")).lower())
    fig, axes = _figure(2)
    tiers, precisions = column(t, "tier"), column(t, "precision")
    for precision in dict.fromkeys(precisions):
        rows = [i for i, p in enumerate(precisions) if p == precision]
        axes[0].plot([tiers[i] for i in rows], [number(column(t, "accuracy")[i]) for i in rows], marker="o", label=precision)
        axes[1].plot([tiers[i] for i in rows], [number(column(t, "/ FP32, batch 32")[i]) for i in rows], marker="o", label=f"{precision} latency")
        axes[1].plot([tiers[i] for i in rows], [number(column(t, "bytes / FP32")[i]) for i in rows], marker="s", ls="--", label=f"{precision} bytes")
    axes[0].set(title="accuracy on the digits test split", xlabel="tier", ylabel="top-1 (%)")
    axes[1].set(title="against FP32 (latency at batch 32)", xlabel="tier", ylabel="ratio to FP32")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=6)
    return _done(fig, axes, "Quantized tiers of the demo run (ResNet20)")


def edge(data: dict):
    t = find_table(data, "batch 32 latency ratio / MACs ratio", where=lambda t: len({r[0] for r in t["rows"]}) >= 3)  # a run of several specs
    fig, axes = _figure(2)
    specs = column(t, "spec")
    for ax, batch in zip(axes, ("batch 1", "batch 32")):
        for spec in dict.fromkeys(specs):
            rows = [i for i, s in enumerate(specs) if s == spec]
            ax.plot([number(column(t, "MACs ratio")[i]) for i in rows],
                    [number(column(t, f"{batch} latency ratio")[i]) for i in rows], marker="o", label=spec.split("/")[0])
        ax.axhline(1.2, color="grey", ls="--", lw=1, label="target 1.2")
        ax.set(title=batch, xlabel="MACs ratio", ylabel="latency ratio / MACs ratio", ylim=(0.8, 1.6))
    axes[0].legend(fontsize=7)
    return _done(fig, axes, "Edge families on onnxruntime (224x224)")


def autonest(data: dict):
    groups = [(t["title"].split(":")[0], t) for t in data["runs"][-1]["tables"]]
    fig, axes = _figure(2)
    kinds = ("exact", "inexact by construction", "refused")
    bottom = np.zeros(len(groups))
    for kind in kinds:
        counts = np.array([sum(c.startswith(kind) for c in column(t, "class")) for _, t in groups])
        axes[0].bar([g for g, _ in groups], counts, bottom=bottom, label=kind)
        bottom += counts
    axes[0].set(title="models per outcome", ylabel="models")
    axes[0].legend(fontsize=7)
    for name, t in groups:
        ratios = [v for v in _numbers(column(t, "ratio")) if not np.isnan(v)]
        axes[1].hist(ratios, bins=np.linspace(0.45, 1.0, 23), alpha=0.6, label=name)
    axes[1].set(title="parameters kept by the tier at gamma_W 0.5", xlabel="parameter ratio", ylabel="models")
    axes[1].legend(fontsize=7)
    return _done(fig, axes, "Automatic nesting of timm and torchvision models")


def accel(data: dict):
    rounds = find_table(data, "sequential s", "batched s")
    epoch = find_table(data, "DataLoader ms", "resident ms")
    fig, axes = _figure(2)
    labels = [m.split(" (")[0] for m in column(rounds, "digits-quick round")]
    _bars(axes[0], labels, {"sequential": _numbers(column(rounds, "sequential s")), "batched": _numbers(column(rounds, "batched s"))})
    axes[0].set(title="one digits-quick round (CPU)", ylabel="seconds")
    axes[0].legend(fontsize=8)
    labels = ["epoch of batches", "client's training"]
    _bars(axes[1], labels, {"DataLoader": _numbers(column(epoch, "DataLoader ms")), "device-resident": _numbers(column(epoch, "resident ms"))})
    axes[1].set(title="data on the device (CPU)", ylabel="ms (log)", yscale="log")
    axes[1].legend(fontsize=8)
    return _done(fig, axes, "Batched clients and device-resident data on 2 CPU cores")


def nested(data: dict):
    fig, axes = _figure(3, 4.4, 3.8)
    sources = data["parts"]["bytes"]["result"]["sources"]
    names = [s["key"].split("/")[0] for s in sources]
    series = {}
    for precision in ("fp32", "int8", "fp16"):
        series[precision] = [next((r["nested"] / r["full"] for r in s["rows"] if r["precision"] == precision and r.get("full")), np.nan)
                             for s in sources]
    _bars(axes[0], names, series, rotate=30)
    axes[0].axhline(1.10, color="grey", ls="--", lw=1)
    axes[0].axhline(1.25, color="grey", ls=":", lw=1)
    axes[0].set(title="nested file / full tier's file", ylabel="bytes ratio")
    axes[0].legend(fontsize=7)
    rows = data["parts"]["tiers"]["result"]["rows"]
    for precision in ("fp32", "int8"):
        keys = [k for k, r in rows.items() if r["precision"] == precision]
        for batch, style in (("b1", "-"), ("b32", "--")):
            axes[1].plot([rows[k]["name"] for k in keys], [rows[k][batch]["nested"] / rows[k][batch]["files"] for k in keys],
                         marker="o", ls=style, label=f"{precision}, batch {batch[1:]}")
    axes[1].axhline(1.10, color="grey", ls="--", lw=1)
    axes[1].set(title="latency, nested / per-tier file", xlabel="tier", ylabel="ratio")
    axes[1].legend(fontsize=7)
    adaptive = data["parts"].get("adaptive", {}).get("tables") or [t for run in data.get("runs", []) for t in run["tables"]]
    streams = [t for t in adaptive if "miss rate (call > deadline; per pass)" in t["columns"]]
    if streams:  # the last stream: batch 128 every 100 ms as published
        t = streams[-1]
        phases = list(dict.fromkeys(column(t, "phase")))
        for policy in ("static", "adaptive"):
            miss = [number(t["rows"][i][3]) for i, p in enumerate(column(t, "policy")) if p == policy]
            axes[2].plot(range(len(phases)), miss, marker="o", label=policy)
        axes[2].set_xticks(range(len(phases)), [p.split(". ")[1] for p in phases], fontsize=7, rotation=30, ha="right")
        axes[2].set(title="largest batch under load (part 3)", ylabel="requests over the deadline (%)")
        axes[2].legend(fontsize=7)
    return _done(fig, axes, "Nested deployment: one file for every tier (demo run, onnxruntime)")


def batched_order(data: dict):
    merged = {}  # (rule, method) -> row, later runs first-class: one run per set of overrides
    for t in tables(data):
        if "batched, 1 thread" in t["columns"]:
            rule = ""
            for row in t["rows"]:
                rule = row[0] or rule
                merged[(rule, row[1].split(" (")[0])] = [rule, *row[1:]]
    drift = {"columns": ["last-batch rule", "method", "sequential, 2 threads", "batched, 1 thread"], "rows": list(merged.values())}
    acc = find_table(data, "NeFL worst / avg")
    fig, axes = _figure(2)
    rules, methods = [], column(drift, "method")
    rule = ""
    for cell in column(drift, "last-batch rule"):
        rule = cell or rule
        rules.append(rule.split(" (")[0].strip("`").replace("`", ""))
    labels = [f"{m.split(' (')[0]}, {r}" for m, r in zip(methods, rules)]
    worst = {name: [float(re.search(r"worst ([\d.]+)%", c).group(1)) for c in column(drift, name)]
             for name in ("sequential, 2 threads", "batched, 1 thread")}
    _hbars(axes[0], labels, {k: (v, [0] * len(v)) for k, v in worst.items()})
    axes[0].set(title="drift from sequential, 1 thread", xlabel="worst tensor, % of the round's update (log)", xscale="log")
    axes[0].legend(fontsize=7, loc="lower right")
    labels = [f"{r.strip('`').replace('`', '')}, {bn}" for r, bn in zip(column(acc, "rule"), column(acc, "BN at evaluation"))]
    _hbars(axes[1], labels, {"NeFL worst": (_numbers(column(acc, "NeFL worst")), [_std(c) for c in column(acc, "NeFL worst")]),
                             "HeteroFL worst": (_numbers(column(acc, "HeteroFL worst")), [_std(c) for c in column(acc, "HeteroFL worst")])})
    axes[1].set(title="accuracy per last-batch rule (2 seeds)", xlabel="worst-case top-1 (%)", xlim=(60, 100))
    axes[1].legend(fontsize=7, loc="lower right")
    return _done(fig, axes, "Batched clients and summation order")


def fedavg_mnist(data: dict):
    t = find_table(data, "paper (C = 0.1)", "ours")
    fig, axes = _figure(1, 8, 3.8)
    labels = [f"{m.split(' (')[0]}, E={e}, {p.split(' (')[0]}" for m, e, p in zip(column(t, "model"), column(t, "E"), column(t, "partition"))]
    _hbars(axes[0], labels, {"FedAvg paper": (_numbers(column(t, "paper")), [0] * len(labels)),
                             "ours": (_numbers([r[t["columns"].index("ours")] for r in t["rows"]]), [0] * len(labels))})
    axes[0].set(xlabel="communication rounds to the target (log)", xscale="log")
    axes[0].legend(fontsize=8)
    return _done(fig, axes, "FedAvg on MNIST: rounds to 97% (2NN) / 99% (CNN) accuracy")


def nested_mnist(data: dict):
    fig, axes = _figure(2)
    curves = {}  # (model, method) -> {part: accuracies per tier}
    for run in data["runs"]:
        for t in run["tables"]:
            if t["columns"][:2] != ["Method", "g0.2"]:
                continue
            tiers = t["columns"][1:]
            for row in t["rows"]:
                if "\\|" in row[1]:  # transcribed: "IID \| Dirichlet" per cell, the model in the method's name
                    model, method = row[0].split(" ", 1)
                    for i, part in enumerate(("IID", "Dirichlet")):
                        curves.setdefault((model, method), {})[part] = [float(re.split(r"\\\|", c)[i]) for c in row[1:]]
                else:  # one part of one model per run: --model M --part P
                    model = re.search(r"--model (\w+)", run["command"]).group(1).upper()
                    part = "IID" if "--part iid" in run["command"] else "Dirichlet"
                    curves.setdefault((model, row[0]), {})[part] = _numbers(row[1:])
    for (model, method), by_part in curves.items():
        ax = axes[0] if model == "2NN" else axes[1]
        color = None
        for part, style in (("IID", "-"), ("Dirichlet", "--")):
            if part in by_part:
                line, = ax.plot(tiers, by_part[part], marker="o" if part == "IID" else "s", ls=style, color=color,
                                label=f"{method}, {part}")
                color = line.get_color()
    for ax, model in zip(axes, ("2NN", "CNN")):
        ax.set(title=model, xlabel="submodel", ylabel="top-1 accuracy (%)")
        ax.legend(fontsize=6)
    axes[1].set_ylim(86, 98)
    return _done(fig, axes, "Nested methods on MNIST (3 seeds; solid IID, dashed Dirichlet 0.5)")


def robust(data: dict):
    attacks, shares = ("sign_flip", "scale50", "gaussian"), (0.1, 0.2, 0.3)
    fig, axes = _figure(len(attacks) + 1, 3.6, 3.4)
    for ax, attack in zip(axes, attacks):
        for rule, by in data["attacks"].items():
            acc = [by["clean"]["curve"][-1]["full"], *(by[attack][f"{s:g}"]["curve"][-1]["full"] for s in shares)]
            ax.plot([0, *(100 * s for s in shares)], [100 * a for a in acc], marker="o", label=rule)
        ax.set(title=attack, xlabel="attacking clients (%)", ylabel="full-model accuracy (%)", ylim=(0, 100))
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for z, res in data["dp"].items():
        ax.plot([c["epsilon"] for c in res["curve"]], [100 * c["full"] for c in res["curve"]], marker="o", label=f"z = {z}")
    ax.axhline(100 * data["attacks"]["mean"]["clean"]["curve"][-1]["full"], color="k", ls="--", label="non-private")
    ax.set(title="DP-FedAvg (clip %g)" % data["setting"]["clip"], xlabel="epsilon (delta 1e-5)", ylabel="full-model accuracy (%)",
           xscale="log", ylim=(0, 100))
    ax.legend(fontsize=7)
    return _done(fig, axes, "Robust aggregation and DP-FedAvg on MNIST (nested 2NN, 20 rounds)")


def clock(data: dict):
    entries = data["scenario"]["entries"]
    curves = data["scenario"].get("curves")
    fig, axes = _figure(2 if curves else 1, 5.5, 3.8)
    if curves:
        for key, curve in curves.items():
            axes[0].plot(np.array(curve["sim_time_s"]) / 60, curve["accuracy"], marker=".", label=entries[key]["label"])
        target = next(iter(entries.values()))["target"]
        axes[0].axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.2f}%")
        axes[0].set(title="worst-case accuracy", xlabel="simulated time (min)", ylabel="top-1 (%)")
        axes[0].legend(fontsize=6)
    labels = [e["label"] for e in entries.values()]
    axes[-1].barh(labels, [e["mean_time_to_target_s"] or np.nan for e in entries.values()])
    axes[-1].set(title="time to the target", xlabel="simulated seconds")
    axes[-1].invert_yaxis()
    axes[-1].tick_params(axis="y", labelsize=7)
    return _done(fig, axes, "Time to accuracy on a simulated clock (MNIST, 1,000 devices)")


def device_classes(data: dict):
    scenarios = data["scenarios"]
    fig, axes = plt.subplots(2, len(scenarios), figsize=(5 * len(scenarios), 7.2), squeeze=False)
    for col, found in enumerate(scenarios.values()):
        top, bottom = axes[0][col], axes[1][col]
        labels = found["labels"]
        for key, curve in found["curves"].items():
            top.plot(np.array(curve["sim_time_s"]) / 60, curve["worst_device_class"], marker=".", label=labels[key])
        top.set(title=f"{found['title']}\nworst device class (seed mean)", xlabel="simulated time (min)", ylabel="top-1 (%)")
        names = list(next(iter(found["device_classes"].values()))["classes"])
        x, width = np.arange(len(labels)), 0.8 / len(names)
        for i, name in enumerate(names):
            stats = np.array([found["device_classes"][k]["classes"][name]["tier"] for k in labels])
            bottom.bar(x + (i - (len(names) - 1) / 2) * width, stats[:, 0], width, yerr=stats[:, 1], capsize=2, label=name)
        bottom.set_xticks(x, [labels[k] for k in labels], rotation=30, ha="right", fontsize=6)
        bottom.set(title="each device class on the tier it runs, at the end", ylabel="top-1 (%)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    axes[1][0].legend(fontsize=6)
    fig.suptitle("Where nested FL pays\nMNIST, 1,000 phones and laptops, data by device class", fontsize=11)
    fig.tight_layout()
    return fig


def secagg(data: dict):
    fig, axes = _figure(2, 4.5, 3.4)
    variants = {"plain Flower": data["plain"], "SecAgg+": data["secure"]}
    axes[0].bar(list(variants), [v["per_round_s"] for v in variants.values()])
    axes[0].set(title="time per round (median of rounds 2-3)", ylabel="seconds")
    down = [v.get("protocol_bytes_down", v["tensor_bytes_down"]) / 1e6 for v in variants.values()]
    up = [v.get("protocol_bytes_up", v["tensor_bytes_up"]) / 1e6 for v in variants.values()]
    _bars(axes[1], list(variants), {"down": down, "up": up})
    axes[1].set(title="bytes per round", ylabel="MB")
    axes[1].legend(fontsize=8)
    return _done(fig, axes, f"SecAgg+ against plain Flower ({data['clients']} clients, NeFL)")


def _peer_ratios(data: dict, *words: str) -> tuple[list[str], dict[str, list[float]]]:
    """Every run's rows of bench_peer's tables with ``words`` in their columns: row labels, and
    per nefl-zoo side the ratio (the ``x`` after its ``SIDE s`` column; NaN where it did not run)."""
    labels, ratios = [], {}
    for table in [t for t in tables(data) if all(w in t["columns"] for w in words)]:
        cols = table["columns"]
        sides = {c.removesuffix(" s"): i + 1 + (cols[i + 1] == "load") for i, c in enumerate(cols)
                 if c.endswith(" s") and c not in ("authors s", "compile s") and i + 1 < len(cols)}
        for row in table["rows"]:
            model, method = row[0].split()[:2]
            labels.append(" ".join([model, method.removeprefix("NeFL-"), *([row[1]] if "submodel" in words else [])]))
            for side in dict.fromkeys([*ratios, *sides]):
                ratios.setdefault(side, [np.nan] * (len(labels) - 1)).append(
                    number(row[sides[side]]) if side in sides else np.nan)
    return labels, ratios


def peer(data: dict):
    """Per case (median round) and per submodel (one client): the authors' seconds over each
    nefl-zoo side's, every run's cases together."""
    fig, (ax1, ax2) = _figure(2, width=5.5)
    cases, per_case = _peer_ratios(data, "authors s", "load range")
    _bars(ax1, cases, per_case)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.axhline(1.5, color="grey", lw=0.8, ls="--")
    ax1.set_ylabel("authors' median round / nefl-zoo's")
    ax1.legend(fontsize=7)
    labels, per_tier = _peer_ratios(data, "submodel", "authors s")
    _hbars(ax2, labels, {side: (values, [0] * len(labels)) for side, values in per_tier.items()})
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_xlabel("authors' time / nefl-zoo's (per client)")
    ax2.legend(fontsize=7)
    return _done(fig, [ax1, ax2], "nefl-zoo against the NeFL authors' code, the same rounds (dashed: 1.5x)")


FIGURES: dict[str, Callable[[dict], "matplotlib.figure.Figure"]] = {
    "accel": accel, "autonest": autonest, "batched_order": batched_order, "cli": cli, "clock": clock, "compare": compare,
    "device_classes": device_classes,
    "edge": edge, "export": export, "fedavg_mnist": fedavg_mnist, "fedlps": fedlps, "fl": fl, "flower": flower,
    "latency": latency, "nested": nested, "nested_mnist": nested_mnist, "peer": peer, "quant": quant, "robust": robust,
    "secagg": secagg, "slim": slim,
}

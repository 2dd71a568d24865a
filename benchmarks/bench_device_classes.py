"""Where nested FL pays: data that differs by device, and what each device class gets
(docs/benchmarks/device_classes.md).

Three scenarios on MNIST with 1,000 clients that are low-end phones, mid phones and laptops (the
device mix of specs/train/mnist-devices.yaml), each client's 50 images drawn by its device class:
``specs/train/mnist-devices-{iid,label-skew,unseen}.yaml`` (the training set's mix for every
class; each class mostly its own digits; laptops never a 9). Every entry of ``compare --preset
time-to-accuracy``: NeFL, HeteroFL, FjORD (NeFL's) and DepthFL (NeFL's) with each client on the
largest tier it finishes in time, FedAvg waiting for every online client on the full model, FedAvg
on the clients that fit the full model; and FjORD as its paper has it (ordered dropout per batch
up to the client's tier, self-distillation). ``--seeds`` seeds, all scenarios one seed after the other
(an interrupted benchmark has whole seeds), ``--jobs`` runs at a time of one torch thread each;
finished runs of the same length are reused.

Per scenario: the time to accuracy on the simulated clock on the worst-case submodel, the full
model and the worst device class (each against the highest accuracy every entry reaches); what each
device class gets at the end (its clients' own test splits on the tier they run and on the full
model, the worst class, the spread, its updates); and the papers' own measures on the test set: the
NeFL paper's "Worst" (the worst-case, smallest submodel) and "Avg" (the mean over the submodels),
and FjORD's accuracy of every submodel (its p-submodels: width p of every layer). Written to
benchmarks/results/device_classes.json, with the load average around each part, and the figure
drawn from it to docs/benchmarks/img/device_classes.png (``--plot-only`` redraws it). Each
scenario's ``stages`` give the wall time and the load average around the training of each seed.

    python benchmarks/mnist_offline.py /tmp/mnist-data
    python benchmarks/bench_device_classes.py --root /tmp/mnist-data --out /tmp/bench-device-classes
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import yaml

import publish

from nefl_zoo.fl.compare import Entry, accuracies, compare_methods, time_entries, worst_case
from nefl_zoo.fl.config import load_config
from nefl_zoo.fl.devices.report import read_records
from nefl_zoo.fl.engine import RunResult

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = {"iid": "IID: every class the training set's mix", "label-skew": "label skew by device class",
             "unseen": "a digit only phones hold (laptops never see a 9)"}
MEASURES = ("worst-case", "full model", "worst device class")


def config_path(scenario: str) -> Path:
    return ROOT / f"specs/train/mnist-devices-{scenario}.yaml"


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def entries(config) -> list[Entry]:
    """The preset's entries and FjORD as its paper has it (ordered dropout per batch, self-distillation)."""
    return [*time_entries(config), Entry("fjord", "fjord", name="FjORD (its paper's)")]


def papers_measures(results: dict, treatment: str) -> dict:
    """Per entry, from ``results.json``: the NeFL paper's Worst and Avg and every submodel's accuracy
    (FjORD's p-submodels), % on the test set under ``treatment``, mean and std over the seeds."""
    out = {}
    for key, saved in results.items():
        runs = [RunResult(**r) for r in saved]
        per_seed = [{t: 100 * a for t, a in accuracies(r, treatment).items()} for r in runs]
        stats = {"Worst": [worst_case(r, acc) for r, acc in zip(runs, per_seed)],
                 "Avg": [float(np.mean(list(acc.values()))) for acc in per_seed],
                 **{t: [acc[t] for acc in per_seed] for t in per_seed[0]}}
        out[key] = {k: [float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0] for k, v in stats.items()}
    return out


def refuse_other_lengths(folder: Path, rounds: int) -> None:
    """Stop, in one line, at a finished run of another number of rounds in ``folder``: compare
    reuses every finished run it finds there, whatever its length."""
    for saved in sorted(folder.glob("*/seed*/config.yaml")):
        found = yaml.safe_load(saved.read_text())["rounds"]
        if found != rounds:
            raise SystemExit(f"error: {saved.parent}: a run of {found} rounds, not {rounds}; give another --out or remove it")


def scenario(name: str, root: Path, out: Path, rounds: int, seeds: int, jobs: int) -> dict:
    """Train every entry of one scenario for ``seeds`` seeds (finished runs reused) and gather its results."""
    config = load_config(config_path(name), [f"data.root={root}", f"rounds={rounds}"])
    refuse_other_lengths(out / name, rounds)
    stage = {"seeds": seeds, "load_before": load()}
    start = time.perf_counter()
    compare_methods(config, entries(config), seeds, out / name, jobs=jobs, threads=1, reuse=True)
    stage.update(wall_s=round(time.perf_counter() - start, 1), load_after=load())
    tta = json.loads((out / name / "time_to_accuracy.json").read_text())
    classes = json.loads((out / name / "device_classes.json").read_text())
    results = json.loads((out / name / "results.json").read_text())
    times = {"worst-case": {"target": next(iter(tta["entries"].values()))["target"], "entries": tta["entries"]}, **tta["measures"]}
    return {"config": str(config_path(name).relative_to(ROOT)), "title": SCENARIOS[name], "rounds": rounds, "seeds": seeds,
            "seed_values": [config.seed + s for s in range(seeds)], "stages": [stage], "treatment": tta["treatment"], "time_to_accuracy": times,
            "device_classes": classes["entries"], "labels": classes["labels"], "papers": papers_measures(results, tta["treatment"]),
            "curves": curves(out / name, classes["labels"], seeds, config.seed)}


def curves(out: Path, labels: dict, seeds: int, first: int) -> dict:
    """Per entry, the worst device class's accuracy (%) at each evaluation, seed means, against the
    simulated time (s, seed means), from the runs' ``metrics.jsonl``."""
    found = {}
    for key in labels:
        runs = [read_records(out / key / f"seed{first + s}") for s in range(seeds)]
        evaluated = [[r for r in rs if "worst_device_class" in r] for rs in runs]
        found[key] = {"sim_time_s": np.mean([[r["sim_time_s"] for r in e] for e in evaluated], axis=0).round(1).tolist(),
                      "worst_device_class": (100 * np.mean([[r["worst_device_class"] for r in e] for e in evaluated], axis=0)).round(2).tolist()}
    return found


def _cell(stat) -> str:
    return f"{stat[0]:.2f} ± {stat[1]:.2f}"


def tables(name: str, found: dict) -> str:
    """The markdown of one scenario: time to accuracy, what each class gets, the papers' measures."""
    labels, times = found["labels"], found["time_to_accuracy"]
    lines = [f"## {found['title']} ({found['config']}, {found['seeds']} seed(s) {found['seed_values']}, {found['rounds']} rounds)", "",
             "Time to accuracy on the simulated clock, seconds (mean over the seeds that reach the target; seeds reaching it):", "",
             "| Method | " + " | ".join(f"{m}: to {times[m]['target']:.2f}%" for m in MEASURES) + " | Final worst device class (%) |",
             "|---|" + "---|" * (len(MEASURES) + 1)]
    for key, label in labels.items():
        cells = []
        for m in MEASURES:
            row = times[m]["entries"][key]
            reached = sum(t is not None for t in row["time_to_target_s"])
            value = "–" if row["mean_time_to_target_s"] is None else f"{row['mean_time_to_target_s']:,.0f}"
            cells.append(f"{value} ({reached}/{len(row['time_to_target_s'])})")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_cell(found['device_classes'][key]['worst_class'])} |")
    names = list(next(iter(found["device_classes"].values()))["classes"])
    lines += ["", "What each device class gets at the end: top-1 (%) on its clients' own test splits, on the tier each client "
              "runs and on the full model; the worst class and the spread (best minus worst) on the tiers; mean ± std over the seeds:", "",
              "| Method | " + " | ".join(f"{n}: its tier | {n}: full" for n in names) + " | Worst class | Spread |",
              "|---|" + "---|---|" * len(names) + "---|---|"]
    for key, label in labels.items():
        row = found["device_classes"][key]
        cells = " | ".join(f"{_cell(row['classes'][n]['tier'])} | {_cell(row['classes'][n]['full'])}" for n in names)
        lines.append(f"| {label} | {cells} | {_cell(row['worst_class'])} | {_cell(row['spread'])} |")
    lines += ["", "Updates per device class over the run (seed means): arrived, dropped or lost; and the tier its clients run:", "",
              "| Method | " + " | ".join(f"{n}: arrived | {n}: dropped + lost | {n}: tier" for n in names) + " |",
              "|---|" + "---|---|---|" * len(names)]
    for key, label in labels.items():
        row = found["device_classes"][key]["classes"]
        cells = []
        for n in names:
            u = row[n]["updates"]
            cells.append(f"{u['arrived']:,.1f} | {u['dropped'] + u['lost']:,.1f} | " + ", ".join(f"{t} ({c})" for t, c in row[n]["tiers"].items()))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    tiers = list(dict.fromkeys(t for p in found["papers"].values() for t in p if t not in ("Worst", "Avg")))
    lines += ["", f"The papers' own measures on the test set (BN {found['treatment']}), top-1 (%), mean ± std over the seeds: the NeFL "
              "paper's Worst (the worst-case submodel) and Avg (the mean over the submodels), and FjORD's accuracy of every submodel:", "",
              "| Method | Worst | Avg | " + " | ".join(tiers) + " |", "|---|---|---|" + "---|" * len(tiers)]
    for key, label in labels.items():
        p = found["papers"][key]
        lines.append(f"| {label} | {_cell(p['Worst'])} | {_cell(p['Avg'])} | " + " | ".join(_cell(p[t]) if t in p else "–" for t in tiers) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="folder holding MNIST/raw (benchmarks/mnist_offline.py)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-device-classes"), help="folder of the runs (outside the repository)")
    parser.add_argument("--rounds", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    results_path = publish.results_path("device_classes")
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results["provenance"] = publish.provenance()
    for seeds in range(1, args.seeds + 1):  # every scenario at one seed, then at two, ...: whole seeds first
        for name in names:
            found = scenario(name, args.root.resolve(), args.out, args.rounds, seeds, args.jobs)
            earlier = results.get("scenarios", {}).get(name, {})
            if earlier.get("rounds") == args.rounds:  # the runs of earlier seeds were reused: keep their wall times and loads
                found["stages"] = [s for s in earlier.get("stages", []) if s["seeds"] < seeds] + found["stages"]
            results.setdefault("scenarios", {})[name] = found
            results["provenance"]["load_after"] = publish._load()
            publish.save("device_classes", results)
            print(tables(name, found))
    print(f"wrote {results_path.relative_to(ROOT)} and {publish.figure('device_classes').relative_to(ROOT)}")


if __name__ == "__main__":
    publish.run("device_classes", main, capture=False)

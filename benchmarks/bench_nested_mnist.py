"""Nested FL on real images: the FedAvg paper's 2NN and CNN nested automatically, on MNIST
(docs/benchmarks/nested_mnist.md).

The two plain ``nn.Module``s of bench_fedavg_mnist.py, brought in with ``nz.nest`` and given five
width tiers (gamma_W 0.2, 0.4, 0.6, 0.8, 1: every hidden layer keeps its first
ceil(C * sqrt(gamma_W)) units). Neither has a residual block, so nesting offers no skippable
block: NeFL-WD is NeFL-W here and is not a row. Rows: NeFL-W, HeteroFL, FjORD (its own paper's,
``variant: original``, and the NeFL authors', ``nefl``) and FedAvg on the full model, trained by
``compare`` with the NeFL paper's setting scaled to MNIST: 100 clients, 10 a round, the paper's
dynamic environment (five client groups, each choosing among its allowed tiers every round),
E = 5 local epochs of batch 32, SGD at lr 0.1 decayed x0.1 at T/2 and 3T/4, T = 60 rounds; IID and Dirichlet
alpha 0.5; 3 seeds; the flatness test of bench_compare.py on every row. No BatchNorm in either
model, so the BN treatments coincide; the table shows ``running``.

    python benchmarks/mnist_offline.py /tmp/mnist-data
    OMP_NUM_THREADS=1 python benchmarks/bench_nested_mnist.py --root /tmp/mnist-data --out /tmp/nested-mnist --model 2nn --part iid &
    OMP_NUM_THREADS=1 python benchmarks/bench_nested_mnist.py --root /tmp/mnist-data --out /tmp/nested-mnist --model 2nn --part dirichlet
    python benchmarks/bench_nested_mnist.py --root /tmp/mnist-data --out /tmp/nested-mnist --model 2nn --part iid --report-only

A model's runs are registered in the process that trains them (``nz.nest``), so each part runs
in its own process (``compare --jobs`` spawns fresh ones): start the two parts side by side.

Results: every table printed goes to ``benchmarks/results/nested_mnist.json`` and the figure drawn from it
to ``docs/benchmarks/img/nested_mnist.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench_compare import flatness_table
from bench_fedavg_mnist import MODELS, nest_models
from nefl_zoo.fl.compare import Entry, compare_methods, load_runs, report
from nefl_zoo.fl.config import parse_config

import publish  # results JSON and figure (benchmarks/publish.py)

TIERS = [{"name": f"g{g:g}", "gamma": g, "gamma_w": g} for g in (0.2, 0.4, 0.6, 0.8, 1.0)]
ENTRIES = [Entry("nefl-w", "nefl", name="NeFL-W"), Entry("heterofl", "heterofl", name="HeteroFL"),
           Entry("fjord", "fjord", variant="original", name="FjORD (its paper's)"),
           Entry("fjord-nefl", "fjord", variant="nefl", name="FjORD (NeFL's)"), Entry("fedavg", "fedavg", name="FedAvg (full model)")]
PARTS = {"iid": {"partition": "iid"}, "dirichlet": {"partition": "dirichlet", "alpha": 0.5}}


def config(model_name: str, root: Path, part: str, rounds: int, epochs: int):
    """The comparison's config for one model and partition."""
    return parse_config({
        "name": f"nested-mnist-{part}", "method": "nefl", "seed": 0, "rounds": rounds,
        "spec": {"model": model_name, "inconsistent": ["steps", "norm"], "tiers": TIERS},
        "data": {"dataset": "mnist", "root": str(root), "augment": False, **PARTS[part]},
        "clients": {"num_clients": 100, "fraction": 0.1, "environment": "dynamic"},
        "train": {"local_epochs": epochs, "batch_size": 32, "lr": 0.1, "schedule": "step"},
        "eval": {"every": 5, "batch_size": 1000},
        "checkpoint_every": 25,
    }, "bench_nested_mnist")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="folder holding MNIST/raw (benchmarks/mnist_offline.py)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="2nn")
    parser.add_argument("--part", choices=sorted(PARTS), default="iid")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--report-only", action="store_true", help="tabulate the finished runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = nest_models()
    cfg = config(names[args.model], args.root.resolve(), args.part, args.rounds, args.epochs)
    out = args.out / args.model / args.part
    start = time.perf_counter()
    if args.report_only:
        comparison = report(cfg, ENTRIES, load_runs(cfg, ENTRIES, args.seeds, out), out, plot=False)
    else:
        comparison = compare_methods(cfg, ENTRIES, args.seeds, out, reuse=True, plot=False)
    flat = flatness_table(out, cfg, ENTRIES, args.seeds)
    text = f"{args.model.upper()}, {args.part}\n\n{comparison.markdown}\n{flat}\n"
    print(text)
    print(f"wall time: {(time.perf_counter() - start) / 60:.1f} min")
    (out / "bench.md").write_text(text)


if __name__ == "__main__":
    publish.run("nested_mnist", main)

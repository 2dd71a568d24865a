"""Batched clients against sequential ones and against a second thread, on the shipped config
(docs/benchmarks/batched_order.md): one round of
specs/train/digits-quick.yaml at lr 0.05 from the same seeded initial state; per tensor, the
difference as a share of the round's own update (median and worst), and the worst difference
relative to the tensor itself (max |a - b| / max |b|, what the 1e-5 promise bounds).

    OMP_NUM_THREADS=2 python benchmarks/bench_batched_order.py [--set train.last_batch=merge --set train.min_batch=16]

Each run (one per set of overrides) becomes a run of ``benchmarks/results/batched_order.json``;
the figure is drawn from it (:mod:`publish`; ``--plot-only`` redraws it alone).
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

import publish

from nefl_zoo.fl.config import load_config
from nefl_zoo.fl.engine import Engine

QUICK = str(Path(__file__).resolve().parent.parent / "specs/train/digits-quick.yaml")


def one_round(threads: int, parallel: int, method: str, out: Path, extra: list[str]):
    """The initial and the round-1 global state at ``threads`` torch threads and ``parallel_clients``."""
    torch.set_num_threads(threads)
    overrides = ["rounds=1", "train.local_epochs=1", "train.lr=0.05", f"method={method}", f"train.parallel_clients={parallel}", *extra]
    engine = Engine(load_config(QUICK, overrides), out)
    torch.manual_seed(engine.config.seed)
    init = engine.state = engine.strategy.init_global_state()
    engine.run_round(0)
    return init, engine.state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="extra", action="append", default=[], help="a config override for every run")
    parser.add_argument("--methods", default="fedavg,nefl")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp())
    rule = " ".join(args.extra) or "default"
    compared = {"sequential, 2 threads": (2, 1), "batched, 1 thread": (1, 2)}  # (threads, parallel_clients)
    print(f"overrides: {rule}; per tensor against sequential training at 1 thread: the median and worst difference as a share "
          "of the round's update, then the worst difference relative to the tensor\n")
    print("| last-batch rule | method | " + " | ".join(compared) + " |\n|---|---|---|---|")
    for method in args.methods.split(","):
        init, base = one_round(1, 1, method, out, args.extra)
        cells = []
        for threads, parallel in compared.values():
            _, other = one_round(threads, parallel, method, out, args.extra)
            shares, relative = [], 0.0
            for k, b in base.items():
                if not b.is_floating_point():
                    continue
                difference = float((other[k] - b).abs().max())
                relative = max(relative, difference / max(float(b.abs().max()), 1e-12))
                update = float((b - init[k]).abs().max())
                if update > 0:
                    shares.append(difference / update)
            cells.append(f"median {100 * np.median(shares):.1f}%, worst {100 * max(shares):.1f}%; {relative:.1e}")
        print(f"| {rule} | {method} ({len(shares)} tensors) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    publish.run("batched_order", main)

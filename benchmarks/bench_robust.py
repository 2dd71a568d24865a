"""Robust aggregation and client-level DP on nested updates, on MNIST (the page
"Robust aggregation and differential privacy", docs/benchmarks/robust.md).

The FedAvg paper's 2NN nested automatically (``nz.nest``, five width tiers gamma_W 0.2 .. 1),
NeFL with 100 clients, 10 a round, the NeFL paper's dynamic environment (five client groups),
E = 1 local epoch of batch 32 at lr 0.1, IID; accuracy of the full and the smallest submodel on
the first 2,000 test images after the last round.

1. Attacks: 0/10/20/30% of the clients (client ids ``c % 10 < 10 p``, so spread over the tier
   groups) attack every round they are sampled: ``sign_flip`` returns ``received - delta``,
   ``scale50`` ``received + 50 delta``, ``gaussian`` ``received + N(0, 1)`` (``delta`` = its
   honestly trained tensors minus the received ones). Rows: plain averaging (NeFedAvg), median,
   trimmed mean (trim 0.3) and norm bounding (clip ``--clip``). The attack is a wrapper around
   the strategy's client-side ``train`` hook, here only: the server's aggregation is untouched.
2. DP: DP-FedAvg (clip ``--clip``, three noise multipliers) beside the non-private run;
   accuracy and cumulative epsilon (delta 1e-5, q = 0.1) every ``--dp-every`` rounds.

    python benchmarks/mnist_offline.py /tmp/mnist-data
    OMP_NUM_THREADS=1 python benchmarks/bench_robust.py --root /tmp/mnist-data

Writes ``benchmarks/results/robust.json`` and the figure drawn from it
(``docs/benchmarks/img/robust.png``; ``--plot-only`` redraws it alone) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

import publish
from bench_fedavg_mnist import TwoNN

RESULTS = Path(__file__).resolve().parent / "results"
TIERS = [{"name": f"g{g:g}", "gamma_w": g} for g in (0.2, 0.4, 0.6, 0.8, 1.0)]
ATTACKS = ("sign_flip", "scale50", "gaussian")
SHARES = (0.1, 0.2, 0.3)


def rules(clip: float) -> dict[str, dict]:
    """The aggregation sections compared under attack."""
    return {"mean": {}, "median": {"rule": "median"}, "trimmed_mean": {"rule": "trimmed_mean", "trim": 0.3}, "norm_bound": {"clip": clip}}


def config(model: str, root: Path, rounds: int, aggregation: dict, every: int):
    """The benchmark's run config with ``aggregation`` as its section."""
    from nefl_zoo.fl.config import parse_config

    return parse_config({
        "name": "robust-mnist", "method": "nefl", "seed": 0, "rounds": rounds,
        "spec": {"model": model, "tiers": TIERS},
        "data": {"dataset": "mnist", "root": str(root), "augment": False, "partition": "iid", "max_test_samples": 2000},
        "clients": {"num_clients": 100, "fraction": 0.1, "environment": "dynamic"},
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.1, "schedule": "constant"},
        "eval": {"every": every, "batch_size": 1000},
        "checkpoint_every": rounds, "aggregation": aggregation,
    }, "bench_robust")


def forge(kind: str, received: torch.Tensor, trained: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """An attacker's tensor from its honestly trained one."""
    if kind == "sign_flip":
        return received - (trained - received)
    if kind == "scale50":
        return received + 50 * (trained - received)
    return received + torch.randn(received.shape, generator=generator, dtype=received.dtype)


def attacked(train, attackers: set[int], kind: str):
    """``train`` (a strategy's client hook) whose replies from ``attackers`` are forged."""
    def run(instruction, data, client_state):
        reply = train(instruction, data, client_state)
        cid = int(instruction.config["client"])
        if cid in attackers:
            generator = torch.Generator().manual_seed(int(instruction.config["seed"]))
            reply.arrays = {k: forge(kind, instruction.arrays[k], v, generator) if v.is_floating_point() else v
                            for k, v in reply.arrays.items()}
        return reply
    return run


def run(cfg, out: Path, attack: str | None = None, share: float = 0.0) -> dict:
    """One run; its per-evaluation accuracies (full and smallest submodel) and epsilons."""
    from nefl_zoo.fl.engine import Engine

    engine = Engine(cfg, out)
    if attack is not None:
        engine.strategy.train = attacked(engine.strategy.train, {c for c in range(100) if c % 10 < round(10 * share)}, attack)
    engine.run(overwrite=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"curve": [{"round": r["round"], "full": r["acc"]["g1"], "smallest": r["acc"]["g0.2"], "epsilon": r.get("epsilon")}
                      for r in rows if "acc" in r],
            "clipped": sum(r.get("clipped", 0) for r in rows)}


def table(results: dict) -> str:
    """The markdown tables of ``results``."""
    rules_ = list(results["attacks"])
    lines = ["| attack | share | " + " | ".join(rules_) + " |", "|---|---:|" + "---:|" * len(rules_)]
    acc = lambda res: f"{100 * res['curve'][-1]['full']:.1f} / {100 * res['curve'][-1]['smallest']:.1f}"  # noqa: E731
    lines.append("| none | 0% | " + " | ".join(acc(results["attacks"][r]["clean"]) for r in rules_) + " |")
    for attack in ATTACKS:
        for s in SHARES:
            lines.append(f"| {attack} | {100 * s:.0f}% | " + " | ".join(acc(results["attacks"][r][attack][f"{s:g}"]) for r in rules_) + " |")
    lines += ["", "| noise multiplier | " + " | ".join(f"round {c['round']}" for c in results["dp"][next(iter(results["dp"]))]["curve"]) + " |",
              "|---|" + "---:|" * len(results["dp"][next(iter(results["dp"]))]["curve"])]
    for z, res in results["dp"].items():
        lines.append(f"| {z} | " + " | ".join(f"{100 * c['full']:.1f} (eps {c['epsilon']:.3g})" for c in res["curve"]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="folder holding MNIST/raw (benchmarks/mnist_offline.py)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-robust"), help="run directories")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clip", type=float, default=0.5, help="norm bound of the norm_bound row and of DP")
    parser.add_argument("--noise", type=float, nargs=3, default=[0.1, 0.3, 1.0], help="DP noise multipliers")
    parser.add_argument("--dp-every", type=int, default=4, help="evaluate private runs every N rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("nefl_zoo").setLevel(logging.ERROR)  # a diverged run rejects every NaN update with a warning
    import nefl_zoo as nz

    torch.manual_seed(0)
    model = nz.nest(TwoNN(), (2, 1, 28, 28), name="robust_2nn")
    start = time.perf_counter()
    results: dict = {"setting": {"rounds": args.rounds, "clip": args.clip, "clients": 100, "per_round": 10, "model": "2NN nested, 5 widths"},
                     "attacks": {}, "dp": {}}
    for rule, section in rules(args.clip).items():
        cfg = config(model, args.root.resolve(), args.rounds, section, args.rounds)
        by = results["attacks"][rule] = {"clean": run(cfg, args.out / rule / "clean")}
        for attack in ATTACKS:
            by[attack] = {f"{s:g}": run(cfg, args.out / rule / f"{attack}-{s:g}", attack, s) for s in SHARES}
        print(f"{rule}: done at {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    for z in args.noise:
        dp = {"clip": args.clip, "dp": {"noise_multiplier": z, "delta": 1e-5}}
        results["dp"][f"{z:g}"] = run(config(model, args.root.resolve(), args.rounds, dp, args.dp_every), args.out / f"dp-{z:g}")
    results["wall_s"] = round(time.perf_counter() - start, 1)
    results["load_average"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "robust.json").write_text(json.dumps(results, indent=1))
    publish.figure("robust", results)
    print(table(results))
    print(f"\nfull / smallest submodel accuracy (%) after {args.rounds} rounds; wall {results['wall_s'] / 60:.1f} min on "
          f"{os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in results['load_average'])}")


if __name__ == "__main__":
    publish.run("robust", main, capture=False)

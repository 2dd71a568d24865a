"""SecAgg+ against plain Flower: per-round wall time and bytes of nested
federated learning on Flower's simulation engine, with and without ``secure_aggregation``.

The run: NeFL, ResNet20 at 8x8 (digits), three width tiers (0.25, 0.5, 1), ``--clients``
clients all training every round, 1 local epoch, ``--rounds`` rounds, evaluated once after the
last. Both variants run in one simulation (one Ray start, 2 actors with one torch thread each),
in the order plain, secure, secure, plain, so a drift in the machine's load falls on both alike.

Per round: the median of the records' ``time_s`` over rounds 2..R (round 1 also holds the nodes'
imports and data loading), over both passes. Bytes per round: plain, the tensors moved (each
client's submodel down and up, the records' ``bytes_down`` + ``bytes_up``); secure, every
message of SecAgg+'s four stages (``secagg_bytes``: instructions with the submodels, public
keys, encrypted key shares, masked vectors, unmasking shares), and of them the masked vectors
(the records' ``bytes_up``).

Run: ``python benchmarks/bench_secagg.py [--clients 10] [--rounds 3]``; prints markdown and
writes ``benchmarks/results/secagg.json`` and the figure drawn from it
(``docs/benchmarks/img/secagg.png``; ``--plot-only`` redraws it alone).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import publish  # noqa: E402
from nefl_zoo.fl.config import parse_config  # noqa: E402
from nefl_zoo.fl.flower import SimulatedRun, simulate_runs  # noqa: E402


def config(clients: int, rounds: int, secure: bool):
    data = {
        "name": "secagg", "method": "nefl", "rounds": rounds,
        "spec": {"model": "resnet20", "model_args": {"in_chans": 1, "img_size": 8},
                 "tiers": [{"name": "g0.25", "gamma_w": 0.25}, {"name": "g0.5", "gamma_w": 0.5}, {"name": "g1", "gamma_w": 1.0}]},
        "data": {"dataset": "digits", "augment": False},
        "clients": {"num_clients": clients, "fraction": 1.0},
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.1, "schedule": "constant"},
        "eval": {"every": rounds},
        "checkpoint_every": rounds,
    }
    if secure:
        data["secure_aggregation"] = {}
    return parse_config(data)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(runs: list[Path]) -> dict:
    """Median per-round time (rounds 2..R of every pass), round 1's, and bytes per round."""
    recs = [records(r) for r in runs]
    later = [r["time_s"] for rs in recs for r in rs[1:]]
    first = [rs[0]["time_s"] for rs in recs]
    last = recs[0][-1]
    out = {"per_round_s": statistics.median(later), "round_times_s": [[r["time_s"] for r in rs] for rs in recs],
           "round1_s": statistics.median(first), "tensor_bytes_down": last["bytes_down"], "tensor_bytes_up": last["bytes_up"],
           "acc_avg": [rs[-1]["avg"] for rs in recs]}
    if "secagg_bytes" in last:
        out["protocol_bytes_down"], out["protocol_bytes_up"] = last["secagg_bytes"]["down"], last["secagg_bytes"]["up"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        order = [("plain", False, 0), ("secure", True, 0), ("secure", True, 1), ("plain", False, 1)]
        simulate_runs([SimulatedRun(config(args.clients, args.rounds, secure), out / f"{name}-{p}") for name, secure, p in order], threads=1)
        plain, secure = (summary([out / f"{name}-0", out / f"{name}-1"]) for name in ("plain", "secure"))
    load_after = os.getloadavg()
    plain_bytes = plain["tensor_bytes_down"] + plain["tensor_bytes_up"]
    secure_bytes = secure["protocol_bytes_down"] + secure["protocol_bytes_up"]
    result = {
        "clients": args.clients, "rounds": args.rounds, "plain": plain, "secure": secure,
        "time_ratio": secure["per_round_s"] / plain["per_round_s"], "bytes_ratio": secure_bytes / plain_bytes,
        "load_before": load_before, "load_after": load_after, "wall_s": time.perf_counter() - start,
        "torch": torch.__version__, "flwr": __import__("flwr").__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
    }
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "secagg.json").write_text(json.dumps(result, indent=2) + "\n")
    publish.figure("secagg", result)
    mb = 1e6
    print(f"NeFL, ResNet20 8x8, {args.clients} clients per round, {args.rounds} rounds, Flower simulation (2 actors); "
          f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after\n")
    print("| variant | per round (s, median of rounds 2-R) | round 1 (s) | MB per round, down / up | of which masked vectors (MB) | final avg accuracy |")
    print("|---|---|---|---|---|---|")
    print(f"| plain Flower | {plain['per_round_s']:.2f} | {plain['round1_s']:.2f} | {plain['tensor_bytes_down'] / mb:.2f} / "
          f"{plain['tensor_bytes_up'] / mb:.2f} | - | {', '.join(f'{a:.3f}' for a in plain['acc_avg'])} |")
    print(f"| SecAgg+ | {secure['per_round_s']:.2f} | {secure['round1_s']:.2f} | {secure['protocol_bytes_down'] / mb:.2f} / "
          f"{secure['protocol_bytes_up'] / mb:.2f} | {secure['tensor_bytes_up'] / mb:.2f} | {', '.join(f'{a:.3f}' for a in secure['acc_avg'])} |")
    print(f"\nSecAgg+ / plain: time per round {result['time_ratio']:.2f}x, bytes per round {result['bytes_ratio']:.2f}x")


if __name__ == "__main__":
    publish.run("secagg", main, capture=False)

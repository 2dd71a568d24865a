"""Training-engine benchmarks.

1. Engine overhead: wall time of ``Engine.run_round`` against the same clients' local training
   run as plain PyTorch loops (DataLoader, SGD, cross-entropy) on the same slim modules and data.
2. Aggregation: ``nefedavg`` over 10 ResNet18 (NeFL-WD, CIFAR stem) client updates, against one
   client's local training time (500 samples x 5 epochs at batch 32, timed on 20 batches and
   scaled; synthetic 32x32 images as CIFAR-10 is not bundled).
3. Peak memory of one client's local training per tier (ResNet18 NeFL-WD, batch 32, synthetic
   32x32 images): each tier in a fresh subprocess; the kernel's peak RSS (VmHWM) is reset just
   before training through /proc/self/clear_refs and read after it, minus the RSS before it.

Run: ``python benchmarks/bench_fl.py [--rounds 5] [--threads 1]``; prints markdown.

Results: every table printed goes to ``benchmarks/results/fl.json`` and the figure drawn from it
to ``docs/benchmarks/img/fl.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import publish  # results JSON and figure (benchmarks/publish.py)

ROOT = Path(__file__).resolve().parents[1]
RESNET18 = ROOT / "specs" / "resnet18" / "nefl-wd.yaml"


def engine_overhead(rounds: int) -> dict:
    import tempfile

    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from nefl_zoo.fl.config import load_config
    from nefl_zoo.fl.engine import Engine

    config = load_config(ROOT / "specs/train/digits-quick.yaml")
    engine = Engine(config, tempfile.mkdtemp())
    torch.manual_seed(0)
    strategy = engine.strategy
    engine.state = strategy.init_global_state()
    train = config.train
    ratios, engine_s, plain_s = [], [], []
    for r in range(rounds + 1):  # round 0 warms both paths up and is not counted
        # the same clients and submodels the engine will use in round r
        jobs = []
        for cid, instruction in strategy.configure_train(r + 1, engine.state, engine.clients).items():
            net = strategy.compiled[instruction.level].build()
            net.load_state_dict(instruction.arrays)
            jobs.append((cid, net))
        start = time.perf_counter()
        for cid, net in jobs:
            torch.manual_seed(cid)
            opt = torch.optim.SGD(net.parameters(), lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
            loader = DataLoader(engine.data.client_dataset(cid), batch_size=train.batch_size, shuffle=True)
            net.train()
            for _ in range(train.local_epochs):
                for x, y in loader:
                    if len(y) < 2:
                        continue
                    opt.zero_grad()
                    F.cross_entropy(net(x), y).backward()
                    opt.step()
        plain = time.perf_counter() - start
        start = time.perf_counter()
        engine.run_round(r)
        full = time.perf_counter() - start
        if r == 0:
            continue
        engine_s.append(full)
        plain_s.append(plain)
        ratios.append(full / plain)
    return {"clients_per_round": len(jobs), "engine_s": engine_s, "plain_s": plain_s, "ratio": ratios,
            "median_ratio": statistics.median(ratios)}


def _resnet18():
    from nefl_zoo.slim import compile_spec
    from nefl_zoo.spec import load_spec

    return compile_spec(load_spec(RESNET18))


def aggregation_time(repeats: int) -> dict:
    import torch.nn.functional as F

    from nefl_zoo.fl.aggregation.nefedavg import Update, nefedavg

    compiled = _resnet18()
    torch.manual_seed(0)
    state = compiled.init_global_state()
    tiers = list(compiled.tiers)
    updates = []
    for i in range(10):
        sub = compiled[tiers[i % len(tiers)]].extract(state)
        sub = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in sub.items()}
        updates.append(Update(compiled[tiers[i % len(tiers)]].slice_map, sub, 1.0, i))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        nefedavg(state, updates)
        times.append(time.perf_counter() - start)
    # one client's local training on the full tier: 500 samples x 5 epochs at batch 32
    net = compiled[tiers[-1]].build().train()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    for _ in range(2):
        opt.zero_grad(); F.cross_entropy(net(x), y).backward(); opt.step()
    start = time.perf_counter()
    for _ in range(20):
        opt.zero_grad(); F.cross_entropy(net(x), y).backward(); opt.step()
    per_batch = (time.perf_counter() - start) / 20
    batches = 5 * -(-500 // 32)
    return {"aggregate_s": statistics.median(times), "per_batch_s": per_batch, "client_train_s": per_batch * batches,
            "client_batches": batches}


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def memory_one_tier(tier: str) -> dict:
    """(Runs in a subprocess.) Peak extra RSS of one client's local training on ``tier``."""
    from nefl_zoo.fl.training.client import fit
    from nefl_zoo.data.loading import TensorImages
    from nefl_zoo.fl.strategy.local_model import SubmodelLocal

    compiled = _resnet18()
    net = compiled[tier].build()
    data = TensorImages(torch.randn(160, 3, 32, 32), torch.randint(0, 10, (160,)).numpy())
    cfg = {"local_epochs": 1, "batch_size": 32, "lr": 0.01, "momentum": 0.0, "weight_decay": 0.0, "seed": 1}
    before = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
    fit(SubmodelLocal(net), data, cfg)
    peak = _rss_kb("VmHWM")
    params = sum(p.numel() for p in net.parameters())
    return {"tier": tier, "params": params, "extra_peak_mib": (peak - before) / 1024, "rss_before_mib": before / 1024}


def memory_per_tier(threads: int) -> list[dict]:
    out = []
    for tier in _resnet18().tiers:
        cmd = [sys.executable, __file__, "--memory-tier", tier, "--threads", str(threads)]
        out.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="engine rounds to time (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory-tier", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_tier:
        print(json.dumps(memory_one_tier(args.memory_tier)))
        return
    over = engine_overhead(args.rounds)
    agg = aggregation_time(5)
    mem = memory_per_tier(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)\n")
    print("### Engine overhead (digits-quick: ResNet20 16x16, 10 clients/round, E=5)\n")
    print("| round | engine (s) | plain loops (s) | ratio |\n|---|---|---|---|")
    for i, (e, p, r) in enumerate(zip(over["engine_s"], over["plain_s"], over["ratio"]), 1):
        print(f"| {i} | {e:.2f} | {p:.2f} | {r:.3f}x |")
    print(f"\nmedian ratio {over['median_ratio']:.3f}x\n")
    print("### Aggregation of 10 ResNet18 NeFL-WD updates\n")
    print(f"nefedavg: {1000 * agg['aggregate_s']:.0f} ms (median of 5); one client's local training "
          f"({agg['client_batches']} batches of 32 at 32x32, full tier): {agg['client_train_s']:.1f} s "
          f"({1000 * agg['per_batch_s']:.0f} ms per batch x {agg['client_batches']})\n")
    print("### Peak memory of one client's local training (ResNet18 NeFL-WD, batch 32, 32x32)\n")
    print("| tier | parameters | extra peak RSS (MiB) |\n|---|---|---|")
    for m in mem:
        print(f"| {m['tier']} | {m['params']:,} | {m['extra_peak_mib']:.1f} |")


if __name__ == "__main__":
    publish.run("fl", main)

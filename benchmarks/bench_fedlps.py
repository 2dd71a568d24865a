"""FedLPS on the bundled digits.

For every seed: a short centralised pre-training of the backbone on the held-out public split
that no client holds (``data.public_fraction``, ``pretrain_backbone``), then
``specs/train/digits-fedlps.yaml`` (two tasks: digits 0-4 and 5-9, each its own images) with that
backbone and with the seed's random initialisation (``pretrained: none``). Prints markdown:
accuracy per task on its own test images (mean ± std over seeds), and per resource level the
pruning ratio, trained predictor parameters (and their share of the unpruned predictors), bytes
a client sends up per round, and the forward MACs of one image through the encoder and the
pruned predictors of all tasks against one full model per task (fvcore).

Run: ``python benchmarks/bench_fedlps.py [--config CONFIG] [--seeds 3] [--pretrain-epochs 30]
[--out runs/bench-fedlps] [--set K=V ...]``; ``--config specs/train/folders-fedlps.yaml`` with
overrides runs the paper's tasks from folders (docs/benchmarks/fedlps.md, "FedLPS's MNIST task").

Results: every table printed goes to ``benchmarks/results/fedlps.json`` and the figure drawn from it
to ``docs/benchmarks/img/fedlps.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import publish  # results JSON and figure (benchmarks/publish.py)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "specs" / "train" / "digits-fedlps.yaml"


def _mean_std(values: list[float]) -> str:
    a = [100 * v for v in values]
    return f"{statistics.mean(a):.2f} ± {statistics.stdev(a) if len(a) > 1 else 0.0:.2f}"


def main() -> None:
    from nefl_zoo.fl.config import load_config
    from nefl_zoo.fl.engine import Engine
    from nefl_zoo.fl.methods.fedlps import pretrain_backbone

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG, help="a FedLPS training config (default: digits-fedlps.yaml)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--pretrain-epochs", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-fedlps")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override K=V")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    base = load_config(args.config, args.overrides)
    runs: dict[str, list[dict]] = {"random": [], "pretrained": []}
    pretrain: list[tuple[float, float]] = []
    for s in range(args.seeds):
        seed = base.seed + s
        config = load_config(args.config, [*args.overrides, f"seed={seed}"])
        weights = args.out / f"backbone-s{seed}.safetensors"
        start = time.perf_counter()
        accuracy = pretrain_backbone(config, args.pretrain_epochs, weights)
        pretrain.append((accuracy, time.perf_counter() - start))
        for kind, extra in (("random", ["method_args.pretrained=none"]), ("pretrained", [f"method_args.pretrained={weights}"])):
            cfg = load_config(args.config, [*args.overrides, f"seed={seed}", *extra])
            start = time.perf_counter()
            engine = Engine(cfg, args.out / kind / f"seed{seed}")
            result = engine.run(overwrite=True)
            elapsed = time.perf_counter() - start
            # the same global state evaluated with the averaged BN statistics (the paper as written)
            averaged = load_config(args.config, [*args.overrides, f"seed={seed}", *extra, "eval.bn=running"])
            acc_averaged = averaged.build_strategy().evaluate(cfg.rounds, engine.state, engine.data)
            runs[kind].append({"acc": result.acc, "acc_averaged_bn": acc_averaged, "time_s": elapsed,
                               "bytes_up": result.bytes_up, "bytes_down": result.bytes_down})

    strategy = base.build_strategy()
    tasks = strategy.tasks
    print(f"FedLPS on {base.data.dataset if base.data.dataset != 'tasks' else '+'.join(base.data.task_datasets)} ({base.rounds} rounds, {base.clients.num_clients} clients x {base.clients.fraction}, "
          f"E = {base.train.local_epochs}, lr {base.train.lr}, {base.spec if isinstance(base.spec, str) else base.submodel_spec().model}, "
          f"encoder: stem + {strategy.num_encoder_blocks} of {strategy.num_encoder_blocks + len(strategy.block_keys)} blocks), "
          f"{args.seeds} seed(s); accuracy (%) of the global task predictors on the test split, mean ± std.\n")
    print("| backbone | BN statistics at evaluation | " + " | ".join(tasks) + " | wall time per run (s) |")
    print("|---|---|" + "---|" * (len(tasks) + 1))
    pre_acc = _mean_std([a for a, _ in pretrain])
    labels = {"random": "random init (seed)",
              "pretrained": f"pre-trained on the public split ({args.pretrain_epochs} epochs; alone, all labels: {pre_acc})"}
    for kind, results in runs.items():
        for key, bn in (("acc", f"recomputed ({base.eval.bn_batches} batches, eval.bn: recompute)"),
                        ("acc_averaged_bn", "averaged (the paper as written)")):
            cells = [_mean_std([r[key][t] for r in results]) for t in tasks]
            wall = f"{statistics.mean(r['time_s'] for r in results):.1f}" if key == "acc" else "same runs"
            print(f"| {labels[kind]} | {bn} | " + " | ".join(cells) + f" | {wall} |")
    print(f"\nPre-training: {statistics.mean(t for _, t in pretrain):.1f} s per backbone.\n")

    print("| level | rho | predictor params (all tasks) | share of the unpruned | bytes up per round | "
          "MACs (encoder + pruned predictors) | vs one full model per task |")
    print("|---|---|---|---|---|---|---|")
    costs = strategy.level_costs()
    unpruned = max(c.predictor_params for c in costs)
    for cost in costs:
        masks = strategy.level_masks(cost.level)
        up = sum(m.numel() * m.element_size() for m in masks.values())
        for task in tasks:
            module, _ = strategy.predictor(task, masks)
            up += sum(t.numel() * t.element_size() for t in module.state_dict().values())
        print(f"| {cost.level} | {cost.rho:g} | {cost.predictor_params:,} | {cost.predictor_params / unpruned:.1%} | {up:,} | {cost.macs / 1e6:.2f}M | "
              f"{cost.macs_ratio:.3f} ({cost.full_macs / 1e6:.2f}M) |")
    down = sum(v.numel() * v.element_size() for v in strategy.init_global_state().values())
    print(f"\nEvery client receives the full predictors of all tasks: {down:,} bytes per round.")
    (args.out / "results.json").write_text(json.dumps({"runs": runs, "pretrain": pretrain}, indent=2))


if __name__ == "__main__":
    publish.run("fedlps", main)

"""Accelerators and batched clients: rounds per second, sequential against batched.

0. Batches: one epoch of the digits training set, and one client's local training, through the
   DataLoader against device-resident tensors cropped there (the same batches, bit for bit).
1. Digits: ``Engine.run_round`` (local training and aggregation, no evaluation) of
   ``specs/train/digits-quick.yaml`` with ``train.parallel_clients`` 1 (one client after another)
   and N (the clients of one submodel together, ``torch.func.vmap``), timed interleaved in one
   run from the same start state, for NeFL (clients spread over 5 submodels) and FedAvg (every
   client on the full model).
2. Projection of the NeFL paper's CIFAR-10 ResNet18 run (500 rounds, 100 clients, 10 per
   round, 5 local epochs of 500 samples at batch 32, NeFL-WD ``specs/resnet18/nefl-wd.yaml``):
   the time of ``--steps`` local SGD steps of 2 clients per submodel, sequential and batched,
   on synthetic 32x32 images (CIFAR-10 is not bundled), scaled to 16 steps x 5 epochs x 2
   clients of each of the 5 submodels per round, x 500 rounds.

Run: ``python benchmarks/bench_accel.py [--device cpu|cuda] [--parallel 4] [--repeats 3]``;
prints markdown. ``--device cuda`` runs both parts on the GPU (the global state stays on the CPU).

Results: every table printed goes to ``benchmarks/results/accel.json`` and the figure drawn from it
to ``docs/benchmarks/img/accel.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

import publish  # results JSON and figure (benchmarks/publish.py)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAPER = {"rounds": 500, "clients_per_round": 10, "epochs": 5, "samples": 500, "batch": 32}


def batches(device: str, repeats: int) -> dict[str, float]:
    """Median ms of one epoch of batches of the digits training set (crop augmentation, batch 32,
    16x16) through the DataLoader and from device-resident tensors (:mod:`nefl_zoo.fl.training.batches`)."""
    from torch.utils.data import DataLoader

    from nefl_zoo.fl.training.batches import shuffled_batches
    from nefl_zoo.data.loading import load_data
    from nefl_zoo.data.config import DataConfig
    from nefl_zoo.timing import interleaved_median_ms

    data = load_data(DataConfig(), ROOT, (1, 16, 16), 1, 0)

    def loader():
        for x, y in DataLoader(data.train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)):
            x.to(device), y.to(device)

    def resident():
        for _ in shuffled_batches(data.train, 32, 0, 1, device):
            pass

    return interleaved_median_ms({"DataLoader": loader, "resident": resident}, rounds=repeats, warmup_rounds=1)


def local_training(device: str, repeats: int, out: Path) -> dict[str, float]:
    """Median ms of one client's local training in ``digits-quick`` (full tier, 5 epochs) with
    its batches through the DataLoader (the dataset wrapped so the resident path is not taken:
    the same batches) and from device-resident tensors."""
    from torch.utils.data import ConcatDataset

    from nefl_zoo.fl.training.client import fit
    from nefl_zoo.fl.config import load_config
    from nefl_zoo.fl.training.device import placed
    from nefl_zoo.fl.engine import Engine
    from nefl_zoo.timing import interleaved_median_ms

    engine = Engine(load_config(ROOT / "specs/train/digits-quick.yaml", [f"train.device={device}", "method=fedavg"]), out / "local")
    torch.manual_seed(0)
    cid, instruction = next(iter(engine.strategy.configure_train(1, engine.strategy.init_global_state(), engine.clients).items()))
    data = engine.data.client_dataset(cid)

    def run(dataset):
        def go():
            with placed(engine.placement):
                fit(engine.strategy.local_model(instruction), dataset, instruction.config)
        return go

    return interleaved_median_ms({"DataLoader": run(ConcatDataset([data])), "resident": run(data)}, rounds=repeats, warmup_rounds=1)


def digits(method: str, device: str, parallel: int, repeats: int, out: Path) -> dict[str, float]:
    """Median seconds of one round per engine (``sequential``, ``batched``)."""
    from nefl_zoo.fl.config import load_config
    from nefl_zoo.fl.engine import Engine
    from nefl_zoo.timing import interleaved_median_ms

    engines = {}
    for name, n in (("sequential", 1), ("batched", parallel)):
        config = load_config(ROOT / "specs/train/digits-quick.yaml",
                             [f"method={method}", f"train.device={device}", f"train.parallel_clients={n}"])
        engines[name] = Engine(config, out / f"{method}-{name}")
    torch.manual_seed(0)
    start = engines["sequential"].strategy.init_global_state()

    def one_round(engine):
        def run():
            engine.state = dict(start)
            engine.run_round(0)
        return run

    ms = interleaved_median_ms({k: one_round(e) for k, e in engines.items()}, rounds=repeats, warmup_rounds=1)
    return {k: v / 1e3 for k, v in ms.items()}


def projection(device: str, parallel: int, steps: int) -> dict[str, float]:
    """Projected hours of the paper's run, sequential and batched, from timed local steps."""
    from torch.utils.data import Subset

    from nefl_zoo.fl.training.parallel import fit_together
    from nefl_zoo.fl.training.client import fit
    from nefl_zoo.fl.config import parse_config
    from nefl_zoo.data.loading import TensorImages
    from nefl_zoo.fl.training.device import Placement, placed
    from nefl_zoo.timing import interleaved_median_ms

    config = parse_config({"spec": str(ROOT / "specs/resnet18/nefl-wd.yaml"), "method": "nefl", "clients": {"fraction": 1.0},
                           "train": {"device": device, "local_epochs": 1, "batch_size": PAPER["batch"]}})
    strategy = config.build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    images = TensorImages(torch.randn(2 * steps * PAPER["batch"], *strategy.info.input_size),
                          torch.randint(0, 10, (2 * steps * PAPER["batch"],)).numpy())
    datasets = [Subset(images, range(i * steps * PAPER["batch"], (i + 1) * steps * PAPER["batch"])) for i in range(2)]
    instructions = {}
    for tier in strategy.info.levels:
        from nefl_zoo.fl.strategy.base import ClientInfo

        picked = strategy.configure_train(1, state, [ClientInfo(c, (tier,)) for c in range(2)])
        instructions[tier] = list(picked.values())
    where = Placement.of(config.train)
    group = min(parallel, 2)

    def sequential():
        with placed(where):
            for pair in instructions.values():
                for instruction, data in zip(pair, datasets):
                    fit(strategy.local_model(instruction), data, instruction.config)

    def together():
        with placed(where):
            for pair in instructions.values():
                fit_together([strategy.local_model(i) for i in pair[:group]], datasets[:group], [i.config for i in pair[:group]])

    ms = interleaved_median_ms({"sequential": sequential, "batched": together}, rounds=1, warmup_rounds=0)
    steps_per_client = PAPER["epochs"] * -(-PAPER["samples"] // PAPER["batch"])
    scale = steps_per_client / steps * PAPER["clients_per_round"] / (2 * len(instructions)) * PAPER["rounds"]
    return {k: v / 1e3 * scale / 3600 for k, v in ms.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="train.device: cpu, cuda, cuda:N, mps, auto")
    parser.add_argument("--parallel", type=int, default=4, help="train.parallel_clients of the batched engine")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds per engine")
    parser.add_argument("--steps", type=int, default=2, help="local steps per client timed for the projection")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_accel"), help="scratch run directories")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from nefl_zoo.fl.training.device import resolve_device

    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"device {device} ({name}), torch {torch.__version__}, {args.threads} CPU thread(s), parallel_clients {args.parallel}\n")
    ms = batches(args.device, args.repeats)
    print("| one epoch of digits batches (1,347 images, crop, batch 32) | DataLoader ms | resident ms | speed-up |")
    print("|---|---|---|---|")
    print(f"| {device} | {ms['DataLoader']:.1f} | {ms['resident']:.1f} | {ms['DataLoader'] / ms['resident']:.1f}x |")
    ms = local_training(args.device, args.repeats, args.out)
    print(f"| one client's local training (full tier, 67 images, 5 epochs) | {ms['DataLoader']:.0f} | {ms['resident']:.0f} | "
          f"{ms['DataLoader'] / ms['resident']:.2f}x |\n")
    print("| digits-quick round | sequential s | batched s | rounds/s seq | rounds/s batched | speed-up |")
    print("|---|---|---|---|---|---|")
    for method in ("nefl", "fedavg"):
        t = digits(method, args.device, args.parallel, args.repeats, args.out)
        print(f"| {method} | {t['sequential']:.2f} | {t['batched']:.2f} | {1 / t['sequential']:.3f} | "
              f"{1 / t['batched']:.3f} | {t['sequential'] / t['batched']:.2f}x |")
    hours = projection(args.device, args.parallel, args.steps)
    print("\n| NeFL paper run (CIFAR-10 ResNet18, 500 rounds x 10 clients x 5 epochs), projected | sequential | batched |")
    print("|---|---|---|")
    print(f"| wall time, hours | {hours['sequential']:.1f} | {hours['batched']:.1f} |")


if __name__ == "__main__":
    publish.run("accel", main)

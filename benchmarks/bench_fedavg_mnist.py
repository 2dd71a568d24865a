"""The FedAvg paper's MNIST rounds-to-target, side by side (docs/benchmarks/fedavg_mnist.md).

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data"
(AISTATS 2017): 100 clients of 600 MNIST images, C = 0.1 (10 clients a round), plain SGD at a
constant learning rate, clients weighted by their sample counts; the 2NN (784-200-200-10, ReLU,
199,210 parameters) and the CNN (5x5 convolutions with 32 and 64 channels, each followed by 2x2
max-pooling, a 512-unit fully connected layer, softmax; 1,663,370 parameters, which needs the
convolutions' "same" padding). Both are written here as plain ``nn.Module``s and brought in with
``nz.nest(module, example_input)``, then trained with ``method: fedavg`` through the engine,
evaluated on the 10,000 test images after every round. Partitions: IID (shuffled, 600 each) and
the paper's pathological non-IID one (sorted by label, 200 shards of 300, 2 per client:
``partition: shards``). No augmentation, as in the paper.

Rounds to target are the paper's: the curve made monotone (best accuracy so far), the round where
it crosses the target by linear interpolation, the best learning rate of a grid of step
10^(1/3) per row (the paper: 11-13 values of step 10^(1/3) or 10^(1/6)). A run stops once it
has crossed the target; a row none of whose rates reach it within its round cap says so.
Every run is one seed (0), as the paper's rows are. Two ablations of the 2NN explain how far we
are from the paper: ``2nn_raw`` (raw [0, 1] pixels, as the paper's, instead of standardised ones)
and ``2nn_glorot`` (raw pixels and TensorFlow's Glorot-uniform initialisation).

    python benchmarks/mnist_offline.py /tmp/mnist-data
    python benchmarks/bench_fedavg_mnist.py --root /tmp/mnist-data --out /tmp/fedavg-mnist --rows 2nn-e1-iid,2nn-e1-noniid,cnn-e1-iid

Results: every table printed goes to ``benchmarks/results/fedavg_mnist.json`` and the figure drawn from it
to ``docs/benchmarks/img/fedavg_mnist.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
from torch import nn

import publish  # results JSON and figure (benchmarks/publish.py)


class TwoNN(nn.Module):
    """The paper's 2NN: two hidden layers of 200 units with ReLU."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 200)
        self.fc2 = nn.Linear(200, 200)
        self.fc3 = nn.Linear(200, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(torch.flatten(x, 1)))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class CNN(nn.Module):
    """The paper's CNN: conv 5x5 (32) - pool - conv 5x5 (64) - pool - fc 512 - fc 10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * 7 * 7, 512)
        self.fc2 = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class TwoNNRawPixels(TwoNN):
    """The 2NN fed raw [0, 1] pixels, as the paper's inputs are (its first operation undoes the
    training data's standardisation): an ablation of the input scaling."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * MNIST_STD + MNIST_MEAN)


class TwoNNGlorot(TwoNNRawPixels):
    """The raw-pixel 2NN initialised as TensorFlow's dense layers are (Glorot-uniform weights,
    zero biases; PyTorch's default is uniform in +-1/sqrt(fan_in) for both): a second ablation."""

    def __init__(self):
        super().__init__()
        for layer in (self.fc1, self.fc2, self.fc3):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # nefl_zoo.data.datasets.NORMALIZATION["mnist"]
MODELS = {"2nn": TwoNN, "cnn": CNN, "2nn_raw": TwoNNRawPixels, "2nn_glorot": TwoNNGlorot}
TARGET = {"2nn": 0.97, "cnn": 0.99, "2nn_raw": 0.97, "2nn_glorot": 0.97}


@dataclass(frozen=True)
class Row:
    """One row of the paper's tables: a model, E, B and the partition, with the paper's rounds
    to target (and where they are printed) and this benchmark's learning-rate grid and round cap."""

    model: str
    epochs: int
    batch: int
    partition: str
    paper: int
    source: str
    lrs: tuple[float, ...]
    cap: int


GRID = tuple(round(10 ** (k / 3), 4) for k in range(-5, 0))  # 0.0215 0.0464 0.1 0.2154 0.4642
ROWS = {  # the paper's C = 0.1 rows (Table 1: 2NN E=1; Table 2: CNN, 99%)
    "2nn-e1-iid": Row("2nn", 1, 10, "iid", 87, "Table 1", GRID[1:], 400),
    "2nn-e1-noniid": Row("2nn", 1, 10, "shards", 664, "Table 1", GRID[1:4], 1500),
    "2nn_raw-e1-iid": Row("2nn_raw", 1, 10, "iid", 87, "Table 1", GRID[2:], 400),
    "2nn_raw-e1-noniid": Row("2nn_raw", 1, 10, "shards", 664, "Table 1", GRID[2:], 1500),
    "2nn_glorot-e1-iid": Row("2nn_glorot", 1, 10, "iid", 87, "Table 1", GRID[2:], 400),
    "2nn_glorot-e1-noniid": Row("2nn_glorot", 1, 10, "shards", 664, "Table 1", GRID[2:], 1500),
    "cnn-e1-iid": Row("cnn", 1, 10, "iid", 34, "Table 2", GRID[1:4], 150),
    "cnn-e5-iid": Row("cnn", 5, 10, "iid", 20, "Table 2", GRID[1:4], 80),
    "cnn-e1-noniid": Row("cnn", 1, 10, "shards", 350, "Table 2", GRID[2:3], 700),
}


def nest_models() -> dict[str, str]:
    """Register the models with ``nz.nest`` (built in this order after ``torch.manual_seed(0)``, so
    every process and every run of a model starts from the same weights); their zoo names."""
    import nefl_zoo as nz

    torch.manual_seed(0)
    return {key: nz.nest(cls(), (2, 1, 28, 28), name=f"fedavg_{key}") for key, cls in MODELS.items()}


def run_config(row: Row, lr: float, root: Path, name: str):
    """The run config of one row at one learning rate."""
    from nefl_zoo.fl.config import parse_config

    return parse_config({
        "name": f"fedavg-mnist-{row.model}-e{row.epochs}-{row.partition}-lr{lr}", "method": "fedavg", "seed": 0, "rounds": row.cap,
        "spec": {"model": name, "tiers": [{"name": "full", "gamma": 1.0, "gamma_w": 1.0}]},
        "data": {"dataset": "mnist", "root": str(root), "augment": False, "partition": row.partition, "shards_per_client": 2},
        "clients": {"num_clients": 100, "fraction": 0.1},
        "train": {"local_epochs": row.epochs, "batch_size": row.batch, "min_batch": 1, "lr": lr, "schedule": "constant",
                  "weighting": "samples"},
        "eval": {"every": 1, "batch_size": 1000},
        "checkpoint_every": 50,
    }, "bench_fedavg_mnist")


class TargetReached(Exception):
    """Raised by :class:`StopAtTarget` to end a run that has crossed its target."""


class StopAtTarget:
    """A run observer that ends the run after the first round at or above ``target``."""

    def __init__(self, target: float):
        self.target = target

    def start(self, engine) -> None:
        pass

    def round(self, record: dict, last_eval: dict) -> None:
        if record.get("acc", {}).get("full", 0.0) >= self.target:
            raise TargetReached

    def end(self, engine, result) -> None:
        pass


def rounds_to_target(accuracies: list[float], target: float) -> float | None:
    """The paper's measure: the running best of the per-round accuracies (round 1 first), and the
    (linearly interpolated) round where it crosses ``target``; ``None`` if it never does."""
    best = 0.0
    for r, acc in enumerate(accuracies, start=1):
        if acc >= target:
            return r - 1 + (target - best) / (acc - best) if r > 1 else 1.0
        best = max(best, acc)
    return None


def _train(row_key: str, lr: float, root: str, out: str) -> dict:
    """One (row, learning rate) run, one torch thread; its per-round accuracies and wall time."""
    from nefl_zoo.fl.engine import Engine

    torch.set_num_threads(1)
    row = ROWS[row_key]
    names = nest_models()
    engine = Engine(run_config(row, lr, Path(root), names[row.model]), out)
    start = time.perf_counter()
    try:
        engine.run(overwrite=True, observer=StopAtTarget(TARGET[row.model]))
    except TargetReached:
        pass
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    acc = [r["acc"]["full"] for r in records]
    return {"row": row_key, "lr": lr, "acc": acc, "seconds": time.perf_counter() - start,
            "rounds_to_target": rounds_to_target(acc, TARGET[row.model])}


def table(results: list[dict]) -> str:
    """Markdown: per row, the paper's rounds, ours at the best rate, the ratio, and every rate tried."""
    lines = ["| model | E | B | partition | target | paper (C = 0.1) | ours | ours / paper | best lr | every lr: rounds (best accuracy) | wall min, all rates |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in ROWS.items():
        runs = sorted((r for r in results if r["row"] == key), key=lambda r: r["lr"])
        if not runs:
            continue
        reached = [r for r in runs if r["rounds_to_target"] is not None]
        best = min(reached, key=lambda r: r["rounds_to_target"]) if reached else None
        ours = f"{best['rounds_to_target']:.0f}" if best else f"> {row.cap}"
        ratio = f"{best['rounds_to_target'] / row.paper:.2f}" if best else "-"
        tried = "; ".join(f"{r['lr']}: " + (f"{r['rounds_to_target']:.1f}" if r["rounds_to_target"] is not None
                                            else f"> {len(r['acc'])}") + f" ({max(r['acc']):.4f})" for r in runs)
        part = "IID" if row.partition == "iid" else "non-IID (2 shards of 300)"
        lines.append(f"| {row.model.upper()} | {row.epochs} | {row.batch} | {part} | {TARGET[row.model]:.0%} | "
                     f"{row.paper} ({row.source}) | {ours} | {ratio} | {best['lr'] if best else '-'} | {tried} | "
                     f"{sum(r['seconds'] for r in runs) / 60:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="folder holding MNIST/raw (benchmarks/mnist_offline.py)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one torch thread each")
    args = parser.parse_args()
    unknown = [k for k in args.rows.split(",") if k not in ROWS]
    if unknown:
        parser.error(f"unknown row {unknown[0]!r}; rows: {', '.join(ROWS)}")
    done = args.out / "results.jsonl"
    results = [json.loads(line) for line in done.read_text().splitlines()] if done.is_file() else []
    finished = {(r["row"], r["lr"]) for r in results}
    keys = args.rows.split(",")
    todo = [(key, lr) for key in keys for lr in ROWS[key].lrs if (key, lr) not in finished]
    start = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_train, key, lr, str(args.root.resolve()), str(args.out / key / f"lr{lr}")) for key, lr in todo]
        for future in futures:
            result = future.result()
            with done.open("a") as f:
                f.write(json.dumps(result) + "\n")
            results.append(result)
            found = result["rounds_to_target"]
            print(f"{result['row']} lr {result['lr']}: " + (f"{found:.1f} rounds" if found is not None else
                  f"not reached in {len(result['acc'])} rounds") + f" (best {max(result['acc']):.4f}, {result['seconds']:.0f} s)", flush=True)
    report = table([r for r in results if r["row"] in keys])
    print(report)
    print(f"wall time of this invocation: {(time.perf_counter() - start) / 60:.1f} min (load average {os.getloadavg()})")
    (args.out / "table.md").write_text(report + "\n")


if __name__ == "__main__":
    publish.run("fedavg_mnist", main)

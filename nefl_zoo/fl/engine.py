"""The in-process simulation engine: sample clients, send submodels, train, aggregate, evaluate.

The engine only moves tensors: a method (strategy object) says which tensors a client gets,
:func:`~nefl_zoo.fl.client.fit` trains them and :func:`~nefl_zoo.fl.aggregate.nefedavg` merges
them. A run directory holds ``config.yaml``, ``spec.yaml`` (the spec of the method's global
state: the run's spec for NeFL, its width-only or depth-only derivation for the baselines),
``global.safetensors`` (the global state at the latest checkpoint or the end),
``metrics.jsonl``, ``metrics.csv``, ``checkpoint.safetensors`` + ``checkpoint.json`` (round,
configuration and all RNG states) and, at the end, ``summary.json``.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from ..files import atomic_write
from ..slim import SliceMap
from .aggregate import Update, nefedavg
from .client import evaluate, fit, learning_rate
from .config import RunConfig, parse_config
from .data import FederatedData, load_data
from .methods import Assignment, Method, build_method

log = logging.getLogger(__name__)

CHECKPOINT_JSON, CHECKPOINT_STATE, GLOBAL_STATE = "checkpoint.json", "checkpoint.safetensors", "global.safetensors"


def client_groups(config: RunConfig, levels: list[str]) -> list[list[str]]:
    """Allowed resource levels per client group (see :class:`~nefl_zoo.fl.config.ClientsConfig`)."""
    if config.clients.groups is not None:
        return [list(g) for g in config.clients.groups]
    if config.clients.environment == "fixed":
        return [[t] for t in levels]
    n = len(levels)
    return [levels[max(0, i - 2): min(n, i + 3)] for i in range(n)]


def _nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _rng_states() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }


def _set_rng_states(states: dict) -> None:
    py = states["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = states["numpy"]
    np.random.set_state((np_state[0], np.asarray(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))


class RunExistsError(ValueError):
    """The run directory already holds a run."""


@dataclass
class RunResult:
    """The end of a run: final accuracies per tier, worst, average, bytes moved."""

    acc: dict[str, float]
    worst: float
    avg: float
    bytes_down: int
    bytes_up: int
    rounds: int


class Engine:
    """Runs one training configuration into ``out_dir``.

    Args:
        config: the run configuration.
        out_dir: the run directory (created).
        progress: show a rich progress bar and a final summary table.
    """

    def __init__(self, config: RunConfig, out_dir: str | Path, progress: bool = False):
        self.config = config
        self.out = Path(out_dir)
        self.progress = progress
        self.spec = config.submodel_spec()
        self.method: Method = build_method(config, self.spec)
        self.levels = list(self.method.levels.tiers)
        self.groups = client_groups(config, self.levels)
        m = config.clients.num_clients
        self.group_of = [c * len(self.groups) // m for c in range(m)]
        self.data: FederatedData = load_data(
            config.data, config.data_root(), self.method.compiled.input_size, m, config.seed
        )
        classes = self.method.compiled.full_shapes.get("fc.weight", self.method.compiled.full_shapes.get("head.weight"))
        if classes is not None and classes[0] != self.data.num_classes:
            raise ValueError(
                f"{config.data.dataset} has {self.data.num_classes} classes but the model outputs {classes[0]} "
                "(set spec model_args.num_classes)"
            )
        self.state: dict[str, torch.Tensor] = {}
        self.round = 0
        self.totals = {"bytes_down": 0, "bytes_up": 0}
        self.last_eval: dict = {}

    # -- one round ---------------------------------------------------------------------
    def sample(self, round_index: int) -> list[int]:
        """The clients taking part in round ``round_index`` (seeded by run seed and round)."""
        m = self.config.clients.num_clients
        rng = random.Random(f"{self.config.seed}:sample:{round_index}")
        return sorted(rng.sample(range(m), max(1, round(self.config.clients.fraction * m))))

    def run_round(self, round_index: int) -> dict:
        """Sample, train and aggregate one round; return its metrics record."""
        cfg = self.config
        lr = learning_rate(cfg.train, round_index, cfg.rounds)
        rng = random.Random(f"{cfg.seed}:assign:{round_index}")
        updates, losses, tiers = [], [], []
        down = up = 0
        start = time.perf_counter()
        for cid in self.sample(round_index):
            assignment = self.method.assign(self.groups[self.group_of[cid]], rng)
            if assignment is None:
                continue
            entries = self.method.entries(assignment)
            payload = SliceMap(dict(entries)).extract(self.state)
            local = self.method.local_model(assignment, payload)
            seed = int(np.random.SeedSequence([cfg.seed, round_index, cid]).generate_state(1)[0])
            result = fit(local, self.data.client_dataset(cid), cfg.train, lr, seed)
            weight = 1.0 if cfg.train.weighting == "clients" else float(result.num_samples)
            updates.append(Update(entries, result.state, weight, cid))
            losses.append(result.metrics["loss"])
            tiers.append(assignment.tier)
            down += _nbytes(payload)
            up += _nbytes(result.state)
        self.state, rejected = nefedavg(self.state, updates)
        self.totals["bytes_down"] += down
        self.totals["bytes_up"] += up
        return {
            "round": round_index + 1,
            "lr": lr,
            "clients": len(updates) - len(rejected),
            "rejected": len(rejected),
            "tiers": {t: tiers.count(t) for t in sorted(set(tiers), key=self.method.tier_names.index)},
            "train_loss": float(np.mean(losses)) if losses else float("nan"),
            "bytes_down": down,
            "bytes_up": up,
            "bytes_down_per_client": down // max(1, len(updates)),
            "bytes_up_per_client": up // max(1, len(updates)),
            "cum_bytes": self.totals["bytes_down"] + self.totals["bytes_up"],
            "time_s": round(time.perf_counter() - start, 4),
        }

    def evaluate(self) -> dict[str, float]:
        """Accuracy of every submodel on the test set."""
        acc = {}
        for tier in self.method.tier_names:
            gen = torch.Generator().manual_seed(self.config.seed)
            loader = DataLoader(self.data.train_eval, batch_size=self.config.train.batch_size, shuffle=True, generator=gen)
            bn = itertools.islice(loader, self.config.eval.bn_recompute_batches)
            model = self.method.eval_model(self.state, tier, bn)
            acc[tier] = evaluate(model, self.data.test, self.config.eval.batch_size)
        return acc

    # -- files ---------------------------------------------------------------------------
    def _init_dir(self, overwrite: bool) -> None:
        if not overwrite and any((self.out / f).exists() for f in (CHECKPOINT_JSON, "metrics.jsonl")):
            raise RunExistsError(
                f"{self.out}: already holds a run; continue it with --resume {self.out}, "
                "or choose another --out (--overwrite replaces it)"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        data = self.config.to_dict()
        (self.out / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        method_spec = self.method.compiled.spec.model_dump(mode="json", exclude_none=True)
        (self.out / "spec.yaml").write_text(yaml.safe_dump(method_spec, sort_keys=False))
        (self.out / "metrics.jsonl").write_text("")
        self._csv_header()

    def _csv_columns(self) -> list[str]:
        return ["round", "lr", "clients", "rejected", "train_loss", "bytes_down", "bytes_up", "cum_bytes", "time_s",
                "worst", "avg", *(f"acc_{t}" for t in self.method.tier_names)]

    def _csv_header(self) -> None:
        with open(self.out / "metrics.csv", "w", newline="") as f:
            csv.writer(f).writerow(self._csv_columns())

    def _log(self, record: dict) -> None:
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        flat = {**record, **{f"acc_{t}": a for t, a in record.get("acc", {}).items()}}
        with open(self.out / "metrics.csv", "a", newline="") as f:
            csv.writer(f).writerow([flat.get(c, "") for c in self._csv_columns()])

    def save_checkpoint(self) -> None:
        """Write the global state and ``checkpoint.json`` atomically (temp file + rename)."""
        state = {k: v.contiguous() for k, v in self.state.items()}
        atomic_write(self.out / CHECKPOINT_STATE, lambda p: save_file(state, str(p)))
        atomic_write(self.out / GLOBAL_STATE, lambda p: save_file(state, str(p)))
        meta = {"round": self.round, "config": self.config.to_dict(), "totals": self.totals,
                "last_eval": self.last_eval, "rng": _rng_states()}
        atomic_write(self.out / CHECKPOINT_JSON, lambda p: p.write_text(json.dumps(meta)))

    def _restore(self) -> None:
        meta = json.loads((self.out / CHECKPOINT_JSON).read_text())
        self.state = load_file(str(self.out / CHECKPOINT_STATE))
        self.round, self.totals, self.last_eval = meta["round"], meta["totals"], meta["last_eval"]
        _set_rng_states(meta["rng"])
        lines = (self.out / "metrics.jsonl").read_text().splitlines() if (self.out / "metrics.jsonl").exists() else []
        kept = [json.loads(line) for line in lines if line and json.loads(line)["round"] <= self.round]
        (self.out / "metrics.jsonl").write_text("")
        self._csv_header()
        for record in kept:
            self._log(record)

    # -- the loop ------------------------------------------------------------------------
    def run(self, resume: bool = False, overwrite: bool = False) -> RunResult:
        """Train ``config.rounds`` rounds (continuing from the checkpoint when ``resume``).

        A fresh run refuses a directory that already holds one unless ``overwrite``.
        """
        if resume:
            self._restore()
        else:
            self._init_dir(overwrite)
            torch.manual_seed(self.config.seed)
            self.state = self.method.init_global_state()
        cfg = self.config
        with _Progress(self.progress, cfg.rounds, self.round, f"{cfg.method} {cfg.name}") as advance:
            while self.round < cfg.rounds:
                record = self.run_round(self.round)
                self.round += 1
                if self.round % cfg.eval.every == 0 or self.round == cfg.rounds:
                    acc = self.evaluate()
                    self.last_eval = {"acc": acc, "worst": min(acc.values()), "avg": float(np.mean(list(acc.values())))}
                    record.update(self.last_eval)
                self._log(record)
                if self.round % cfg.checkpoint_every == 0 or self.round == cfg.rounds:
                    self.save_checkpoint()
                advance(record, self.last_eval)
        result = RunResult(self.last_eval["acc"], self.last_eval["worst"], self.last_eval["avg"],
                           self.totals["bytes_down"], self.totals["bytes_up"], self.round)
        (self.out / "summary.json").write_text(json.dumps(result.__dict__, indent=2))
        if self.progress:
            print_summary(self, result)
        return result


class _Progress:
    """A rich progress bar (or nothing) advanced with each round's record."""

    def __init__(self, enabled: bool, total: int, done: int, title: str):
        self.enabled, self.total, self.done, self.title = enabled, total, done, title

    def __enter__(self):
        if not self.enabled:
            return lambda record, last: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self.bar.__enter__()
        task = self.bar.add_task(self.title, total=self.total, completed=self.done)

        def advance(record: dict, last: dict) -> None:
            acc = f" worst {last['worst']:.3f} avg {last['avg']:.3f}" if last else ""
            self.bar.update(task, advance=1, description=f"{self.title} round {record['round']} loss {record['train_loss']:.3f}{acc}")

        return advance

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)


def print_summary(engine: Engine, result: RunResult) -> None:
    """A rich table of the final accuracy and size of every submodel."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{engine.config.method}: {engine.config.name} after {result.rounds} rounds")
    table.add_column("submodel")
    table.add_column("elements sent", justify="right")
    table.add_column("accuracy", justify="right")
    for tier, acc in result.acc.items():
        size = sum(e.numel for e in engine.method.entries(Assignment(tier, (tier,))).values())
        table.add_row(tier, f"{size:,}", f"{100 * acc:.2f}%")
    table.add_row("worst / avg", "", f"{100 * result.worst:.2f}% / {100 * result.avg:.2f}%")
    console = Console()
    console.print(table)
    console.print(f"communication: {result.bytes_down / 1e6:.1f} MB down, {result.bytes_up / 1e6:.1f} MB up; run dir {engine.out}")


def resume_config(run_dir: str | Path) -> RunConfig:
    """The configuration saved in a run directory's checkpoint."""
    path = Path(run_dir) / CHECKPOINT_JSON
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: no {CHECKPOINT_JSON} to resume from")
    return parse_config(json.loads(path.read_text())["config"], str(path))


def train(config: RunConfig, out_dir: str | Path, progress: bool = False, overwrite: bool = False) -> RunResult:
    """Run one configuration into ``out_dir``."""
    return Engine(config, out_dir, progress).run(overwrite=overwrite)

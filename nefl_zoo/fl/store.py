"""The run directory: metrics files, checkpoints and RNG state, owned by one object.

A run directory holds ``config.yaml``, ``spec.yaml`` (the spec of the method's global state),
``metrics.jsonl`` and ``metrics.csv`` (one record per round), ``global.safetensors`` (the
global state at the latest checkpoint or the end), ``checkpoint.safetensors`` +
``checkpoint.json`` (round, configuration, totals and every RNG state), per-client and server
state when a method keeps any (``clients.safetensors``, ``server.safetensors``) and, at the
end, ``summary.json``. An engine (in-process or Flower) writes through a :class:`RunStore`, so
every engine leaves the same layout and resumes bit-identically.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

from ..files import atomic_write

CHECKPOINT_JSON, CHECKPOINT_STATE, GLOBAL_STATE = "checkpoint.json", "checkpoint.safetensors", "global.safetensors"
CLIENT_STATES, SERVER_STATE, METRICS_JSONL, METRICS_CSV = "clients.safetensors", "server.safetensors", "metrics.jsonl", "metrics.csv"
CLIENT_SEP = "/"  # clients.safetensors keys are CLIENT/KEY


class RunExistsError(ValueError):
    """The run directory already holds a run."""


@dataclass
class Checkpoint:
    """Everything a run needs to continue: completed rounds, the global state, per-client and
    server state, the running totals and the last evaluation."""

    round: int
    state: dict[str, torch.Tensor]
    client_states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    server_state: dict[str, torch.Tensor] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    last_eval: dict[str, Any] = field(default_factory=dict)


def rng_states() -> dict:
    """Python's, NumPy's and torch's global RNG states, JSON-safe."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_states(states: dict) -> None:
    """Restore :func:`rng_states`."""
    py = states["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = states["numpy"]
    np.random.set_state((np_state[0], np.asarray(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))


def _contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in state.items()}


class RunStore:
    """Reads and writes one run directory.

    Args:
        out: the run directory.
        columns: the ``metrics.csv`` columns.
    """

    def __init__(self, out: str | Path, columns: list[str]):
        self.out = Path(out)
        self.columns = columns

    def create(self, config: dict, spec: dict, overwrite: bool) -> None:
        """Start a fresh run: refuse a directory holding one unless ``overwrite``."""
        if not overwrite and any((self.out / f).exists() for f in (CHECKPOINT_JSON, METRICS_JSONL)):
            raise RunExistsError(
                f"{self.out}: already holds a run; continue it with --resume {self.out}, "
                "or choose another --out (--overwrite replaces it)"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (self.out / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        (self.out / METRICS_JSONL).write_text("")
        self._csv_header()

    def _csv_header(self) -> None:
        with open(self.out / METRICS_CSV, "w", newline="") as f:
            csv.writer(f).writerow(self.columns)

    def log(self, record: dict) -> None:
        """Append one round's record to ``metrics.jsonl`` and ``metrics.csv``."""
        with open(self.out / METRICS_JSONL, "a") as f:
            f.write(json.dumps(record) + "\n")
        flat = {**record, **{f"acc_{t}": a for t, a in record.get("acc", {}).items()}}
        with open(self.out / METRICS_CSV, "a", newline="") as f:
            csv.writer(f).writerow([flat.get(c, "") for c in self.columns])

    def save(self, checkpoint: Checkpoint, config: dict) -> None:
        """Write a checkpoint (tensors first, ``checkpoint.json`` last), each file atomically."""
        state = _contiguous(checkpoint.state)
        atomic_write(self.out / CHECKPOINT_STATE, lambda p: save_file(state, str(p)))
        atomic_write(self.out / GLOBAL_STATE, lambda p: save_file(state, str(p)))
        clients = {f"{cid}{CLIENT_SEP}{k}": v for cid, s in checkpoint.client_states.items() for k, v in s.items()}
        for name, tensors in ((CLIENT_STATES, clients), (SERVER_STATE, checkpoint.server_state)):
            if tensors:
                atomic_write(self.out / name, lambda p, t=_contiguous(tensors): save_file(t, str(p)))
        meta = {"round": checkpoint.round, "config": config, "totals": checkpoint.totals,
                "last_eval": checkpoint.last_eval, "rng": rng_states()}
        atomic_write(self.out / CHECKPOINT_JSON, lambda p: p.write_text(json.dumps(meta)))

    def load(self) -> Checkpoint:
        """The latest checkpoint; restores the RNG states and drops metrics records of rounds
        after it (they are replayed)."""
        meta = json.loads((self.out / CHECKPOINT_JSON).read_text())
        clients: dict[int, dict[str, torch.Tensor]] = {}
        if (self.out / CLIENT_STATES).exists():
            for key, value in load_file(str(self.out / CLIENT_STATES)).items():
                cid, _, name = key.partition(CLIENT_SEP)
                clients.setdefault(int(cid), {})[name] = value
        server = load_file(str(self.out / SERVER_STATE)) if (self.out / SERVER_STATE).exists() else {}
        checkpoint = Checkpoint(meta["round"], load_file(str(self.out / CHECKPOINT_STATE)), clients, server,
                                meta["totals"], meta["last_eval"])
        set_rng_states(meta["rng"])
        path = self.out / METRICS_JSONL
        lines = path.read_text().splitlines() if path.exists() else []
        kept = [json.loads(line) for line in lines if line and json.loads(line)["round"] <= checkpoint.round]
        path.write_text("")
        self._csv_header()
        for record in kept:
            self.log(record)
        return checkpoint

    def write_summary(self, summary: dict) -> None:
        """Write ``summary.json`` at the end of a run."""
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))


def saved_config(run_dir: str | Path) -> tuple[dict, str]:
    """The configuration saved in a run directory's checkpoint, and the file it came from."""
    path = Path(run_dir) / CHECKPOINT_JSON
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: no {CHECKPOINT_JSON} to resume from")
    return json.loads(path.read_text())["config"], str(path)

"""The checkpoint format of a run directory, and its verified reader.

``checkpoint.json`` (:class:`Pointer`) is a run's commit point: it names one generation of
files (``ckpt-ROUND-ID.global.safetensors``, ``….clients.safetensors``,
``….server.safetensors``, ``….run.json``) with each file's size and sha256, plus the round,
the configuration, the byte totals and the last evaluation. ``run.json`` holds the Python,
NumPy and torch RNG states and every metrics record up to that round. :func:`read_checkpoint`
trusts nothing else: it reads each named file once, checks its hash and decodes the bytes it
hashed (safetensors: tensors only). Every problem is a one-line :class:`CheckpointError`
(a ``ValueError``) naming the file and what to do. The writer is :class:`~.store.RunStore`.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from safetensors.torch import load as load_tensors

from ..userfiles import FileError, format_validation_error

CHECKPOINT_JSON, GLOBAL_STATE = "checkpoint.json", "global.safetensors"
CLIENT_STATES, SERVER_STATE, RUN_JSON = "clients.safetensors", "server.safetensors", "run.json"
GENERATION = "ckpt-"  # generation files: ckpt-ROUND-ID.ROLE
CLIENT_SEP = "/"  # clients.safetensors keys are CLIENT/KEY
FORMAT = 2
MAX_POINTER_BYTES = 16 << 20
REDO = "start the run again with --overwrite"


class CheckpointError(FileError):
    """A run's checkpoint cannot be trusted or does not fit the run: one line naming the file."""


class FileRef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: StrictInt = Field(ge=0)


class Pointer(BaseModel):
    """``checkpoint.json``: the committed generation, its files' hashes, and the run's counters."""

    model_config = ConfigDict(extra="forbid")
    format: Literal[2]
    round: StrictInt = Field(ge=0)
    generation: str = Field(pattern=r"^ckpt-[0-9]{6,}-[0-9a-f]{8}$")
    files: dict[Literal["global.safetensors", "clients.safetensors", "server.safetensors", "run.json"], FileRef]
    spec_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    config: dict[str, Any]
    totals: dict[str, StrictInt]
    last_eval: dict[str, Any]


@dataclass
class Checkpoint:
    """Everything a run needs to continue: completed rounds, the global state, per-client and
    server state, the running totals and the last evaluation (and, when read back, the
    metrics records and RNG states committed with it, and the configuration)."""

    round: int
    state: dict[str, torch.Tensor]
    client_states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    server_state: dict[str, torch.Tensor] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    last_eval: dict[str, Any] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    rng: tuple | None = None
    config: dict = field(default_factory=dict)


def rng_states() -> dict:
    """Python's, NumPy's and torch's global RNG states, JSON-safe."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }


def _parse_rng(states: dict) -> tuple:
    """:func:`rng_states` as the objects the RNGs take, checked on throwaway generators."""
    py = states["python"]
    py = (py[0], tuple(py[1]), py[2])
    np_state = states["numpy"]
    np_state = (np_state[0], np.asarray(np_state[1], dtype=np.uint32), *np_state[2:])
    torch_state = torch.tensor(states["torch"], dtype=torch.uint8)
    random.Random().setstate(py)
    np.random.RandomState().set_state(np_state)
    torch.Generator().set_state(torch_state)
    return py, np_state, torch_state


def set_rng_states(states: dict | tuple) -> None:
    """Restore :func:`rng_states` (or what :func:`_parse_rng` made of them)."""
    py, np_state, torch_state = states if isinstance(states, tuple) else _parse_rng(states)
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_pointer(run_dir: str | Path) -> Pointer:
    """The validated ``checkpoint.json`` of ``run_dir``; every problem is one line naming it."""
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT_JSON
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_POINTER_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{run_dir}: no {CHECKPOINT_JSON} to resume from (the run stopped before its first checkpoint; {REDO})"
        ) from None
    except OSError as exc:
        raise CheckpointError(str(path), "", f"cannot read it ({exc.strerror or exc})") from None
    if len(text) > MAX_POINTER_BYTES:
        raise CheckpointError(str(path), "", f"larger than {MAX_POINTER_BYTES >> 20} MiB, not a checkpoint pointer; {REDO}")
    try:
        return Pointer.model_validate_json(text)
    except ValidationError as exc:
        err = format_validation_error(str(path), exc, CheckpointError)
        raise CheckpointError(str(path), err.field, f"{err.message}; not a checkpoint this nefl-zoo wrote ({REDO})") from None


def saved_config(run_dir: str | Path) -> tuple[dict, str]:
    """The configuration saved in a run directory's checkpoint, and the file it came from."""
    return read_pointer(run_dir).config, str(Path(run_dir) / CHECKPOINT_JSON)


def read_checkpoint(run_dir: str | Path, template: Mapping[str, torch.Tensor] | None = None,
                    rounds: int | None = None) -> tuple[Checkpoint, Pointer]:
    """The committed checkpoint of ``run_dir`` and its pointer, every file's hash verified.
    ``template``: the keys, shapes and dtypes the global state must have; ``rounds``: the
    configured rounds, which the checkpoint's round must not exceed."""
    run_dir = Path(run_dir)
    pointer = read_pointer(run_dir)
    where = str(run_dir / CHECKPOINT_JSON)
    if rounds is not None and pointer.round > rounds:
        raise CheckpointError(where, "round", f"{pointer.round} completed rounds, but the configuration has only "
                              f"{rounds}; resume with --set rounds=N for some N >= {pointer.round}")
    if GLOBAL_STATE not in pointer.files or RUN_JSON not in pointer.files:
        raise CheckpointError(where, "files", f"names no {GLOBAL_STATE} or {RUN_JSON}; {REDO}")
    paths = {role: run_dir / f"{pointer.generation}.{role}" for role in pointer.files}
    blobs = {role: _read_verified(paths[role], pointer.files[role]) for role in pointer.files}
    tensors = {role: _tensors(paths[role], blobs[role]) for role in pointer.files if role.endswith(".safetensors")}
    state = tensors[GLOBAL_STATE]
    if template is not None:
        check_state(state, template, str(paths[GLOBAL_STATE]))
    clients: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.get(CLIENT_STATES, {}).items():
        cid, _, name = key.partition(CLIENT_SEP)
        if not (cid.isdigit() and name):
            raise CheckpointError(str(paths[CLIENT_STATES]), key, f"not CLIENT{CLIENT_SEP}KEY; {REDO}")
        clients.setdefault(int(cid), {})[name] = value
    records, rng = _run_json(paths[RUN_JSON], blobs[RUN_JSON], pointer.round)
    checkpoint = Checkpoint(pointer.round, state, clients, tensors.get(SERVER_STATE, {}), dict(pointer.totals),
                            dict(pointer.last_eval), records, rng, pointer.config)
    return checkpoint, pointer


def _read_verified(path: Path, ref: FileRef) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(str(path), "", f"missing, though {CHECKPOINT_JSON} names it; restore it or {REDO}") from None
    except OSError as exc:
        raise CheckpointError(str(path), "", f"cannot read it ({exc.strerror or exc})") from None
    digest = sha256(data)
    if len(data) != ref.bytes or digest != ref.sha256:
        raise CheckpointError(str(path), "", f"{len(data)} bytes with sha256 {digest[:12]}..., but {CHECKPOINT_JSON} "
                              f"names {ref.bytes} bytes with sha256 {ref.sha256[:12]}... (changed or damaged); "
                              f"restore it or {REDO}")
    return data


def _tensors(path: Path, data: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_tensors(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own errors, and Rust panics
        raise CheckpointError(str(path), "", f"not a readable safetensors file ({exc}); {REDO}") from None


def _run_json(path: Path, data: bytes, round_: int) -> tuple[list[dict], tuple]:
    try:
        run = json.loads(data)
        records, rng = run["metrics"], _parse_rng(run["rng"])
        rounds = [r["round"] for r in records]
    except Exception as exc:  # noqa: BLE001 - any shape of bad data (OverflowError from a huge integer, ...)
        raise CheckpointError(str(path), "", f"not the RNG states and metrics records of a checkpoint ({exc}); {REDO}") from None
    if rounds != list(range(1, round_ + 1)):
        raise CheckpointError(str(path), "metrics", f"records of rounds {rounds[:3]}..., expected 1..{round_}; {REDO}")
    return records, rng


def check_state(state: Mapping[str, torch.Tensor], template: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise :class:`CheckpointError` unless ``state`` has the keys, shapes and dtypes of ``template``."""
    hint = "the checkpoint does not belong to this configuration (resume without changing the model, or start again with --overwrite)"
    missing = sorted(set(template) - set(state))
    if missing:
        raise CheckpointError(source, missing[0], f"missing ({len(missing)} keys missing); {hint}")
    unexpected = sorted(set(state) - set(template))
    if unexpected:
        raise CheckpointError(source, unexpected[0], f"not in this configuration's global state ({len(unexpected)} unexpected keys); {hint}")
    for key, want in template.items():
        got = state[key]
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise CheckpointError(source, key, f"{got.dtype} {tuple(got.shape)}, the configuration needs {want.dtype} {tuple(want.shape)}; {hint}")

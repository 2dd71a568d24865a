"""The run directory: metrics files, checkpoints and RNG state, owned by one object.

A run directory holds ``config.yaml``, ``spec.yaml`` (the spec of the method's global state),
``metrics.jsonl`` and ``metrics.csv`` (one record per round), ``checkpoint.json`` (the commit
point), the files of the committed checkpoint (``ckpt-ROUND-ID.*``), ``global.safetensors``
(plus ``clients.safetensors`` / ``server.safetensors`` when the method keeps such state: hard
links to the committed checkpoint's files), ``run.lock`` and, at the end, ``summary.json``.

**Commit protocol.** A checkpoint writes a new generation of files under new names
(``ckpt-000004-1a2b3c4d.global.safetensors``, ``….clients.safetensors``,
``….server.safetensors``, ``….run.json`` holding the RNG states and every metrics record up to
that round), fsyncs them and the directory, then atomically replaces ``checkpoint.json``, which
names the generation and each file's sha256: that rename is the one commit point. Only then are
``global.safetensors`` and friends re-linked to the new files and older generations deleted.
Readers trust only what ``checkpoint.json`` names and verify every hash before loading the
bytes they hashed. ``metrics.jsonl`` is appended to between checkpoints and never rewritten in
place: a resume replaces it (write a temporary file, rename) with the committed records, after
every check has passed, so records of rounds after the checkpoint (and a torn last line) go.

An ``OSError`` while writing (a full disk) is one line naming the file and the fix
(:class:`~nefl_zoo.files.WriteError`): ``RUN/ckpt-000012-1a2b3c4d.global.safetensors: cannot
write (No space left on device); free space, then continue with --resume RUN (the last
checkpoint, round 10, is intact)``.

Every writer holds ``run.lock`` (:class:`~nefl_zoo.files.DirLock`, exclusive; export takes
it shared). The crash points (:func:`~nefl_zoo.files.crash_point`) of the fault-injection
tests, in the order a run reaches them:

=============================== ===============================================================
``overwrite:cleared``           ``--overwrite`` removed the old ``checkpoint.json``, nothing else
``log:jsonl``                   a round's record appended to ``metrics.jsonl``, not ``metrics.csv``
``save:partial``                the new generation's global state written, the rest not
``save:before-commit``          the new generation written and fsynced, not committed
``before-rename:checkpoint.json`` the new pointer fsynced under its temporary name
``save:committed``              committed; ``global.safetensors`` still the previous one
``publish:ROLE``                ``global.safetensors`` (then client, server state) re-linked
``save:published``              all re-linked; the previous generation not yet deleted
``summary``                     the last checkpoint committed, ``summary.json`` not written
``before-rename:metrics.jsonl`` a resume's new ``metrics.jsonl`` (then ``.csv``) not yet renamed
=============================== ===============================================================
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Mapping

import torch
import yaml
from safetensors.torch import save as save_tensors

from ..files import DirLock, atomic_write, crash_point, fsync_path, naming_write_errors, write_durably
from .checkpoint import (
    CHECKPOINT_JSON,
    CLIENT_SEP,
    CLIENT_STATES,
    FORMAT,
    GENERATION,
    GLOBAL_STATE,
    RUN_JSON,
    SERVER_STATE,
    Checkpoint,
    CheckpointError,
    Pointer,
    read_checkpoint,
    read_pointer,
    rng_states,
    saved_config,
    set_rng_states,
    sha256,
)

METRICS_JSONL, METRICS_CSV, SUMMARY_JSON = "metrics.jsonl", "metrics.csv", "summary.json"
CONFIG_YAML, SPEC_YAML, LOCK_FILE = "config.yaml", "spec.yaml", "run.lock"
PUBLISHED = (GLOBAL_STATE, CLIENT_STATES, SERVER_STATE)  # linked into the run directory

__all__ = ["CHECKPOINT_JSON", "Checkpoint", "CheckpointError", "RunExistsError", "RunStore", "read_pointer", "rng_states",
           "saved_config", "set_rng_states"]


class RunExistsError(ValueError):
    """The run directory already holds a run."""


def _safetensors_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    return save_tensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


class RunStore:
    """Reads and writes one run directory (see the module docstring for the protocol).

    Args:
        out: the run directory.
        columns: the ``metrics.csv`` columns.
    """

    def __init__(self, out: str | Path, columns: list[str]):
        self.out = Path(out)
        self.columns = columns
        self._lock = DirLock(self.out, LOCK_FILE)
        self._records: list[dict] | None = None  # this run's metrics records so far
        self._pointer: Pointer | None = None  # the committed checkpoint last read or written
        self._spec_sha256: str | None = None

    # -- the lock ------------------------------------------------------------------------
    def open(self, create: bool = False, overwrite: bool = False, shared: bool = False) -> None:
        """Take ``run.lock`` (``shared`` for a reader). ``create``: a fresh run, refused (before
        anything is written) where a run exists unless ``overwrite``; the directory is made."""
        if create:
            if not overwrite:
                self._refuse_existing()
            self.out.mkdir(parents=True, exist_ok=True)
        elif not self.out.is_dir():
            raise FileNotFoundError(f"{self.out}: no such run directory")
        self._lock.acquire(shared=shared)

    def close(self) -> None:
        """Release ``run.lock``."""
        self._lock.release()

    def _require_lock(self) -> None:
        if not self._lock.held:
            raise RuntimeError(f"{self.out}: RunStore.open() must be called before writing")

    def _writes(self, path: Path | None = None) -> contextlib.AbstractContextManager[None]:
        """Turn an ``OSError`` inside into a :class:`~nefl_zoo.files.WriteError` naming the
        file (else ``path``, else the run directory) and what to do, which depends on whether a
        checkpoint is committed."""

        def fix() -> str:
            if self._pointer is None:
                return "free space, then start the run again with --overwrite (no checkpoint was committed yet)"
            return f"free space, then continue with --resume {self.out} (the last checkpoint, round {self._pointer.round}, is intact)"

        return naming_write_errors(path or self.out, fix)

    def _refuse_existing(self) -> None:
        if any((self.out / f).exists() for f in (CHECKPOINT_JSON, METRICS_JSONL)):
            raise RunExistsError(
                f"{self.out}: already holds a run; continue it with --resume {self.out}, "
                "or choose another --out (--overwrite replaces it)"
            )

    # -- a fresh run -----------------------------------------------------------------------
    def create(self, config: dict, spec: dict, overwrite: bool) -> None:
        """Start a fresh run: refuse a directory holding one unless ``overwrite``, which first
        removes the old run's commit point (so nothing can resume it), then its files."""
        self._require_lock()
        if not overwrite:
            self._refuse_existing()
        with self._writes():
            if overwrite:
                (self.out / CHECKPOINT_JSON).unlink(missing_ok=True)
                fsync_path(self.out)
                crash_point("overwrite:cleared")
                for path in self.out.iterdir():
                    if path.name in (*PUBLISHED, SUMMARY_JSON, METRICS_JSONL, METRICS_CSV) or path.name.startswith(GENERATION):
                        path.unlink()
                self._remove_temporaries()
            spec_bytes = yaml.safe_dump(spec, sort_keys=False).encode()
            atomic_write(self.out / CONFIG_YAML, lambda p: p.write_bytes(yaml.safe_dump(config, sort_keys=False).encode()))
            atomic_write(self.out / SPEC_YAML, lambda p: p.write_bytes(spec_bytes))
            self._spec_sha256 = sha256(spec_bytes)
            self._write_metrics([])

    def _write_metrics(self, records: list[dict]) -> None:
        """Replace ``metrics.jsonl`` and ``metrics.csv`` with ``records`` (temporary file + rename)."""
        atomic_write(self.out / METRICS_JSONL, lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in records)))

        def write_csv(path: Path) -> None:
            with open(path, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(self.columns)
                writer.writerows(self._csv_row(r) for r in records)

        atomic_write(self.out / METRICS_CSV, write_csv)
        self._records = list(records)

    def _csv_row(self, record: dict) -> list:
        flat = {**record, **{f"acc_{t}": a for t, a in record.get("acc", {}).items()}}
        return [flat.get(c, "") for c in self.columns]

    def log(self, record: dict) -> None:
        """Append one round's record to ``metrics.jsonl`` and ``metrics.csv``."""
        if self._records is None:
            raise RuntimeError(f"{self.out}: RunStore.create() or resume() must come before log()")
        line = json.dumps(record)
        with self._writes(self.out / METRICS_JSONL), open(self.out / METRICS_JSONL, "a") as f:
            f.write(line + "\n")
        crash_point("log:jsonl")
        with self._writes(self.out / METRICS_CSV), open(self.out / METRICS_CSV, "a", newline="") as f:
            csv.writer(f).writerow(self._csv_row(record))
        self._records.append(json.loads(line))  # a copy, as the line reads

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, checkpoint: Checkpoint, config: dict) -> None:
        """Commit a checkpoint: a new generation of files, fsynced, then ``checkpoint.json``.
        An ``OSError`` is a :class:`~nefl_zoo.files.WriteError` (the committed checkpoint, if
        any, stays the one ``checkpoint.json`` names)."""
        self._require_lock()
        if self._records is None:
            raise RuntimeError(f"{self.out}: RunStore.create() or resume() must come before save()")
        with self._writes():
            self._save(checkpoint, config)

    def _save(self, checkpoint: Checkpoint, config: dict) -> None:
        generation = f"{GENERATION}{checkpoint.round:06d}-{secrets.token_hex(4)}"
        clients = {f"{cid}{CLIENT_SEP}{k}": v for cid, s in checkpoint.client_states.items() for k, v in s.items()}
        blobs = {GLOBAL_STATE: _safetensors_bytes(checkpoint.state)}
        if clients:
            blobs[CLIENT_STATES] = _safetensors_bytes(clients)
        if checkpoint.server_state:
            blobs[SERVER_STATE] = _safetensors_bytes(checkpoint.server_state)
        blobs[RUN_JSON] = json.dumps({"rng": rng_states(), "metrics": self._records}).encode()
        files = {}
        for role, data in blobs.items():
            files[role] = {"sha256": write_durably(self.out / f"{generation}.{role}", data), "bytes": len(data)}
            if role == GLOBAL_STATE:
                crash_point("save:partial")
        fsync_path(self.out)
        crash_point("save:before-commit")
        pointer = Pointer.model_validate({
            "format": FORMAT, "round": checkpoint.round, "generation": generation, "files": files,
            "spec_sha256": self._spec_sha256, "config": config, "totals": checkpoint.totals,
            "last_eval": checkpoint.last_eval,
        })
        atomic_write(self.out / CHECKPOINT_JSON, lambda p: p.write_text(json.dumps(pointer.model_dump())))
        self._pointer = pointer
        crash_point("save:committed")
        self._publish(pointer)
        crash_point("save:published")
        self._prune(pointer)

    def _publish(self, pointer: Pointer) -> None:
        """Point ``global.safetensors`` (and client/server state) at the committed files."""
        for role in PUBLISHED:
            target = self.out / role
            if role not in pointer.files:
                target.unlink(missing_ok=True)
                continue
            source, tmp = self.out / f"{pointer.generation}.{role}", self.out / f".{role}.tmp"
            tmp.unlink(missing_ok=True)
            try:
                os.link(source, tmp)
            except OSError:  # no hard links on this file system: copy
                shutil.copyfile(source, tmp)
                fsync_path(tmp)
            os.replace(tmp, target)
            crash_point(f"publish:{role}")
        fsync_path(self.out)

    def _prune(self, pointer: Pointer) -> None:
        """Delete every generation but the committed one."""
        for path in self.out.iterdir():
            if path.name.startswith(GENERATION) and not path.name.startswith(pointer.generation + "."):
                path.unlink(missing_ok=True)

    def _remove_temporaries(self) -> None:
        for path in self.out.glob(".*.tmp"):
            path.unlink(missing_ok=True)

    def read_checkpoint(self, template: Mapping[str, torch.Tensor] | None = None, rounds: int | None = None) -> Checkpoint:
        """The committed checkpoint, every file's hash verified, changing nothing (see
        :func:`~.checkpoint.read_checkpoint` for ``template`` and ``rounds``)."""
        checkpoint, self._pointer = read_checkpoint(self.out, template, rounds)
        return checkpoint

    def resume(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint`` (read by :meth:`read_checkpoint`, every check passed):
        replace the metrics files with its records, re-link ``global.safetensors``, delete
        uncommitted generations and ``summary.json``, and restore the RNG states."""
        self._require_lock()
        if self._pointer is None or checkpoint.rng is None:
            raise RuntimeError("RunStore.resume() takes the checkpoint read_checkpoint() returned")
        with self._writes():
            self._write_metrics(checkpoint.records)
            self._publish(self._pointer)
            self._prune(self._pointer)
            self._remove_temporaries()
            (self.out / SUMMARY_JSON).unlink(missing_ok=True)  # written again when the run ends
        self._spec_sha256 = self._pointer.spec_sha256
        set_rng_states(checkpoint.rng)

    def load(self, template: Mapping[str, torch.Tensor] | None = None, rounds: int | None = None) -> Checkpoint:
        """:meth:`read_checkpoint`, then :meth:`resume` from it."""
        checkpoint = self.read_checkpoint(template, rounds)
        self.resume(checkpoint)
        return checkpoint

    def read_spec_text(self) -> str:
        """``spec.yaml``, verified against the hash the committed checkpoint names (call
        :meth:`read_checkpoint` first)."""
        path = self.out / SPEC_YAML
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise FileNotFoundError(f"{path}: missing or unreadable ({exc.strerror or exc}); a run directory holds spec.yaml") from None
        expected = self._pointer.spec_sha256 if self._pointer else None
        if expected is not None and sha256(data) != expected:
            raise CheckpointError(str(path), "", f"changed since the checkpoint was written (sha256 differs from {CHECKPOINT_JSON}); restore it")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(str(path), "", f"not UTF-8 text (byte {exc.start})") from None

    def write_summary(self, summary: dict) -> None:
        """Write ``summary.json`` at the end of a run."""
        crash_point("summary")
        with self._writes():
            atomic_write(self.out / SUMMARY_JSON, lambda p: p.write_text(json.dumps(summary, indent=2)))

"""One export at a time writes an export folder (issue 33): an export paused between moving its
files into place and writing ``manifest.json`` holds ``OUT/.export.lock``; a second export into
the same folder is refused in one line, and the manifest left behind matches its files. The
lock file is transient: nothing of it stays in the folder, and a holder that removed it on
release never leaves another process locking a file no one else sees."""

from __future__ import annotations

import errno
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from nefl_zoo.export import ExportOptions, ExportSource, export_tiers
from nefl_zoo.export import staging
from nefl_zoo.export.staging import EXPORT_LOCK, export_lock
from nefl_zoo.files import DirLock, LockedError
from nefl_zoo.manifest import file_sha256, load_manifest
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec
from nefl_zoo_cli.app import app

SPEC = {"model": "resnet20", "model_args": {"img_size": 8}, "tiers": [{"name": "g0.25", "gamma_w": 0.25}, {"name": "g1"}]}
BUSY = "another nefl-zoo process (pid {pid}) is using this export folder; wait for it to finish or choose another --out"


def source(seed: int) -> ExportSource:
    """The tiny spec with the random weights of ``seed`` (another seed: other file bytes)."""
    compiled = compile_spec(parse_spec(SPEC))
    torch.manual_seed(seed)
    return ExportSource(compiled, compiled.init_global_state(), f"seed {seed}")


def assert_manifest_matches_its_files(out: Path) -> None:
    """Every tier file is the one the manifest names; no lock file or staging folder is left."""
    manifest = load_manifest(out)
    assert all(file_sha256(out / t.file) == t.sha256 for t in manifest.tiers), "a file is not the one the manifest names"
    assert [p.name for p in out.iterdir() if p.name.startswith(".export")] == []


def test_a_second_export_into_a_folder_being_published_is_refused(tmp_path, monkeypatch):
    """Export A pauses after moving its tier files into OUT, before writing the manifest; export
    B into OUT (library and CLI) is refused in one line, and A's manifest matches A's files."""
    out = tmp_path / "out"
    paused, proceed = threading.Event(), threading.Event()
    write_manifest = staging.atomic_write

    def slow_manifest(path, write):
        if Path(path).name == "manifest.json" and threading.current_thread().name.startswith("export-a"):
            paused.set()
            assert proceed.wait(120), "export A was never let go"
        write_manifest(path, write)

    monkeypatch.setattr(staging, "atomic_write", slow_manifest)
    with ThreadPoolExecutor(1, thread_name_prefix="export-a") as pool:
        first = pool.submit(export_tiers, source(0), out, ExportOptions(latency_runs=1, threads=1))
        while not paused.wait(0.1):
            assert not first.done(), first.result()  # export A failed before its manifest: show why
        busy = re.escape(f"{out}: " + BUSY.format(pid=os.getpid()))
        with pytest.raises(LockedError, match=f"^{busy}$"):
            export_tiers(source(1), out, ExportOptions(latency_runs=1, threads=1))
        spec = tmp_path / "spec.yaml"
        spec.write_text(yaml.safe_dump(SPEC))
        result = CliRunner().invoke(app, ["export", str(spec), "--out", str(out), "--seed", "1", "--latency-runs", "1",
                                          "--pad-channels", "1"])
        assert result.exit_code == 2, result.output
        assert result.output.splitlines() == [f"error: {out}: " + BUSY.format(pid=os.getpid())]
        proceed.set()
        manifest = first.result(timeout=120)
    assert load_manifest(out) == manifest and manifest.source == "seed 0"
    assert_manifest_matches_its_files(out)


def test_the_export_lock_is_exclusive_and_leaves_nothing_behind(tmp_path):
    (tmp_path / EXPORT_LOCK).write_text("4242\n")  # what a killed export leaves: a file no one locks
    holder = export_lock(tmp_path)
    holder.acquire()
    assert (tmp_path / EXPORT_LOCK).read_text() == f"{os.getpid()}\n"
    with pytest.raises(LockedError, match=f"^{re.escape(f'{tmp_path}: ' + BUSY.format(pid=os.getpid()))}$"):
        export_lock(tmp_path).acquire()
    holder.release()
    assert list(tmp_path.iterdir()) == []
    second = export_lock(tmp_path)
    second.acquire()
    second.release()
    assert list(tmp_path.iterdir()) == []


def test_a_lock_file_removed_by_its_releasing_holder_is_taken_afresh(tmp_path, monkeypatch):
    """B opens the lock file; A then releases it (removing the file) before B locks it: B must
    not keep a lock on the removed file (a third export would get the folder too) but lock
    the file now at the path."""
    first, second = export_lock(tmp_path), export_lock(tmp_path)
    first.acquire()
    opened = DirLock._open

    def open_then_first_releases(self, shared):
        result = opened(self, shared)
        if self is second and first.held:
            first.release()
        return result

    monkeypatch.setattr(DirLock, "_open", open_then_first_releases)
    second.acquire()
    assert (tmp_path / EXPORT_LOCK).exists()
    with pytest.raises(LockedError):
        export_lock(tmp_path).acquire()
    second.release()
    assert not (tmp_path / EXPORT_LOCK).exists()


def test_the_run_directory_lock_keeps_its_message(tmp_path):
    holder = DirLock(tmp_path)
    holder.acquire()
    with pytest.raises(LockedError) as refused:
        DirLock(tmp_path).acquire()
    assert str(refused.value) == (f"{tmp_path}: another nefl-zoo process (pid {os.getpid()}) is using this run directory; "
                                  "wait for it to finish or stop it")
    holder.release()
    assert (tmp_path / "run.lock").exists()  # a run directory's lock file stays


@pytest.mark.parametrize("written, shown", [(b"garbage\n", "pid unknown"), (b"\xff\xfe12\n", "pid unknown"), (b"4242\n", "pid 4242")])
def test_a_holder_that_is_not_a_pid_is_an_unknown_one(tmp_path, written, shown):
    holder = DirLock(tmp_path)
    holder.acquire()
    holder.path.write_bytes(written)  # what another writer of the lock file left in it
    with pytest.raises(LockedError, match=rf"^{re.escape(str(tmp_path))}: another nefl-zoo process \({shown}\) is using"):
        DirLock(tmp_path).acquire()
    holder.release()


def refuse_writing(monkeypatch, errno_value: int) -> None:
    """``os.open`` of a lock file for writing fails as on a directory this process cannot write."""
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if str(path).endswith(".lock") and flags & os.O_RDWR:
            raise OSError(errno_value, os.strerror(errno_value), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


@pytest.mark.parametrize("errno_value", [errno.EACCES, errno.EPERM, errno.EROFS])
def test_a_reader_of_a_directory_it_cannot_write_locks_the_writers_file_if_there_is_one(tmp_path, monkeypatch, errno_value):
    refuse_writing(monkeypatch, errno_value)
    reader = DirLock(tmp_path)
    reader.acquire(shared=True)
    assert not reader.held and not reader.path.exists()  # no writer ever locked it: nothing to lock, nothing made
    monkeypatch.undo()
    writer = DirLock(tmp_path)
    writer.acquire()
    writer.release()
    refuse_writing(monkeypatch, errno_value)
    reader.acquire(shared=True)
    assert reader.held and reader.path.read_text() == f"{os.getpid()}\n"  # locked read-only: the writer's pid kept
    monkeypatch.undo()
    with pytest.raises(LockedError):
        DirLock(tmp_path).acquire()  # a writer waits for the reader
    reader.release()


def test_a_writer_that_cannot_open_the_lock_file_is_one_line(tmp_path, monkeypatch):
    refuse_writing(monkeypatch, errno.EACCES)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'run.lock'))}: cannot open the lock file \(Permission "
                                         r"denied\); the run directory must be writable$"):
        DirLock(tmp_path).acquire()


def test_fsync_tolerates_a_directory_the_file_system_cannot_fsync_but_never_a_file(tmp_path, monkeypatch):
    from nefl_zoo.files import fsync_path

    data = tmp_path / "data.bin"
    data.write_bytes(b"x")

    def fsync(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", fsync)
    fsync_path(tmp_path)  # some file systems refuse to fsync a directory: its entries are flushed anyway
    with pytest.raises(OSError) as failed:
        fsync_path(data)
    assert (failed.value.errno, failed.value.filename) == (errno.EINVAL, str(data))

"""Staging an export and publishing it: tier files are written into a locked staging folder
inside the output folder and moved into place only when every tier passed, the manifest last.

One export at a time writes an output folder: :func:`staging` holds an exclusive ``flock`` on
``OUT/.export.lock`` (:class:`~nefl_zoo.files.DirLock`, removed when the export ends) from
before its staging folder exists until after the manifest is written, so a second export into
the same folder is refused in one line instead of mixing its files into the first one's
manifest. Each staging folder is locked too (its ``.lock``) by the export writing it; the
next export into the same folder removes staging folders whose export died. An ``OSError``
while staging or publishing is one line naming the file and the fix
(:class:`~nefl_zoo.files.WriteError`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from ..files import DirLock, atomic_write, naming_write_errors
from ..manifest import MANIFEST_NAME, Manifest

STAGING_PREFIX = ".export-"
EXPORT_LOCK = ".export.lock"  # in the output folder, while an export writes it
_LOCK_NAME = ".lock"
_YOUNG_S = 60.0  # a staging folder without a lock file yet may be an export that is starting


def export_lock(out_dir: Path) -> DirLock:
    """The lock an export holds on its output folder (exclusive, non-blocking, removed on release)."""
    return DirLock(out_dir, EXPORT_LOCK, what="export folder", fix="wait for it to finish or choose another --out",
                   transient=True)


@contextlib.contextmanager
def staging(out_dir: Path) -> Iterator[Path]:
    """A new staging folder in ``out_dir``, for the export that holds ``out_dir``'s
    :func:`export_lock` throughout (another export's :class:`~nefl_zoo.files.LockedError`
    names it). The folder is locked with an exclusive ``flock`` on its ``.lock`` while the
    export runs (the kernel releases it when the process dies, which is how
    :func:`remove_stale_staging` recognises a dead export's folder) and removed afterwards.
    Stale folders of earlier, killed exports are removed first. An ``OSError`` inside becomes
    a :class:`~nefl_zoo.files.WriteError` naming the file and the fix."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locks (and no clean-up of other folders)
        fcntl = None
    fix = "free space or choose another --out, then export again"
    with contextlib.ExitStack() as stack:
        if fcntl is not None:
            stack.enter_context(export_lock(out_dir))
        stack.enter_context(naming_write_errors(out_dir, lambda: fix))
        remove_stale_staging(out_dir)
        folder = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir))
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        if fcntl is not None:
            lock = stack.enter_context(open(folder / _LOCK_NAME, "w"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


def remove_stale_staging(out_dir: Path) -> list[Path]:
    """Remove the staging folders in ``out_dir`` left by exports that died (no process holds
    their lock any more); folders of running exports are left alone. Returns those removed."""
    try:
        import fcntl
    except ImportError:
        return []
    removed = []
    for folder in out_dir.glob(f"{STAGING_PREFIX}*"):
        if folder.is_symlink() or not folder.is_dir():
            continue
        lock_path = folder / _LOCK_NAME
        try:
            if not lock_path.exists():
                if time.time() - folder.stat().st_mtime < _YOUNG_S:
                    continue  # perhaps an export between creating its folder and locking it
            else:
                with open(lock_path, "a") as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        continue  # a running export holds it
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def manifest_files(manifest: Manifest) -> list[str]:
    """Every file ``manifest`` names, once each (a nested model serves several entries)."""
    return list(dict.fromkeys(e.file for e in manifest.tiers))


def publish(folder: Path, out_dir: Path, manifest: Manifest) -> None:
    """Move verified tier files into ``out_dir`` and write the manifest atomically.

    The old manifest is removed first, so an interruption leaves no manifest rather than one
    whose hashes do not match the files next to it.
    """
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for name in manifest_files(manifest):
        os.replace(folder / name, out_dir / name)
    atomic_write(out_dir / MANIFEST_NAME, lambda p: p.write_text(manifest.model_dump_json(indent=2) + "\n"))

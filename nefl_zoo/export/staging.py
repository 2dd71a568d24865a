"""Staging an export and publishing it: tier files are written into a locked staging folder
inside the output folder and moved into place only when every tier passed, the manifest last.
Each staging folder is locked (``flock``) by the export writing it; the next export into the
same folder removes staging folders whose export died.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from ..files import atomic_write
from ..manifest import MANIFEST_NAME, Manifest

STAGING_PREFIX = ".export-"
_LOCK_NAME = ".lock"
_YOUNG_S = 60.0  # a staging folder without a lock file yet may be an export that is starting


@contextlib.contextmanager
def staging(out_dir: Path) -> Iterator[Path]:
    """A new staging folder in ``out_dir``, locked with an exclusive ``flock`` on its ``.lock``
    while the export runs (the kernel releases it when the process dies, which is how
    :func:`remove_stale_staging` recognises a dead export's folder) and removed afterwards.
    Stale folders of earlier, killed exports are removed first."""
    remove_stale_staging(out_dir)
    folder = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir))
    try:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock (and no clean-up of other folders)
            yield folder
            return
        with open(folder / _LOCK_NAME, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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


def publish(folder: Path, out_dir: Path, manifest: Manifest) -> None:
    """Move verified tier files into ``out_dir`` and write the manifest atomically.

    The old manifest is removed first, so an interruption leaves no manifest rather than one
    whose hashes do not match the files next to it.
    """
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for entry in manifest.tiers:
        os.replace(folder / entry.file, out_dir / entry.file)
    atomic_write(out_dir / MANIFEST_NAME, lambda p: p.write_text(manifest.model_dump_json(indent=2) + "\n"))

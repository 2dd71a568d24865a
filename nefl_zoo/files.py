"""Durable files: atomic writes, fsync, an exclusive lock on a directory, and named crash points.

* :func:`atomic_write` writes a temporary file beside the target, fsyncs it, renames it over
  the target and fsyncs the directory: after a crash the path holds the old file or the
  complete new one, and after it returns the new one survives a power loss.
* :class:`DirLock` is an ``fcntl.flock`` on a lock file in a directory (exclusive for writers,
  shared for readers), non-blocking: a second holder gets a one-line :class:`LockedError`
  naming the first one's PID.
* :func:`crash_point` is the fault-injection hook of the test suite: with
  ``NEFL_ZOO_CRASH_AT=NAME`` (or ``NAME:N``, the N-th time) the process ends with
  ``os._exit(99)`` when it reaches that point, as a kill would (no cleanup, no flush).
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Callable

CRASH_ENV = "NEFL_ZOO_CRASH_AT"
CRASH_EXIT_CODE = 99
_crash_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """End the process at once (``os._exit(99)``) if ``$NEFL_ZOO_CRASH_AT`` names this point
    (``NAME`` = the first time it is reached, ``NAME:N`` = the N-th time); else do nothing."""
    wanted = os.environ.get(CRASH_ENV)
    if not wanted:
        return
    point, _, count = wanted.rpartition(":")
    if not (point and count.isdigit()):
        point, count = wanted, "1"
    if point != name:
        return
    _crash_hits[name] = _crash_hits.get(name, 0) + 1
    if _crash_hits[name] == int(count):
        os._exit(CRASH_EXIT_CODE)


def fsync_path(path: str | Path) -> None:
    """Flush a file's (or a directory's) data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync a directory; the data is flushed anyway
        if not Path(path).is_dir() or exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_durably(path: str | Path, data: bytes) -> str:
    """Write ``data`` to a new file ``path`` and fsync it (the caller fsyncs the directory);
    return its sha256."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write`` on a temporary file beside ``path``, fsync it, rename it over ``path``
    and fsync the directory (crash point ``before-rename:NAME`` just before the rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        fsync_path(tmp)
        crash_point(f"before-rename:{path.name}")
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


class LockedError(ValueError):
    """Another process holds the directory's lock."""


class DirLock:
    """An ``fcntl.flock`` on ``directory/name``: exclusive for a writer, shared for readers.

    :meth:`acquire` never waits: when another process holds a conflicting lock it raises
    :class:`LockedError` naming that process's PID (which every holder writes into the lock
    file). The lock is released by :meth:`release`, when the object is discarded, or when the
    process ends, however it ends.
    """

    def __init__(self, directory: str | Path, name: str = "run.lock"):
        self.directory = Path(directory)
        self.path = self.directory / name
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, shared: bool = False) -> None:
        """Take the lock (``shared`` for a reader); idempotent while held."""
        import fcntl  # POSIX only: imported here so that the rest of this module works anywhere

        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            writable = True
        except OSError as exc:
            if not (shared and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)):
                raise ValueError(f"{self.path}: cannot open the lock file ({exc.strerror or exc}); "
                                 "the run directory must be writable") from None
            try:  # a reader of a directory it cannot write: lock the file if a writer made one
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                writable = False
            except FileNotFoundError:
                return  # no writer has ever locked it, and none can start without writing it
            except OSError as again:
                raise ValueError(f"{self.path}: cannot open the lock file ({again.strerror or again})") from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            who = f"pid {holder}" if holder.isdigit() else "pid unknown"
            raise LockedError(
                f"{self.directory}: another nefl-zoo process ({who}) is using this run directory; "
                "wait for it to finish or stop it"
            ) from None
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (closing the file releases it)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> "DirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["CRASH_ENV", "DirLock", "LockedError", "atomic_write", "crash_point", "fsync_path", "write_durably"]

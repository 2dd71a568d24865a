"""Durable files: atomic writes, fsync, an exclusive lock on a directory, and named crash points.

* :func:`atomic_write` writes a temporary file beside the target, fsyncs it, renames it over
  the target and fsyncs the directory: after a crash the path holds the old file or the
  complete new one, and after it returns the new one survives a power loss.
* :class:`DirLock` is an ``fcntl.flock`` on a lock file in a directory (exclusive for writers,
  shared for readers), non-blocking: a second holder gets a one-line :class:`LockedError`
  naming the first one's PID.
* :class:`WriteError` is an ``OSError`` met while writing, as one line naming the file and the
  fix (:func:`naming_write_errors` makes one).
* :func:`crash_point` is the fault-injection hook of the test suite: with
  ``NEFL_ZOO_CRASH_AT=NAME`` (or ``NAME:N``, the N-th time) the process ends with
  ``os._exit(99)`` when it reaches that point, as a kill would (no cleanup, no flush).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from pathlib import Path
from typing import Callable, Iterator

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
            exc.filename = exc.filename or str(path)
            raise
    finally:
        os.close(fd)


def write_durably(path: str | Path, data: bytes) -> str:
    """Write ``data`` to a new file ``path`` and fsync it (the caller fsyncs the directory);
    return its sha256. An ``OSError`` names ``path``."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        exc.filename = exc.filename or str(path)  # write() and fsync() name no file
        raise
    return hashlib.sha256(data).hexdigest()


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write`` on a temporary file beside ``path``, fsync it, rename it over ``path``
    and fsync the directory (crash point ``before-rename:NAME`` just before the rename). An
    ``OSError`` names ``path`` where the system names no file or the temporary one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        fsync_path(tmp)
        crash_point(f"before-rename:{path.name}")
        os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as exc:
        if exc.filename in (None, str(tmp)):  # the temporary file is ours: name the one being written
            exc.filename = str(path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


class WriteError(OSError):
    """An ``OSError`` met while writing (a full disk, a read-only or failing one), printed as
    one line: ``FILE: cannot write (No space left on device); FIX``. Keeps the original
    ``errno``; ``strerror`` holds everything after the file name."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


@contextlib.contextmanager
def naming_write_errors(fallback: str | Path, fix: Callable[[], str]) -> Iterator[None]:
    """Turn an ``OSError`` raised inside into a :class:`WriteError` naming its file (else
    ``fallback``) and ``fix()``, e.g. ``free space or choose another --out``."""
    try:
        yield
    except WriteError:
        raise
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise WriteError(exc.errno, f"cannot write ({reason}); {fix()}", str(exc.filename or fallback)) from exc


class LockedError(ValueError):
    """Another process holds the directory's lock."""


class DirLock:
    """An ``fcntl.flock`` on ``directory/name``: exclusive for a writer, shared for readers.

    :meth:`acquire` never waits: when another process holds a conflicting lock it raises
    :class:`LockedError` naming that process's PID (which every holder writes into the lock
    file): ``DIR: another nefl-zoo process (pid N) is using this WHAT; FIX``. The lock is
    released by :meth:`release`, when the object is discarded, or when the process ends,
    however it ends. With ``transient`` the lock file is removed on :meth:`release` (while
    still locked), so that nothing is left behind; :meth:`acquire` therefore checks that the
    file it locked is still the one at the path, and opens it again if not.
    """

    def __init__(self, directory: str | Path, name: str = "run.lock", what: str = "run directory",
                 fix: str = "wait for it to finish or stop it", transient: bool = False):
        self.directory = Path(directory)
        self.path = self.directory / name
        self.what, self.fix, self.transient = what, fix, transient
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, shared: bool = False) -> None:
        """Take the lock (``shared`` for a reader); idempotent while held."""
        import fcntl  # POSIX only: imported here so that the rest of this module works anywhere

        while self._fd is None:
            opened = self._open(shared)
            if opened is None:
                return  # no writer has ever locked it, and none can start without writing it
            fd, writable = opened
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                os.close(fd)
                who = f"pid {holder}" if holder.isdigit() else "pid unknown"
                raise LockedError(
                    f"{self.directory}: another nefl-zoo process ({who}) is using this {self.what}; {self.fix}"
                ) from None
            if not self._still_at_path(fd):  # a transient lock file its holder removed on release
                os.close(fd)
                continue
            if writable:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._fd = fd

    def _open(self, shared: bool) -> tuple[int, bool] | None:
        """The lock file's descriptor and whether it is writable (``None``: a reader of a
        directory it cannot write, where no lock file exists)."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), True
        except OSError as exc:
            if not (shared and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)):
                raise ValueError(f"{self.path}: cannot open the lock file ({exc.strerror or exc}); "
                                 f"the {self.what} must be writable") from None
        try:  # a reader of a directory it cannot write: lock the file if a writer made one
            return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC), False
        except FileNotFoundError:
            return None
        except OSError as again:
            raise ValueError(f"{self.path}: cannot open the lock file ({again.strerror or again})") from None

    def _still_at_path(self, fd: int) -> bool:
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        locked = os.fstat(fd)
        return (at_path.st_dev, at_path.st_ino) == (locked.st_dev, locked.st_ino)

    def release(self) -> None:
        """Drop the lock (closing the file releases it); a transient lock file is removed first."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self.transient:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass  # left behind: the next holder takes it over
        finally:
            os.close(fd)

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> "DirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["CRASH_ENV", "DirLock", "LockedError", "WriteError", "atomic_write", "crash_point", "fsync_path",
           "naming_write_errors", "write_durably"]

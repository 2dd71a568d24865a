"""Tier bytes and onnxruntime sessions: read once, hash-checked, never reopened by path.

numpy, onnxruntime and the standard library only.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import onnxruntime as ort

from ..manifest import ManifestError
from .wire import WireError, external_tensors

CPU_PROVIDER = "CPUExecutionProvider"
MAX_TIER_BYTES = 2**31  # protobuf's limit: a self-contained .onnx file is never larger
ORT_LOG_ENV = "NEFL_ZOO_ORT_LOG"  # onnxruntime's own log severity, 0 (verbose) .. 4 (fatal)
QUIET = 4  # by default only what the runtime raises reaches the user, as one line
LOW_MEMORY_OPTIMIZERS = ("ConstantFolding",)  # what the low-memory mode turns off


def ort_log_severity() -> int:
    """The severity from which onnxruntime's own log lines are printed: :data:`ORT_LOG_ENV`
    when set (``NEFL_ZOO_ORT_LOG=2`` shows its warnings), else :data:`QUIET` (fatal only; its
    errors reach the user as the runtime's one-line errors). ``ValueError`` for another value."""
    text = os.environ.get(ORT_LOG_ENV, "").strip()
    if not text:
        return QUIET
    if text not in ("0", "1", "2", "3", "4"):
        raise ValueError(f"{ORT_LOG_ENV}: must be an onnxruntime log severity 0 (verbose) .. 4 (fatal), got {text!r}")
    return int(text)


def session_options(threads: int | None = None, low_memory: bool = False) -> ort.SessionOptions:
    """Session options as the runtime creates every session with: ``threads`` intra-op
    threads (default: onnxruntime's, one per physical core), onnxruntime's logging at
    :func:`ort_log_severity`, and with ``low_memory`` constant folding off: a nested model then
    keeps one copy of its shared weights and cuts each tier's weights out of them at every run
    (slower; see the nested model's documentation)."""
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    options.log_severity_level = ort_log_severity()
    if low_memory:
        options.add_session_config_entry("optimization.disable_specified_optimizers", ",".join(LOW_MEMORY_OPTIMIZERS))
    return options


def read_tier(path: str | Path, sha256: str, root: str | Path | None = None, size: int | None = None) -> bytes:
    """The bytes of a tier file, read once and checked against ``sha256``.

    With ``root`` (the manifest's folder), the path, resolved through every symlink, must lie
    inside it. The file's size is checked before a byte is read: against ``size`` (the
    manifest's declared bytes) when given, and against the 2 GiB that no self-contained
    .onnx file exceeds.

    Args:
        path: the tier file.
        sha256: its expected SHA-256 (hex).
        root: the folder it must lie inside (the manifest's).
        size: its expected size in bytes.

    Returns:
        The file's bytes, as checked.

    Raises:
        ManifestError: the file is missing, outside ``root``, not a regular file, of another
            size or too large, or does not match the hash; the message names it.
    """
    path = Path(path)
    if root is not None:
        resolved, folder = path.resolve(), Path(root).resolve()
        if not resolved.is_relative_to(folder):
            raise ManifestError(
                str(path), "", f"resolves to {resolved}, outside the manifest's folder {folder} (refused; re-export)"
            )
        path = resolved  # opened below without following a symlink swapped in since
    # O_NONBLOCK: a FIFO in the tier's place is refused below instead of blocking the open
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ManifestError(str(path), "", "tier file is missing (re-export the model)") from None
    except OSError as exc:
        raise ManifestError(str(path), "", f"cannot read the tier file ({exc.strerror or exc})") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):  # checked before fdopen, which refuses a directory itself
        problem = "not a regular file"
    elif size is not None and info.st_size != size:
        problem = f"{info.st_size} bytes, but the manifest declares {size} (truncated, replaced or appended to; re-export it)"
    elif info.st_size > MAX_TIER_BYTES:
        problem = "larger than 2 GiB, which no self-contained .onnx file is"
    if problem:
        os.close(fd)
        raise ManifestError(str(path), "", problem)
    with os.fdopen(fd, "rb") as f:
        data = f.read(min(info.st_size, MAX_TIER_BYTES) + 1)  # one byte more: a file that grew since is seen
    if len(data) != info.st_size:
        raise ManifestError(str(path), "", f"changed while it was read (not {info.st_size} bytes any more; stop what writes it)")
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise ManifestError(
            str(path),
            "",
            f"sha256 {actual[:12]}... does not match the manifest's {sha256[:12]}... "
            "(the file was modified or corrupted; re-export it)",
        )
    return data


def session_from_bytes(
    model: bytes, source: str, providers: tuple[str, ...] = (CPU_PROVIDER,), threads: int | None = None,
    low_memory: bool = False, tier: str | None = None,
) -> ort.InferenceSession:
    """An onnxruntime session for the serialized ``model`` (already verified bytes) with
    :func:`session_options`.

    Args:
        model: the model's bytes.
        source: the file they came from, named in errors.
        providers: onnxruntime execution providers, in order of preference.
        threads: intra-op threads (default: one per physical core).
        low_memory: one copy of the weights (see :func:`session_options`).
        tier: the entry it is opened for, named in errors.

    Returns:
        The session.

    Raises:
        ManifestError: onnxruntime cannot load the model, or it refers to external data
            (:func:`check_self_contained`).
    """
    check_self_contained(model, source)
    options = session_options(threads, low_memory)
    try:
        return ort.InferenceSession(model, options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        what = "the model" if tier is None else f"the model for tier {tier}"
        raise ManifestError(source, "", f"onnxruntime cannot load {what} ({first_line(exc)})") from None


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (onnxruntime's run a page), else its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def create_session(
    path: str | Path,
    sha256: str,
    providers: tuple[str, ...] = (CPU_PROVIDER,),
    threads: int | None = None,
    root: str | Path | None = None,
    size: int | None = None,
    low_memory: bool = False,
    tier: str | None = None,
) -> ort.InferenceSession:
    """An onnxruntime session for the tier file ``path``: read once (:func:`read_tier`, inside
    ``root`` when given, of ``size`` bytes when given), checked against ``sha256``, and those
    bytes loaded.

    Args:
        path: the tier file.
        sha256: its expected SHA-256.
        providers: onnxruntime execution providers, in order of preference.
        threads: intra-op threads (default: one per physical core).
        root: the folder the file must lie inside.
        size: its expected size in bytes.
        low_memory: one copy of the weights (see :func:`session_options`).
        tier: the entry it is opened for, named in errors.

    Returns:
        The session.

    Raises:
        ManifestError: as :func:`read_tier` and :func:`session_from_bytes`.
    """
    return session_from_bytes(read_tier(path, sha256, root, size), str(path), providers, threads, low_memory, tier)


def check_self_contained(model: bytes, source: str) -> None:
    """:class:`ManifestError` naming ``source`` and the tensor when the serialized model
    keeps any tensor's data in an external file: onnxruntime would open that file by its
    path (relative to the working directory for a model given as bytes), past every hash
    check. Bytes that are not a protobuf message are left to onnxruntime's own error.

    Args:
        model: the serialized model.
        source: the file it came from, named in the error.

    Raises:
        ManifestError: a tensor keeps its data in an external file.
    """
    try:
        external = external_tensors(model)
    except WireError:
        return
    if external:
        more = f" (and {len(external) - 1} more)" if len(external) > 1 else ""
        raise ManifestError(
            source, "", f"tensor {external[0]}{more} is stored as external data, which no hash covers "
            "(refused; export self-contained files)",
        )

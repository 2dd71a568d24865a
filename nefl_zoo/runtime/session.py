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
    model: bytes, source: str, providers: tuple[str, ...] = (CPU_PROVIDER,), threads: int | None = None
) -> ort.InferenceSession:
    """An onnxruntime session for the serialized ``model`` (already verified bytes);
    ``source`` names it in a :class:`ManifestError` when onnxruntime cannot load it or when
    it refers to external data (:func:`check_self_contained`).

    Args:
        model: the model's bytes.
        source: the file they came from, named in errors.
        providers: onnxruntime execution providers, in order of preference.
        threads: intra-op threads (default: one per physical core).

    Returns:
        The session.

    Raises:
        ManifestError: onnxruntime cannot load the model, or it refers to external data.
    """
    check_self_contained(model, source)
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(model, options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own pybind exception types
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ManifestError(source, "", f"onnxruntime cannot load the model ({first_line})") from None


def create_session(
    path: str | Path,
    sha256: str,
    providers: tuple[str, ...] = (CPU_PROVIDER,),
    threads: int | None = None,
    root: str | Path | None = None,
    size: int | None = None,
) -> ort.InferenceSession:
    """An onnxruntime session for the tier file ``path``: read once (:func:`read_tier`, inside
    ``root`` when given, of ``size`` bytes when given), checked against ``sha256``, and those
    bytes loaded; ``threads`` caps onnxruntime's intra-op threads (default: one per physical core).

    Args:
        path: the tier file.
        sha256: its expected SHA-256.
        providers: onnxruntime execution providers, in order of preference.
        threads: intra-op threads.
        root: the folder the file must lie inside.
        size: its expected size in bytes.

    Returns:
        The session.

    Raises:
        ManifestError: as :func:`read_tier` and :func:`session_from_bytes`.
    """
    return session_from_bytes(read_tier(path, sha256, root, size), str(path), providers, threads)


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

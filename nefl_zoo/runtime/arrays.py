"""Read safetensors files with numpy alone: the arrays of a nested package.

The format (8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the data) is parsed here so that the runtime needs no
``safetensors`` package; the exporter writes the files with ``safetensors.numpy``. Arrays are
read-only views of the verified bytes (no copy).
"""

from __future__ import annotations

import json
import math

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "U8": np.uint8, "I32": np.int32, "I64": np.int64}
MAX_HEADER_BYTES = 100 * 2**20


class ArrayFileError(ValueError):
    """Bytes that are not a well-formed safetensors file (the message is one line)."""


def parse_header(data: bytes) -> tuple[dict, dict[str, str], int]:
    """``(tensor entries, metadata, offset of the data bytes)`` of a safetensors file's bytes,
    without reading the tensors; :class:`ArrayFileError` when the header is missing, runs past
    the end or is not a JSON object with string metadata."""
    if len(data) < 8:
        raise ArrayFileError("shorter than the 8-byte header length")
    size = int.from_bytes(data[:8], "little")
    if size > min(MAX_HEADER_BYTES, len(data) - 8):
        raise ArrayFileError(f"header length {size} runs past the end of the file")
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArrayFileError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ArrayFileError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ArrayFileError("__metadata__ must map names to strings")
    return header, metadata, 8 + size


def parse_safetensors(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(arrays, metadata)`` of a safetensors file's bytes; :class:`ArrayFileError` naming
    what is wrong (a header that is not JSON, an unknown dtype, byte ranges that overlap, leave
    gaps, run past the end or do not match the shape)."""
    header, metadata, start = parse_header(data)
    body = memoryview(data)[start:]
    arrays, ranges = {}, []
    for name, info in header.items():
        try:
            dtype, shape, (start, stop) = np.dtype(DTYPES[info["dtype"]]), [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ArrayFileError(f"{name}: needs dtype (one of {', '.join(DTYPES)}), shape and data_offsets") from None
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= len(body)):
            raise ArrayFileError(f"{name}: data_offsets {[start, stop]} outside the {len(body)} data bytes")
        if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != stop - start:
            raise ArrayFileError(f"{name}: shape {shape} of {dtype} does not fill data_offsets {[start, stop]}")
        arrays[name] = np.frombuffer(body[start:stop], dtype=dtype.newbyteorder("<")).reshape(shape)
        ranges.append((start, stop))
    covered = 0
    for start, stop in sorted(ranges):
        if start != covered:
            raise ArrayFileError(f"data bytes {covered}..{start} belong to no tensor, or tensors overlap")
        covered = stop
    if covered != len(body):
        raise ArrayFileError(f"data bytes {covered}..{len(body)} belong to no tensor")
    return arrays, metadata

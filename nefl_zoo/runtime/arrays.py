"""Read a safetensors file's header with the standard library alone (the Flower records check
a payload's header before safetensors reads its tensors).

The format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range (and optional string ``__metadata__``), then the data.
"""

from __future__ import annotations

import json

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

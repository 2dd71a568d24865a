"""The ``manifest.json`` of an ONNX tier export: schema, reading and file hashing.

Shared by the exporter (:mod:`nefl_zoo.export`, torch side) and the runtime
(:mod:`nefl_zoo.runtime`); it imports only pydantic (and :mod:`nefl_zoo.userfiles`)
and the standard library, so the runtime stays importable without torch.

Schema version 1 (every field required unless marked nullable)::

    schema_version   1
    model            zoo model name; model_args: its create_model kwargs
    source           what was exported (spec file or run directory)
    created_by       "nefl-zoo VERSION"
    opset            ONNX opset of every file
    input            name, shape [C, H, W], dtype "float32", layout "NCHW",
                     batch (null = dynamic batch dimension, else the fixed batch size),
                     normalization {mean, std} per channel (nullable: raw [0, 1] pixels),
                     dataset (nullable)
    output           name, num_classes
    class_names      list (nullable)
    tiers[]          name, file (relative to the manifest), sha256, params, params_ratio,
                     macs, macs_ratio, gamma (nullable, nominal), gamma_w,
                     blocks_per_stage, accuracy (nullable: test accuracy of the source run),
                     batchnorm_folded, channel_align (inner channels zero-padded to a
                     multiple of it; 1 = none), max_abs_diff (onnxruntime vs PyTorch),
                     weights_mb, activation_mb_per_sample,
                     latency {median_ms, batch, runs, threads (nullable: onnxruntime's
                     default, one per physical core), machine {processor, platform,
                     cpu_count, onnxruntime, provider}}
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .userfiles import MISSING_KEY, FileError, format_validation_error, read_text

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


class ManifestError(FileError):
    """A manifest or tier file that cannot be used, as one line naming the file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Normalization(_Strict):
    """Per-channel ``(x - mean) / std`` applied to pixels scaled to [0, 1]."""

    mean: list[float]
    std: list[float]


class InputSpec(_Strict):
    """The model input: one batch of images."""

    name: str
    shape: list[int] = Field(description="[C, H, W]")
    dtype: Literal["float32"] = "float32"
    layout: Literal["NCHW"] = "NCHW"
    batch: int | None = Field(description="null: dynamic batch dimension; else the fixed batch size")
    normalization: Normalization | None
    dataset: str | None


class OutputSpec(_Strict):
    """The model output: logits of shape [batch, num_classes]."""

    name: str
    num_classes: int


class Machine(_Strict):
    """Where a latency was measured."""

    processor: str
    platform: str
    cpu_count: int
    onnxruntime: str
    provider: str


class Latency(_Strict):
    """Median wall time of one ``session.run`` on a batch of ``batch`` inputs."""

    median_ms: float
    batch: int
    runs: int
    threads: int | None = Field(description="onnxruntime intra-op threads; null: its default")
    machine: Machine


class TierEntry(_Strict):
    """One exported tier: its file, what it costs and how it was checked."""

    name: str
    file: str = Field(pattern=r"^[A-Za-z0-9._-]+\.onnx$", description="next to the manifest")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    params: int
    params_ratio: float
    macs: int
    macs_ratio: float
    gamma: float | None
    gamma_w: float
    blocks_per_stage: list[int]
    accuracy: float | None
    batchnorm_folded: bool
    channel_align: int = Field(description="inner channels zero-padded to a multiple of this; 1 = none")
    max_abs_diff: float
    weights_mb: float
    activation_mb_per_sample: float
    latency: Latency

    def memory_mb(self, batch: int = 1) -> float:
        """Estimated memory to run a batch: weights plus the largest activation per sample
        times the batch (a lower bound of onnxruntime's peak, which also holds buffers)."""
        return self.weights_mb + self.activation_mb_per_sample * batch


class Manifest(_Strict):
    """All tiers of one exported model."""

    schema_version: Literal[1]
    model: str
    model_args: dict[str, Any]
    source: str
    created_by: str
    opset: int
    input: InputSpec
    output: OutputSpec
    class_names: list[str] | None
    tiers: list[TierEntry] = Field(min_length=1)

    def tier(self, name: str) -> TierEntry:
        """The tier called ``name``; ``KeyError`` naming the known tiers otherwise."""
        for entry in self.tiers:
            if entry.name == name:
                return entry
        raise KeyError(f"unknown tier {name!r}; tiers: {', '.join(t.name for t in self.tiers)}")


def parse_manifest(data: Any, source: str = MANIFEST_NAME) -> Manifest:
    """Validate loaded manifest data; :class:`ManifestError` names the first bad field."""
    if not isinstance(data, dict):
        raise ManifestError(source, "", f"expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version is None:
        raise ManifestError(source, "schema_version", MISSING_KEY)
    if version != SCHEMA_VERSION:
        raise ManifestError(
            source,
            "schema_version",
            f"unsupported version {version!r} (this nefl-zoo reads {SCHEMA_VERSION}; re-export or upgrade nefl-zoo)",
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(source, exc, ManifestError) from None


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate ``manifest.json`` (or the one inside a directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    text = read_text(path, ManifestError, what="the manifest")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(str(path), "", f"not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ManifestError(str(path), "", "JSON nested too deeply to read") from None
    return parse_manifest(data, str(path))


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()

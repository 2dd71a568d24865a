"""The ``manifest.json`` of an ONNX tier export: schema, reading and file hashing.

Shared by the exporter (:mod:`nefl_zoo.export`, torch side) and the runtime
(:mod:`nefl_zoo.runtime`); it imports only pydantic (and :mod:`nefl_zoo.userfiles`)
and the standard library, so the runtime stays importable without torch.

Schema version 5: :class:`Manifest` and the models it nests, every field required unless
nullable or defaulted, every number finite. Versions 4 (before declared file sizes), 3, 2
(before nested packages) and 1 (before precisions, every entry FP32) are read as well, except
version 3's nested packages, which are refused (re-export).

A manifest is also checked for consistency when it is read: ``class_names`` has
``output.num_classes`` names, ``normalization`` one mean and one positive std per input
channel, ``model_args`` (where it names them) agree with ``input.shape`` and
``output.num_classes``, and (tier, precision) pairs are unique.

An entry is named by its *label*: the tier name for FP32, ``NAME:PRECISION`` otherwise
(``g0.6``, ``g0.6:int8``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .userfiles import MISSING_KEY, FileError, field_error, format_validation_error, read_json

SCHEMA_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)  # 1: before precisions (every entry FP32); 2: before nested packages; 3: packages; 4: before bytes
MANIFEST_NAME = "manifest.json"
Precision = Literal["fp32", "int8", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
Format = Literal["files", "nested"]
FORMATS: tuple[str, ...] = get_args(Format)


class ManifestError(FileError):
    """A manifest or tier file that cannot be used, as one line naming the file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


Count = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]


class Normalization(_Strict):
    """Per-channel ``(x - mean) / std`` applied to pixels scaled to [0, 1]."""

    mean: list[float] = Field(min_length=1, description="per channel")
    std: list[Annotated[float, Field(gt=0)]] = Field(min_length=1, description="per channel, > 0")

    @model_validator(mode="after")
    def _one_per_channel(self) -> "Normalization":
        if len(self.mean) != len(self.std):
            raise field_error("std", f"{len(self.std)} values for {len(self.mean)} means; give one per channel")
        return self


class InputSpec(_Strict):
    """The model input: one batch of images."""

    name: str = Field(min_length=1, description="the ONNX input's name")
    shape: list[Positive] = Field(min_length=3, max_length=3, description="[C, H, W]")
    dtype: Literal["float32"] = Field("float32", description="always float32")
    layout: Literal["NCHW"] = Field("NCHW", description="always NCHW")
    batch: Positive | None = Field(description="null: dynamic batch dimension; else the fixed batch size")
    normalization: Normalization | None = Field(description="null: raw [0, 1] pixels")
    dataset: str | None = Field(description="the dataset trained on, when known")

    @model_validator(mode="after")
    def _normalization_per_channel(self) -> "InputSpec":
        norm = self.normalization
        if norm is not None and len(norm.mean) != self.shape[0]:
            raise field_error(
                "normalization.mean", f"{len(norm.mean)} values for {self.shape[0]} input channels (shape[0])"
            )
        return self


class OutputSpec(_Strict):
    """The model output: logits of shape [batch, num_classes]."""

    name: str = Field(min_length=1, description="the ONNX output's name")
    num_classes: Positive = Field(description="logits per image")


class Machine(_Strict):
    """Where a latency was measured."""

    processor: str = Field(description="the CPU")
    platform: str = Field(description="the operating system")
    cpu_count: Positive = Field(description="logical CPUs")
    onnxruntime: str = Field(description="onnxruntime's version")
    provider: str = Field(description="the execution provider that ran the model")


class Latency(_Strict):
    """Median wall time of one ``session.run`` on a batch of ``batch`` inputs."""

    median_ms: NonNegative = Field(description="the median, in milliseconds")
    batch: Positive = Field(description="the batch it was measured at")
    runs: Positive = Field(description="timed runs")
    threads: Positive | None = Field(description="onnxruntime intra-op threads; null: its default")
    machine: Machine = Field(description="where it was measured")


class Agreement(_Strict):
    """How an INT8/FP16 file's logits agree with its tier's FP32 file on verification images."""

    images: Positive = Field(description="verification images compared")
    top1_agreement: Fraction = Field(description="share of images given the FP32 file's top-1 class")
    max_abs_diff: NonNegative = Field(description="largest |logit difference|")
    relative_error: NonNegative = Field(description="max_abs_diff / max(1, max |FP32 logit|)")


class Calibration(_Strict):
    """The images an INT8 file's activation ranges were calibrated on."""

    method: str = Field(min_length=1, description="e.g. MinMax")
    images: Positive = Field(description="how many images")
    source: str = Field(description="where they came from")


class PackageFile(_Strict):
    """One file of an export, next to the manifest."""

    file: str = Field(pattern=r"^[A-Za-z0-9._-]+\.(onnx|safetensors)$", description="next to the manifest")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="checked before the file is used")
    bytes: Count = Field(description="the file's size")


class TierEntry(_Strict):
    """One exported (tier, precision): its file, what it costs and how it was checked."""

    name: str = Field(min_length=1, description="the tier's name")
    precision: Precision = Field("fp32", description="fp32, int8 or fp16")
    file: str = Field(pattern=r"^[A-Za-z0-9._-]+\.onnx$", description="next to the manifest")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="checked before onnxruntime reads the file")
    index: Count | None = Field(None, description="nested only: the tier input value that selects this entry")
    bytes: Count | None = Field(None, description="the file's size, checked before it is read (required from schema 5)")
    params: Count = Field(description="the tier's parameters")
    params_ratio: NonNegative = Field(description="over the full tier's")
    macs: Count = Field(description="MACs per image (fvcore)")
    macs_ratio: NonNegative = Field(description="over the full tier's")
    gamma: Annotated[float, Field(gt=0, le=1)] | None = Field(description="nominal parameter ratio")
    gamma_w: float = Field(gt=0, le=1, description="width parameter ratio")
    blocks_per_stage: list[Count] = Field(description="residual blocks kept, per stage")
    accuracy: Fraction | None = Field(description="test accuracy, when measured")
    accuracy_on: str | None = Field(None, description="what accuracy was measured on; null: the source run's record")
    batchnorm_folded: bool = Field(description="BatchNorm folded into the convolutions")
    channel_align: Positive = Field(description="inner channels zero-padded to a multiple of this; 1 = none")
    channel_align_ms: dict[str, NonNegative] | None = Field(
        None,
        description="--pad-channels auto: median latency (ms) of each alignment tried, keyed by it; the faster was kept",
    )
    max_abs_diff: NonNegative = Field(description="FP32: onnxruntime vs PyTorch; else vs the FP32 file")
    vs_fp32: Agreement | None = Field(None, description="INT8/FP16: agreement with the FP32 file")
    calibration: Calibration | None = Field(None, description="INT8: its calibration images")
    weights_mb: NonNegative = Field(description="the tier's own self-contained model, MB")
    activation_mb_per_sample: NonNegative = Field(description="the largest activation per image, MB")
    latency: Latency = Field(description="measured at export")

    @property
    def label(self) -> str:
        """The entry's name: the tier's for FP32, else ``NAME:PRECISION``."""
        return self.name if self.precision == "fp32" else f"{self.name}:{self.precision}"

    def memory_mb(self, batch: int = 1) -> float:
        """Estimated memory to run a batch: weights plus the largest activation per sample
        times the batch (a lower bound of onnxruntime's peak, which also holds buffers).

        Args:
            batch: the batch size.

        Returns:
            The estimate, in MB.
        """
        return self.weights_mb + self.activation_mb_per_sample * batch


class Manifest(_Strict):
    """All tiers of one exported model: what ``manifest.json`` holds.

    Read one with :func:`load_manifest`.

    Attributes:
        schema_version: the format's version (1 to 5).
        format: ``nested`` (one file per precision) or ``files`` (one per tier and precision).
        model: the model's name.
        model_args: its ``create_model`` arguments.
        source: what was exported (a run directory or a spec).
        created_by: the nefl-zoo version that wrote it.
        opset: the ONNX opset.
        input: the model's input.
        output: the model's output.
        class_names: the class of each logit, when known.
        tiers: every exported (tier, precision) entry.
    """

    schema_version: Literal[1, 2, 3, 4, 5]
    format: Format = "files"
    model: str
    model_args: dict[str, Any]
    source: str
    created_by: str
    opset: int
    input: InputSpec
    output: OutputSpec
    class_names: list[str] | None
    tiers: list[TierEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        classes = self.output.num_classes
        if self.class_names is not None and len(self.class_names) != classes:
            raise field_error("class_names", f"{len(self.class_names)} names for {classes} classes (output.num_classes)")
        channels, height, width = self.input.shape
        declared = {"num_classes": ("output.num_classes", classes), "in_chans": ("input.shape[0]", channels)}
        if height == width:
            declared["img_size"] = ("input.shape[1:]", height)
        for key, (field, value) in declared.items():
            given = self.model_args.get(key)
            if isinstance(given, int) and not isinstance(given, bool) and given != value:
                raise field_error(field, f"{value} contradicts model_args.{key} = {given}")
        if "img_size" in self.model_args and height != width:
            raise field_error("input.shape", f"{height}x{width} is not square, but model_args.img_size is one size")
        labels: set[str] = set()
        for t, entry in enumerate(self.tiers):
            if entry.label in labels:
                raise field_error(f"tiers[{t}].name", f"duplicate tier name {entry.name!r} at precision {entry.precision}")
            if self.schema_version == 1 and entry.precision != "fp32":
                raise field_error(f"tiers[{t}].precision", "schema version 1 has FP32 entries only")
            labels.add(entry.label)
        self._check_format()
        return self

    def _check_format(self) -> None:
        """A nested manifest (version 4 on) gives every entry its index into the one file of
        its precision, 0 .. T-1; a files manifest gives none. From version 5 every entry
        declares its file's size, one size per file."""
        nested = self.format == "nested"
        if nested and self.schema_version < 4:
            raise field_error("format", f"nested models need schema version 4, got {self.schema_version}")
        files: dict[str, str] = {}
        indices: dict[str, list[int]] = {}
        for t, entry in enumerate(self.tiers):
            if self.schema_version >= 5 and entry.bytes is None:
                raise field_error(f"tiers[{t}].bytes", f"required from schema version 5 (the size of {entry.file})")
            if nested != (entry.index is not None):
                raise field_error(f"tiers[{t}].index", "required for format nested" if nested else "only for format nested")
            if not nested:
                continue
            if files.setdefault(entry.precision, entry.file) != entry.file:
                raise field_error(f"tiers[{t}].file", f"{entry.file}, but the {entry.precision} entries are in {files[entry.precision]}")
            indices.setdefault(entry.precision, []).append(entry.index)
        if len(set(files.values())) != len(files) or MANIFEST_NAME in files.values():
            raise field_error("tiers", "each precision needs a nested file of its own")
        for precision, found in indices.items():
            if sorted(found) != list(range(len(found))):
                raise field_error("tiers", f"the {precision} entries' indices are {sorted(found)}; expected 0 .. {len(found) - 1}")
        sizes: dict[str, int | None] = {}
        for t, entry in enumerate(self.tiers):
            if sizes.setdefault(entry.file, entry.bytes) != entry.bytes:
                raise field_error(f"tiers[{t}].bytes", f"{entry.bytes}, but another entry declares {sizes[entry.file]} for {entry.file}")

    def tier(self, name: str, precision: str | None = None) -> TierEntry:
        """The entry of tier ``name`` at ``precision``; without one, the entry labelled
        ``name`` (``g1``, ``g1:int8``), else the tier's only entry.

        Args:
            name: a tier name, or an entry's label.
            precision: ``fp32``, ``int8`` or ``fp16``.

        Returns:
            The entry.

        Raises:
            KeyError: no such tier, or not at that precision; the message names what exists.
        """
        if precision is None:
            for entry in self.tiers:
                if entry.label == name:
                    return entry
        same = [t for t in self.tiers if t.name == name]
        if not same:
            names = dict.fromkeys(t.name for t in self.tiers)
            raise KeyError(f"unknown tier {name!r}; tiers: {', '.join(names)}")
        chosen = [t for t in same if t.precision == precision] if precision else same
        if len(chosen) != 1:
            have = ", ".join(t.precision for t in same)
            raise KeyError(f"tier {name!r} has no {precision or 'fp32'} file; its precisions: {have}")
        return chosen[0]


def parse_manifest(data: Any, source: str = MANIFEST_NAME) -> Manifest:
    """Validate loaded manifest data; :class:`ManifestError` names the first bad field.

    Args:
        data: the manifest, as loaded from JSON.
        source: where it came from, named in errors.

    Returns:
        The validated manifest.

    Raises:
        ManifestError: the first problem, as ``SOURCE: FIELD: what was expected``.
    """
    if not isinstance(data, dict):
        raise ManifestError(source, "", f"expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version is None:
        raise ManifestError(source, "schema_version", MISSING_KEY)
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, READABLE_VERSIONS[:-1])) + f" and {READABLE_VERSIONS[-1]}"
        raise ManifestError(
            source,
            "schema_version",
            f"unsupported version {version!r} (this nefl-zoo reads {readable}; re-export or upgrade nefl-zoo)",
        )
    if version == 3 and data.get("format") == "nested":
        raise ManifestError(
            source, "format", "a schema 3 nested package (graph and tensors files), which this nefl-zoo no longer "
            "reads; re-export it (nefl-zoo export SOURCE --out DIR) to get one standard nested .onnx file",
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(source, exc, ManifestError) from None


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate ``manifest.json`` (or the one inside a directory).

    Args:
        path: the manifest, or the export directory that holds it.

    Returns:
        The validated manifest.

    Raises:
        ManifestError: an unreadable or invalid manifest, in one line naming the field.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    return parse_manifest(read_json(path, ManifestError, what="the manifest"), str(path))


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks.

    Args:
        path: the file.

    Returns:
        The digest, 64 hex digits.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()

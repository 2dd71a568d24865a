"""ExportOptions: how :func:`~nefl_zoo.export.export_tiers` exports, verifies and times the tiers."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from ..manifest import FORMATS, PRECISIONS
from .onnx_file import MIN_OPSET

CALIBRATION_IMAGES = 256  # training images of a run that INT8 ranges are calibrated on


@dataclass(frozen=True)
class ExportOptions:
    """How :func:`~nefl_zoo.export.export_tiers` exports, verifies and times the tiers: the
    settings of ``nefl-zoo export``, in one object. Every setting is checked when the options
    are made (``ValueError`` naming it); ``tiers`` and ``precisions`` are kept as tuples,
    without repeats.

    Attributes:
        tiers: the tiers to export, by name (default: all).
        opset: the ONNX opset (default: the exporter's).
        batch_dynamic: export the batch dimension as dynamic.
        batch: the batch the latency is measured at; with ``batch_dynamic=False`` also the
            files' fixed batch. The dynamic-batch export uses a batch of at least 2 and is
            verified on another batch size.
        dataset: recorded with its normalisation when one of :data:`DATASETS` and its class
            names when known (default: the source's dataset).
        latency_runs: timed runs per file (the median is recorded).
        threads: onnxruntime intra-op threads for the latency (default: one per core).
        channel_align: above 1, inner channel counts are zero-padded to a multiple of it
            (:func:`pad_channels`): same outputs, faster CPU kernels for odd widths, larger
            files; the manifest's params and MACs stay the tier's own. ``"auto"``: each tier
            is exported plain and padded to the CPU kernels' channel block, both are timed
            (interleaved) and the faster is kept; the manifest records the choice and both
            latencies (``channel_align``, ``channel_align_ms``), and a later ``"auto"`` export
            reuses the recorded choice instead of timing again, so that exporting the same
            source twice gives the same files.
        precisions: the files shipped per tier, of ``fp32``, ``int8`` and ``fp16``; INT8 and
            FP16 files are made from the FP32 file and dropped with a warning when they fail
            the check against it.
        calibration: images (normalised float32, N x C x H x W) that INT8 is calibrated on,
            named by ``calibration_source``; default: ``calibration_images`` training images
            of a run source. Data, not a setting: left out of ``==``, ``hash`` and ``repr``.
        calibration_source: what ``calibration`` is, for the manifest.
        calibration_images: how many training images of a run INT8 is calibrated on.
        format: ``files`` (one self-contained file per tier and precision) or ``nested``
            (one standard ``.onnx`` file per precision holding every tier, the shared
            tensors once).
        alignments_from: the ``manifest.json`` (or its folder) whose recorded ``"auto"``
            choices are reused (default: the export folder's, when there is one).

    Examples:
        >>> from nefl_zoo.export import ExportOptions
        >>> ExportOptions(precisions=["fp32", "int8", "fp32"], format="nested").precisions
        ('fp32', 'int8')
        >>> ExportOptions(batch=0)
        Traceback (most recent call last):
            ...
        ValueError: batch must be >= 1 and channel_align >= 1 or 'auto', got 0 and 1
    """

    tiers: Sequence[str] | None = None
    opset: int | None = None
    batch_dynamic: bool = True
    batch: int = 1
    dataset: str | None = None
    latency_runs: int = 20
    threads: int | None = None
    channel_align: int | Literal["auto"] = 1
    precisions: Sequence[str] = ("fp32",)
    calibration: np.ndarray | None = field(default=None, repr=False, compare=False)
    calibration_source: str = "the images given"
    calibration_images: int = CALIBRATION_IMAGES
    format: str = "files"
    alignments_from: str | Path | None = None

    def __post_init__(self) -> None:
        for name in ("tiers", "precisions"):
            if isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: expected a list of names, got the string {getattr(self, name)!r}")
        object.__setattr__(self, "tiers", tuple(dict.fromkeys(self.tiers or ())) or None)  # none or empty: all
        precisions = tuple(dict.fromkeys(self.precisions))
        object.__setattr__(self, "precisions", precisions)
        if not precisions or any(p not in PRECISIONS for p in precisions):
            raise ValueError(f"precisions: expected some of {', '.join(PRECISIONS)}, got {', '.join(precisions) or 'none'}")
        align = self.channel_align
        if not _at_least_1(self.batch) or not (align == "auto" or _at_least_1(align)):
            raise ValueError(f"batch must be >= 1 and channel_align >= 1 or 'auto', got {self.batch} and {align!r}")
        if self.opset is not None and self.opset < MIN_OPSET:
            raise ValueError(f"opset: the torch.export-based exporter writes opset {MIN_OPSET} or later, got {self.opset}")
        if self.format not in FORMATS:
            raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {self.format!r}")
        for name in ("latency_runs", "calibration_images", *(("threads",) if self.threads is not None else ())):
            if not _at_least_1(getattr(self, name)):
                raise ValueError(f"{name}: must be an integer >= 1, got {getattr(self, name)!r}")


def _at_least_1(value: object) -> bool:
    """Whether ``value`` is an integer (numpy's too; not a bool) of at least 1."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1

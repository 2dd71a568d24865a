"""The files of one tier at every precision asked for, checked and measured together.

The tier's verified FP32 file is the reference: its INT8 and FP16 versions (:mod:`.quantize`)
are compared with it on images calibration never saw (:func:`~.verify.check_agreement`), and a
version outside the bounds is dropped with a warning, not shipped. Every file's accuracy is
measured on a labelled test split when there is one, and the files of a tier are timed in
alternation (:func:`~nefl_zoo.timing.interleaved_median_ms`), so that their latency ratios are
not skewed by a change of machine load.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from ..manifest import Agreement, Calibration
from ..runtime import run_in_chunks
from ..timing import interleaved_median_ms
from .data import ExportImages
from .onnx_file import INPUT_NAME, activation_bytes_per_sample
from .quantize import INT8_METHOD, quantize_int8, to_fp16
from .verify import ExportError, check_agreement, check_single_file, hashed_session


@dataclass(frozen=True)
class PrecisionFile:
    """One file of a tier, written to the staging folder and verified."""

    precision: str
    file: str
    sha256: str
    session: ort.InferenceSession
    activation_bytes_per_sample: int
    logits: np.ndarray | None = None  # on the test images
    agreement: Agreement | None = None
    calibration: Calibration | None = None
    data: bytes | None = None  # the serialized model (kept for the nested model)
    model_bytes: int | None = None  # nested: the size of the tier's own file


def precision_filename(tier_file: str, precision: str) -> str:
    """The file of a tier at ``precision``: ``g1.onnx`` for FP32, ``g1.int8.onnx`` else."""
    return tier_file if precision == "fp32" else f"{tier_file.removesuffix('.onnx')}.{precision}.onnx"


def tier_logits(session: ort.InferenceSession, images: np.ndarray, fixed_batch: int | None) -> np.ndarray:
    """The logits of ``images`` (in chunks; a fixed-batch file's last chunk zero-padded)."""
    return run_in_chunks(lambda batch: session.run(None, {INPUT_NAME: batch})[0], images, fixed_batch)


def precision_files(
    name: str,
    fp32: PrecisionFile,
    fp32_data: bytes,
    precisions: Sequence[str],
    images: ExportImages | None,
    staging: Path,
    fixed_batch: int | None,
    threads: int | None,
    warn: Callable[[str], None],
    keep_names: bool = False,
    int8_weights: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None,
) -> list[PrecisionFile]:
    """The tier's FP32 file and its versions at the other ``precisions`` that pass the check
    against it, each written to ``staging`` (``keep_names``: with the exporter's tensor names,
    see :func:`~.quantize.compact`; ``int8_weights``: rewrites the quantized INT8 model, see
    :func:`~.nested.shared_int8_model`); with ``images``, each with its test logits."""
    fp32 = dataclasses.replace(fp32, data=fp32_data)
    if images is None:
        return [fp32]
    reference = tier_logits(fp32.session, images.test, fixed_batch)
    files = [dataclasses.replace(fp32, logits=reference)]
    for precision in precisions:
        if precision == "fp32":
            continue
        calibration = None
        if precision == "int8":
            data = quantize_int8(fp32_data, images.calibration, fixed_batch, rename=not keep_names, weights=int8_weights)
            calibration = Calibration(method=INT8_METHOD, images=len(images.calibration), source=images.calibration_source)
        else:
            data = to_fp16(fp32_data, rename=not keep_names)
        file = precision_filename(fp32.file, precision)
        model = onnx.load_model_from_string(data)
        check_single_file(name, model, None)
        sha256, session = hashed_session(data, file, threads)
        logits = tier_logits(session, images.test, fixed_batch)
        try:
            agreement = check_agreement(name, precision, reference, logits)
        except ExportError as exc:
            warn(f"{exc} on {images.test_source}; not shipped")
            continue
        (staging / file).write_bytes(data)
        files.append(
            PrecisionFile(precision, file, sha256, session, activation_bytes_per_sample(model), logits, agreement, calibration, data)
        )
    return files


def time_files(files: list[PrecisionFile], feed: np.ndarray, runs: int) -> dict[str, float]:
    """Median ms per precision of one run on ``feed``, the files timed in alternation."""
    calls = {f.precision: functools.partial(f.session.run, None, {INPUT_NAME: feed}) for f in files}
    return interleaved_median_ms(calls, runs, warmup_rounds=2)


def accuracy(file: PrecisionFile, labels: np.ndarray | None) -> float | None:
    """Top-1 accuracy of ``file``'s test logits against ``labels`` (``None`` without labels)."""
    if labels is None or file.logits is None:
        return None
    return float((file.logits.argmax(1) == labels).mean())

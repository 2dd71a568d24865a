"""Checks of an exported tier: one self-contained file, its hash, and parity with PyTorch.

The file is read once: the bytes that are hashed into the manifest are the bytes onnxruntime
loads for the parity check (:func:`hashed_session`), never the path a second time.

Outputs agree when their largest absolute difference is at most
``ATOL * max(1, max |reference logit|)`` (:func:`tolerance_for`); the same bound decides
whether a rewrite (:mod:`nefl_zoo.export.surgery`) may be used and whether onnxruntime's
output matches the PyTorch module. INT8 and FP16 files are held to looser bounds against
their tier's FP32 file (:func:`agreement_problem`).
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from ..manifest import Agreement
from ..runtime import session_from_bytes
from ..runtime.wire import external_tensors
from .onnx_file import INPUT_NAME

ATOL = 1e-4


class ExportError(RuntimeError):
    """A tier whose export could not be verified."""


def tolerance_for(reference: torch.Tensor) -> float:
    """The largest difference from ``reference`` that still counts as the same output.

    Args:
        reference: PyTorch's output.

    Returns:
        ``ATOL * max(1, max |reference|)``.

    Examples:
        >>> import torch
        >>> from nefl_zoo.export import tolerance_for
        >>> tolerance_for(torch.tensor([0.5, -30.0]))
        0.003
    """
    return ATOL * max(1.0, float(reference.abs().max()))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@torch.no_grad()
def same_output(module: nn.Module, x: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether ``module(x)`` is within :func:`tolerance_for` of ``reference``."""
    return max_abs_diff(module(x), reference) <= tolerance_for(reference)


def check_single_file(name: str, model: onnx.ModelProto, opset: int | None) -> int:
    """The opset ``model`` was written with; :class:`ExportError` when its weights live in
    external files or it is not the ``opset`` asked for.

    Args:
        name: the tier's name, for the error.
        model: the exported model.
        opset: the opset asked for (``None``: any).

    Returns:
        The model's opset.

    Raises:
        ExportError: external data, or another opset.
    """
    external = external_tensors(model.SerializeToString())
    if external:
        raise ExportError(f"tier {name}: the exporter wrote tensor {external[0]} as external data; expected one file")
    (written,) = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if opset is not None and written != opset:
        raise ExportError(f"tier {name}: asked for opset {opset}, the exporter wrote {written}")
    return written


def hashed_session(model: bytes, source: str, threads: int | None) -> tuple[str, ort.InferenceSession]:
    """The sha256 of a serialized model and an onnxruntime session of those same bytes."""
    return hashlib.sha256(model).hexdigest(), session_from_bytes(model, source, threads=threads)


def check_parity(name: str, session: ort.InferenceSession, x: torch.Tensor, reference: torch.Tensor) -> float:
    """onnxruntime's largest difference from ``reference`` on input ``x``;
    :class:`ExportError` when it exceeds :func:`tolerance_for`.

    Args:
        name: the tier's name, for the error.
        session: the exported file's session.
        x: the input.
        reference: PyTorch's output on ``x``.

    Returns:
        The largest absolute difference.

    Raises:
        ExportError: the difference exceeds the tolerance.
    """
    diff = max_abs_diff(torch.from_numpy(session.run(None, {INPUT_NAME: x.numpy()})[0]), reference)
    tolerance = tolerance_for(reference)
    if not diff <= tolerance:
        raise ExportError(
            f"tier {name}: onnxruntime vs PyTorch max abs diff {diff:.3g} > {tolerance:.3g} "
            f"(1e-4 x max(1, max |logit| = {float(reference.abs().max()):.3g}))"
        )
    return diff


# ---- INT8 / FP16 files against their tier's FP32 file ------------------------------------
# A quantized file ships only when, on images calibration never saw, it gives the FP32 file's
# top-1 class on at least MIN_TOP1_AGREEMENT of them and its largest logit difference is at
# most MAX_RELATIVE_ERROR x max(1, max |FP32 logit|).
MIN_TOP1_AGREEMENT = {"int8": 0.95, "fp16": 0.98}
MAX_RELATIVE_ERROR = {"int8": 0.25, "fp16": 0.01}


def check_agreement(name: str, precision: str, reference: np.ndarray, logits: np.ndarray) -> Agreement:
    """How the ``precision`` file's ``logits`` agree with the FP32 ``reference`` logits of the
    same images; :class:`ExportError` when that is below the bounds above (or not finite)."""
    diff = float(np.abs(logits.astype(np.float64) - reference).max())
    relative = diff / max(1.0, float(np.abs(reference).max()))
    top1 = float((logits.argmax(1) == reference.argmax(1)).mean())
    low, high = MIN_TOP1_AGREEMENT[precision], MAX_RELATIVE_ERROR[precision]
    if not top1 >= low:
        raise ExportError(f"tier {name} {precision}: top-1 agreement with FP32 {top1:.3f} < {low}")
    if not relative <= high:
        raise ExportError(f"tier {name} {precision}: logit error {relative:.3g} x max(1, max |FP32 logit|) > {high}")
    return Agreement(images=len(reference), top1_agreement=top1, max_abs_diff=diff, relative_error=relative)

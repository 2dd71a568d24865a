"""INT8 and FP16 versions of an exported FP32 tier file, with onnxruntime's own tools.

INT8: onnxruntime's static quantization (``quantize_static``) in QDQ format, int8 weights
per output channel and uint8 activations, their ranges calibrated (MinMax) on images fed by a
:class:`CalibrationDataReader`. It starts from the exported FP32 file, whose BatchNorms are
already folded into the convolutions. FP16: onnxruntime's float16 converter
(``onnxruntime.transformers.float16``) turns weights and activations to half precision and
keeps the input and output float32, so a file of any precision takes the same input;
onnxruntime runs in float32 (inserting casts) the operators its provider has no float16
kernel for. Both are written without the exporter's debug metadata (:func:`compact`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnx

from .onnx_file import INPUT_NAME

INT8_METHOD = "onnxruntime quantize_static, QDQ, per-channel int8 weights, uint8 activations, MinMax calibration"
CALIBRATION_BATCH = 32


def quantize_int8(fp32: bytes, images: np.ndarray, fixed_batch: int | None, rename: bool = True,
                  weights: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None) -> bytes:
    """The serialized INT8 (QDQ) model of the FP32 model ``fp32``, calibrated on ``images``
    (fed in batches of ``fixed_batch`` for a fixed-batch model, the last one dropped if
    short, else of :data:`CALIBRATION_BATCH`); ``weights`` rewrites the quantized model (tensor
    names as exported) before it is compacted (``rename``: see :func:`compact`)."""
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static

    size = fixed_batch or CALIBRATION_BATCH
    batches = [images[i : i + size] for i in range(0, len(images), size)]
    batches = [b for b in batches if fixed_batch is None or len(b) == fixed_batch]
    if not batches:
        raise ValueError(f"{len(images)} calibration images; the fixed batch of {fixed_batch} needs at least that many")

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._feeds = iter({INPUT_NAME: np.ascontiguousarray(b, np.float32)} for b in batches)

        def get_next(self) -> dict | None:
            return next(self._feeds, None)

    with tempfile.TemporaryDirectory(prefix="nefl-int8-") as tmp, _quiet():
        out = Path(tmp) / "int8.onnx"
        quantize_static(
            onnx.load_model_from_string(fp32), out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax,
        )
        model = onnx.load(str(out))
    if weights is not None:
        model = weights(model)
    return compact(model, rename).SerializeToString()


def to_fp16(fp32: bytes, rename: bool = True) -> bytes:
    """The serialized FP16 model of the FP32 model ``fp32`` (float32 input and output);
    ``rename``: see :func:`compact`."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with _quiet():
        model = convert_float_to_float16(onnx.load_model_from_string(fp32), keep_io_types=True)
    return compact(model, rename).SerializeToString()


def compact(model: onnx.ModelProto, rename: bool = True) -> onnx.ModelProto:
    """``model`` without what only debugging needs: the exporter's per-node metadata (source
    locations), doc strings and node names, the intermediate shapes (onnxruntime infers them),
    and long tensor names: every tensor but the graph's input and output is renamed ``t0``,
    ``t1``, ... (the quantizer's names such as ``layer3.0.conv2.weight_quantized_scale`` are a
    fifth of a small INT8 file). A graph with subgraphs, or ``rename=False`` (a nested
    package traces tensors back by name), keeps its tensor names."""
    graph = model.graph
    for node in graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
        node.name = ""
    del graph.value_info[:]
    if not rename or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        return model
    keep = {v.name for v in (*graph.input, *graph.output)}
    short: dict[str, str] = {}

    def rename(name: str) -> str:
        return name if not name or name in keep else short.setdefault(name, f"t{len(short)}")

    for tensor in graph.initializer:
        tensor.name = rename(tensor.name)
    for node in graph.node:
        node.input[:] = [rename(n) for n in node.input]
        node.output[:] = [rename(n) for n in node.output]
    return model


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the quantizer's advice (``logging.warning`` on the root logger, which would
    also install a handler there) and the float16 converter's truncation warnings while they
    run; what they produce is checked afterwards."""
    root = logging.getLogger()
    level, placeholder = root.level, logging.NullHandler()
    root.setLevel(logging.ERROR)
    root.addHandler(placeholder)  # a root logger with a handler is not given one by logging.warning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        root.removeHandler(placeholder)
        root.setLevel(level)

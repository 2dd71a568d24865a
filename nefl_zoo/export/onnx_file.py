"""Writing one tier as an ONNX file, and what the file and the machine tell about it.

:func:`write_onnx` runs ``torch.onnx.export`` (the torch.export path) with the weights inside
the one file, reusing one operator registry per opset (:func:`reused_torchlib_registry`);
:func:`activation_bytes_per_sample` reads the largest working set from ONNX shape inference;
:func:`cpu_channel_block` names the channel block the CPU kernels prefer and
:func:`onnx_latency_ms` times a module as export would write it.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import threading
from pathlib import Path

import onnx
import torch
from torch import nn

from ..runtime import session_from_bytes
from ..timing import median_ms
from .surgery import fold_batchnorm

MIN_OPSET = 18  # the torch.export-based exporter writes nothing older
INPUT_NAME, OUTPUT_NAME = "input", "logits"
_EXPORT_LOCK = threading.Lock()  # the registry is swapped in for one export at a time


def tier_filename(name: str) -> str:
    """A file name for a tier: its name with anything but ``[A-Za-z0-9._-]`` replaced.

    Args:
        name: the tier's name.

    Returns:
        ``NAME.onnx``, safe on every file system.

    Examples:
        >>> from nefl_zoo.export import tier_filename
        >>> tier_filename("g0.2"), tier_filename("tier 1/2")
        ('g0.2.onnx', 'tier_1_2.onnx')
    """
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".onnx"


def write_onnx(
    module: nn.Module, path: Path, input_size: tuple[int, ...], example_batch: int, batch_dynamic: bool, opset: int | None
) -> None:
    """``torch.onnx.export`` through torch.export, weights inside the one file.

    Args:
        module: the module to export, in eval mode.
        path: the ``.onnx`` file to write.
        input_size: one input's shape, ``(C, H, W)``.
        example_batch: the batch of the example input that is traced.
        batch_dynamic: export the batch dimension as dynamic.
        opset: the ONNX opset (``None``: the exporter's default).
    """
    example = torch.randn(example_batch, *input_size)
    dynamic_shapes = ({0: torch.export.Dim("batch")},) if batch_dynamic else None
    with _EXPORT_LOCK, reused_torchlib_registry():
        torch.onnx.export(
            module,
            (example,),
            str(path),
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            opset_version=opset,
            dynamo=True,
            external_data=False,
            dynamic_shapes=dynamic_shapes,
            verbose=False,
        )


_REGISTRIES: dict[int, object] = {}  # opset -> torch's operator registry, built once


@contextlib.contextmanager
def reused_torchlib_registry():
    """Within the block, ``torch.onnx.export`` reuses one operator registry per opset.

    The exporter builds its registry from onnxscript's torchlib on every call, parsing the
    source of some 500 functions: more than half the time of exporting a small tier. Without a
    custom translation table (write_onnx passes none) the exporter only reads the registry, so
    one per opset serves every export of the process; the files are byte-identical (tested).
    Where torch's internals differ from the ones this was written against, nothing is changed.
    """
    try:
        from torch.onnx._internal.exporter import _constants, _registration

        registry_class = _registration.ONNXRegistry
        original = registry_class.__dict__["from_torchlib"]
        build = original.__func__
        default_opset = _constants.TORCHLIB_OPSET
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def from_torchlib(cls, opset_version=default_opset):
        if opset_version not in _REGISTRIES:
            _REGISTRIES[opset_version] = build(cls, opset_version=opset_version)
        return _REGISTRIES[opset_version]

    registry_class.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        registry_class.from_torchlib = original


def onnx_latency_ms(module: nn.Module, input_size: tuple[int, ...], batch: int, threads: int | None, runs: int) -> float:
    """Median onnxruntime latency (ms) on this machine of ``module`` as export writes it
    (BatchNorm folded, here with a fixed ``batch``), after two warm-up runs."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "candidate.onnx"
        write_onnx(fold_batchnorm(module.eval()), path, input_size, batch, False, None)
        session = session_from_bytes(path.read_bytes(), str(path), threads=threads)
    feed = {INPUT_NAME: torch.randn(batch, *input_size).numpy()}
    return median_ms(lambda: session.run(None, feed), runs, warmup=2)


def activation_bytes_per_sample(model: onnx.ModelProto) -> int:
    """Largest single-node working set (its activation inputs plus outputs, weights excluded)
    for one sample, from ONNX shape inference (symbolic dimensions counted as 1).

    Args:
        model: the ONNX model.

    Returns:
        The working set, in bytes.
    """
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    weights = {t.name for t in graph.initializer}
    sizes: dict[str, int] = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type
        if not tensor.HasField("shape"):
            continue
        numel = 1
        for dim in tensor.shape.dim:
            numel *= dim.dim_value if dim.HasField("dim_value") else 1
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
        sizes[info.name] = numel * itemsize
    return max(
        sum(sizes.get(name, 0) for name in [*node.input, *node.output] if name not in weights)
        for node in graph.node
    )


def cpu_channel_block() -> int:
    """Channel block of onnxruntime's NCHWc CPU convolutions on this machine: 16 with AVX-512,
    else 8 (what ``--pad-channels auto`` pads to)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return 8
    return 16 if re.search(r"\bavx512f\b", cpuinfo) else 8



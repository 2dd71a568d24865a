"""Trace each tier's weights back to the shared tensors of the global model.

For one tier at one precision, :func:`nested_entry` takes the tier's verified self-contained
model (the per-tier file, tensor names kept) and finds, for every initializer, the shared
global tensor it is a slice of, checked element by element (:func:`materialize` must give
exactly the file's array for FP32 and INT8 weights); what is no such
slice is kept with the tier as a literal (step sizes, folded biases, quantization scales, and
anything the rules below do not prove). The rules:

* FP32: the initializer is the tier's slice map region of a shared tensor, or that region times
  a per-channel factor when a BatchNorm was folded into the layer (PyTorch's factor
  ``weight * rsqrt(running_var + eps)``, kept with the tier), possibly zero-padded; or a 2-D
  region transposed, found by value (the exporter's MatMul weight of a Linear layer, under a
  name of its own).
* INT8: a weight the quantizer dequantizes per output channel (axis 0) whose FP32 tensor is
  such a slice is replaced by the same region of the *shared* int8 tensor, quantized once per
  output channel over the full global tensor (symmetric, zero point 0); its dequantization
  scale becomes the shared scale times the folding factor, and the layer's int32 bias is
  re-quantized for it. Activation ranges stay the tier's own calibration.
* FP16: the tier's FP32 graph over weights stored in half precision: the shared tensor in half
  precision, scaled by the factor in float32 and rounded to half precision, then cast to float32
  for the graph (the tier's own tensors likewise). onnxruntime's CPU provider computes an FP16
  graph in float32 too, but inside an ``If`` branch it leaves the casts it inserts for
  half-precision weights unfolded, which made the FP16 tiers 1.4-2.3x slower than their files.

:class:`SharedTensors` collects, per precision, the shared tensors some tier uses;
:mod:`.nested_model` turns the entries into one ONNX model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from ..slim.slicemap import SliceMap
from .quantize import compact

INT8_MAX = 127


def fold_factors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Per-channel factors of the BatchNorms that :func:`~nefl_zoo.export.surgery.
    fold_batchnorm` folds into the layer before them, keyed by that layer's weight name:
    ``bn.weight * rsqrt(bn.running_var + bn.eps)``, computed as PyTorch's fold computes it."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return {}
    traced = torch.fx.symbolic_trace(module)
    modules = dict(traced.named_modules())
    factors = {}
    for node in traced.graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], (nn.BatchNorm1d, nn.BatchNorm2d)):
            continue
        producer = node.args[0]
        if not (isinstance(producer, torch.fx.Node) and producer.op == "call_module" and len(producer.users) == 1):
            continue
        if isinstance(modules[producer.target], (nn.Conv2d, nn.Linear)):
            bn = modules[node.target]
            with torch.no_grad():
                factors[f"{producer.target}.weight"] = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
    return factors


def quantize_per_channel(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 of ``weight`` per output channel (axis 0) and the float32 scales."""
    flat = np.abs(weight.reshape(weight.shape[0], -1)).max(axis=1) if weight.size else np.zeros(weight.shape[0])
    scale = (flat / INT8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, 1).reshape(-1, *[1] * (weight.ndim - 1))
    return np.clip(np.round(weight / safe), -INT8_MAX, INT8_MAX).astype(np.int8), scale


@dataclass
class SharedTensors:
    """The shared tensors of one precision that some tier uses, keyed by global key."""

    precision: str
    global_state: Mapping[str, torch.Tensor]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    int8_scales: dict[str, np.ndarray] = field(default_factory=dict)
    _full: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def full(self, key: str) -> np.ndarray:
        """The global tensor ``key`` at float32."""
        if key not in self._full:
            self._full[key] = self.global_state[key].detach().cpu().float().numpy()
        return self._full[key]

    def use(self, key: str) -> np.ndarray:
        """The shared tensor ``key`` at this precision (added on first use)."""
        if key not in self.arrays:
            full = self.full(key)
            if self.precision == "int8":
                self.arrays[key], self.int8_scales[key] = quantize_per_channel(full)
            else:
                self.arrays[key] = full.astype(np.float16 if self.precision == "fp16" else np.float32)
        return self.arrays[key]


@dataclass(frozen=True)
class Slice:
    """How one initializer is cut from a shared tensor: per dimension of ``shared`` a
    ``(start, stop)`` range, the name of an int64 index tensor of the tier, or ``None`` (all);
    then optionally times the tier tensor ``scale`` along axis 0, cast to ``dtype``, transposed
    (2-D) and zero-padded to the shape ``pad``."""

    name: str
    shared: str
    index: tuple
    scale: str | None = None
    dtype: str | None = None
    pad: tuple[int, ...] | None = None
    transpose: bool = False  # a 2-D slice transposed (before the pad): a Linear layer's MatMul weight


@dataclass(frozen=True)
class NestedEntry:
    """One tier at one precision: its graph (no initializers), its own tensors (``literals``
    are initializers; index tensors and folding factors serve the slices) and its slices."""

    name: str
    graph: onnx.ModelProto
    arrays: dict[str, np.ndarray]
    literals: tuple[str, ...]
    slices: tuple[Slice, ...]
    half_weights: bool = False  # FP16: weights stored in half precision, cast to float32 in the branch


def materialize(cut: Slice, shared: Mapping[str, np.ndarray], tier: Mapping[str, np.ndarray]) -> np.ndarray:
    """The initializer ``cut`` describes; ``ValueError`` (one line) when its shared tensor,
    index, scale or pad does not fit."""
    if cut.shared not in shared:
        raise ValueError(f"{cut.name}: shared tensor {cut.shared} is not in the shared file")
    array = shared[cut.shared]
    if len(cut.index) != array.ndim:
        raise ValueError(f"{cut.name}: {len(cut.index)} index dimensions for {cut.shared} of shape {list(array.shape)}")
    for d, i in enumerate(cut.index):
        if i is None:
            continue
        if isinstance(i, tuple):
            if i[1] > array.shape[d]:
                raise ValueError(f"{cut.name}: index[{d}] {list(i)} runs past {cut.shared}'s {array.shape[d]}")
            array = array[(slice(None),) * d + (slice(*i),)]
            continue
        positions = tier.get(i)
        if positions is None or positions.ndim != 1 or positions.dtype != np.int64:
            raise ValueError(f"{cut.name}: index[{d}] {i} is not a 1-D int64 tensor of the tier file")
        if positions.size and (positions.min() < 0 or positions.max() >= array.shape[d]):
            raise ValueError(f"{cut.name}: index[{d}] {i} points outside {cut.shared}'s {array.shape[d]}")
        array = np.take(array, positions, axis=d)
    if cut.scale is not None:
        factor = tier.get(cut.scale)
        if factor is None or factor.shape != (array.shape[0],):
            raise ValueError(f"{cut.name}: scale {cut.scale} is not a tier tensor of {array.shape[0]} values")
        array = array.astype(np.float32, copy=False) * factor.astype(np.float32).reshape(-1, *[1] * (array.ndim - 1))
    if cut.dtype is not None:
        array = array.astype(cut.dtype, copy=False)
    if cut.transpose:
        if array.ndim != 2:
            raise ValueError(f"{cut.name}: transpose of a {array.ndim}-D slice (only 2-D slices are transposed)")
        array = array.T
    if cut.pad is not None:
        if len(cut.pad) != array.ndim or any(p < n for p, n in zip(cut.pad, array.shape)):
            raise ValueError(f"{cut.name}: pad {list(cut.pad)} is smaller than its slice {list(array.shape)}")
        padded = np.zeros(cut.pad, array.dtype)
        padded[tuple(slice(0, n) for n in array.shape)] = array
        array = padded
    return np.asarray(array, order="C")  # (ascontiguousarray would make a scalar 1-D)


def _region(slice_map: SliceMap, name: str) -> tuple[str, tuple, dict[str, np.ndarray]] | None:
    """``(global key, index, index tensors)`` of a shared tensor's region, else ``None``."""
    entry = slice_map.get(name)
    if entry is None or not entry.consistent:
        return None
    index, tensors = [], {}
    for d, i in enumerate(entry.index):
        if isinstance(i, slice):
            index.append((i.start or 0, i.stop))
        else:
            tensors[f"~index/{name}/{d}"] = i.detach().cpu().numpy().astype(np.int64)
            index.append(f"~index/{name}/{d}")
    return entry.global_key, tuple(index) if entry.index else (None,) * len(entry.shape), tensors


def _fp32_slice(name: str, array: np.ndarray, slice_map: SliceMap, factors: Mapping[str, torch.Tensor],
                shared: SharedTensors) -> tuple[Slice, dict[str, np.ndarray]] | None:
    """The slice that gives exactly ``array``, with the tier tensors it needs, else ``None``."""
    region = _region(slice_map, name)
    if region is None or array.dtype != np.float32:
        return None
    key, index, tier = region
    options = [(None, {})]
    if name in factors:
        options.append((f"~scale/{name}", {f"~scale/{name}": factors[name].detach().cpu().numpy().astype(np.float32)}))
    for scale, extra in options:
        arrays = {**tier, **extra}
        cut = Slice(name, key, index, scale)
        try:
            value = materialize(cut, {key: shared.full(key)}, arrays)
        except ValueError:
            continue
        if value.shape != array.shape and value.ndim == array.ndim and all(a >= v for a, v in zip(array.shape, value.shape)):
            cut = Slice(name, key, index, scale, pad=tuple(array.shape))
            value = materialize(cut, {key: shared.full(key)}, arrays)
        if value.shape == array.shape and np.array_equal(value, array):
            shared.use(key)
            return cut, arrays
    return None


def _transposed_slice(name: str, array: np.ndarray, slice_map: SliceMap,
                      shared: SharedTensors) -> tuple[Slice, dict[str, np.ndarray]] | None:
    """The transposed slice that gives exactly the 2-D ``array`` (the exporter's MatMul weight
    of a Linear layer, under a name of its own), with its tier tensors, else ``None``."""
    if array.ndim != 2 or array.dtype != np.float32:
        return None
    for key, entry in slice_map.items():
        if tuple(entry.shape) != array.shape[::-1] or (region := _region(slice_map, key)) is None:
            continue
        global_key, index, tier = region
        cut = Slice(name, global_key, index, transpose=True)
        if np.array_equal(materialize(cut, {global_key: shared.full(global_key)}, tier), array):
            shared.use(global_key)
            return cut, tier
    return None


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output}


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 1)


def _int8_slices(model: onnx.ModelProto, arrays: dict[str, np.ndarray], fp32: Mapping[str, tuple[Slice, dict]],
                 fp32_arrays: Mapping[str, np.ndarray], shared: SharedTensors) -> dict[str, tuple[Slice, dict]]:
    """The int8 weights of ``model`` replaced by regions of the shared int8 tensors; their
    scales and their layers' biases are rewritten in ``arrays`` (the tier's literals)."""
    producers, out = _producers(model.graph), {}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 2:
            continue
        w_dq, x_dq = producers.get(node.input[1]), producers.get(node.input[0])
        if w_dq is None or w_dq.op_type != "DequantizeLinear" or _axis(w_dq) != 0 or len(w_dq.input) < 3:
            continue
        q_name, s_name = w_dq.input[0], w_dq.input[1]
        source = fp32.get(q_name.removesuffix("_quantized"))
        if source is None or q_name not in arrays or arrays[q_name].dtype != np.int8 or s_name not in arrays:
            continue
        cut, tier = source
        shared.use(cut.shared)
        int8 = Slice(q_name, cut.shared, cut.index, pad=cut.pad)
        scales = materialize(Slice(s_name, cut.shared, cut.index[:1]), {cut.shared: shared.int8_scales[cut.shared]}, tier)
        factor = tier[cut.scale] if cut.scale else np.float32(1)
        new_scale = arrays[s_name].astype(np.float32)  # channels padded with zeros keep the quantizer's scale
        if new_scale.ndim != 1 or len(new_scale) < len(scales):
            continue
        new_scale[: len(scales)] = scales * factor
        if not np.all(new_scale != 0):
            continue
        bias = _requantized_bias(node, producers, arrays, fp32_arrays, x_dq, new_scale)
        if bias is None and len(node.input) > 2 and node.input[2]:
            continue
        arrays[s_name] = new_scale
        arrays.update(bias or {})
        out[q_name] = (int8, {k: v for k, v in tier.items() if k != cut.scale})
    return out


def _requantized_bias(node, producers, arrays, fp32_arrays, x_dq, weight_scale) -> dict[str, np.ndarray] | None:
    """The layer's int32 bias and its scale for the new weight scale (as onnxruntime's
    quantizer computes them: scale = input scale x weight scale), else ``None``."""
    if len(node.input) < 3 or not node.input[2]:
        return None
    b_dq = producers.get(node.input[2])
    if b_dq is None or b_dq.op_type != "DequantizeLinear" or x_dq is None or x_dq.op_type != "DequantizeLinear":
        return None
    b_name, b_scale_name, x_scale = b_dq.input[0], b_dq.input[1], arrays.get(x_dq.input[1])
    bias = fp32_arrays.get(b_name.removesuffix("_quantized"))
    if bias is None or x_scale is None or x_scale.size != 1 or b_name not in arrays:
        return None
    scale = (x_scale.astype(np.float32) * weight_scale).astype(np.float32)
    return {b_name: np.round(bias.astype(np.float64) / scale).astype(np.int32), b_scale_name: scale}


def _fp32_slices(fp32_arrays: Mapping[str, np.ndarray], slice_map: SliceMap, factors: Mapping[str, torch.Tensor],
                 fp32_shared: SharedTensors) -> dict[str, tuple[Slice, dict[str, np.ndarray]]]:
    """The initializers of a tier's FP32 model that are slices of the shared tensors, with their cuts."""
    return {n: found for n, a in fp32_arrays.items()
            if (found := _fp32_slice(n, a, slice_map, factors, fp32_shared) or _transposed_slice(n, a, slice_map, fp32_shared))}


def shared_int8_model(model: onnx.ModelProto, slice_map: SliceMap, factors: Mapping[str, torch.Tensor],
                      shared: SharedTensors, fp32_shared: SharedTensors, fp32_model: onnx.ModelProto) -> onnx.ModelProto:
    """The tier's INT8 ``model`` (tensor names as exported) with the quantization a nested model
    gives it: every weight the INT8 rule above traces is the tier's region of the shared int8
    tensor, with its scale and its layer's bias rewritten for it; the rest is unchanged. A
    per-tier INT8 file and the tier of a nested model are then one quantization (tracing such a
    model again gives the same entry)."""
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    fp32_arrays = {t.name: numpy_helper.to_array(t) for t in fp32_model.graph.initializer}
    slices = _int8_slices(model, arrays, _fp32_slices(fp32_arrays, slice_map, factors, fp32_shared), fp32_arrays, shared)
    for name, (cut, tier) in slices.items():
        arrays[name] = materialize(cut, shared.arrays, tier)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in out.graph.initializer:
        tensor.CopyFrom(numpy_helper.from_array(np.asarray(arrays[tensor.name], order="C"), tensor.name))
    return out


def nested_entry(name: str, model: onnx.ModelProto, slice_map: SliceMap, factors: Mapping[str, torch.Tensor],
                 shared: SharedTensors, fp32_shared: SharedTensors, fp32_model: onnx.ModelProto) -> NestedEntry:
    """The nested entry of tier ``name`` at ``shared.precision`` from its self-contained
    ``model`` (tensor names as exported); INT8 and FP16 weights are traced back through the
    tier's ``fp32_model`` and the FP32 shared tensors ``fp32_shared``."""
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    fp32_arrays = {t.name: numpy_helper.to_array(t) for t in fp32_model.graph.initializer}
    fp32 = _fp32_slices(fp32_arrays, slice_map, factors, fp32_shared)
    if shared.precision == "fp32":
        slices = fp32
    elif shared.precision == "int8":
        slices = _int8_slices(model, arrays, fp32, fp32_arrays, shared)
    else:  # FP16: the FP32 graph over half-precision weights (see the module docstring)
        model, slices = fp32_model, {}
        arrays = {n: a.astype(np.float16) if a.dtype == np.float32 else a for n, a in fp32_arrays.items()}
        for initializer, (cut, tier) in fp32.items():
            shared.use(cut.shared)
            slices[initializer] = (dataclasses.replace(cut, dtype="float16"), tier)
    graph = onnx.ModelProto()
    graph.CopyFrom(model)
    names = [t.name for t in graph.graph.initializer]
    compact(graph)  # short tensor names, as in a per-tier file; initializers keep their order
    short = dict(zip(names, (t.name for t in graph.graph.initializer)))
    del graph.graph.initializer[:]
    literals = tuple(short[n] for n in arrays if n not in slices)
    tier_arrays = {short[n]: np.asarray(a, order="C") for n, a in arrays.items() if n not in slices}
    for _, extra in slices.values():
        tier_arrays.update(extra)
    cuts = tuple(dataclasses.replace(cut, name=short[cut.name]) for cut, _ in slices.values())
    return NestedEntry(name, graph, tier_arrays, literals, cuts, half_weights=shared.precision == "fp16")

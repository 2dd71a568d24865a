"""Nested packages: every tier from one copy of the shared tensors.

A nested export (``manifest.json`` with ``format: nested``) holds, next to the manifest::

    shared.PREC.safetensors          the global model's shared tensors at precision PREC, once
    NAME.PREC.graph.onnx             one entry's graph, without initializers
    NAME.PREC.tensors.safetensors    its per-tier tensors (BatchNorm-folded biases, step sizes,
                                     quantization scales, folding factors, index tensors) and,
                                     in its metadata, its slice map

The slice map (metadata key ``nefl_zoo.slices``, JSON) lists, for every initializer of the
graph, either a *literal* (a tensor of the tier file under the initializer's name) or a
*slice* of a shared tensor::

    {"name": "layer1.0.conv1.weight", "shared": "layer1.0.conv1.weight",
     "index": [[0, 16], [0, 16], null, null],   # per dimension: [start, stop], the name of an
                                                # int64 index tensor of the tier file, or null
     "scale": "~scale/layer1.0.conv1.weight",   # optional: tier tensor multiplying axis 0
     "dtype": "float16",                        # optional: cast after scaling
     "pad": [16, 16, 3, 3]}                     # optional: zero-padded to this shape

A BatchNorm folded into a convolution scales the convolution's output channels, so the folded
weight of a tier is its slice of the *unfolded* shared weight times a per-channel factor kept
with the tier (``scale``): FP32 computes it exactly as PyTorch's fold does, INT8 shares the
int8 weights (quantized once per output channel over the full tensor) and folds the factor
into each tier's dequantization scales. :meth:`NestedPackage.model_bytes` builds the entry's
self-contained model in memory (:func:`~nefl_zoo.runtime.wire.with_initializers`), so
onnxruntime gets constant initializers and optimises the tier as it would a per-tier file.

Every file is read once and checked against the manifest's sha256 before use
(:func:`~nefl_zoo.runtime.session.read_tier`); arrays are views of those verified bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from ..manifest import Manifest, ManifestError, PackageFile, TierEntry
from .arrays import ArrayFileError, parse_safetensors
from .session import read_tier
from .wire import with_initializers

SLICES_KEY = "nefl_zoo.slices"


@dataclass(frozen=True)
class Slice:
    """How one initializer is cut from a shared tensor (see the module docstring)."""

    name: str
    shared: str
    index: tuple  # per dimension: (start, stop), an index tensor's name, or None
    scale: str | None = None
    dtype: str | None = None
    pad: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        out = {"name": self.name, "shared": self.shared, "index": [list(i) if isinstance(i, tuple) else i for i in self.index]}
        out.update({k: v for k, v in (("scale", self.scale), ("dtype", self.dtype)) if v is not None})
        if self.pad is not None:
            out["pad"] = list(self.pad)
        return out


@dataclass(frozen=True)
class TierArrays:
    """One entry's per-tier file: its tensors, the names that are literal initializers, and
    the slices of shared tensors."""

    arrays: dict[str, np.ndarray]
    literals: tuple[str, ...]
    slices: tuple[Slice, ...]


def tier_metadata(literals: list[str], slices: list[Slice]) -> dict[str, str]:
    """The safetensors metadata of a per-tier file."""
    return {SLICES_KEY: json.dumps({"literals": literals, "slices": [s.to_json() for s in slices]}, separators=(",", ":"))}


def _parse_slice(item: object, where: str) -> Slice:
    if not isinstance(item, dict) or not {"name", "shared", "index"} <= set(item) or set(item) - {"name", "shared", "index", "scale", "dtype", "pad"}:
        raise ValueError(f"{where}: expected name, shared, index and optionally scale, dtype, pad")
    index = item["index"]
    if not isinstance(index, list):
        raise ValueError(f"{where}.index: expected a list")
    parsed = []
    for d, i in enumerate(index):
        if i is None or isinstance(i, str):
            parsed.append(i)
        elif isinstance(i, list) and len(i) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in i) and 0 <= i[0] <= i[1]:
            parsed.append(tuple(i))
        else:
            raise ValueError(f"{where}.index[{d}]: expected [start, stop], an index tensor's name or null")
    pad = item.get("pad")
    if pad is not None and not (isinstance(pad, list) and all(isinstance(v, int) and v >= 0 for v in pad)):
        raise ValueError(f"{where}.pad: expected a shape")
    dtype = item.get("dtype")
    if dtype is not None and dtype not in ("float32", "float16"):
        raise ValueError(f"{where}.dtype: expected float32 or float16")
    scale = item.get("scale")
    if not all(isinstance(v, str) for v in (item["name"], item["shared"])) or not (scale is None or isinstance(scale, str)):
        raise ValueError(f"{where}: name, shared and scale must be strings")
    return Slice(item["name"], item["shared"], tuple(parsed), scale, dtype, tuple(pad) if pad is not None else None)


def parse_tier_file(data: bytes, source: str) -> TierArrays:
    """The per-tier file's arrays, literals and slices; :class:`ManifestError` naming the
    file and what is wrong."""
    try:
        arrays, metadata = parse_safetensors(data)
    except ArrayFileError as exc:
        raise ManifestError(source, "", f"not a valid tensors file ({exc})") from None
    try:
        content = json.loads(metadata[SLICES_KEY])
        literals, items = content["literals"], content["slices"]
        if not (isinstance(literals, list) and all(isinstance(n, str) for n in literals) and isinstance(items, list)):
            raise ValueError("expected {literals: [names], slices: [...]}")
        slices = tuple(_parse_slice(item, f"slices[{k}]") for k, item in enumerate(items))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ManifestError(source, SLICES_KEY, f"missing or not the slice map's JSON ({type(exc).__name__})") from None
    except ValueError as exc:
        raise ManifestError(source, SLICES_KEY, str(exc)) from None
    missing = [n for n in literals if n not in arrays]
    if missing:
        raise ManifestError(source, SLICES_KEY, f"literal {missing[0]} is not a tensor of the file")
    names = [*literals, *(s.name for s in slices)]
    if len(set(names)) != len(names):
        raise ManifestError(source, SLICES_KEY, "an initializer is named twice")
    return TierArrays(arrays, tuple(literals), slices)


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
    if cut.pad is not None:
        if len(cut.pad) != array.ndim or any(p < n for p, n in zip(cut.pad, array.shape)):
            raise ValueError(f"{cut.name}: pad {list(cut.pad)} is smaller than its slice {list(array.shape)}")
        padded = np.zeros(cut.pad, array.dtype)
        padded[tuple(slice(0, n) for n in array.shape)] = array
        array = padded
    return np.asarray(array, order="C")  # (ascontiguousarray would make a scalar 1-D)


class NestedPackage:
    """The files of a nested manifest: each precision's shared tensors read (and checked)
    once, on first use, and each entry's self-contained model assembled from them."""

    def __init__(self, manifest: Manifest, root: str | Path):
        if manifest.format != "nested":
            raise ValueError("not a nested package (format files)")
        self.manifest, self.root = manifest, Path(root)
        self._shared: dict[str, dict[str, np.ndarray]] = {}

    def _read(self, ref: PackageFile | TierEntry) -> bytes:
        return read_tier(self.root / ref.file, ref.sha256, root=self.root)

    def shared(self, precision: str) -> dict[str, np.ndarray]:
        """The shared tensors at ``precision`` (read and verified on first use)."""
        if precision not in self._shared:
            ref = self.manifest.shared[precision]
            try:
                arrays, _ = parse_safetensors(self._read(ref))
            except ArrayFileError as exc:
                raise ManifestError(str(self.root / ref.file), "", f"not a valid tensors file ({exc})") from None
            self._shared[precision] = arrays
        return self._shared[precision]

    def model_bytes(self, entry: TierEntry) -> bytes:
        """``entry``'s self-contained serialized model: its verified graph with its
        initializers appended (:func:`assemble`)."""
        graph = self._read(entry)
        tensors = self._read(entry.tensors)
        return assemble(graph, tensors, self.shared(entry.precision), str(self.root / entry.tensors.file))


def tier_initializers(tensors: bytes, shared: Mapping[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """Every initializer of an entry's graph from its per-tier file's bytes ``tensors``:
    its literals and its slices of the ``shared`` tensors; :class:`ManifestError` naming
    ``source`` when one does not fit."""
    tier = parse_tier_file(tensors, source)
    out = {name: tier.arrays[name] for name in tier.literals}
    for cut in tier.slices:
        try:
            out[cut.name] = materialize(cut, shared, tier.arrays)
        except ValueError as exc:
            raise ManifestError(source, SLICES_KEY, str(exc)) from None
    return out


def assemble(graph: bytes, tensors: bytes, shared: Mapping[str, np.ndarray], source: str) -> bytes:
    """The self-contained serialized model of a weights-free ``graph`` and its per-tier file
    ``tensors`` over the ``shared`` tensors of its precision."""
    return with_initializers(graph, tier_initializers(tensors, shared, source))

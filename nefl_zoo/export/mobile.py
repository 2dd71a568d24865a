"""The nested models of an export in onnxruntime's ORT format (``.ort``), what its mobile and
minimal builds load: ``nefl-zoo convert-ort EXPORT``.

onnxruntime loads an ``.ort`` file as it was saved: it runs no graph optimization on it, in a
minimal build or in the full one. A nested model's tiers cut their weights out of the shared
tensors, so the file is one of two styles:

* ``compact`` (the default): the shared tensors stored once, the cuts run at every request.
  Saved with every optimization of onnxruntime's converter but constant folding (fused
  convolutions and activations, INT8 ``QLinearConv``, ...), and without the one-input
  ``Concat`` that made a whole shared tensor a constant of its branch (at run time it would
  copy the tensor at every request). About the bytes of the ``.onnx`` file; one copy of the
  weights in memory; each request pays for its cuts and for kernels that cannot pre-pack
  non-constant weights (measured on the benchmark pages).
* ``folded``: what ``python -m onnxruntime.tools.convert_onnx_models_to_ort`` writes: every
  tier's cuts folded into constants, so each tier runs as fast as its own ``.ort`` file, for
  about the bytes of every per-tier file together.

Like onnxruntime's converter, the default ``--target-platform arm`` leaves out the x86-only
NCHWc layout (and lets INT8 run with int8 activations where the file allows it); ``amd64`` keeps
them (the file then runs on x86 only). Every tier of each ``.ort`` file is run and checked
against the ``.onnx`` file it came from (FP32 and FP16 within
:func:`~nefl_zoo.export.verify.tolerance_for`, INT8 exactly) before anything is written; the
files land atomically next to ``required_operators.config``, the operators a reduced build of
onnxruntime needs (``--include_ops_by_config``). The tier table travels in the ``.ort`` file's
metadata; its key ``nefl_zoo.nested.source`` holds the sha256 of the ``.onnx`` file it was
converted from.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ..files import atomic_write
from ..manifest import MANIFEST_NAME, load_manifest
from ..runtime.nested import METADATA_KEY, TIER_INPUT
from ..runtime.session import first_line, read_tier, session_from_bytes, session_options
from .verify import ExportError, tolerance_for

STYLES = ("compact", "folded")
TARGET_PLATFORMS = ("arm", "amd64")
SOURCE_KEY = f"{METADATA_KEY}.source"  # the .onnx file's sha256, in the .ort file's metadata
CONFIG_NAME = "required_operators.config"
CHECK_IMAGES = 8  # seeded random images every tier of an .ort file is checked on


@dataclass(frozen=True)
class OrtFile:
    """One nested model in the ORT format, written and checked."""

    file: str
    source: str  # the .onnx file
    precision: str
    bytes: int
    source_bytes: int
    max_abs_diff: float  # the largest logit difference from the .onnx file over every tier


def ort_filename(onnx_file: str) -> str:
    """``nested.fp32.onnx`` -> ``nested.fp32.ort``."""
    return onnx_file.removesuffix(".onnx") + ".ort"


def unfolded(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for a session that folds no constants: every one-input ``Concat`` (the nested
    model's way of making a whole shared tensor a constant of its branch) replaced by its input."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    todo = [model.graph]
    while todo:
        graph = todo.pop()
        renamed = {}
        for node in list(graph.node):
            if node.op_type == "Concat" and len(node.input) == 1:
                renamed[node.output[0]] = node.input[0]
                graph.node.remove(node)
        for node in graph.node:
            node.input[:] = [renamed.get(name, name) for name in node.input]
            todo.extend(a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH)
        for output in graph.output:
            if output.name in renamed:
                raise ExportError(f"a one-input Concat gives the graph output {output.name}; not a nested model")
    return model


def save_ort(model: bytes, path: Path, style: str, target_platform: str) -> None:
    """Save the serialized ``model`` in the ORT format at ``path``, optimized as ``style`` and
    ``target_platform`` say (the module docstring)."""
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(path)
    options.add_session_config_entry("session.save_model_format", "ORT")
    options.add_session_config_entry("session.qdqisint8allowed", "1" if target_platform == "arm" else "0")
    disabled = [] if target_platform == "amd64" else ["NchwcTransformer"]
    if style == "compact":
        disabled.append("ConstantFolding")
    ort.InferenceSession(model, options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled)


def _with_source(model: onnx.ModelProto, sha256: str) -> bytes:
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, SOURCE_KEY: sha256})
    return model.SerializeToString()


def _check(name: str, precision: str, source: ort.InferenceSession, converted: ort.InferenceSession, tiers: int,
           shape: list[int]) -> float:
    """The largest logit difference between the ``.ort`` session and its ``.onnx`` one over
    every tier; :class:`ExportError` when it is past what the precision allows."""
    x = np.random.default_rng(0).standard_normal((CHECK_IMAGES, *shape), dtype=np.float32)
    worst = 0.0
    for tier in range(tiers):
        feed = {"input": x, TIER_INPUT: np.array(tier, np.int64)}
        expected = source.run(None, feed)[0]
        try:
            got = converted.run(None, feed)[0]
        except Exception as exc:  # onnxruntime's own exception types
            raise ExportError(f"{name}: tier {tier} fails in the ORT format ({first_line(exc)})") from None
        diff = float(np.abs(got.astype(np.float64) - expected).max())
        allowed = 0.0 if precision == "int8" else tolerance_for(torch.from_numpy(expected))
        if not diff <= allowed:
            raise ExportError(f"{name}: tier {tier}'s logits differ from the .onnx file's by {diff:.3g} (allowed {allowed:.3g})")
        worst = max(worst, diff)
    return worst


def convert_to_ort(export: str | Path, out_dir: str | Path | None = None, style: Literal["compact", "folded"] = "compact",
                   target_platform: Literal["arm", "amd64"] = "arm", threads: int | None = None) -> list[OrtFile]:
    """Write the ORT-format file of every nested model of an export, each checked tier by tier
    against its ``.onnx`` file, and ``required_operators.config`` beside them.

    Args:
        export: the export folder, or its ``manifest.json``.
        out_dir: where to write (default: the export's folder).
        style: ``compact`` (the shared weights once, the cuts run at every request) or
            ``folded`` (every tier's weights folded in, as onnxruntime's converter writes).
        target_platform: ``arm`` (a file for any CPU) or ``amd64`` (x86 only).
        threads: onnxruntime intra-op threads for the check.

    Returns:
        One :class:`OrtFile` per nested model written.

    Raises:
        ValueError: an export that is not nested, or an unknown style or platform.
        ManifestError: a file that does not match its manifest.
        ExportError: a tier whose logits in the ORT format differ from the ``.onnx`` file's.
    """
    if style not in STYLES:
        raise ValueError(f"style: expected {' or '.join(STYLES)}, got {style!r}")
    if target_platform not in TARGET_PLATFORMS:
        raise ValueError(f"target platform: expected {' or '.join(TARGET_PLATFORMS)}, got {target_platform!r}")
    path = Path(export)
    manifest_path = path / MANIFEST_NAME if path.is_dir() else path
    manifest = load_manifest(manifest_path)
    if manifest.format != "nested":
        raise ValueError(f"{manifest_path}: format: {manifest.format}; convert-ort converts nested models (export --format nested)")
    root = manifest_path.parent
    out = Path(out_dir) if out_dir is not None else root
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: is a file; convert-ort writes a folder")
    files: dict[str, tuple[str, str, int]] = {}
    for entry in manifest.tiers:
        files.setdefault(entry.file, (entry.precision, entry.sha256, entry.bytes))
    made: list[OrtFile] = []
    with tempfile.TemporaryDirectory(prefix="nefl-ort-") as tmp:
        staged = []
        for file, (precision, sha256, size) in files.items():
            data = read_tier(root / file, sha256, root, size)
            model = onnx.load_model_from_string(data)
            if style == "compact":
                model = unfolded(model)
            target = Path(tmp) / ort_filename(file)
            try:
                save_ort(_with_source(model, sha256), target, style, target_platform)
            except Exception as exc:  # onnxruntime's own exception types
                raise ExportError(f"{file}: onnxruntime cannot save it in the ORT format ({first_line(exc)})") from None
            source = session_from_bytes(data, file, threads=threads)
            converted = session_from_bytes(target.read_bytes(), target.name, threads=threads)
            metadata = converted.get_modelmeta().custom_metadata_map
            if metadata.get(SOURCE_KEY) != sha256 or json.loads(metadata[METADATA_KEY])["precision"] != precision:
                raise ExportError(f"{target.name}: the tier table or its source did not travel into the ORT format")
            tiers = sum(1 for e in manifest.tiers if e.file == file)
            diff = _check(target.name, precision, source, converted, tiers, manifest.input.shape)
            made.append(OrtFile(target.name, file, precision, target.stat().st_size, len(data), diff))
            staged.append(target)
        config = _operators_config(staged)
        out.mkdir(parents=True, exist_ok=True)
        for target in staged:
            atomic_write(out / target.name, lambda p, data=target.read_bytes(): p.write_bytes(data))
        atomic_write(out / CONFIG_NAME, lambda p: p.write_text(config))
    return made


def _operators_config(files: list[Path]) -> str:
    """onnxruntime's ``required_operators.config`` for ``files`` (their names, not their
    temporary paths, in its header)."""
    root, placeholder = logging.getLogger(), logging.NullHandler()
    root.addHandler(placeholder)  # onnxruntime's tools call logging.basicConfig on import: not on this process's root
    try:
        from onnxruntime.tools.ort_format_model import create_config_from_models
    finally:
        root.removeHandler(placeholder)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("ort_format_model"):
            logging.getLogger(name).setLevel(logging.WARNING)  # its "Created config in ..." line

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / CONFIG_NAME
        create_config_from_models(files, config, enable_type_reduction=False)
        text = config.read_text()
    for file in files:
        text = text.replace(str(file), file.name)
    return text

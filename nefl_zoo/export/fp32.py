"""The FP32 file of one tier: folded and padded where that keeps the output, written, checked
against PyTorch with onnxruntime, and timed.

The slim module's BatchNorms are folded into the preceding convolutions where that leaves the
output unchanged, and its inner channels optionally zero-padded (:mod:`.surgery`); the file is
written (:mod:`.onnx_file`), checked to be one self-contained file and to give the module's
logits (:mod:`.verify`), and timed. With ``channel_align="auto"`` the plain and the padded
file are both timed, interleaved, and the faster is kept; the choice is recorded in the
manifest and reused by the next export (:func:`recorded_alignments`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from ..manifest import MANIFEST_NAME, Latency, Machine, ManifestError, load_manifest
from ..timing import interleaved_median_ms
from .onnx_file import INPUT_NAME, activation_bytes_per_sample, cpu_channel_block, write_onnx
from .options import ExportOptions
from .surgery import fold_batchnorm, pad_channels
from .verify import check_parity, check_single_file, hashed_session, same_output


@dataclass(frozen=True)
class ExportedTier:
    """What exporting one tier measured (its FP32 file)."""

    data: bytes
    session: ort.InferenceSession
    sha256: str
    opset: int
    num_classes: int
    batchnorm_folded: bool
    max_abs_diff: float
    activation_bytes_per_sample: int
    latency: Latency
    channel_align: int
    channel_align_ms: dict[str, float] | None
    inputs: np.ndarray  # the batch parity was checked on


def _alignments(module: nn.Module, channel_align: int | Literal["auto"]) -> dict[int, nn.Module]:
    """The variants of ``module`` to export, by channel alignment: the one asked for, or with
    ``auto`` the plain module and, where padding changes a width, the one padded to
    :func:`cpu_channel_block` (modules :func:`pad_channels` cannot pad stay plain)."""
    if channel_align == 1:
        return {1: module}
    if channel_align != "auto":
        return {channel_align: pad_channels(module, channel_align)}
    block = cpu_channel_block()
    try:
        padded = pad_channels(module, block)
    except ValueError:
        return {1: module}
    shapes = [t.shape for t in module.state_dict().values()]
    same = shapes == [t.shape for t in padded.state_dict().values()]
    return {1: module} if same else {1: module, block: padded}


def recorded_alignments(manifest_path: str | Path, compiled, profiles: Mapping[str, object]) -> dict[str, tuple[int, dict[str, float]]]:
    """The alignment ``--pad-channels auto`` chose for each tier in the export of
    ``manifest_path`` (a ``manifest.json`` or its folder), with the timings it chose on:
    ``{tier: (channel_align, channel_align_ms)}`` for every tier of the same model whose params
    and MACs are those of ``profiles`` (the same tier) and whose alignment is 1 or this CPU's
    channel block; empty when there is no readable manifest of that model."""
    path = Path(manifest_path)
    path = path / MANIFEST_NAME if path.is_dir() else path
    try:
        manifest = load_manifest(path)
    except (ManifestError, OSError):
        return {}
    if (manifest.model, manifest.model_args) != (compiled.spec.model, compiled.spec.model_args):
        return {}
    block = cpu_channel_block()
    return {
        t.name: (t.channel_align, dict(t.channel_align_ms)) for t in manifest.tiers
        if t.channel_align_ms and t.name in profiles and t.channel_align in (1, block)
        and (t.params, t.macs) == (profiles[t.name].params, profiles[t.name].macs)
    }


def export_fp32(
    name: str, module: nn.Module, input_size: tuple[int, ...], path: Path, options: ExportOptions, machine: Machine,
    generator: torch.Generator, recorded: tuple[int, dict[str, float]] | None = None,
) -> ExportedTier:
    """Fold, pad, export, check against ``module`` with onnxruntime and time one tier; with
    ``channel_align="auto"`` both alignments are exported and timed, interleaved, and the
    faster file is kept at ``path``, unless a choice was ``recorded`` for the tier (see
    :func:`recorded_alignments`): then that alignment is exported and its timings kept."""
    x = torch.randn(options.batch + 1 if options.batch_dynamic else options.batch, *input_size, generator=generator)
    with torch.no_grad():
        reference = module(x)
        folded = fold_batchnorm(module)
        batchnorm_folded = folded is not module and same_output(folded, x, reference)
    optimized = folded if batchnorm_folded else module
    example_batch = max(2, options.batch) if options.batch_dynamic else options.batch
    variants = {}
    wanted = recorded[0] if recorded is not None and options.channel_align == "auto" else options.channel_align
    for align, variant in _alignments(optimized, wanted).items():
        file = path if align == 1 or options.channel_align != "auto" else path.with_name(f"{path.stem}.align{align}.onnx")
        write_onnx(variant, file, input_size, example_batch, options.batch_dynamic, options.opset)
        data = file.read_bytes()  # read once: these bytes are checked, hashed and verified
        model = onnx.load_model_from_string(data)
        opset = check_single_file(name, model, options.opset)
        sha256, session = hashed_session(data, str(file), options.threads)
        diff = check_parity(name, session, x, reference)
        variants[align] = (file, model, opset, sha256, session, diff, data)
    feed = {INPUT_NAME: torch.randn(options.batch, *input_size, generator=generator).numpy()}
    runs = interleaved_median_ms({a: functools.partial(v[4].run, None, feed) for a, v in variants.items()},
                                 options.latency_runs, warmup_rounds=2)
    align = min(runs, key=runs.get)
    file, model, opset, sha256, session, diff, data = variants[align]
    for other, (other_file, *_) in variants.items():
        if other != align and other_file != path:
            other_file.unlink()
    os.replace(file, path)  # the kept file under the tier's name
    latency = Latency(
        median_ms=runs[align], batch=options.batch, runs=options.latency_runs, threads=options.threads, machine=machine,
    )
    if options.channel_align != "auto":
        tried = None
    else:
        tried = recorded[1] if recorded is not None else {str(a): ms for a, ms in runs.items()}
    return ExportedTier(
        data, session, sha256, opset, int(reference.shape[1]), batchnorm_folded, diff, activation_bytes_per_sample(model), latency,
        align, tried, x.numpy(),
    )

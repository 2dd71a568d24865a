"""Export every tier of a source, verified and timed, then publish the files and the manifest.

For each tier: take the slim module from :meth:`CompiledTier.load`, fold and pad it where that
keeps the output (:mod:`.surgery`), write it (:mod:`.onnx_file`), check the file and its parity
with onnxruntime (:mod:`.verify`) and time it. Files are staged and moved into place only when
every tier passed, the manifest last.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import onnx
import torch
from torch import nn

from .. import __version__
from ..datasets import CLASS_NAMES, NORMALIZATION
from ..files import atomic_write
from ..manifest import MANIFEST_NAME, InputSpec, Latency, Machine, Manifest, Normalization, OutputSpec, TierEntry
from ..profile import profile_tiers
from ..timing import median_ms
from .onnx_file import (
    INPUT_NAME,
    MIN_OPSET,
    OUTPUT_NAME,
    activation_bytes_per_sample,
    machine_description,
    tier_filename,
    write_onnx,
)
from .sources import ExportSource
from .surgery import fold_batchnorm, pad_channels
from .verify import check_parity, check_single_file, hashed_session, same_output


@dataclass(frozen=True)
class _TierOptions:
    """How every tier is exported and timed (the arguments of :func:`export_tiers`)."""

    opset: int | None
    batch_dynamic: bool
    batch: int
    latency_runs: int
    threads: int | None
    channel_align: int
    machine: Machine


@dataclass(frozen=True)
class _ExportedTier:
    """What exporting one tier measured."""

    sha256: str
    opset: int
    num_classes: int
    batchnorm_folded: bool
    max_abs_diff: float
    activation_bytes_per_sample: int
    latency: Latency


def _export_tier(
    name: str, module: nn.Module, input_size: tuple[int, ...], path: Path, options: _TierOptions, generator: torch.Generator
) -> _ExportedTier:
    """Fold, pad, export, check against ``module`` with onnxruntime and time one tier."""
    x = torch.randn(options.batch + 1 if options.batch_dynamic else options.batch, *input_size, generator=generator)
    with torch.no_grad():
        reference = module(x)
        folded = fold_batchnorm(module)
        batchnorm_folded = folded is not module and same_output(folded, x, reference)
    optimized = folded if batchnorm_folded else module
    if options.channel_align > 1:
        optimized = pad_channels(optimized, options.channel_align)
    example_batch = max(2, options.batch) if options.batch_dynamic else options.batch
    write_onnx(optimized, path, input_size, example_batch, options.batch_dynamic, options.opset)

    model = onnx.load(str(path))
    opset = check_single_file(name, model, options.opset)
    sha256, session = hashed_session(path, options.threads)
    diff = check_parity(name, session, x, reference)
    feed = {INPUT_NAME: torch.randn(options.batch, *input_size, generator=generator).numpy()}
    latency_ms = median_ms(lambda: session.run(None, feed), options.latency_runs, warmup=2)
    latency = Latency(
        median_ms=latency_ms, batch=options.batch, runs=options.latency_runs, threads=options.threads,
        machine=options.machine,
    )
    return _ExportedTier(
        sha256, opset, int(reference.shape[1]), batchnorm_folded, diff, activation_bytes_per_sample(model), latency
    )


def export_tiers(
    source: ExportSource,
    out_dir: str | Path,
    *,
    tiers: Sequence[str] | None = None,
    opset: int | None = None,
    batch_dynamic: bool = True,
    batch: int = 1,
    dataset: str | None = None,
    latency_runs: int = 20,
    threads: int | None = None,
    channel_align: int = 1,
) -> Manifest:
    """Export, verify and time the ``tiers`` (default: all) of ``source`` into ``out_dir``.

    Args:
        dataset: recorded with its normalisation when one of :data:`DATASETS` and its class
            names when known (default: the source's dataset).
        batch: the batch the latency is measured at; with ``batch_dynamic=False`` also the
            files' fixed batch. The dynamic-batch export uses a batch of at least 2 and is
            verified on another batch size.
        threads: onnxruntime intra-op threads for the latency (default: one per core).
        channel_align: above 1, inner channel counts are zero-padded to a multiple of it
            (:func:`pad_channels`): same outputs, faster CPU kernels for odd widths, larger
            files; the manifest's params and MACs stay the tier's own.

    Files are written to a staging directory and moved into place only when every tier
    passed, the manifest last (via a temporary file), so a failed export never leaves a
    manifest that does not match its files. Raises :class:`ExportError` when onnxruntime and
    PyTorch differ by more than ``ATOL * max(1, max |logit|)``.
    """
    compiled = source.compiled
    names = list(tiers) if tiers else list(compiled.tiers)
    unknown = [n for n in names if n not in compiled.tiers]
    if unknown:
        raise KeyError(f"unknown tier {unknown[0]!r}; tiers: {', '.join(compiled.tiers)}")
    dataset = dataset or source.dataset
    files = {name: tier_filename(name) for name in names}
    if len(set(files.values())) != len(files):
        raise ValueError(f"tiers {names} map to clashing file names {sorted(files.values())}")
    if batch < 1 or channel_align < 1:
        raise ValueError(f"batch and channel_align must be >= 1, got {batch} and {channel_align}")
    if opset is not None and opset < MIN_OPSET:
        raise ValueError(f"opset: the torch.export-based exporter writes opset {MIN_OPSET} or later, got {opset}")

    profiles = {p.name: p for p in profile_tiers(compiled)}
    options = _TierOptions(opset, batch_dynamic, batch, latency_runs, threads, channel_align, machine_description())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir))
    generator = torch.Generator().manual_seed(0)
    try:
        entries = []
        for name in names:
            module = compiled[name].load(source.global_state).eval()
            path = staging / files[name]
            exported = _export_tier(name, module, compiled.input_size, path, options, generator)
            prof = profiles[name]
            entries.append(
                TierEntry(
                    name=name,
                    file=files[name],
                    sha256=exported.sha256,
                    params=prof.params,
                    params_ratio=prof.params_ratio,
                    macs=prof.macs,
                    macs_ratio=prof.macs_ratio,
                    gamma=prof.gamma,
                    gamma_w=prof.gamma_w,
                    blocks_per_stage=prof.blocks_per_stage,
                    accuracy=source.accuracy.get(name),
                    batchnorm_folded=exported.batchnorm_folded,
                    channel_align=channel_align,
                    max_abs_diff=exported.max_abs_diff,
                    weights_mb=path.stat().st_size / 2**20,
                    activation_mb_per_sample=exported.activation_bytes_per_sample / 2**20,
                    latency=exported.latency,
                )
            )
        normalization = NORMALIZATION.get(dataset) if dataset else None
        manifest = Manifest(
            schema_version=1,
            model=compiled.spec.model,
            model_args=compiled.spec.model_args,
            source=source.description,
            created_by=f"nefl-zoo {__version__}",
            opset=exported.opset,
            input=InputSpec(
                name=INPUT_NAME,
                shape=list(compiled.input_size),
                batch=None if batch_dynamic else batch,
                normalization=Normalization(mean=list(normalization[0]), std=list(normalization[1]))
                if normalization
                else None,
                dataset=dataset,
            ),
            output=OutputSpec(name=OUTPUT_NAME, num_classes=exported.num_classes),
            class_names=list(CLASS_NAMES[dataset]) if dataset in CLASS_NAMES else None,
            tiers=entries,
        )
        _publish(staging, out_dir, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _publish(staging: Path, out_dir: Path, manifest: Manifest) -> None:
    """Move verified tier files into ``out_dir`` and write the manifest atomically.

    The old manifest is removed first, so an interruption leaves no manifest rather than one
    whose hashes do not match the files next to it.
    """
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for entry in manifest.tiers:
        os.replace(staging / entry.file, out_dir / entry.file)
    atomic_write(out_dir / MANIFEST_NAME, lambda p: p.write_text(manifest.model_dump_json(indent=2) + "\n"))

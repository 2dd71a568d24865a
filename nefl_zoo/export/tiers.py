"""Export every tier of a source, verified and timed, then publish the files and the manifest.

For each tier: take the slim module from :meth:`CompiledTier.load`, fold and pad it where that
keeps the output (:mod:`.surgery`), write it (:mod:`.onnx_file`), check the file and its parity
with onnxruntime (:mod:`.verify`) and time it; then its INT8/FP16 versions, checked against it
(:mod:`.precisions`). Files are staged and moved into place only when every tier passed, the
manifest last (:mod:`.staging`).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from ..version import __version__
from ..datasets import CLASS_NAMES, normalization as dataset_normalization
from ..manifest import (
    FORMATS, MANIFEST_NAME, PRECISIONS, SCHEMA_VERSION, InputSpec, Latency, Machine, Manifest, ManifestError, Normalization,
    OutputSpec, TierEntry, load_manifest,
)
from ..profile import check_batch_fits, profile_tiers
from ..runtime.latency import machine_description
from ..timing import interleaved_median_ms
from .onnx_file import (
    INPUT_NAME,
    MIN_OPSET,
    OUTPUT_NAME,
    activation_bytes_per_sample,
    cpu_channel_block,
    tier_filename,
    write_onnx,
)
from .data import ExportImages, export_images
from .precisions import PrecisionFile, accuracy, precision_filename, precision_files, time_files
from ..runtime.nested import TierSession
from .nested_model import nested_table
from .nested import SharedTensors, fold_factors, shared_int8_model
from .package import PackageWriter
from .sources import ExportSource
from .staging import publish, staging
from .surgery import fold_batchnorm, pad_channels
from .verify import ExportError, check_parity, check_single_file, hashed_session, same_output

CALIBRATION_IMAGES = 256  # training images of a run that INT8 ranges are calibrated on
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _TierOptions:
    """How every tier is exported and timed (the arguments of :func:`export_tiers`)."""

    opset: int | None
    batch_dynamic: bool
    batch: int
    latency_runs: int
    threads: int | None
    channel_align: int | Literal["auto"]
    machine: Machine


@dataclass(frozen=True)
class _ExportedTier:
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


def _export_tier(
    name: str, module: nn.Module, input_size: tuple[int, ...], path: Path, options: _TierOptions, generator: torch.Generator,
    recorded: tuple[int, dict[str, float]] | None = None,
) -> _ExportedTier:
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
        median_ms=runs[align], batch=options.batch, runs=options.latency_runs, threads=options.threads,
        machine=options.machine,
    )
    if options.channel_align != "auto":
        tried = None
    else:
        tried = recorded[1] if recorded is not None else {str(a): ms for a, ms in runs.items()}
    return _ExportedTier(
        data, session, sha256, opset, int(reference.shape[1]), batchnorm_folded, diff, activation_bytes_per_sample(model), latency,
        align, tried, x.numpy(),
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
    channel_align: int | Literal["auto"] = 1,
    precisions: Sequence[str] = ("fp32",),
    calibration: np.ndarray | None = None,
    calibration_source: str = "the images given",
    calibration_images: int = CALIBRATION_IMAGES,
    warn: Callable[[str], None] | None = None,
    format: str = "files",
    alignments_from: str | Path | None = None,
) -> Manifest:
    """Export, verify and time the ``tiers`` (default: all) of ``source`` into ``out_dir``.

    Args:
        source: what to export (:func:`load_source`).
        out_dir: the export folder, created if needed.
        tiers: the tiers to export, by name (default: all).
        opset: the ONNX opset (default: the exporter's).
        batch_dynamic: export the batch dimension as dynamic.
        latency_runs: timed runs per file (the median is recorded).
        calibration_source: what ``calibration`` is, for the manifest.
        calibration_images: how many training images of a run INT8 is calibrated on.
        dataset: recorded with its normalisation when one of :data:`DATASETS` and its class
            names when known (default: the source's dataset).
        batch: the batch the latency is measured at; with ``batch_dynamic=False`` also the
            files' fixed batch. The dynamic-batch export uses a batch of at least 2 and is
            verified on another batch size.
        threads: onnxruntime intra-op threads for the latency (default: one per core).
        channel_align: above 1, inner channel counts are zero-padded to a multiple of it
            (:func:`pad_channels`): same outputs, faster CPU kernels for odd widths, larger
            files; the manifest's params and MACs stay the tier's own. ``"auto"``: each tier
            is exported plain and padded to :func:`cpu_channel_block`, both are timed
            (interleaved) and the faster is kept; the manifest records the choice and both
            latencies (``channel_align``, ``channel_align_ms``), and a later ``"auto"`` export
            reuses the recorded choice instead of timing again (:func:`recorded_alignments`),
            so that exporting the same source twice gives the same files.
        alignments_from: the ``manifest.json`` (or its folder) whose recorded ``"auto"``
            choices are reused (default: ``out_dir``'s, when there is one).
        precisions: the files shipped per tier, of ``fp32``, ``int8`` and ``fp16``; INT8 and
            FP16 files are made from the FP32 file and dropped with a warning when they fail
            the check against it (:mod:`.precisions`).
        calibration: images (normalised float32, N x C x H x W) that INT8 is calibrated on,
            named by ``calibration_source``; default: ``calibration_images`` training images
            of a run source.
        warn: called with each warning (default: logged).
        format: ``files`` (one self-contained file per tier and precision) or ``nested``
            (one standard ``.onnx`` file per precision holding every tier, the shared
            tensors once; :mod:`.nested_model`, :mod:`nefl_zoo.runtime.nested`).

    A run source's test split (when its data loads) gives every file's accuracy and the
    images the check uses. Files are written to a staging directory and moved into place
    only when every tier passed, the manifest last (via a temporary file), so a failed export
    never leaves a manifest that does not match its files.

    Returns:
        The manifest written to ``out_dir/manifest.json``.

    Raises:
        ExportError: onnxruntime and PyTorch differ by more than
            ``ATOL * max(1, max |logit|)``, or no quantized file passed its check.
        KeyError: an unknown tier.
        ValueError: an invalid setting (precisions, batch, opset, format), INT8 without
            calibration images, or an ``out_dir`` that is a file.

    The quickstart of the documentation exports a tier with it, and runs the file.
    """
    compiled = source.compiled
    names = list(tiers) if tiers else list(compiled.tiers)
    unknown = [n for n in names if n not in compiled.tiers]
    if unknown:
        raise KeyError(f"unknown tier {unknown[0]!r}; tiers: {', '.join(compiled.tiers)}")
    dataset = dataset or source.dataset
    precisions = list(dict.fromkeys(precisions))
    if not precisions or any(p not in PRECISIONS for p in precisions):
        raise ValueError(f"precisions: expected some of {', '.join(PRECISIONS)}, got {', '.join(precisions) or 'none'}")
    files = {name: tier_filename(name) for name in names}
    every_file = [precision_filename(files[n], p) for n in names for p in ("fp32", *precisions)]
    if len(set(every_file)) != len(dict.fromkeys((n, p) for n in names for p in ("fp32", *precisions))):
        raise ValueError(f"tiers {names} map to clashing file names {sorted(every_file)}")
    if batch < 1 or not (channel_align == "auto" or (isinstance(channel_align, int) and channel_align >= 1)):
        raise ValueError(f"batch must be >= 1 and channel_align >= 1 or 'auto', got {batch} and {channel_align!r}")
    if opset is not None and opset < MIN_OPSET:
        raise ValueError(f"opset: the torch.export-based exporter writes opset {MIN_OPSET} or later, got {opset}")
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {format!r}")
    if "int8" in precisions and calibration is None and source.data is None:
        raise ValueError("int8: needs calibration images; export a run directory, or give a folder of images (--calibration)")

    check_batch_fits(compiled.create_global_model(), compiled.input_size, batch)
    warn = warn or _log.warning
    images = _images(source, precisions, calibration, calibration_source, calibration_images, warn)
    profiles = {p.name: p for p in profile_tiers(compiled)}
    options = _TierOptions(opset, batch_dynamic, batch, latency_runs, threads, channel_align, machine_description())
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: is a file; export writes a folder (tier files and manifest.json)")
    if alignments_from is not None and not Path(alignments_from).exists():
        raise ValueError(f"{alignments_from}: no such manifest or export folder (the alignments to reuse)")
    recorded = recorded_alignments(alignments_from or out_dir, compiled, profiles) if channel_align == "auto" else {}
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    fixed_batch = None if batch_dynamic else batch
    # one quantization for both formats: a per-tier INT8 file has the int8 weights its nested tier has
    shared = {p: SharedTensors(p, source.global_state) for p in dict.fromkeys(("fp32", *precisions))}
    package = PackageWriter(shared, precisions, threads, fixed_batch) if format == "nested" else None
    normalization = dataset_normalization(dataset, compiled.input_size[0]) if dataset else None
    input_spec = InputSpec(
        name=INPUT_NAME,
        shape=list(compiled.input_size),
        batch=fixed_batch,
        normalization=Normalization(mean=list(normalization[0]), std=list(normalization[1])) if normalization else None,
        dataset=dataset,
    )
    class_names = list(CLASS_NAMES[dataset]) if dataset in CLASS_NAMES else None
    with staging(out_dir) as folder:
        made = []  # (file, what its tier's export measured, its accuracy)
        for name in names:
            module = compiled[name].load(source.global_state).eval()
            exported = _export_tier(name, module, compiled.input_size, folder / files[name], options, generator, recorded.get(name))
            fp32 = PrecisionFile("fp32", files[name], exported.sha256, exported.session, exported.activation_bytes_per_sample)
            slice_map = compiled[name].slice_map
            factors = fold_factors(module) if package is not None or "int8" in precisions else {}
            int8_weights = functools.partial(
                shared_int8_model, slice_map=slice_map, factors=factors, shared=shared.get("int8"), fp32_shared=shared["fp32"],
                fp32_model=onnx.load_model_from_string(exported.data),
            ) if "int8" in precisions else None
            shipped = precision_files(
                name, fp32, exported.data, precisions, images, folder, fixed_batch, threads, warn, keep_names=package is not None,
                int8_weights=int8_weights,
            )
            if package is not None:
                shipped = package.add(name, factors, slice_map, shipped, exported.inputs, images, warn)
            shipped = [f for f in shipped if f.precision in precisions]
            latencies = {"fp32": exported.latency.median_ms}
            if package is None and any(f.precision != "fp32" for f in shipped):  # the files shipped, in alternation
                latencies = time_files(shipped, torch.randn(batch, *compiled.input_size, generator=generator).numpy(), latency_runs)
            for file in shipped:
                measured = accuracy(file, images.labels if images else None)
                made.append((name, file, exported, latencies.get(file.precision), measured))
        if not made:
            raise ExportError("no file passed its check against FP32; nothing to ship")
        output_spec = OutputSpec(name=OUTPUT_NAME, num_classes=made[-1][2].num_classes)

        def entry(name: str, file: PrecisionFile, exported: _ExportedTier, latency: float, measured: float | None,
                  **nested) -> TierEntry:
            prof = profiles[name]
            size = file.model_bytes or (folder / file.file).stat().st_size  # nested: its entry gets the package's
            return TierEntry(
                name=name, precision=file.precision, file=file.file, sha256=file.sha256, bytes=size, **nested,
                params=prof.params, params_ratio=prof.params_ratio, macs=prof.macs, macs_ratio=prof.macs_ratio,
                gamma=prof.gamma, gamma_w=prof.gamma_w, blocks_per_stage=prof.blocks_per_stage,
                accuracy=measured if measured is not None or file.precision != "fp32" else source.accuracy.get(name),
                accuracy_on=images.test_source if measured is not None else None,
                batchnorm_folded=exported.batchnorm_folded,
                channel_align=exported.channel_align,
                channel_align_ms=exported.channel_align_ms,
                max_abs_diff=file.agreement.max_abs_diff if file.agreement else exported.max_abs_diff,
                vs_fp32=file.agreement,
                calibration=file.calibration,
                weights_mb=size / 2**20,
                activation_mb_per_sample=file.activation_bytes_per_sample / 2**20,
                latency=exported.latency.model_copy(update={"median_ms": latency}),
            )

        if package is None:
            entries = [entry(*item) for item in made]
        else:
            entries = _nested_entries(package, folder, made, entry, input_spec, output_spec, class_names, batch, latency_runs)
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            format=format,
            model=compiled.spec.model,
            model_args=compiled.spec.model_args,
            source=source.description,
            created_by=f"nefl-zoo {__version__}",
            opset=made[-1][2].opset,
            input=input_spec,
            output=output_spec,
            class_names=class_names,
            tiers=entries,
        )
        if package is not None:
            package.verify(folder, manifest)
        publish(folder, out_dir, manifest)
    return manifest


def _nested_entries(package: PackageWriter, folder: Path, made: list, entry: Callable[..., TierEntry], input_spec: InputSpec,
                    output_spec: OutputSpec, class_names: list[str] | None, batch: int, runs: int) -> list[TierEntry]:
    """Write the nested model of each precision (its tier table in its metadata) and the
    manifest entries pointing into it, every entry timed on that model, all in alternation."""
    drafts = {(name, file.precision): entry(name, file, exported, 0.0, measured) for name, file, exported, _, measured in made}

    def metadata(precision: str, names: list[str]) -> dict:
        return nested_table(precision, [drafts[n, precision] for n in names], input_spec, output_spec, class_names)

    nested = package.finish(folder, metadata)
    positions = {precision: [e.name for e in entries] for precision, entries in package.entries.items()}
    index = {(name, precision): positions[precision].index(name) for name, precision in drafts}
    feed = {INPUT_NAME: np.random.default_rng(0).standard_normal((batch, *input_spec.shape), dtype=np.float32)}
    calls = {key: functools.partial(TierSession(nested[key[1]].session, index[key]).run, None, feed) for key in drafts}
    latencies = interleaved_median_ms(calls, runs, warmup_rounds=2)
    return [
        draft.model_copy(update={
            "file": nested[key[1]].file.file, "sha256": nested[key[1]].file.sha256, "bytes": nested[key[1]].file.bytes,
            "index": index[key],
            "latency": draft.latency.model_copy(update={"median_ms": latencies[key]}),
        })
        for key, draft in drafts.items()
    ]


def _images(
    source: ExportSource, precisions: list[str], calibration: np.ndarray | None, calibration_source: str,
    calibration_images: int, warn: Callable[[str], None],
) -> ExportImages | None:
    """The images INT8/FP16 files are calibrated and checked on and accuracy is measured on;
    ``None`` when nothing needs them (FP32 only, from a spec)."""
    if source.data is None and precisions == ["fp32"]:
        return None
    images = export_images(
        source.data, source.compiled.input_size, calibration=calibration, calibration_source=calibration_source,
        train_images=calibration_images, warn=warn,
    )
    if "int8" in precisions and images.calibration is None:
        raise ValueError("int8: needs calibration images and the run's data cannot be loaded; give a folder of images (--calibration)")
    return images


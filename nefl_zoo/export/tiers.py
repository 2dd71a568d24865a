"""Export every tier of a source, verified and timed, then publish the files and the manifest.

For each tier: take the slim module from :meth:`CompiledTier.load` and make its FP32 file,
folded and padded where that keeps the output, checked against PyTorch and timed
(:mod:`.fp32`); then its INT8/FP16 versions, checked against it (:mod:`.precisions`). Files
are staged and moved into place only when every tier passed, the manifest last
(:mod:`.staging`). What to export and how is one :class:`ExportOptions` (:mod:`.options`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import onnx
import torch

from ..version import __version__
from ..data.datasets import CLASS_NAMES, normalization as dataset_normalization
from ..manifest import SCHEMA_VERSION, InputSpec, Machine, Manifest, Normalization, OutputSpec, TierEntry
from ..profile import TierProfile, check_batch_fits, profile_tiers
from ..runtime.latency import machine_description
from ..timing import interleaved_median_ms
from .fp32 import ExportedTier, export_fp32, recorded_alignments
from .onnx_file import INPUT_NAME, OUTPUT_NAME, tier_filename
from .data import ExportImages, export_images
from .precisions import PrecisionFile, accuracy, precision_filename, precision_files, time_files
from ..runtime.nested import TierSession
from .nested_model import nested_table
from .nested import SharedTensors, fold_factors, shared_int8_model
from .options import CALIBRATION_IMAGES, ExportOptions  # noqa: F401 (CALIBRATION_IMAGES: importable from here too)
from .package import PackageWriter
from .sources import ExportSource
from .staging import publish, staging
from .verify import ExportError

_log = logging.getLogger(__name__)
_OPTIONS = tuple(f.name for f in dataclasses.fields(ExportOptions))  # export_tiers' keyword arguments before ExportOptions


class _Shipped(NamedTuple):
    """One file an export ships: its tier, the file, its tier's FP32 export, latency, accuracy."""

    name: str
    file: PrecisionFile
    exported: ExportedTier
    latency: float | None
    accuracy: float | None


@dataclass(frozen=True)
class _Plan:
    """One export, worked out before any file is written: its options, its tiers and their FP32
    file names, and what every tier's files share."""

    source: ExportSource
    options: ExportOptions
    files: dict[str, str]  # tier -> its FP32 file, in the order exported
    images: ExportImages | None
    profiles: dict[str, TierProfile]
    machine: Machine
    recorded: dict[str, tuple[int, dict[str, float]]]  # the "auto" alignments reused
    generator: torch.Generator
    shared: dict[str, SharedTensors]  # by precision: one quantization for both formats
    package: PackageWriter | None  # the nested models, for format="nested"
    input_spec: InputSpec
    class_names: list[str] | None
    warn: Callable[[str], None]


def export_tiers(
    source: ExportSource,
    out_dir: str | Path,
    options: ExportOptions | None = None,
    *,
    warn: Callable[[str], None] | None = None,
    **settings,
) -> Manifest:
    """Export, verify and time the tiers of ``source`` into ``out_dir``, as ``options`` say.

    A run source's test split (when its data loads) gives every file's accuracy and the
    images the check uses. Files are written to a staging directory and moved into place
    only when every tier passed, the manifest last (via a temporary file), so a failed export
    never leaves a manifest that does not match its files. The quickstart of the documentation
    exports a tier with it (``export_tiers(source, out, ExportOptions(tiers=["g0.2"]))``) and
    runs the file.

    Args:
        source: what to export (:func:`load_source`).
        out_dir: the export folder, created if needed.
        options: what to export and how (default: ``ExportOptions()``, every tier's FP32
            file, one file per tier).
        warn: called with each warning (default: logged).
        **settings: deprecated: the fields of :class:`ExportOptions` as keyword arguments
            (``tiers=["small"]``), applied over ``options`` with a ``DeprecationWarning``;
            pass ``options=ExportOptions(tiers=["small"])`` instead.

    Returns:
        The manifest written to ``out_dir/manifest.json``.

    Raises:
        ExportError: onnxruntime and PyTorch differ by more than
            ``ATOL * max(1, max |logit|)``, or no quantized file passed its check.
        KeyError: an unknown tier.
        ValueError: an invalid setting (:class:`ExportOptions`), tiers whose files would
            clash, INT8 without calibration images, or an ``out_dir`` that is a file.
    """
    options = _with_settings(options, settings)
    out_dir = Path(out_dir)
    files = _tier_files(source, options)
    _check_destination(source, options, out_dir)
    plan = _plan(source, options, files, out_dir, warn or _log.warning)
    out_dir.mkdir(parents=True, exist_ok=True)
    with staging(out_dir) as folder:
        shipped = [item for name in files for item in _ship_tier(plan, name, folder)]
        if not shipped:
            raise ExportError("no file passed its check against FP32; nothing to ship")
        manifest = _manifest(plan, folder, shipped)
        if plan.package is not None:
            plan.package.verify(folder, manifest)
        publish(folder, out_dir, manifest)
    return manifest


def _with_settings(options: ExportOptions | None, settings: dict) -> ExportOptions:
    """``options`` with the keyword arguments ``export_tiers`` took before
    :class:`ExportOptions` applied over them (deprecated: a ``DeprecationWarning``)."""
    options = options if options is not None else ExportOptions()
    if not settings:
        return options
    unknown = [name for name in settings if name not in _OPTIONS]
    if unknown:
        raise TypeError(f"export_tiers() got an unexpected keyword argument {unknown[0]!r}")
    given = ", ".join(f"{name}=..." for name in settings)
    warnings.warn(
        f"export_tiers(..., {given}) is deprecated and will be removed in the next release: "
        f"pass options=ExportOptions({given})", DeprecationWarning, stacklevel=3,
    )
    return dataclasses.replace(options, **settings)


def _tier_files(source: ExportSource, options: ExportOptions) -> dict[str, str]:
    """The FP32 file of each tier to export (all, unless ``options.tiers``), in that order;
    ``KeyError`` for an unknown tier, ``ValueError`` for tiers whose files would clash."""
    compiled = source.compiled
    names = list(options.tiers or compiled.tiers)
    unknown = [n for n in names if n not in compiled.tiers]
    if unknown:
        raise KeyError(f"unknown tier {unknown[0]!r}; tiers: {', '.join(compiled.tiers)}")
    files = {name: tier_filename(name) for name in names}
    precisions = ("fp32", *options.precisions)
    every_file = [precision_filename(files[n], p) for n in names for p in precisions]
    if len(set(every_file)) != len(dict.fromkeys((n, p) for n in names for p in precisions)):
        raise ValueError(f"tiers {names} map to clashing file names {sorted(every_file)}")
    return files


def _check_destination(source: ExportSource, options: ExportOptions, out_dir: Path) -> None:
    """``ValueError`` for INT8 with no images to calibrate on, an ``out_dir`` that is a file,
    or an ``alignments_from`` that does not exist."""
    if "int8" in options.precisions and options.calibration is None and source.data is None:
        raise ValueError("int8: needs calibration images; export a run directory, or give a folder of images (--calibration)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: is a file; export writes a folder (tier files and manifest.json)")
    if options.alignments_from is not None and not Path(options.alignments_from).exists():
        raise ValueError(f"{options.alignments_from}: no such manifest or export folder (the alignments to reuse)")


def _plan(source: ExportSource, options: ExportOptions, files: dict[str, str], out_dir: Path,
          warn: Callable[[str], None]) -> _Plan:
    """Check that a batch fits in memory, load the images, profile the tiers, read the
    alignments to reuse and describe the input: what every tier's export needs."""
    compiled = source.compiled
    check_batch_fits(compiled.create_global_model(), compiled.input_size, options.batch)
    images = _images(source, options, warn)
    profiles = {p.name: p for p in profile_tiers(compiled)}
    machine = machine_description()
    alignments_from = options.alignments_from or out_dir
    recorded = recorded_alignments(alignments_from, compiled, profiles) if options.channel_align == "auto" else {}
    fixed_batch = None if options.batch_dynamic else options.batch
    shared = {p: SharedTensors(p, source.global_state) for p in dict.fromkeys(("fp32", *options.precisions))}
    package = PackageWriter(shared, list(options.precisions), options.threads, fixed_batch) if options.format == "nested" else None
    dataset = options.dataset or source.dataset
    normalization = dataset_normalization(dataset, compiled.input_size[0]) if dataset else None
    input_spec = InputSpec(
        name=INPUT_NAME,
        shape=list(compiled.input_size),
        batch=fixed_batch,
        normalization=Normalization(mean=list(normalization[0]), std=list(normalization[1])) if normalization else None,
        dataset=dataset,
    )
    class_names = list(CLASS_NAMES[dataset]) if dataset in CLASS_NAMES else None
    return _Plan(source, options, files, images, profiles, machine, recorded, torch.Generator().manual_seed(0), shared,
                 package, input_spec, class_names, warn)


def _ship_tier(plan: _Plan, name: str, folder: Path) -> list[_Shipped]:
    """Export tier ``name`` into ``folder``: its FP32 file (:func:`.fp32.export_fp32`), the versions
    at the other precisions that pass their check against it (and, nested, its place in the
    nested models), each file timed and its accuracy measured."""
    compiled, options, package = plan.source.compiled, plan.options, plan.package
    module = compiled[name].load(plan.source.global_state).eval()
    exported = export_fp32(name, module, compiled.input_size, folder / plan.files[name], options, plan.machine,
                            plan.generator, plan.recorded.get(name))
    fp32 = PrecisionFile("fp32", plan.files[name], exported.sha256, exported.session, exported.activation_bytes_per_sample)
    slice_map = compiled[name].slice_map
    int8 = "int8" in options.precisions
    factors = fold_factors(module) if package is not None or int8 else {}
    int8_weights = functools.partial(
        shared_int8_model, slice_map=slice_map, factors=factors, shared=plan.shared.get("int8"), fp32_shared=plan.shared["fp32"],
        fp32_model=onnx.load_model_from_string(exported.data),
    ) if int8 else None
    files = precision_files(
        name, fp32, exported.data, options.precisions, plan.images, folder, plan.input_spec.batch, options.threads, plan.warn,
        keep_names=package is not None, int8_weights=int8_weights,
    )
    if package is not None:
        files = package.add(name, factors, slice_map, files, exported.inputs, plan.images, plan.warn)
    files = [f for f in files if f.precision in options.precisions]
    latencies = {"fp32": exported.latency.median_ms}
    if package is None and any(f.precision != "fp32" for f in files):  # the files shipped, in alternation
        inputs = torch.randn(options.batch, *compiled.input_size, generator=plan.generator).numpy()
        latencies = time_files(files, inputs, options.latency_runs)
    labels = plan.images.labels if plan.images else None
    return [_Shipped(name, file, exported, latencies.get(file.precision), accuracy(file, labels)) for file in files]


def _manifest(plan: _Plan, folder: Path, shipped: list[_Shipped]) -> Manifest:
    """The manifest of the ``shipped`` files (format ``nested``: after writing the nested
    models, each entry pointing into one)."""
    output_spec = OutputSpec(name=OUTPUT_NAME, num_classes=shipped[-1].exported.num_classes)
    if plan.package is None:
        entries = [_entry(plan, folder, *item) for item in shipped]
    else:
        entries = _nested_entries(plan, folder, shipped, output_spec)
    compiled = plan.source.compiled
    return Manifest(
        schema_version=SCHEMA_VERSION,
        format=plan.options.format,
        model=compiled.spec.model,
        model_args=compiled.spec.model_args,
        source=plan.source.description,
        created_by=f"nefl-zoo {__version__}",
        opset=shipped[-1].exported.opset,
        input=plan.input_spec,
        output=output_spec,
        class_names=plan.class_names,
        tiers=entries,
    )


def _entry(plan: _Plan, folder: Path, name: str, file: PrecisionFile, exported: ExportedTier, latency: float,
           measured: float | None, **nested) -> TierEntry:
    """The manifest entry of one shipped file (``nested``: the fields of its nested model)."""
    prof = plan.profiles[name]
    size = file.model_bytes or (folder / file.file).stat().st_size  # nested: its entry gets the package's
    return TierEntry(
        name=name, precision=file.precision, file=file.file, sha256=file.sha256, bytes=size, **nested,
        params=prof.params, params_ratio=prof.params_ratio, macs=prof.macs, macs_ratio=prof.macs_ratio,
        gamma=prof.gamma, gamma_w=prof.gamma_w, blocks_per_stage=prof.blocks_per_stage,
        accuracy=measured if measured is not None or file.precision != "fp32" else plan.source.accuracy.get(name),
        accuracy_on=plan.images.test_source if measured is not None else None,
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


def _nested_entries(plan: _Plan, folder: Path, shipped: list[_Shipped], output_spec: OutputSpec) -> list[TierEntry]:
    """Write the nested model of each precision (its tier table in its metadata) and the
    manifest entries pointing into it, every entry timed on that model, all in alternation."""
    package, input_spec = plan.package, plan.input_spec
    drafts = {(item.name, item.file.precision): _entry(plan, folder, *item[:3], 0.0, item.accuracy) for item in shipped}

    def metadata(precision: str, names: list[str]) -> dict:
        return nested_table(precision, [drafts[n, precision] for n in names], input_spec, output_spec, plan.class_names)

    nested = package.finish(folder, metadata)
    positions = {precision: [e.name for e in entries] for precision, entries in package.entries.items()}
    index = {(name, precision): positions[precision].index(name) for name, precision in drafts}
    batch, runs = plan.options.batch, plan.options.latency_runs
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


def _images(source: ExportSource, options: ExportOptions, warn: Callable[[str], None]) -> ExportImages | None:
    """The images INT8/FP16 files are calibrated and checked on and accuracy is measured on;
    ``None`` when nothing needs them (FP32 only, from a spec)."""
    if source.data is None and options.precisions == ("fp32",):
        return None
    images = export_images(
        source.data, source.compiled.input_size, calibration=options.calibration, calibration_source=options.calibration_source,
        train_images=options.calibration_images, warn=warn,
    )
    if "int8" in options.precisions and images.calibration is None:
        raise ValueError("int8: needs calibration images and the run's data cannot be loaded; give a folder of images (--calibration)")
    return images

"""``export``, ``convert-ort``, ``select``, ``predict`` and ``bench-tiers``: ONNX tiers and their runtime."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from nefl_zoo.data.datasets import NORMALIZATION, normalization

from .console import console, json_option, print_json, stdout_to_stderr
from .errors import Choice, fail, guarded, require_budget, require_positive, user_errors

NO_FIT = 1  # exit code of `select` when no tier meets the budget


class Precision(str, Enum):
    """The precisions of a tier's files (nefl_zoo.manifest.PRECISIONS)."""

    fp32 = "fp32"
    int8 = "int8"
    fp16 = "fp16"


class ExportFormat(str, Enum):
    """What export writes (nefl_zoo.manifest.FORMATS)."""

    nested = "nested"
    files = "files"


class OrtStyle(str, Enum):
    """How convert-ort writes a nested model (nefl_zoo.export.mobile.STYLES)."""

    compact = "compact"
    folded = "folded"


class TargetPlatform(str, Enum):
    """The CPU an .ort file is optimized for (nefl_zoo.export.mobile.TARGET_PLATFORMS)."""

    arm = "arm"
    amd64 = "amd64"


class PadChannels(str, Enum):
    """--pad-channels: auto, or the multiple inner channel counts are padded to (1: none)."""

    auto = "auto"
    none = "1"
    x4 = "4"
    x8 = "8"
    x16 = "16"
    x32 = "32"
    x64 = "64"


Dataset = Enum("Dataset", {name: name for name in NORMALIZATION}, type=str)  # datasets with a known normalisation


class ChoiceList(Choice):
    """A comma-separated list of choices (``fp32,int8``), each checked as one choice."""

    name = "choice list"

    def convert(self, value, param, ctx) -> list[str]:
        if isinstance(value, (list, tuple)):
            return [v.value if isinstance(v, Enum) else v for v in value]
        return [super(ChoiceList, self).convert(part.strip(), param, ctx) for part in str(value).split(",")]

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(str(c) for c in self.choices) + "],..."


PRECISION_LIST = ChoiceList([p.value for p in Precision])


def export(
    source: str = typer.Argument(..., help="training run directory, spec file or shipped spec name"),
    out: Path = typer.Option(..., "--out", "-o", help="output directory, e.g. exports/NAME/"),
    tiers: Optional[str] = typer.Option(None, help="comma-separated tier names (default: all)"),
    precision: str = typer.Option(
        "fp32", "--precision", click_type=PRECISION_LIST,
        help="comma-separated precisions to ship per tier: fp32, int8 (static quantization, calibrated), "
        "fp16; INT8/FP16 files that fail the check against FP32 are dropped with a warning",
    ),
    calibration: Optional[Path] = typer.Option(
        None, help="folder of images INT8 is calibrated on (default: the run's training images)"
    ),
    calibration_images: int = typer.Option(256, help="run sources: training images INT8 is calibrated on"),
    opset: Optional[int] = typer.Option(None, help="ONNX opset (default: the exporter's)"),
    batch_dynamic: bool = typer.Option(
        True, "--batch-dynamic/--no-batch-dynamic", help="dynamic batch dimension, or fixed to --batch"
    ),
    batch: int = typer.Option(1, help="batch the latency is measured at (the fixed batch with --no-batch-dynamic)"),
    pretrained: Optional[str] = typer.Option(None, help="spec sources: weights file or torchvision:/timm: name"),
    dataset: Optional[Dataset] = typer.Option(None, help="normalisation and class names (default: the run's dataset)"),
    seed: int = typer.Option(0, help="spec sources without --pretrained: seed of the random weights"),
    latency_runs: int = typer.Option(20, help="timed runs per tier (median)"),
    threads: Optional[int] = typer.Option(None, help="onnxruntime threads for the latency (default: per core)"),
    export_format: ExportFormat = typer.Option(
        ExportFormat.nested, "--format",
        help="nested: one standard .onnx file per precision holding every tier, chosen by its int64 input 'tier' "
        "(every tier for about the bytes of the largest); files: one self-contained .onnx file per tier and precision",
    ),
    pad_channels: PadChannels = typer.Option(
        PadChannels.auto,
        help="ResNets: zero-pad inner channels to a multiple of N (same outputs, faster odd widths); "
        "auto: export each tier plain and padded to the CPU kernels' block, keep the faster, and record the choice "
        "in manifest.json: exporting into the same --out again reuses it (the same files)",
    ),
    pad_channels_from: Optional[Path] = typer.Option(
        None, help="with --pad-channels auto: reuse the choices recorded in this export (folder or manifest.json) "
        "instead of --out's",
    ),
    as_json: bool = json_option(),
) -> None:
    """Export every tier, verified, as one nested model per precision (default) or one .onnx file per tier and
    precision, plus manifest.json."""
    from nefl_zoo.export import ExportError, ExportOptions, export_tiers, load_source
    from nefl_zoo.spec import SpecError

    require_positive(batch=batch, latency_runs=latency_runs, threads=threads, calibration_images=calibration_images)
    if out.exists() and not out.is_dir():
        raise fail(f"--out: {out} is a file; export writes a folder (tier files and manifest.json)")
    if pad_channels_from is not None and not pad_channels_from.exists():
        raise fail(f"--pad-channels-from: {pad_channels_from} does not exist (an export folder or its manifest.json)")
    warnings: list[str] = []

    def warn(message: str) -> None:
        warnings.append(message)
        typer.echo(f"warning: {message}", err=True)

    with user_errors(SpecError), stdout_to_stderr(as_json):
        src = load_source(source, pretrained=pretrained, seed=seed)
        name = dataset.value if dataset else src.dataset
        options = ExportOptions(
            tiers=[t.strip() for t in tiers.split(",") if t.strip()] if tiers else None, opset=opset,
            batch_dynamic=batch_dynamic, batch=batch, dataset=name, latency_runs=latency_runs, threads=threads,
            channel_align="auto" if pad_channels is PadChannels.auto else int(pad_channels.value), precisions=precision,
            calibration=_calibration_images(calibration, src.compiled.input_size, name) if calibration else None,
            calibration_source=str(calibration), calibration_images=calibration_images, format=export_format.value,
            alignments_from=pad_channels_from,
        )
        try:
            manifest = export_tiers(src, out, options, warn=warn)
        except ExportError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
    if as_json:
        print_json({"manifest_path": str(out / "manifest.json"), "warnings": warnings, "manifest": manifest.model_dump(mode="json")})
        return
    _print_export(manifest, out, batch)


def _print_export(manifest, out: Path, batch: int) -> None:
    """What ``export`` wrote: a table of every file, each nested model's size, and where."""
    from rich.table import Table

    table = Table(
        "tier", "precision", "file", "MB", "params", "MACs ratio", "accuracy", "max |diff|",
        f"latency ms (batch {batch})", "BN folded", "padded to",
    )
    for t in manifest.tiers:
        tried = ", ".join(f"{a}: {ms:.3f} ms" for a, ms in (t.channel_align_ms or {}).items())
        table.add_row(
            t.name, t.precision, t.file, f"{t.weights_mb:.3f}", f"{t.params:,}", f"{t.macs_ratio:.3f}",
            "-" if t.accuracy is None else f"{t.accuracy:.4f}", f"{t.max_abs_diff:.1e}",
            f"{t.latency.median_ms:.3f}", "yes" if t.batchnorm_folded else "no",
            ("-" if t.channel_align == 1 else str(t.channel_align)) + (f" (auto; {tried})" if tried else ""),
        )
    console().print(table)
    if manifest.format == "nested":
        for file in dict.fromkeys(t.file for t in manifest.tiers):
            entries = [t for t in manifest.tiers if t.file == file]
            size, full = (out / file).stat().st_size, max(entries, key=lambda t: t.params)
            typer.echo(f"nested {entries[0].precision}: {file}, {size:,} bytes for {len(entries)} tiers "
                       f"({size / (full.weights_mb * 2**20):.3f}x the full tier's own file); choose one with its int64 input 'tier'")
    typer.echo(f"wrote {out / 'manifest.json'}")


def convert_ort(
    export_dir: Path = typer.Argument(..., metavar="EXPORT", help="a nested export's folder or its manifest.json"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="folder for the .ort files (default: the export's)"),
    style: OrtStyle = typer.Option(
        OrtStyle.compact, help="compact: the shared weights once, each tier's cut out of them at every request (about the "
        ".onnx file's bytes and memory, slower requests); folded: every tier's weights folded in (as fast as each tier's "
        "own .ort file, about the bytes of every tier together)",
    ),
    target_platform: TargetPlatform = typer.Option(
        TargetPlatform.arm, help="arm: runs on any CPU (onnxruntime's converter's default); amd64: x86 only, with its "
        "NCHWc layout",
    ),
    threads: Optional[int] = typer.Option(None, help="onnxruntime threads for the check (default: per core)"),
    as_json: bool = json_option(),
) -> None:
    """Write each nested model of an export in onnxruntime's ORT format (its mobile and minimal builds), every tier
    checked against the .onnx file, and required_operators.config for a reduced build."""
    from nefl_zoo.export import ExportError
    from nefl_zoo.export.mobile import CONFIG_NAME, convert_to_ort
    from nefl_zoo.manifest import ManifestError

    require_positive(threads=threads)
    if out is not None and out.exists() and not out.is_dir():
        raise fail(f"--out: {out} is a file; convert-ort writes a folder (.ort files and {CONFIG_NAME})")
    with user_errors(ManifestError), stdout_to_stderr(as_json):
        try:
            made = convert_to_ort(export_dir, out, style.value, target_platform.value, threads)
        except ExportError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
    folder = out or (export_dir if export_dir.is_dir() else export_dir.parent)
    if as_json:
        print_json({"folder": str(folder), "style": style.value, "target_platform": target_platform.value,
                    "files": [vars(f) for f in made], "config": CONFIG_NAME})
        return
    for f in made:
        typer.echo(f"{f.file}: {f.bytes:,} bytes ({f.bytes / f.source_bytes:.3f}x {f.source}), every tier's logits "
                   f"within {f.max_abs_diff:.2g} of {f.source}'s")
    typer.echo(f"wrote {len(made)} .ort files ({style.value}, {target_platform.value}) and {CONFIG_NAME} to {folder}")


def _calibration_images(folder: Path, shape, dataset: str | None):
    """The images of ``--calibration FOLDER``, normalised as the manifest will say."""
    from nefl_zoo.images import image_files, load_images

    norm = normalization(dataset, shape[0]) if dataset else None
    try:
        return load_images(image_files(folder), shape, *(norm or (None, None)))
    except ValueError as exc:
        raise fail(f"--calibration: {exc}") from None


def select(
    manifest: Path = typer.Argument(..., help="manifest.json or the export directory"),
    latency_ms: Optional[float] = typer.Option(
        None, "--latency-ms", "--max-ms", help="latency budget (ms, as measured at export, or on the device with --latency-table)"
    ),
    latency_table: Optional[Path] = typer.Option(
        None, "--latency-table", help="the device's latencies (`python -m nefl_zoo.runtime bench --out FILE`), read at --batch"
    ),
    max_mb: Optional[float] = typer.Option(None, "--max-mb", help="file size budget (MB of the .onnx file)"),
    max_macs: Optional[float] = typer.Option(None, help="MACs budget"),
    max_params: Optional[float] = typer.Option(None, help="parameter budget"),
    max_memory_mb: Optional[float] = typer.Option(None, help="memory budget (MB: weights + activations)"),
    batch: int = typer.Option(1, help="batch for the memory estimate (and the --latency-table latency)"),
    precision: Optional[str] = typer.Option(
        None, "--precision", click_type=PRECISION_LIST, help="comma-separated precisions to choose from (default: all)"
    ),
    as_json: bool = json_option(),
) -> None:
    """Pick the most accurate (else largest) tier and precision within the budget, and say why."""
    from nefl_zoo.manifest import ManifestError
    from nefl_zoo.runtime import NoTierFits, TierRuntime
    from nefl_zoo.runtime.latency import load_latency_table

    require_budget(latency_ms=latency_ms, max_mb=max_mb, max_macs=max_macs, max_params=max_params, max_memory_mb=max_memory_mb)
    require_positive(batch=batch)
    with user_errors(ManifestError):
        runtime = TierRuntime(manifest)
        latencies, source = None, "on export"
        if latency_table is not None:
            table = load_latency_table(latency_table)
            latencies, source = table.for_batch(batch), table.measured_on
            table.check_matches(runtime.manifest, batch, [t.label for t in runtime.entries(precision or None)])
        try:
            choice = runtime.select(
                latency_ms, max_macs, max_params, max_memory_mb, batch=batch, max_file_mb=max_mb,
                precisions=precision or None, latencies=latencies, latency_source=source,
            )
        except NoTierFits as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(NO_FIT) from None
        runtime.session(choice.label)  # what is recommended must load: hash-checked, self-contained
    if as_json:
        print_json({
            "tier": choice.tier, "precision": choice.precision, "label": choice.label,
            "file": runtime.manifest.tier(choice.label).file, "reason": choice.reason, "fitting": list(choice.fitting),
        })
    else:
        typer.echo(choice.reason)


def predict(
    manifest: Path = typer.Argument(..., help="manifest.json or the export directory"),
    images: list[Path] = typer.Argument(..., help="image files of the model's input size and mode"),
    tier: str = typer.Option("auto", help="tier name (or NAME:PRECISION), or auto (most accurate, else largest)"),
    precision: Optional[Precision] = typer.Option(
        None, help="the precision of the file to run (default: FP32, or the tier's only file; with auto, chosen among)"
    ),
    top_k: int = typer.Option(5, help="classes printed per image"),
    low_memory: bool = typer.Option(
        False, "--low-memory", help="nested models: one copy of the shared weights per session, each tier's cut out of "
        "them at every run (less memory, slower runs)",
    ),
    as_json: bool = json_option(),
) -> None:
    """Classify images with one tier and print the top-k classes."""
    import numpy as np

    from nefl_zoo.images import load_images
    from nefl_zoo.manifest import ManifestError
    from nefl_zoo.runtime import NoTierFits, TierRuntime, run_in_chunks

    require_positive(top_k=top_k)
    with user_errors(ManifestError, NoTierFits):
        runtime = TierRuntime(manifest, low_memory=low_memory)
        if tier == "auto" and precision is not None:
            runtime.select(precisions=[precision.value])
        label = runtime.resolve(tier, precision.value if precision is not None and tier != "auto" else None)
        entry = runtime.manifest.tier(label)
        spec = runtime.manifest.input
        norm = spec.normalization
        batch = load_images(images, spec.shape, norm.mean if norm else None, norm.std if norm else None)
        logits = run_in_chunks(lambda b: runtime.run(b, label), batch, spec.batch)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    classes = runtime.manifest.class_names
    results = [
        {"image": str(path), "top": [
            {"class": int(i), "label": classes[i] if classes else None, "probability": float(p[i])}
            for i in np.argsort(-p)[:top_k]
        ]}
        for path, p in zip(images, probs)
    ]
    if as_json:
        print_json({"tier": entry.name, "precision": entry.precision, "label": label, "predictions": results})
        return
    for result in results:
        typer.echo(f"{result['image']} (tier {label}):")
        for top in result["top"]:
            name = top["label"] if top["label"] is not None else f"class {top['class']}"
            typer.echo(f"  {top['probability']:.4f}  {name} ({top['class']})")


def bench_tiers(
    manifest: Path = typer.Argument(..., help="manifest.json or the export directory"),
    batch: int = typer.Option(1, help="batch size"),
    runs: int = typer.Option(10, help="timed runs per tier (median; every file timed in turn, interleaved)"),
    threads: Optional[int] = typer.Option(None, help="onnxruntime intra-op threads (default: per core)"),
    precision: Optional[str] = typer.Option(
        None, "--precision", click_type=PRECISION_LIST, help="comma-separated precisions to measure (default: all)"
    ),
    low_memory: bool = typer.Option(
        False, "--low-memory", help="nested models: one copy of the shared weights per session, each tier's cut out of "
        "them at every run (less memory, slower runs)",
    ),
    as_json: bool = json_option(),
) -> None:
    """Measure every tier's onnxruntime latency on this machine, at every precision."""
    from nefl_zoo.manifest import ManifestError
    from nefl_zoo.runtime import TierRuntime

    require_positive(batch=batch, runs=runs, threads=threads)
    with user_errors(ManifestError):
        runtime = TierRuntime(manifest, threads=threads, low_memory=low_memory)
        entries = runtime.entries(precision or None)
        labels = [t.label for t in entries]
        runtime.check_memory(batch, labels)  # every file, before measuring any
        latencies = runtime.benchmark_many(labels, batch, runs)
    largest = max(entries, key=lambda t: (t.macs, t.precision == "fp32", t.weights_mb))
    fp32 = {t.name: latencies[t.label] for t in entries if t.precision == "fp32"}
    rows = [
        {
            "tier": t.name, "precision": t.precision, "label": t.label, "gamma": t.gamma, "macs": t.macs,
            "macs_ratio": t.macs_ratio, "file_mb": t.weights_mb, "memory_mb": t.memory_mb(batch),
            "accuracy": t.accuracy, "latency_ms": latencies[t.label],
            "latency_ratio": latencies[t.label] / latencies[largest.label],
            "vs_fp32": latencies[t.label] / fp32[t.name] if t.name in fp32 else None,
            "export_ms": t.latency.median_ms,
        }
        for t in entries
    ]
    if as_json:
        print_json({
            "model": runtime.manifest.model, "batch": batch, "runs": runs, "threads": threads, "low_memory": low_memory,
            "reference": largest.label, "tiers": rows,
        })
        return
    from rich.table import Table

    table = Table(
        "tier", "precision", "gamma", "MACs", "MACs ratio", "file MB", "memory MB", "latency ms", "latency ratio",
        "vs FP32", "at export",
        title=f"{runtime.manifest.model}, batch {batch}: median of {runs} runs, "
        f"{threads or 'default'} onnxruntime threads" + (", low-memory sessions" if low_memory else ""),
        caption=f"ratios against {largest.label}; vs FP32: against the tier's FP32 file; memory: weights + "
        f"activations x batch; at export: ms at batch {largest.latency.batch} on {largest.latency.machine.processor}",
    )
    for r in rows:
        table.add_row(
            r["tier"], r["precision"], "" if r["gamma"] is None else f"{r['gamma']:g}", f"{r['macs'] / 1e6:,.2f}M",
            f"{r['macs_ratio']:.3f}", f"{r['file_mb']:.3f}", f"{r['memory_mb']:.2f}", f"{r['latency_ms']:.3f}",
            f"{r['latency_ratio']:.3f}", "" if r["vs_fp32"] is None else f"{r['vs_fp32']:.3f}", f"{r['export_ms']:.3f}",
        )
    console().print(table)


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""
    for command in (export, select, predict):
        app.command()(guarded(command))
    app.command("convert-ort")(guarded(convert_ort))
    app.command("bench-tiers")(guarded(bench_tiers))

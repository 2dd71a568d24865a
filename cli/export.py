"""``export``, ``select``, ``predict`` and ``bench-tiers``: ONNX tiers and their runtime."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .console import console
from .errors import fail, guarded, require_budget, require_positive, user_errors

NO_FIT = 1  # exit code of `select` when no tier meets the budget


def export(
    source: str = typer.Argument(..., help="training run directory, spec file or shipped spec name"),
    out: Path = typer.Option(..., "--out", help="output directory, e.g. exports/NAME/"),
    tiers: Optional[str] = typer.Option(None, help="comma-separated tier names (default: all)"),
    opset: Optional[int] = typer.Option(None, help="ONNX opset (default: the exporter's)"),
    batch_dynamic: bool = typer.Option(
        True, "--batch-dynamic/--no-batch-dynamic", help="dynamic batch dimension, or fixed to --batch"
    ),
    batch: int = typer.Option(1, help="batch the latency is measured at (the fixed batch with --no-batch-dynamic)"),
    pretrained: Optional[str] = typer.Option(None, help="spec sources: weights file or torchvision:/timm: name"),
    dataset: Optional[str] = typer.Option(None, help="normalisation and class names (default: the run's dataset)"),
    seed: int = typer.Option(0, help="spec sources without --pretrained: seed of the random weights"),
    latency_runs: int = typer.Option(20, help="timed runs per tier (median)"),
    threads: Optional[int] = typer.Option(None, help="onnxruntime threads for the latency (default: per core)"),
    pad_channels: str = typer.Option(
        "auto",
        help="ResNets: zero-pad inner channels to a multiple of N (same outputs, faster odd widths); "
        "auto: export each tier plain and padded to the CPU kernels' block, keep the faster",
    ),
) -> None:
    """Export every tier to one verified .onnx file each, plus manifest.json."""
    from nefl_zoo.export import DATASETS, ExportError, export_tiers, load_source
    from nefl_zoo.spec import SpecError

    require_positive(batch=batch, latency_runs=latency_runs, threads=threads)
    align = _pad_channels(pad_channels)
    if out.exists() and not out.is_dir():
        raise fail(f"--out: {out} is a file; export writes a folder (tier files and manifest.json)")
    if dataset is not None and dataset not in DATASETS:
        raise fail(f"--dataset: unknown {dataset!r}; one of {', '.join(DATASETS)}")
    names = [t.strip() for t in tiers.split(",") if t.strip()] if tiers else None
    with user_errors(SpecError):
        src = load_source(source, pretrained=pretrained, seed=seed)
        try:
            manifest = export_tiers(
                src, out, tiers=names, opset=opset, batch_dynamic=batch_dynamic, batch=batch,
                dataset=dataset, latency_runs=latency_runs, threads=threads, channel_align=align,
            )
        except ExportError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
    from rich.table import Table

    table = Table(
        "tier", "file", "params", "MACs ratio", "max |diff|", f"latency ms (batch {batch})", "BN folded", "padded to"
    )
    for t in manifest.tiers:
        tried = ", ".join(f"{a}: {ms:.3f} ms" for a, ms in (t.channel_align_ms or {}).items())
        table.add_row(
            t.name, t.file, f"{t.params:,}", f"{t.macs_ratio:.3f}", f"{t.max_abs_diff:.1e}",
            f"{t.latency.median_ms:.3f}", "yes" if t.batchnorm_folded else "no",
            ("-" if t.channel_align == 1 else str(t.channel_align)) + (f" (auto; {tried})" if tried else ""),
        )
    console().print(table)
    typer.echo(f"wrote {out / 'manifest.json'}")


def _pad_channels(value: str):
    """``--pad-channels``: ``auto`` or a whole number >= 1 (exit 2 otherwise)."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise fail(f"--pad-channels: expected auto or a whole number >= 1, got {value!r}")
    return int(value)


def select(
    manifest: Path = typer.Argument(..., help="manifest.json or the export directory"),
    latency_ms: Optional[float] = typer.Option(None, help="latency budget (ms, as measured at export)"),
    max_macs: Optional[float] = typer.Option(None, help="MACs budget"),
    max_params: Optional[float] = typer.Option(None, help="parameter budget"),
    max_memory_mb: Optional[float] = typer.Option(None, help="memory budget (MB: weights + activations)"),
    batch: int = typer.Option(1, help="batch for the memory estimate"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Pick the most accurate (else largest) tier within the budget, and say why."""
    from nefl_zoo.manifest import ManifestError
    from nefl_zoo.runtime import NoTierFits, TierRuntime

    require_budget(latency_ms=latency_ms, max_macs=max_macs, max_params=max_params, max_memory_mb=max_memory_mb)
    require_positive(batch=batch)
    with user_errors(ManifestError):
        runtime = TierRuntime(manifest)
        try:
            choice = runtime.select(latency_ms, max_macs, max_params, max_memory_mb, batch=batch)
        except NoTierFits as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(NO_FIT) from None
    if as_json:
        typer.echo(json.dumps({"tier": choice.tier, "reason": choice.reason, "fitting": list(choice.fitting)}))
    else:
        typer.echo(choice.reason)


def _load_image(path: Path, shape: list[int]):
    """An image as a float32 (C, H, W) array in [0, 1]; ``ValueError`` on a wrong size or mode.

    The size and mode come from the file's header and are checked before any pixel is
    decoded, so a decompression bomb (a small file declaring a huge image) is refused unread.
    """
    import warnings

    import numpy as np
    from PIL import Image, UnidentifiedImageError

    channels, height, width = shape
    mode = {1: "L", 3: "RGB"}.get(channels)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(path) as image:  # reads the header only
                size, found = image.size, image.mode
                if size != (width, height) or found != mode:
                    raise ValueError(
                        f"{path}: image is {size[0]}x{size[1]} {found}; the model takes "
                        f"{width}x{height} {mode or f'{channels}-channel'} (resize/convert it first)"
                    )
                image.load()
                array = np.asarray(image, dtype=np.float32) / 255.0
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ValueError(
                f"{path}: image declares more pixels than PIL decodes safely; the model takes {width}x{height}"
            ) from None
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            raise ValueError(f"{path}: not a readable image ({exc.__class__.__name__})") from None
    return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)


def predict(
    manifest: Path = typer.Argument(..., help="manifest.json or the export directory"),
    images: list[Path] = typer.Argument(..., help="image files of the model's input size and mode"),
    tier: str = typer.Option("auto", help="tier name, or auto (most accurate, else largest)"),
    top_k: int = typer.Option(5, help="classes printed per image"),
) -> None:
    """Classify images with one tier and print the top-k classes."""
    import numpy as np

    from nefl_zoo.manifest import ManifestError
    from nefl_zoo.runtime import TierRuntime

    require_positive(top_k=top_k)
    with user_errors(ManifestError):
        runtime = TierRuntime(manifest)
        name = runtime.resolve(tier)
        spec = runtime.manifest.input
        batch = np.stack([_load_image(p, spec.shape) for p in images])
        if spec.normalization is not None:
            mean = np.asarray(spec.normalization.mean, dtype=np.float32)[:, None, None]
            std = np.asarray(spec.normalization.std, dtype=np.float32)[:, None, None]
            batch = (batch - mean) / std
        logits = _run_in_chunks(runtime, batch, name)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    classes = runtime.manifest.class_names
    for path, p in zip(images, probs):
        typer.echo(f"{path} (tier {name}):")
        for index in np.argsort(-p)[:top_k]:
            label = classes[index] if classes else f"class {index}"
            typer.echo(f"  {p[index]:.4f}  {label} ({index})")


def _run_in_chunks(runtime, batch, tier: str):
    """Logits of ``batch``; a fixed-batch export runs chunks of its batch, zero-padded."""
    import numpy as np

    fixed = runtime.manifest.input.batch
    if fixed is None:
        return runtime.run(batch, tier)
    out = []
    for start in range(0, len(batch), fixed):
        chunk = batch[start : start + fixed]
        padded = np.concatenate([chunk, np.zeros((fixed - len(chunk), *chunk.shape[1:]), chunk.dtype)])
        out.append(runtime.run(padded, tier)[: len(chunk)])
    return np.concatenate(out)


def bench_tiers(
    manifest: Path = typer.Argument(..., help="manifest.json or the export directory"),
    batch: int = typer.Option(1, help="batch size"),
    runs: int = typer.Option(10, help="timed runs per tier (median)"),
    threads: Optional[int] = typer.Option(None, help="onnxruntime intra-op threads (default: per core)"),
) -> None:
    """Measure every tier's onnxruntime latency on this machine, as a table."""
    from rich.table import Table

    from nefl_zoo.manifest import ManifestError
    from nefl_zoo.runtime import TierRuntime

    require_positive(batch=batch, runs=runs, threads=threads)
    with user_errors(ManifestError):
        runtime = TierRuntime(manifest, threads=threads)
        runtime.check_memory(batch)  # every tier, before measuring any
        latencies = {t.name: runtime.benchmark(t.name, batch, runs) for t in runtime.manifest.tiers}
    largest = max(runtime.manifest.tiers, key=lambda t: t.macs)
    table = Table(
        "tier", "gamma", "MACs", "MACs ratio", "memory MB", "latency ms", "latency ratio", "at export",
        title=f"{runtime.manifest.model}, batch {batch}: median of {runs} runs, "
        f"{threads or 'default'} onnxruntime threads",
        caption=f"ratios against {largest.name}; memory: weights + activations x batch; at export: "
        f"ms at batch {largest.latency.batch} on {largest.latency.machine.processor}",
    )
    for t in runtime.manifest.tiers:
        table.add_row(
            t.name, "" if t.gamma is None else f"{t.gamma:g}", f"{t.macs / 1e6:,.2f}M", f"{t.macs_ratio:.3f}",
            f"{t.memory_mb(batch):.2f}", f"{latencies[t.name]:.3f}",
            f"{latencies[t.name] / latencies[largest.name]:.3f}", f"{t.latency.median_ms:.3f}",
        )
    console().print(table)


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""
    for command in (export, select, predict):
        app.command()(guarded(command))
    app.command("bench-tiers")(guarded(bench_tiers))

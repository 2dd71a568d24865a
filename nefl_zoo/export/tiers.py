"""Export every tier of a source, verified and timed, then publish the files and the manifest.

For each tier: take the slim module from :meth:`CompiledTier.load`, fold and pad it where that
keeps the output (:mod:`.surgery`), write it (:mod:`.onnx_file`), check the file and its parity
with onnxruntime (:mod:`.verify`) and time it. Files are staged and moved into place only when
every tier passed, the manifest last. Each staging folder is locked (``flock``) by the export
writing it; the next export into the same folder removes staging folders whose export died.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Sequence

import onnx
import torch
from torch import nn

from .. import __version__
from ..datasets import CLASS_NAMES, NORMALIZATION
from ..files import atomic_write
from ..manifest import MANIFEST_NAME, InputSpec, Latency, Machine, Manifest, Normalization, OutputSpec, TierEntry
from ..profile import check_batch_fits, profile_tiers
from ..timing import interleaved_median_ms
from .onnx_file import (
    INPUT_NAME,
    MIN_OPSET,
    OUTPUT_NAME,
    activation_bytes_per_sample,
    cpu_channel_block,
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
    channel_align: int | Literal["auto"]
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
    channel_align: int
    channel_align_ms: dict[str, float] | None


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


def _export_tier(
    name: str, module: nn.Module, input_size: tuple[int, ...], path: Path, options: _TierOptions, generator: torch.Generator
) -> _ExportedTier:
    """Fold, pad, export, check against ``module`` with onnxruntime and time one tier; with
    ``channel_align="auto"`` both alignments are exported and timed, interleaved, and the
    faster file is kept at ``path``."""
    x = torch.randn(options.batch + 1 if options.batch_dynamic else options.batch, *input_size, generator=generator)
    with torch.no_grad():
        reference = module(x)
        folded = fold_batchnorm(module)
        batchnorm_folded = folded is not module and same_output(folded, x, reference)
    optimized = folded if batchnorm_folded else module
    example_batch = max(2, options.batch) if options.batch_dynamic else options.batch
    variants = {}
    for align, variant in _alignments(optimized, options.channel_align).items():
        file = path if align == 1 or options.channel_align != "auto" else path.with_name(f"{path.stem}.align{align}.onnx")
        write_onnx(variant, file, input_size, example_batch, options.batch_dynamic, options.opset)
        data = file.read_bytes()  # read once: these bytes are checked, hashed and verified
        model = onnx.load_model_from_string(data)
        opset = check_single_file(name, model, options.opset)
        sha256, session = hashed_session(data, str(file), options.threads)
        diff = check_parity(name, session, x, reference)
        variants[align] = (file, model, opset, sha256, session, diff)
    feed = {INPUT_NAME: torch.randn(options.batch, *input_size, generator=generator).numpy()}
    runs = interleaved_median_ms({a: functools.partial(v[4].run, None, feed) for a, v in variants.items()},
                                 options.latency_runs, warmup_rounds=2)
    align = min(runs, key=runs.get)
    file, model, opset, sha256, _, diff = variants[align]
    for other, (other_file, *_) in variants.items():
        if other != align and other_file != path:
            other_file.unlink()
    os.replace(file, path)  # the kept file under the tier's name
    latency = Latency(
        median_ms=runs[align], batch=options.batch, runs=options.latency_runs, threads=options.threads,
        machine=options.machine,
    )
    return _ExportedTier(
        sha256, opset, int(reference.shape[1]), batchnorm_folded, diff, activation_bytes_per_sample(model), latency,
        align, {str(a): ms for a, ms in runs.items()} if options.channel_align == "auto" else None,
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
            files; the manifest's params and MACs stay the tier's own. ``"auto"``: each tier
            is exported plain and padded to :func:`cpu_channel_block`, both are timed
            (interleaved) and the faster is kept; the manifest records both latencies.

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
    if batch < 1 or not (channel_align == "auto" or (isinstance(channel_align, int) and channel_align >= 1)):
        raise ValueError(f"batch must be >= 1 and channel_align >= 1 or 'auto', got {batch} and {channel_align!r}")
    if opset is not None and opset < MIN_OPSET:
        raise ValueError(f"opset: the torch.export-based exporter writes opset {MIN_OPSET} or later, got {opset}")

    check_batch_fits(compiled.create_global_model(), compiled.input_size, batch)
    profiles = {p.name: p for p in profile_tiers(compiled)}
    options = _TierOptions(opset, batch_dynamic, batch, latency_runs, threads, channel_align, machine_description())
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: is a file; export writes a folder (tier files and manifest.json)")
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    with _staging(out_dir) as staging:
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
                    channel_align=exported.channel_align,
                    channel_align_ms=exported.channel_align_ms,
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
    return manifest


STAGING_PREFIX = ".export-"
_LOCK_NAME = ".lock"
_YOUNG_S = 60.0  # a staging folder without a lock file yet may be an export that is starting


@contextlib.contextmanager
def _staging(out_dir: Path) -> Iterator[Path]:
    """A new staging folder in ``out_dir``, locked with an exclusive ``flock`` on its ``.lock``
    while the export runs (the kernel releases it when the process dies, which is how
    :func:`remove_stale_staging` recognises a dead export's folder) and removed afterwards.
    Stale folders of earlier, killed exports are removed first."""
    remove_stale_staging(out_dir)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir))
    try:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock (and no clean-up of other folders)
            yield staging
            return
        with open(staging / _LOCK_NAME, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_stale_staging(out_dir: Path) -> list[Path]:
    """Remove the staging folders in ``out_dir`` left by exports that died (no process holds
    their lock any more); folders of running exports are left alone. Returns those removed."""
    try:
        import fcntl
    except ImportError:
        return []
    removed = []
    for folder in out_dir.glob(f"{STAGING_PREFIX}*"):
        if folder.is_symlink() or not folder.is_dir():
            continue
        lock_path = folder / _LOCK_NAME
        try:
            if not lock_path.exists():
                if time.time() - folder.stat().st_mtime < _YOUNG_S:
                    continue  # perhaps an export between creating its folder and locking it
            else:
                with open(lock_path, "a") as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        continue  # a running export holds it
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _publish(staging: Path, out_dir: Path, manifest: Manifest) -> None:
    """Move verified tier files into ``out_dir`` and write the manifest atomically.

    The old manifest is removed first, so an interruption leaves no manifest rather than one
    whose hashes do not match the files next to it.
    """
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for entry in manifest.tiers:
        os.replace(staging / entry.file, out_dir / entry.file)
    atomic_write(out_dir / MANIFEST_NAME, lambda p: p.write_text(manifest.model_dump_json(indent=2) + "\n"))

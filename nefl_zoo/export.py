"""Export every tier of a nested model to ONNX, verified, with a ``manifest.json``.

For every tier the slim module (with that tier's step sizes and norms) is taken from
:meth:`CompiledTier.load` and put in eval mode. Its BatchNorms are folded into the preceding
convolutions where that leaves the output unchanged, and its inner channels are optionally
zero-padded to an aligned width (:func:`pad_channels`). ``torch.onnx.export`` (the
torch.export path) then writes it as one self-contained ``.onnx`` file. onnxruntime's output
is checked against the PyTorch module on a random batch and the latency is measured; the
manifest (:mod:`nefl_zoo.manifest`) records what every tier costs.

Sources (:func:`load_source`): a spec YAML (random or ``--pretrained`` weights) or a training
run directory holding::

    spec.yaml            the submodel spec
    global.safetensors   the global state (shared tensors under model keys, per-tier step
                         sizes and norms under KEY@TIER; see nefl_zoo.slim)
    metrics.jsonl        optional; the last line with an "acc" object {tier: accuracy}
                         gives each tier's test accuracy
    config.yaml          optional; data.dataset names the dataset (its normalisation and
                         class names go into the manifest)
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import onnx
import onnxruntime as ort
import torch
import yaml
from torch import nn

from . import __version__
from .fl.data import NORMALIZATION
from .files import atomic_write
from .manifest import (
    MANIFEST_NAME,
    InputSpec,
    Latency,
    Machine,
    Manifest,
    Normalization,
    OutputSpec,
    TierEntry,
    file_sha256,
)
from .profile import profile_tiers
from .runtime import CPU_PROVIDER, create_session
from .timing import median_ms
from .slim import CompiledSpec, compile_spec
from .spec import SubmodelSpec, load_spec, resolve_spec_path

ATOL = 1e-4
MIN_OPSET = 18  # the torch.export-based exporter writes nothing older
INPUT_NAME, OUTPUT_NAME = "input", "logits"

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "cifar10": CIFAR10_CLASSES,
    "cinic10": CIFAR10_CLASSES,
    "svhn": tuple(str(d) for d in range(10)),
}
DATASETS = tuple(NORMALIZATION)  # datasets whose input normalisation is known (training's)


class ExportError(RuntimeError):
    """A tier whose export could not be verified."""


@dataclass
class ExportSource:
    """What to export: the compiled spec, the global state and what the source measured."""

    compiled: CompiledSpec
    global_state: dict[str, torch.Tensor]
    description: str
    accuracy: dict[str, float] = field(default_factory=dict)
    dataset: str | None = None


def load_source(source: str | Path, pretrained: str | None = None, seed: int = 0) -> ExportSource:
    """A run directory (see the module docstring), or a spec file or shipped spec name
    (``resnet56/nefl-d``) with random (seeded) or ``pretrained`` weights. Problems are
    ``ValueError``/``SpecError``/``FileNotFoundError`` naming the file."""
    path = Path(source)
    if path.is_dir():
        if pretrained:
            raise ValueError(f"{path}: --pretrained applies to a spec file, not a run directory")
        return load_run_dir(path)
    path = resolve_spec_path(source)
    compiled = compile_spec(load_spec(path))
    torch.manual_seed(seed)
    state = compiled.init_global_state(compiled.create_global_model(pretrained))
    weights = f"pretrained {pretrained}" if pretrained else f"random weights (seed {seed})"
    return ExportSource(compiled, state, f"{path} ({weights})")


def load_run_dir(path: Path) -> ExportSource:
    """Spec, global state, per-tier accuracy and dataset of a training run directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    spec_path, state_path = path / "spec.yaml", path / "global.safetensors"
    for required in (spec_path, state_path):
        if not required.is_file():
            raise FileNotFoundError(f"{required}: missing (a run directory holds spec.yaml and global.safetensors)")
    compiled = compile_spec(load_spec(spec_path))
    try:
        state = load_file(str(state_path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{state_path}: not a readable safetensors file ({exc})") from None
    check_global_state(compiled, state, str(state_path))
    return ExportSource(
        compiled,
        state,
        str(path),
        accuracy=read_accuracy(path / "metrics.jsonl", compiled.spec),
        dataset=read_dataset(path / "config.yaml"),
    )


def check_global_state(compiled: CompiledSpec, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise ``ValueError`` unless ``state`` has exactly the keys and shapes of the spec."""
    expected = compiled.global_shapes()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{source}: {missing[0]}: missing ({len(missing)} keys missing; wrong spec.yaml?)")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{source}: {unexpected[0]}: not in the spec ({len(unexpected)} unexpected keys)")
    for key, shape in expected.items():
        if tuple(state[key].shape) != tuple(shape):
            raise ValueError(f"{source}: {key}: shape {tuple(state[key].shape)}, the spec needs {tuple(shape)}")


def read_accuracy(path: Path, spec: SubmodelSpec) -> dict[str, float]:
    """Per-tier accuracy from the last ``metrics.jsonl`` line with an ``acc`` object ({} if none)."""
    if not path.is_file():
        return {}
    last: dict = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {number}: not valid JSON ({exc.msg})") from None
        if isinstance(record, dict) and isinstance(record.get("acc"), dict):
            last = record["acc"]
    names = {t.name for t in spec.tiers}
    out = {}
    for tier, value in last.items():
        if tier in names:
            if not isinstance(value, (int, float)):
                raise ValueError(f"{path}: acc.{tier}: expected a number, got {value!r}")
            out[tier] = float(value)
    return out


def read_dataset(path: Path) -> str | None:
    """``data.dataset`` of a run's ``config.yaml`` (``None`` when absent)."""
    if not path.is_file():
        return None
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    dataset = config.get("data", {}).get("dataset") if isinstance(config, dict) else None
    return dataset if isinstance(dataset, str) else None


def fold_batchnorm(module: nn.Module) -> nn.Module:
    """A copy of an eval-mode ``module`` with every BatchNorm that alone consumes a
    convolution's output folded into that convolution (``module`` itself if it has none)."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return module
    from torch.fx.experimental.optimization import fuse

    return fuse(module.eval())


def pad_channels(module: nn.Module, align: int) -> nn.Module:
    """A copy of ``module`` with every inner channel count rounded up to a multiple of
    ``align`` by zero weights, so the output is unchanged while CPU kernels see aligned widths.

    For networks of ``Conv2d``, ``BatchNorm2d`` and ``Linear`` layers and scalar parameters
    such as step sizes (the zoo's ResNets):
    convolutions reading the network input keep their input channels, ``Linear`` layers
    their outputs. ``ValueError`` for any other layer with parameters (e.g. LayerNorm, whose
    statistics padding would change) or grouped convolutions.
    """
    for name, m in module.named_modules():
        if isinstance(m, (nn.BatchNorm2d, nn.Linear)) or (isinstance(m, nn.Conv2d) and m.groups == 1):
            continue
        for tensor_name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.ndim > 0:
                raise ValueError(
                    f"cannot pad channels of {'.'.join(filter(None, (name, tensor_name)))} "
                    f"({type(m).__name__}): only Conv2d/BatchNorm2d/Linear layers and scalars are supported"
                )
    traced = copy.deepcopy(module if isinstance(module, torch.fx.GraphModule) else torch.fx.symbolic_trace(module))
    reads_input = {
        node.target
        for node in traced.graph.nodes
        if node.op == "call_module" and any(arg.op == "placeholder" for arg in node.all_input_nodes)
    }
    for name, m in list(traced.named_modules()):
        if isinstance(m, nn.Conv2d):
            cin = m.in_channels if name in reads_input else _round_up(m.in_channels, align)
            new = nn.Conv2d(cin, _round_up(m.out_channels, align), m.kernel_size, m.stride, m.padding,
                            m.dilation, bias=m.bias is not None, padding_mode=m.padding_mode)
        elif isinstance(m, nn.Linear):
            new = nn.Linear(_round_up(m.in_features, align), m.out_features, bias=m.bias is not None)
        elif isinstance(m, nn.BatchNorm2d):
            new = nn.BatchNorm2d(_round_up(m.num_features, align), eps=m.eps).eval()
        else:
            continue
        _copy_into_zeros(new, m)
        traced.set_submodule(name, new)
    return traced


def _round_up(n: int, align: int) -> int:
    return math.ceil(n / align) * align


@torch.no_grad()
def _copy_into_zeros(padded: nn.Module, original: nn.Module) -> None:
    """Zero the parameters of ``padded`` (BN: identity statistics) and copy ``original``'s
    tensors into their leading corner."""
    for (name, new), old in zip(padded.state_dict().items(), original.state_dict().values()):
        if name != "num_batches_tracked":
            new.fill_(1.0 if name == "running_var" else 0.0)
        new[tuple(slice(0, n) for n in old.shape)] = old


def machine_description() -> Machine:
    """The CPU, OS and onnxruntime version latencies are measured with."""
    return Machine(
        processor=platform.processor() or platform.machine(),
        platform=platform.platform(),
        cpu_count=os.cpu_count() or 1,
        onnxruntime=ort.__version__,
        provider=CPU_PROVIDER,
    )


def activation_bytes_per_sample(model: onnx.ModelProto) -> int:
    """Largest single-node working set (its activation inputs plus outputs, weights excluded)
    for one sample, from ONNX shape inference (symbolic dimensions counted as 1)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    weights = {t.name for t in graph.initializer}
    sizes: dict[str, int] = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type
        if not tensor.HasField("shape"):
            continue
        numel = 1
        for dim in tensor.shape.dim:
            numel *= dim.dim_value if dim.HasField("dim_value") else 1
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
        sizes[info.name] = numel * itemsize
    return max(
        sum(sizes.get(name, 0) for name in [*node.input, *node.output] if name not in weights)
        for node in graph.node
    )


def tier_filename(name: str) -> str:
    """A file name for a tier: its name with anything but ``[A-Za-z0-9._-]`` replaced."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".onnx"


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _export_one(
    module: nn.Module, path: Path, input_size: tuple[int, ...], example_batch: int, batch_dynamic: bool, opset: int | None
) -> None:
    """``torch.onnx.export`` through torch.export, weights inside the one file."""
    example = torch.randn(example_batch, *input_size)
    dynamic_shapes = ({0: torch.export.Dim("batch")},) if batch_dynamic else None
    torch.onnx.export(
        module,
        (example,),
        str(path),
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        opset_version=opset,
        dynamo=True,
        external_data=False,
        dynamic_shapes=dynamic_shapes,
        verbose=False,
    )


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
        tolerance = ATOL * max(1.0, float(reference.abs().max()))
        folded = fold_batchnorm(module)
        batchnorm_folded = folded is not module and _max_abs_diff(folded(x), reference) <= tolerance
    optimized = folded if batchnorm_folded else module
    if options.channel_align > 1:
        optimized = pad_channels(optimized, options.channel_align)
    example_batch = max(2, options.batch) if options.batch_dynamic else options.batch
    _export_one(optimized, path, input_size, example_batch, options.batch_dynamic, options.opset)

    model = onnx.load(str(path))
    if any(onnx.external_data_helper.uses_external_data(t) for t in model.graph.initializer):
        raise ExportError(f"tier {name}: the exporter wrote external data; expected one file")
    (opset,) = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if options.opset is not None and opset != options.opset:
        raise ExportError(f"tier {name}: asked for opset {options.opset}, the exporter wrote {opset}")
    sha256 = file_sha256(path)
    session = create_session(path, sha256, threads=options.threads)
    diff = _max_abs_diff(torch.from_numpy(session.run(None, {INPUT_NAME: x.numpy()})[0]), reference)
    if not diff <= tolerance:
        raise ExportError(
            f"tier {name}: onnxruntime vs PyTorch max abs diff {diff:.3g} > {tolerance:.3g} "
            f"(1e-4 x max(1, max |logit| = {float(reference.abs().max()):.3g}))"
        )
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


__all__ = [
    "ATOL",
    "DATASETS",
    "ExportError",
    "ExportSource",
    "activation_bytes_per_sample",
    "export_tiers",
    "fold_batchnorm",
    "pad_channels",
    "load_run_dir",
    "load_source",
    "machine_description",
]

"""What to export: a spec (random or pretrained weights) or a training run directory.

A run directory holds::

    spec.yaml            the submodel spec
    global.safetensors   the global state (shared tensors under model keys, per-tier step
                         sizes and norms under KEY@TIER; see nefl_zoo.slim)
    metrics.jsonl        optional; the last line with an "acc" object {tier: accuracy}
                         gives each tier's test accuracy
    config.yaml          optional; data.dataset names the dataset (its normalisation and
                         class names go into the manifest)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from ..datasets import NORMALIZATION
from ..slim import CompiledSpec, compile_spec
from ..spec import SpecError, SubmodelSpec, load_spec, resolve_spec_path
from ..userfiles import read_yaml

DATASETS = tuple(NORMALIZATION)  # datasets whose input normalisation is known (training's)


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
    """``data.dataset`` of a run's ``config.yaml`` (``None`` when absent); a file that is not
    valid YAML is a :class:`~nefl_zoo.spec.SpecError` (a ``ValueError``) naming it."""
    if not path.is_file():
        return None
    config = read_yaml(path, SpecError)
    data = config.get("data") if isinstance(config, dict) else None
    dataset = data.get("dataset") if isinstance(data, dict) else None
    return dataset if isinstance(dataset, str) else None

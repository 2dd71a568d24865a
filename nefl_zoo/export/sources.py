"""What to export: a spec (random or pretrained weights) or a training run directory.

A run directory holds::

    spec.yaml            the submodel spec
    global.safetensors   the global state (shared tensors under model keys, per-tier step
                         sizes and norms under KEY@TIER; see nefl_zoo.slim)
    metrics.jsonl        optional; the last line with an "acc" object {tier: accuracy}
                         gives each tier's test accuracy
    config.yaml          optional; data.dataset names the dataset (its normalisation and
                         class names go into the manifest); its data section is how the
                         run's training and test images are loaded (INT8 calibration and
                         accuracy measured on the test split; see nefl_zoo.export.data)

A run written by ``nefl-zoo train`` also holds ``checkpoint.json``, its commit point: then the
global state, the accuracy and the dataset come from the committed checkpoint it names (every
hash verified; see nefl_zoo.runs.store), and spec.yaml must be the one trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from ..data.datasets import NORMALIZATION
from ..slim import CompiledSpec, compile_spec
from ..spec import SpecError, SubmodelSpec, load_spec, parse_spec, resolve_spec_path
from ..userfiles import read_yaml

DATASETS = tuple(NORMALIZATION)  # datasets whose input normalisation is known (training's)


@dataclass
class ExportSource:
    """What to export: the compiled spec, the global state and what the source measured.

    :func:`load_source` makes one from a spec or a run directory.

    Attributes:
        compiled: the compiled spec.
        global_state: the global state the tiers are cut from.
        description: what it is, for the manifest's ``source``.
        accuracy: each tier's test accuracy, when the source measured it.
        dataset: the dataset the source was trained on, when known.
        data: a run's ``data`` config section (how its images are loaded).
    """

    compiled: CompiledSpec
    global_state: dict[str, torch.Tensor]
    description: str
    accuracy: dict[str, float] = field(default_factory=dict)
    dataset: str | None = None
    data: dict | None = None  # a run's data config section (how its images are loaded)


def load_source(source: str | Path, pretrained: str | None = None, seed: int = 0) -> ExportSource:
    """A run directory (see the module docstring), or a spec file or shipped spec name
    (``resnet56/nefl-d``) with random (seeded) or ``pretrained`` weights.

    Args:
        source: a run directory, a spec file, or a shipped spec's name.
        pretrained: weights for a spec's global model, as
            :func:`~nefl_zoo.models.load_pretrained` takes them.
        seed: the seed of a spec's random weights.

    Returns:
        The source: the compiled spec and its global state.

    Raises:
        ValueError: ``pretrained`` with a run directory, or a run that cannot be read.
        SpecError: no such spec, or an invalid one.
        FileNotFoundError: a file of the run is missing.

    Examples:
        >>> from nefl_zoo.export import load_source
        >>> source = load_source("resnet20/nefl-w")
        >>> list(source.compiled.tiers)
        ['g0.2', 'g0.4', 'g0.6', 'g0.8', 'g1']
    """
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
    """Spec, global state, per-tier accuracy and dataset of a training run directory.

    A run written by ``nefl-zoo train`` is read through its commit point (``checkpoint.json``):
    the committed global state, metrics records and configuration, every file's sha256
    verified, and ``spec.yaml`` checked against the hash recorded with the checkpoint. A
    directory without ``checkpoint.json`` is read as the plain layout of the module docstring.
    The run's lock is held (shared) while reading: a directory that a ``train`` is writing is
    refused with a one-line error naming its PID.

    Args:
        path: the run directory.

    Returns:
        The source, with each tier's accuracy and the run's dataset.

    Raises:
        ValueError: a file that fails its hash, a state that does not fit the spec, or a
            run another process is writing.
    """
    from ..runs.store import CHECKPOINT_JSON, RunStore

    store = RunStore(path, [])
    store.open(shared=True)
    try:
        if (path / CHECKPOINT_JSON).exists():
            return _committed_run(path, store)
        return _plain_run_dir(path)
    finally:
        store.close()


def _committed_run(path: Path, store) -> ExportSource:
    from ..runs.store import CHECKPOINT_JSON
    from ..userfiles import parse_yaml

    checkpoint = store.read_checkpoint()
    spec_path = path / "spec.yaml"
    compiled = compile_spec(parse_spec(parse_yaml(store.read_spec_text(), str(spec_path), SpecError), str(spec_path)))
    check_global_state(compiled, checkpoint.state, str(path / "global.safetensors"))
    data = checkpoint.config.get("data")
    data = data if isinstance(data, dict) else None
    return ExportSource(
        compiled,
        checkpoint.state,
        str(path),
        accuracy=last_accuracy(checkpoint.records, compiled.spec, str(path / CHECKPOINT_JSON)),
        dataset=_dataset(data),
        data=data,
    )


def _plain_run_dir(path: Path) -> ExportSource:
    from safetensors import SafetensorError
    from safetensors.torch import load

    spec_path, state_path = path / "spec.yaml", path / "global.safetensors"
    for required in (spec_path, state_path):
        if not required.is_file():
            raise FileNotFoundError(f"{required}: missing (a run directory holds spec.yaml and global.safetensors)")
    compiled = compile_spec(load_spec(spec_path))
    try:
        state = load(state_path.read_bytes())
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{state_path}: not a readable safetensors file ({exc})") from None
    check_global_state(compiled, state, str(state_path))
    data = read_data_section(path / "config.yaml")
    return ExportSource(
        compiled,
        state,
        str(path),
        accuracy=read_accuracy(path / "metrics.jsonl", compiled.spec),
        dataset=_dataset(data),
        data=data,
    )


def check_global_state(compiled: CompiledSpec, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise ``ValueError`` unless ``state`` has exactly the keys and shapes of the spec.

    Args:
        compiled: the compiled spec.
        state: a global state.
        source: where it came from, named in the error.

    Raises:
        ValueError: a missing or unexpected key, or a shape the spec does not give it.
    """
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
    """Per-tier accuracy from the last ``metrics.jsonl`` line with an ``acc`` object ({} if none).
    A torn last line (no line break, not valid JSON: a write cut short) is ignored.

    Args:
        path: the ``metrics.jsonl`` file.
        spec: the run's spec (the tiers the accuracy must name).

    Returns:
        Each tier's accuracy, by name.

    Raises:
        ValueError: a line before the last that is not valid JSON.
    """
    if not path.is_file():
        return {}
    text = path.read_text()
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break  # torn by a crash mid-write
            raise ValueError(f"{path}: line {number}: not valid JSON ({exc.msg})") from None
    return last_accuracy(records, spec, str(path))


def last_accuracy(records: list, spec: SubmodelSpec, source: str) -> dict[str, float]:
    """Per-tier accuracy from the last record with an ``acc`` object ({} if none)."""
    last: dict = {}
    for record in records:
        if isinstance(record, dict) and isinstance(record.get("acc"), dict):
            last = record["acc"]
    names = {t.name for t in spec.tiers}
    out = {}
    for tier, value in last.items():
        if tier in names:
            if not isinstance(value, (int, float)):
                raise ValueError(f"{source}: acc.{tier}: expected a number, got {value!r}")
            out[tier] = float(value)
    return out


def read_data_section(path: Path) -> dict | None:
    """The ``data`` section of a run's ``config.yaml`` (``None`` when absent); a file that is
    not valid YAML is a :class:`~nefl_zoo.spec.SpecError` (a ``ValueError``) naming it."""
    if not path.is_file():
        return None
    config = read_yaml(path, SpecError)
    data = config.get("data") if isinstance(config, dict) else None
    return data if isinstance(data, dict) else None


def read_dataset(path: Path) -> str | None:
    """``data.dataset`` of a run's ``config.yaml`` (``None`` when absent).

    Args:
        path: the run directory's ``config.yaml``.

    Returns:
        The dataset's name, or ``None``.
    """
    return _dataset(read_data_section(path))


def _dataset(data: dict | None) -> str | None:
    dataset = data.get("dataset") if data else None
    return dataset if isinstance(dataset, str) else None

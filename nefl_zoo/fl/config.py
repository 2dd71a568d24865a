"""Training configuration: a strict pydantic model loaded from YAML, with ``--set`` overrides.

A config names the method, the submodel spec (a file path or an inline mapping), the data and
its partition, the client environment, local training and evaluation. Every problem is raised
as a one-line :class:`ConfigError` ``FILE: FIELD: message``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, PrivateAttr, field_validator, model_validator

from ..spec import SpecError, SubmodelSpec, format_validation_error, load_spec, parse_spec

class ConfigError(SpecError):
    """A training-config problem, printed as ``FILE: FIELD: message``."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Strict):
    """Dataset, preprocessing and partition over clients."""

    dataset: Literal["digits", "cifar10", "cifar100", "svhn", "cinic10", "imagefolder"] = "digits"
    root: str = Field("data", description="folder holding the dataset files (not used by digits)")
    download: bool = Field(False, description="let torchvision download the dataset (needs a network)")
    augment: bool = Field(True, description="NeFL-appendix augmentation (random crop, flip/jitter)")
    partition: Literal["iid", "dirichlet", "shards"] = "iid"
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (partition: dirichlet)")
    shards_per_client: int = Field(2, ge=1, description="label shards per client (partition: shards)")
    test_fraction: float = Field(0.25, gt=0, lt=1, description="digits only: held-out test share")
    max_test_samples: int | None = Field(None, ge=1, description="evaluate on the first N test samples")


class ClientsConfig(_Strict):
    """Client population and the environment that decides which submodels a client may train.

    ``environment: dynamic`` is the paper's: as many equal client groups as submodels, group i
    picking each round at random among submodels i-2..i+2 (with 5 submodels: tier 1 from
    {1,2,3}, ..., tier 5 from {3,4,5}). ``fixed``: group i always trains submodel i.
    ``groups`` (a list of lists of tier names) replaces both with explicit equal-size groups.
    """

    num_clients: int = Field(100, ge=1)
    fraction: float = Field(0.1, gt=0, le=1, description="share of clients sampled per round")
    environment: Literal["dynamic", "fixed"] = "dynamic"
    groups: list[list[str]] | None = Field(None, description="explicit allowed tiers per client group")

    @field_validator("groups")
    @classmethod
    def _non_empty(cls, v: list[list[str]] | None) -> list[list[str]] | None:
        if v is not None and (not v or any(not g for g in v)):
            raise ValueError("every group needs at least one tier name")
        return v


class TrainConfig(_Strict):
    """Local training of every client (the same for every method)."""

    local_epochs: int = Field(5, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    schedule: Literal["step", "cosine", "constant"] = Field(
        "step", description="step: x0.1 at T/2 and 3T/4 (the paper's); cosine: with warm-up"
    )
    warmup_rounds: int = Field(0, ge=0, description="linear warm-up rounds (schedule: cosine)")
    grad_clip: float | None = Field(None, gt=0, description="max gradient norm, none = off")
    weighting: Literal["clients", "samples"] = Field(
        "clients", description="NeFedAvg weights: per client (the paper) or per sample"
    )
    kd: bool = Field(False, description="fjord: self-distillation from the client's largest width")


class EvalConfig(_Strict):
    every: int = Field(5, ge=1, description="evaluate every N rounds (and after the last)")
    batch_size: int = Field(256, ge=1)
    bn_recompute_batches: int = Field(20, ge=1, description="heterofl: training batches for static BN")


class RunConfig(_Strict):
    """A whole training run. ``spec`` is a spec file (relative to the config) or a mapping."""

    name: str = "run"
    method: str = Field("nefl", description="a registered method, see nefl_zoo.fl.methods.METHODS")
    seed: int = 0
    rounds: int = Field(500, ge=1)
    spec: str | dict[str, Any]
    data: DataConfig = Field(default_factory=DataConfig)
    clients: ClientsConfig = Field(default_factory=ClientsConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint_every: int = Field(10, ge=1, description="save a resumable checkpoint every N rounds")
    _base_dir: Path = PrivateAttr(default_factory=Path)  # relative paths are resolved against it

    @field_validator("method")
    @classmethod
    def _known_method(cls, name: str) -> str:
        from .methods import METHODS  # the registry is the one list of method names

        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; one of {', '.join(METHODS)}")
        return name

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.clients.groups is not None and len(self.clients.groups) > self.clients.num_clients:
            raise ValueError("clients.groups: more groups than clients")
        return self

    def submodel_spec(self) -> SubmodelSpec:
        """The spec, loaded from its file or validated from the inline mapping."""
        if isinstance(self.spec, dict):
            return parse_spec(self.spec, "spec")
        path = Path(self.spec)
        return load_spec(path if path.is_absolute() else self._base_dir / path)

    def data_root(self) -> Path:
        root = Path(self.data.root)
        return root if root.is_absolute() else self._base_dir / root

    def to_dict(self) -> dict[str, Any]:
        """A JSON/YAML-safe dict with the spec inlined, so a run directory is self-contained."""
        out = self.model_dump(mode="json")
        out["spec"] = self.submodel_spec().model_dump(mode="json", exclude_none=True)
        out["data"]["root"] = str(self.data_root())
        return out


def parse_value(text: str) -> Any:
    """A ``--set`` value: YAML scalar/list syntax (``3``, ``0.5``, ``true``, ``[a, b]``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str) -> dict[str, Any]:
    """Apply ``a.b=v`` overrides to a config mapping (in place) and return it."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(source, "--set", f"expected KEY=VALUE, got {item!r}")
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(source, key, f"{part!r} is not a section")
            node = child
        node[parts[-1]] = parse_value(value)
    return data


def _format(source: str, exc: ValidationError) -> ConfigError:
    err = format_validation_error(source, exc)
    return ConfigError(source, err.field, err.message)


def parse_config(data: Any, source: str = "<config>", base_dir: str | Path = ".") -> RunConfig:
    """Validate a config mapping; raise :class:`ConfigError` on the first problem (the spec too)."""
    if not isinstance(data, dict):
        raise ConfigError(source, "", f"expected a mapping, got {type(data).__name__}")
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise _format(source, exc) from None
    config._base_dir = Path(base_dir)
    try:
        spec = config.submodel_spec()
    except SpecError as exc:
        if isinstance(config.spec, dict):
            raise ConfigError(source, f"spec.{exc.field}" if exc.field else "spec", exc.message) from None
        raise ConfigError(source, "spec", str(exc)) from None
    names = [t.name for t in spec.tiers]
    for g, group in enumerate(config.clients.groups or []):
        unknown = [t for t in group if t not in names]
        if unknown:
            raise ConfigError(source, f"clients.groups[{g}]", f"unknown tier {unknown[0]!r}; tiers: {', '.join(names)}")
    return config


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML training config, apply ``--set`` overrides and validate it."""
    path = Path(path)
    source = str(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(source, "", f"cannot read the file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(source, "", f"not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(source, "", f"expected a mapping, got {type(data).__name__}")
    apply_overrides(data, overrides or [], source)
    return parse_config(data, source, path.parent)

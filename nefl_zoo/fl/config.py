"""Training configuration: a strict pydantic model loaded from YAML, with ``--set`` overrides.

A config names the method and its own settings (``method_args``, validated by the method's
settings model from the registry), the submodel spec (a file path or an inline mapping), the
data and its partition (:mod:`nefl_zoo.data.config`), the client environment
(:class:`ClientsConfig`), local training and evaluation (:mod:`.strategy.sections`). Every problem is raised as a one-line :class:`ConfigError`
``FILE: FIELD: message``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from ..data.config import DataConfig
from ..spec import UNKNOWN_KEY, SpecError, SubmodelSpec, load_spec, parse_spec, shipped_specs_dir
from ..userfiles import Strict, field_error, format_validation_error, is_file, parse_yaml, read_yaml
from .aggregation.rules import AggregationConfig
from .aggregation.secagg import SecureAggregation
from .devices.population import DevicesConfig, read_trace
from .strategy.base import Run, Strategy
from .strategy.registry import get_method, parse_settings, registered_methods
from .strategy.sections import EvalConfig, TrainConfig

if TYPE_CHECKING:
    from .training.device import Placement

MAX_SEED = 2**32 - 1  # what every RNG seeded from it (Python, NumPy, torch) takes


class ClientsConfig(Strict):
    """Client population and the environment that decides which submodels a client may train.

    ``environment: dynamic`` is the paper's: as many equal client groups as submodels, group i
    picking each round at random among submodels i-2..i+2 (with 5 submodels: tier 1 from
    {1,2,3}, ..., tier 5 from {3,4,5}). ``fixed``: group i always trains submodel i.
    ``groups`` (a list of lists of tier names) replaces both with explicit equal-size groups.
    """

    num_clients: int = Field(100, ge=1, le=1_000_000)
    fraction: float = Field(0.1, gt=0, le=1, description="share of clients sampled per round")
    environment: Literal["dynamic", "fixed"] = "dynamic"
    groups: list[list[str]] | None = Field(None, description="explicit allowed tiers per client group")

    @field_validator("groups")
    @classmethod
    def _non_empty(cls, v: list[list[str]] | None) -> list[list[str]] | None:
        if v is not None and (not v or any(not g for g in v)):
            raise ValueError("every group needs at least one tier name")
        return v


class ConfigError(SpecError):
    """A training-config problem, printed as ``FILE: FIELD: message``."""


# keys that moved from the shared sections into a method's own ``method_args``
MOVED = {("train", "kd"): "method_args.kd (method: fjord)",
         ("eval", "bn_recompute_batches"): "eval.bn_batches",
         ("method_args", "bn_recompute_batches"): "eval.bn: recompute and eval.bn_batches (method: fedlps; null: eval.bn: running)"}


class RunConfig(Strict):
    """A whole training run. ``spec`` is a spec file (relative to the config), a shipped spec
    name (``resnet20/nefl-w``) or a mapping.

    Attributes:
        name: the run's name (the default run directory is ``runs/NAME-METHOD-sSEED``).
        rounds: the rounds to train.
        spec: a spec file (relative to the config), a shipped spec's name or an inline spec.
        data: the dataset and how it is split among the clients.
        clients: the clients, the share sampled each round and their environment.
        train: local training: epochs, batch, optimiser, schedule, device.
        eval: evaluation: how often, on what, with which BatchNorm statistics.

    Examples:
        >>> from nefl_zoo.fl import load_config
        >>> config = load_config("digits-quick", ["rounds=2"])
        >>> config.method, config.rounds, config.submodel_spec().model
        ('nefl', 2, 'resnet20')
    """

    name: str = "run"
    method: str = Field("nefl", description="a registered method (`nefl-zoo methods`)")
    method_args: dict[str, Any] = Field(default_factory=dict, description="the method's own settings")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="a 32-bit unsigned integer")
    rounds: int = Field(500, ge=1)
    spec: str | dict[str, Any]
    data: DataConfig = Field(default_factory=DataConfig)
    clients: ClientsConfig = Field(default_factory=ClientsConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig, description="the server's rule, norm bounding, differential privacy")
    secure_aggregation: SecureAggregation | None = Field(None, description="Flower's SecAgg+ on the updates (--engine flower, deployments)")
    devices: DevicesConfig | None = Field(None, description="device population and virtual clock (none: rounds without time)")
    checkpoint_every: int = Field(10, ge=1, description="save a resumable checkpoint every N rounds")
    _base_dir: Path = PrivateAttr(default_factory=Path)  # relative paths are resolved against it
    _spec: SubmodelSpec | None = PrivateAttr(None)  # parsed once
    _source: str = PrivateAttr("<config>")  # the file (or text) it came from, for errors

    @field_validator("method")
    @classmethod
    def _known_method(cls, name: str) -> str:
        known = registered_methods()
        if name not in known:
            raise ValueError(f"unknown method {name!r}; one of {', '.join(known)}")
        return name

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.clients.groups is not None and len(self.clients.groups) > self.clients.num_clients:
            raise ValueError("clients.groups: more groups than clients")
        classes = self.devices.classes if self.devices is not None else []
        if self.data.partition == "devices":
            if self.devices is None:
                raise field_error("data.partition", "devices needs a devices: section whose classes say what their clients hold "
                                  "(devices.classes[].data)")
            missing = next((i for i, c in enumerate(classes) if c.data is None), None)
            if missing is not None:
                raise field_error(f"devices.classes[{missing}].data", "required with data.partition: devices, "
                                  "e.g. {samples: 50} (the training set's label mix)")
        else:
            given = next((i for i, c in enumerate(classes) if c.data is not None), None)
            if given is not None:
                raise field_error(f"devices.classes[{given}].data", f"used only with data.partition: devices "
                                  f"(it is {self.data.partition}); set data.partition: devices or remove it")
        if self.eval.device_classes:
            if self.devices is None:
                raise field_error("eval.device_classes", "needs a devices: section (the device classes to score)")
            if self.data.local_split is None:
                raise field_error("eval.device_classes", "needs each client's held-out data: set data.local_split, e.g. [0.9, 0, 0.1]")
            if self.eval.per_client:
                raise field_error("eval.device_classes", "scores the server's models on the clients' data; "
                                  "remove eval.per_client or eval.device_classes")
        return self

    def submodel_spec(self) -> SubmodelSpec:
        """The spec, loaded from its file or validated from the inline mapping (once).

        Returns:
            The validated spec.
        """
        if self._spec is None:
            if isinstance(self.spec, dict):
                self._spec = parse_spec(self.spec, "spec")
            else:
                local = self._base_dir / self.spec
                self._spec = load_spec(local if is_file(local) else self.spec)
        return self._spec

    def with_method(self, method: str, seed: int | None = None) -> "RunConfig":
        """This config for another method (its default ``method_args`` unless it is this
        config's own method) and optionally another seed.

        Args:
            method: a registered method's name.
            seed: another seed (default: this config's).

        Returns:
            A copy of this config.
        """
        update = {"method": method, "seed": self.seed if seed is None else seed}
        if method != self.method:
            update["method_args"] = {}
        return self.model_copy(update=update)

    def build_strategy(self) -> Strategy:
        """The method's strategy object, set up from this config.

        Returns:
            The strategy.
        """
        run = Run(self.submodel_spec(), self.train, self.seed, self.rounds, self.clients.fraction, self.eval,
                  self.data.model_copy(update={"root": str(self.data_root())}), self.aggregation)
        return get_method(self.method)(run, parse_settings(self.method, self.method_args))

    def placement(self) -> "Placement":
        """Where clients train and models are evaluated (``train.device`` resolved on this machine,
        ``train.precision``).

        Returns:
            The placement.

        Raises:
            ConfigError: the device is absent, in one line.
        """
        from .training.device import DeviceError, Placement

        try:
            return Placement.of(self.train)
        except DeviceError as exc:
            raise ConfigError(self._source, "train.device", str(exc)) from None

    def data_root(self) -> Path:
        """``data.root``, relative to the config's folder unless absolute.

        Returns:
            The folder the datasets are read from.
        """
        root = Path(self.data.root)
        return root if root.is_absolute() else self._base_dir / root

    def to_dict(self) -> dict[str, Any]:
        """A JSON/YAML-safe dict with the spec inlined, so a run directory is self-contained.

        Returns:
            The config, with every default filled in.
        """
        out = self.model_dump(mode="json")
        out["method_args"] = parse_settings(self.method, self.method_args).model_dump(mode="json")
        out["spec"] = self.submodel_spec().model_dump(mode="json", exclude_none=True)
        out["data"]["root"] = str(self.data_root())
        return out


def parse_value(text: str) -> Any:
    """A ``--set`` value: YAML scalar/list syntax (``3``, ``0.5``, ``true``, ``[a, b]``)."""
    try:
        return parse_yaml(text, "--set", ConfigError)
    except ConfigError:
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
    return format_validation_error(source, exc, ConfigError, unknown_key=UNKNOWN_KEY)


def parse_config(data: Any, source: str = "<config>", base_dir: str | Path = ".") -> RunConfig:
    """Validate a config mapping; raise :class:`ConfigError` on the first problem (the spec too).

    Args:
        data: the config, as a mapping (what a YAML config file holds).
        source: where it came from, named in errors.
        base_dir: the folder relative paths (the spec, ``data.root``) are resolved against.

    Returns:
        The validated config.

    Raises:
        ConfigError: the first problem, as ``SOURCE: FIELD: what to fix``.

    Examples:
        >>> from nefl_zoo.fl import ConfigError, parse_config
        >>> try:
        ...     parse_config({"spec": "specs/resnet20/nefl-w.yaml", "rounds": 0})
        ... except ConfigError as error:
        ...     print(error)
        <config>: rounds: Input should be greater than or equal to 1
    """
    if not isinstance(data, dict):
        raise ConfigError(source, "", f"expected a mapping, got {type(data).__name__}")
    for (section, key), target in MOVED.items():
        if isinstance(data.get(section), dict) and key in data[section]:
            raise ConfigError(source, f"{section}.{key}", f"moved to {target}")
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise _format(source, exc) from None
    try:
        parse_settings(config.method, config.method_args)
    except ValidationError as exc:
        err = _format(source, exc)
        raise ConfigError(source, f"method_args.{err.field}" if err.field else "method_args", f"{config.method}: {err.message}") from None
    config._base_dir = Path(base_dir)
    config._source = source
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
    if config.devices is not None and config.devices.trace is not None:  # resolved, so a run directory resumes anywhere
        trace = Path(config.devices.trace) if Path(config.devices.trace).is_absolute() else config._base_dir / config.devices.trace
        try:
            read_trace(trace, config.clients.num_clients)
        except ValueError as exc:
            raise ConfigError(source, "devices.trace", str(exc)) from None
        config.devices = config.devices.model_copy(update={"trace": str(trace.resolve())})
    return config


def shipped_configs_dir() -> Path:
    """The folder of the training configs shipped with nefl-zoo.

    Returns:
        ``train/`` of :func:`nefl_zoo.spec.shipped_specs_dir`.
    """
    return shipped_specs_dir() / "train"


def shipped_configs() -> list[str]:
    """The names of the shipped training configs, which :func:`load_config` takes.

    Returns:
        The names (``digits-quick``, ...), sorted.
    """
    return sorted(p.stem for p in shipped_configs_dir().glob("*.yaml"))


def resolve_config_path(name_or_path: str | Path) -> Path:
    """The file of a training config given by path or by a shipped config's name.

    Args:
        name_or_path: a config file, or a shipped config's name (no folder, no suffix:
            ``digits-quick``).

    Returns:
        The file: ``name_or_path`` itself unless it is a shipped config's name.

    Raises:
        ConfigError: a name that is no shipped config (the line lists them).
    """
    path = Path(name_or_path)
    if is_file(path) or path.suffix or len(path.parts) != 1:
        return path  # a file (read_yaml says what is wrong with it)
    shipped = shipped_configs_dir() / f"{path.name}.yaml"
    if is_file(shipped):
        return shipped
    names = ", ".join(shipped_configs())
    raise ConfigError(str(name_or_path), "", f"no such config file or shipped config (shipped: {names})")


def load_config(name_or_path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML training config, apply ``--set`` overrides and validate it.

    Relative paths in the config (``spec``, ``data.root``, ``devices.trace``) are resolved
    against the config's folder; in a shipped config, ``data.root`` and ``devices.trace`` are
    resolved against the working directory instead, so that data is never looked for or
    written inside the installed package.

    Args:
        name_or_path: the config file, or a shipped config's name (``digits-quick``;
            ``nefl-zoo configs`` lists them).
        overrides: ``KEY=VALUE`` strings, as ``--set`` takes them (the value is YAML).

    Returns:
        The validated config.

    Raises:
        ConfigError: an unreadable file, an unknown name, a bad override or an invalid config,
            in one line.
    """
    path = resolve_config_path(name_or_path)
    source = str(path)
    data = read_yaml(path, ConfigError)
    if not isinstance(data, dict):
        raise ConfigError(source, "", f"expected a mapping, got {type(data).__name__}")
    apply_overrides(data, overrides or [], source)
    shipped = path.resolve().parent == shipped_configs_dir().resolve()
    return parse_config(data, source, Path.cwd() if shipped else path.parent)

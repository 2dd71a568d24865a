"""Declarative submodel specs: pydantic models, YAML loading and errors that name the field.

A spec names a zoo model and its tiers. Each tier has a width parameter ratio ``gamma_w``
(with ``channel_multiple`` m, set for the spec or per tier, channels become ``ceil(C *
sqrt(gamma_w))`` for m = 1, else ``C * sqrt(gamma_w)`` rounded to the nearest multiple of m, not
below 90% of it, at most C; unset, m is the model's own rule: 1 for the ResNets and ViTs, 8 for
the edge families) and per-block step sizes ``steps`` (one list per stage, one entry per block,
0 = block removed). ``inconsistent`` lists the parameter kinds kept per tier (``steps``,
``norm``); the rest are shared by all tiers.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import userfiles
from .userfiles import FileError, field_error

Inconsistent = Literal["steps", "norm"]
UNKNOWN_KEY = "unknown key (check the spelling; `nefl-zoo schema` lists the keys)"
MAX_PARAMS = 4_000_000_000  # 16 GB of float32 weights: ten times the zoo's largest model at any size
PER_TIER_ARGS = ("gamma_w", "steps", "channel_multiple")  # set per tier or spec, never in model_args


class SpecError(FileError):
    """A spec problem, printed on one line as ``FILE: FIELD: what was expected``."""


class TierSpec(BaseModel):
    """One submodel: its width ratio and its per-block step sizes.

    Examples:
        >>> from nefl_zoo import TierSpec
        >>> TierSpec(name="g0.5", gamma_w=0.5, steps=[[1, 1, 0], [1, 1, 0], [1, 1, 0]]).gamma_w
        0.5
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, description="unique tier name, e.g. g0.2")
    gamma_w: float = Field(1.0, description="width parameter ratio in (0, 1]")
    channel_multiple: int | None = Field(
        None, ge=1, le=1024, description="overrides the spec's channel_multiple for this tier"
    )
    steps: list[list[float]] | None = Field(
        None, description="one list per stage, one initial step size per block; 0 = skip"
    )
    learnable_steps: bool = Field(True, description="train the step sizes (false: N/L ablation)")
    gamma: float | None = Field(None, description="nominal parameter ratio (informational)")

    @field_validator("gamma_w", "gamma")
    @classmethod
    def _in_unit_interval(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v


class SubmodelSpec(BaseModel):
    """A zoo model and the tiers (submodels) nested in it: a spec file, validated.

    Validation checks the spec against the model: the model exists, its arguments are valid,
    each tier's ``steps`` has one list per stage and one entry per block, and tier names are
    unique. Build one with :func:`parse_spec` or :func:`load_spec`.

    Attributes:
        tiers: the submodels, at least one; their names are unique.

    Examples:
        >>> import nefl_zoo as nz
        >>> spec = nz.parse_spec({"model": "resnet20", "tiers": [
        ...     {"name": "g0.5", "gamma_w": 0.5}, {"name": "g1"}]})
        >>> [tier.name for tier in spec.tiers], spec.full_tier.name
        (['g0.5', 'g1'], 'g1')
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(description="registered zoo model, see `nefl-zoo models`")
    model_args: dict[str, Any] = Field(default_factory=dict, description="create_model kwargs")
    channel_multiple: int | None = Field(
        None, ge=1, le=1024,
        description="round every scaled width to a multiple of this (1: the paper's ceil(C*sqrt(gamma_w)); "
        "8: hardware-aligned; see nefl_zoo.models.base.scale_width); default: the model's own rule "
        "(1 for the ResNets and ViTs, 8 for the MobileNets, EfficientNet and ShuffleNets)",
    )
    tiers: list[TierSpec] = Field(min_length=1)
    inconsistent: list[Inconsistent] = Field(
        default_factory=lambda: ["steps", "norm"],
        description="parameter kinds kept per tier; the others are shared (NeFedAvg)",
    )

    @model_validator(mode="after")
    def _check_against_model(self) -> "SubmodelSpec":
        from .models import ModelArgsError, NestError, check_model_args, is_model, list_models, model_info

        if not is_model(self.model):
            raise field_error("model", f"unknown model {self.model!r}; one of {', '.join(list_models())}")
        for key in PER_TIER_ARGS:
            if key in self.model_args:
                raise field_error(f"model_args.{key}", f"set per tier (tiers[].{key}), not in model_args")
        try:  # the model's declared constraints, before anything is built
            check_model_args(self.model, self.model_args)
        except ModelArgsError as exc:
            raise field_error(f"model_args.{exc.field}" if exc.field else "model_args", exc.message) from None
        try:
            depths, params = model_shape(self.model, tuple(sorted(self.model_args.items())))
        except Exception as exc:  # whatever the model's constructor makes of these arguments
            message = str(exc) if isinstance(exc, (TypeError, ValueError)) else f"{type(exc).__name__}: {exc}"
            field = "model" if isinstance(exc, NestError) else "model_args"  # a network that cannot be nested
            raise field_error(field, message or type(exc).__name__) from None
        if params > MAX_PARAMS:
            raise field_error(
                "model_args", f"{self.model} with these arguments has {params:,} parameters; at most {MAX_PARAMS:,}"
            )
        nested_automatically = model_info(self.model).module.startswith("nefl_zoo.nesting")  # torchvision:/timm:/nest()
        seen: set[str] = set()
        for t, tier in enumerate(self.tiers):
            where = f"tiers[{t}]"
            if tier.name in seen:
                raise field_error(f"{where}.name", f"duplicate tier name {tier.name!r}")
            seen.add(tier.name)
            if nested_automatically and tier.gamma_w < 1:  # such networks nest or say why, per tier
                _check_nests(self.model, self.model_args | self.tier_args(tier) | {"steps": None}, f"{where}.gamma_w")
            if tier.steps is None:
                continue
            if len(tier.steps) != len(depths):
                raise field_error(
                    f"{where}.steps", f"{self.model} has {len(depths)} stages, got {len(tier.steps)}"
                )
            for s, (stage, depth) in enumerate(zip(tier.steps, depths)):
                if len(stage) != depth:
                    raise field_error(
                        f"{where}.steps[{s}]",
                        f"{self.model} stage {s + 1} has {depth} blocks, got {len(stage)}",
                    )
                for b, value in enumerate(stage):
                    if value < 0:
                        raise field_error(f"{where}.steps[{s}][{b}]", f"step must be >= 0, got {value}")
                    if value != 1 and value != 0 and "steps" not in self.inconsistent:
                        raise field_error(
                            f"{where}.steps[{s}][{b}]",
                            "shared step sizes start at 1 (use 0/1 or add 'steps' to inconsistent)",
                        )
            if not any(v for stage in tier.steps for v in stage):
                raise field_error(f"{where}.steps", "every block is skipped; keep at least one")
            try:  # the tier's arguments against the model's constraints (e.g. blocks that cannot be skipped)
                check_model_args(self.model, self.model_args | self.tier_args(tier))
            except ModelArgsError as exc:
                raise field_error(f"{where}.{exc.field}" if exc.field else where, exc.message) from None
        return self

    def tier(self, name: str) -> TierSpec:
        """The tier called ``name``.

        Args:
            name: a tier name of this spec.

        Returns:
            The tier.

        Raises:
            KeyError: no tier has that name (the message lists the tiers).
        """
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier {name!r}; tiers: {', '.join(t.name for t in self.tiers)}")

    def tier_args(self, tier: TierSpec) -> dict[str, Any]:
        """The per-tier ``create_model`` arguments of ``tier``: width ratio, channel multiple, steps.

        Args:
            tier: one of this spec's tiers.

        Returns:
            ``{"gamma_w": ..., "channel_multiple": ..., "steps": ...}``; the channel multiple
            is the tier's, else the spec's, else the model's own rule.
        """
        from .models.registry import default_channel_multiple

        multiple = next((m for m in (tier.channel_multiple, self.channel_multiple) if m is not None), None)
        if multiple is None:
            multiple = default_channel_multiple(self.model)
        return {"gamma_w": tier.gamma_w, "channel_multiple": multiple, "steps": tier.steps}

    @property
    def full_tier(self) -> TierSpec:
        """The widest, deepest tier (largest ``gamma_w``, then most blocks)."""
        return max(self.tiers, key=lambda t: (t.gamma_w, _kept(t)))


def _check_nests(model: str, args: dict[str, Any], field: str) -> None:
    """Build a tier of an automatically nested network on the meta device; its
    :class:`~nefl_zoo.models.NestError` (e.g. a channel shuffle) becomes a field error."""
    import torch

    from .models import NestError, create_model

    try:
        with torch.device("meta"):
            create_model(model, **args)
    except NestError as exc:
        raise field_error(field, str(exc)) from None


def _kept(tier: TierSpec) -> int:
    return sum(v != 0 for stage in tier.steps for v in stage) if tier.steps else 10**9


def stage_depths(model: str, model_args: tuple) -> tuple[int, ...]:
    """Blocks per stage of a zoo model (built on the meta device, so it costs no memory).

    ``model_args`` is ``tuple(sorted(kwargs.items()))``; results are cached unless a value is
    unhashable (a list, e.g. ``planes: [8, 16, 32, 64]``).

    Args:
        model: a registered model name.
        model_args: its ``create_model`` arguments, as sorted ``(name, value)`` pairs.

    Returns:
        The number of blocks of each stage.

    Examples:
        >>> from nefl_zoo.spec import stage_depths
        >>> stage_depths("resnet20", (("num_classes", 10),))
        (3, 3, 3)
    """
    return model_shape(model, model_args)[0]


def model_shape(model: str, model_args: tuple) -> tuple[tuple[int, ...], int]:
    """Blocks per stage and parameter count of a zoo model (built on the meta device, so it
    costs no memory), cached as :func:`stage_depths`.

    Args:
        model: a registered model name.
        model_args: its ``create_model`` arguments, as sorted ``(name, value)`` pairs.

    Returns:
        ``(blocks per stage, parameter count)``.

    Examples:
        >>> from nefl_zoo.spec import model_shape
        >>> model_shape("resnet20", ())
        ((3, 3, 3), 272483)
    """
    try:
        hash(model_args)
    except TypeError:
        return _model_shape(model, model_args)
    return _cached_model_shape(model, model_args)


@functools.lru_cache(maxsize=64)
def _cached_model_shape(model: str, model_args: tuple) -> tuple[tuple[int, ...], int]:
    return _model_shape(model, model_args)


def _model_shape(model: str, model_args: tuple) -> tuple[tuple[int, ...], int]:
    import torch

    from .models import count_params, create_model

    with torch.device("meta"):
        net = create_model(model, **dict(model_args))
    return net.stage_depths, count_params(net)


def format_validation_error(source: str, exc: ValidationError) -> SpecError:
    """The first error of a pydantic ``ValidationError`` as a one-line :class:`SpecError`
    (:func:`nefl_zoo.userfiles.format_validation_error` with the spec's unknown-key hint).

    Args:
        source: the file (or other source) the spec came from, named in the message.
        exc: the validation error.

    Returns:
        The error, whose message reads ``SOURCE: FIELD: what was expected``.
    """
    return userfiles.format_validation_error(source, exc, SpecError, unknown_key=UNKNOWN_KEY)


def parse_spec(data: Any, source: str = "<spec>") -> SubmodelSpec:
    """Validate already-loaded spec data; raise :class:`SpecError` on the first problem.

    Args:
        data: the spec as a mapping (what a YAML spec file holds).
        source: where it came from, named in errors.

    Returns:
        The validated spec.

    Raises:
        SpecError: the first problem, as ``SOURCE: FIELD: what was expected``.

    Examples:
        >>> import nefl_zoo as nz
        >>> nz.parse_spec({"model": "resnet20", "tiers": [{"name": "g1", "gamma_w": 2}]})
        Traceback (most recent call last):
        ...
        nefl_zoo.spec.SpecError: <spec>: tiers[0].gamma_w: must be in (0, 1], got 2.0
    """
    if not isinstance(data, dict):
        raise SpecError(source, "", f"expected a mapping with model and tiers, got {type(data).__name__}")
    try:
        return SubmodelSpec.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(source, exc) from None


def load_spec(path: str | Path) -> SubmodelSpec:
    """Read a YAML spec file, or a shipped spec by name, with ``yaml.safe_load`` and validate it.

    Args:
        path: the spec file, or a shipped spec's name ``MODEL/NAME`` (``resnet110/nefl-wd``;
            ``nefl-zoo specs`` lists them), as the command line takes it.

    Returns:
        The validated spec.

    Raises:
        SpecError: an unreadable file, an unknown name, invalid YAML or an invalid spec, in one
            line naming the file and the field.

    Examples:
        >>> import nefl_zoo as nz
        >>> spec = nz.load_spec("resnet20/nefl-w")
        >>> spec.model, [tier.name for tier in spec.tiers]
        ('resnet20', ['g0.2', 'g0.4', 'g0.6', 'g0.8', 'g1'])
    """
    if not userfiles.is_file(path) and Path(path).suffix == "":
        path = resolve_spec_path(path)
    return parse_spec(userfiles.read_yaml(path, SpecError), str(path))


def json_schema() -> dict:
    """JSON Schema of spec files (for editor completion).

    Returns:
        The schema, as ``nefl-zoo schema`` prints it.
    """
    return SubmodelSpec.model_json_schema()


def shipped_specs_dir() -> Path:
    """Folder of the specs shipped with nefl-zoo (``$NEFL_ZOO_SPECS`` overrides it).

    The repository's top-level ``specs/`` is installed as the package-data package
    ``nefl_zoo_specs`` (see pyproject.toml), so installed and editable copies both find it.

    Returns:
        The folder.
    """
    import os
    from importlib.resources import files

    override = os.environ.get("NEFL_ZOO_SPECS")
    return Path(override) if override else Path(str(files("nefl_zoo_specs")))


def resolve_spec_path(name_or_path: str | Path) -> Path:
    """A spec file path, or the shipped spec ``MODEL/NAME`` (e.g. ``resnet110/nefl-wd``).

    Args:
        name_or_path: a spec file, or a shipped spec's name.

    Returns:
        The spec file's path.

    Raises:
        SpecError: neither a file nor a shipped spec.

    Examples:
        >>> from nefl_zoo.spec import resolve_spec_path
        >>> resolve_spec_path("resnet20/nefl-w").name
        'nefl-w.yaml'
    """
    path = Path(name_or_path)
    if userfiles.is_file(path):
        return path
    shipped = shipped_specs_dir() / f"{name_or_path}.yaml"
    if userfiles.is_file(shipped):
        return shipped
    raise SpecError(str(name_or_path), "", "no such spec file or shipped spec (see `nefl-zoo specs`)")

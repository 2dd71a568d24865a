"""timm-style model registry: ``register_model``, ``list_models``, ``model_info``, ``create_model``.

An entry point may declare its arguments (``@register_model(args=ResNetArgs)``, a
:class:`~nefl_zoo.models.args.ModelArgs`); :func:`create_model` then validates them before
the constructor runs (:func:`check_model_args`)."""

from __future__ import annotations

import fnmatch
import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .args import ModelArgs, check_args


@dataclass(frozen=True)
class ModelInfo:
    """What the registry knows about a model: its entry point, module and summary."""

    name: str
    fn: Callable[..., nn.Module]
    module: str
    summary: str  # first line of the entry point's docstring
    args: type[ModelArgs] | None = None  # the declared arguments, validated before construction


_MODELS: dict[str, ModelInfo] = {}


class UnknownModelError(ValueError):
    """Raised when a model name is not in the registry."""


def register_model(fn: Callable[..., nn.Module] | None = None, *, args: type[ModelArgs] | None = None):
    """Register a model entry point under its function name (warns when it replaces one).

    Use as ``@register_model``, or ``@register_model(args=MyArgs)`` to declare the entry
    point's arguments (validated by :func:`create_model` before construction)."""
    if fn is None:
        return lambda entry_point: register_model(entry_point, args=args)
    name = fn.__name__
    if name in _MODELS:
        warnings.warn(
            f"model {name!r} from {fn.__module__} replaces the one from {_MODELS[name].module}", stacklevel=2
        )
    summary = (fn.__doc__ or "").strip().split("\n", 1)[0]
    _MODELS[name] = ModelInfo(name, fn, fn.__module__, summary, args)
    return fn


def list_models(pattern: str = "*") -> list[str]:
    """Names of registered models matching a shell-style ``pattern``."""
    return sorted(n for n in _MODELS if fnmatch.fnmatch(n, pattern))


def is_model(name: str) -> bool:
    """Whether ``name`` is a registered model, or ``torchvision:NAME`` / ``timm:NAME`` of an
    existing model (nested automatically, :mod:`nefl_zoo.nest`)."""
    return name in _MODELS or (":" in name and _nest().exists(name))


def _nest():
    """:mod:`nefl_zoo.nest.sources`, imported by name (it depends on this module)."""
    return importlib.import_module("nefl_zoo.nest.sources")


def model_info(name: str) -> ModelInfo:
    """Registry metadata of a model (``torchvision:NAME`` / ``timm:NAME``: built on demand)."""
    if name not in _MODELS and ":" in name:
        return importlib.import_module("nefl_zoo.nest.net").model_info(name)
    if name not in _MODELS:
        raise UnknownModelError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    return _MODELS[name]


def check_model_args(name: str, kwargs: dict[str, Any]) -> None:
    """Validate ``kwargs`` against the arguments ``name`` declares (nothing when it declares
    none); :class:`~nefl_zoo.models.args.ModelArgsError` names the first bad argument."""
    info = model_info(name)
    if info.args is not None:
        check_args(info.args, kwargs)


def default_channel_multiple(name: str) -> int:
    """The width rounding of ``name`` when none is given: its declared ``channel_multiple``
    default (8 for the mobile families, 1, the NeFL paper's ceil rule, for the others)."""
    args = model_info(name).args
    return args.model_fields["channel_multiple"].default if args is not None else 1


def create_model(name: str, pretrained: str | None = None, **kwargs) -> nn.Module:
    """Build a registered model.

    ``kwargs`` go to the constructor (``num_classes``, ``in_chans``, ``gamma_w``, ``steps``,
    and model-specific ones such as ``stem``), after :func:`check_model_args`;
    ``pretrained`` is a state-dict file or a ``torchvision:NAME`` / ``timm:NAME`` reference
    handed to :func:`load_pretrained`.
    """
    check_model_args(name, kwargs)
    model = model_info(name).fn(**kwargs)
    if pretrained:
        from .pretrained import load_pretrained

        load_pretrained(model, pretrained)
    return model

"""timm-style model registry: ``register_model``, ``list_models``, ``create_model``."""

from __future__ import annotations

import fnmatch
from typing import Callable

from torch import nn

_MODELS: dict[str, Callable[..., nn.Module]] = {}


class UnknownModelError(ValueError):
    """Raised when a model name is not in the registry."""


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register a model constructor under its function name."""
    _MODELS[fn.__name__] = fn
    return fn


def list_models(pattern: str = "*") -> list[str]:
    """Names of registered models matching a shell-style ``pattern``."""
    return sorted(n for n in _MODELS if fnmatch.fnmatch(n, pattern))


def is_model(name: str) -> bool:
    """Whether ``name`` is a registered model."""
    return name in _MODELS


def create_model(name: str, pretrained: str | None = None, **kwargs) -> nn.Module:
    """Build a registered model.

    ``kwargs`` go to the constructor (``num_classes``, ``in_chans``, ``gamma_w``, ``steps``,
    and model-specific ones such as ``stem``); ``pretrained`` is a state-dict file or a
    ``torchvision:NAME`` / ``timm:NAME`` reference handed to :func:`load_pretrained`.
    """
    if name not in _MODELS:
        raise UnknownModelError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    model = _MODELS[name](**kwargs)
    if pretrained:
        from .pretrained import load_pretrained

        load_pretrained(model, pretrained)
    return model

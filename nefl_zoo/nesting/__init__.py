"""Automatic nesting of any traceable CNN or vision transformer: ``torchvision:NAME`` /
``timm:NAME`` model names and :func:`nest` for a user's own ``nn.Module``.

A channel-dependency analysis of the torch.fx graph (:mod:`.channels` and :mod:`.layers`, on
id tensors :mod:`.ids`, through data movement :mod:`.movement` and attention :mod:`.attention`)
groups the channels that must be kept together (a head is one group member: whole heads nest);
each group is nested by prefix (:mod:`.plan`); blocks whose branch is added to an identity
shortcut get a step size and can be removed (:mod:`.residual`); each tier is a physically
slimmed graph module (:mod:`.slim`) behind the zoo's model contract
(:class:`.net.AutoNestedNet`), so the spec compiler, NeFedAvg, profiling, auto-tier and ONNX
export use it unchanged.

Importing this package registers the ``torchvision`` and ``timm`` sources with the model
registry (:func:`~nefl_zoo.models.registry.register_source`), so ``create_model("timm:NAME")``
works; the package root declares it as a loader of model sources (:mod:`nefl_zoo.plugins`), so
every entry point gets them without importing it first.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..models.registry import ModelInfo, register_model, register_source
from .sources import PREFIXES, NestError, example_shape, user_source

__all__ = ["NestError", "nest"]


def _library_model(name: str) -> ModelInfo:
    """Registry metadata of ``torchvision:NAME`` / ``timm:NAME`` (the source both prefixes register)."""
    from .net import model_info

    return model_info(name)


for _prefix in PREFIXES:
    register_source(_prefix, _library_model)


def nest(module: nn.Module, example_input: torch.Tensor | Sequence[int], name: str | None = None) -> str:
    """Register ``module`` as a nestable zoo model and return its name (use it in specs,
    ``compile_spec``, ``auto_tier``, ``create_model``).

    ``example_input``: a tensor or a shape ``(N, C, H, W)`` (square inputs): its channels and
    size set ``in_chans`` and ``img_size``. Every tier starts from ``module``'s own weights
    (copied; ``module`` is not changed). ``name`` defaults to the class name in snake case.
    A module that cannot be nested raises :class:`NestError` naming the construct.

    Args:
        module: the network to nest, with its weights.
        example_input: a tensor, or a shape ``(N, C, H, W)``, of the network's input.
        name: the name to register it under.

    Returns:
        The registered name.

    Raises:
        NestError: the module cannot be nested; the message names the construct.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import nefl_zoo as nz
        >>> class Tiny(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.conv, self.fc = nn.Conv2d(3, 16, 3, padding=1), nn.Linear(16, 4)
        ...     def forward(self, x):
        ...         return self.fc(self.conv(x).mean((2, 3)))
        >>> name = nz.nest(Tiny(), (1, 3, 8, 8))
        >>> name
        'tiny'
        >>> nz.create_model(name, gamma_w=0.25).conv
        Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    """
    from .net import AutoArgs, build_tier
    from .plan import cached_plan

    shape = example_shape(example_input)
    chans, size = shape[1], shape[2]
    name = name or "".join(f"_{c.lower()}" if c.isupper() else c for c in type(module).__name__).lstrip("_")
    source, classes, template = user_source(module, shape, name)  # a copy: ``module`` is never touched again
    key = (source.name, id(template))
    cached_plan(key, chans, size, lambda: source)  # analyse now: errors surface here

    def entry(num_classes: int = classes, in_chans: int = chans, img_size: int = size, gamma_w: float = 1.0,
              channel_multiple: int = 1, steps=None):
        if (num_classes, in_chans, img_size) != (classes, chans, size):
            raise NestError(f"{name}: a user module keeps its {classes} classes, {chans} channels, size {size}")
        return build_tier(key, lambda: source, in_chans, img_size, num_classes, gamma_w, channel_multiple, steps)

    entry.__name__ = name
    entry.__doc__ = f"{type(module).__name__}, nested automatically (nefl_zoo.nest)."
    register_model(entry, args=AutoArgs)
    return name

"""timm-style model registry: ``register_model``, ``list_models``, ``model_info``, ``create_model``.

An entry point may declare its arguments (``@register_model(args=ResNetArgs)``, a
:class:`~nefl_zoo.models.args.ModelArgs`); :func:`create_model` then validates them before
the constructor runs (:func:`check_model_args`).

Names ``PREFIX:NAME`` (``torchvision:resnet18``, ``timm:vit_tiny_patch16_224``) come from a
*source* that a higher layer registers (:func:`register_source`; :mod:`nefl_zoo.nesting` registers
``torchvision`` and ``timm``): the registry knows no source itself. The package root declares the
layers that register sources (:mod:`nefl_zoo.plugins`); the registry loads them the first time
it meets a prefix it does not know."""

from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .. import plugins
from .args import ModelArgs, check_args


@dataclass(frozen=True)
class ModelInfo:
    """What the registry knows about a model: its entry point, module and summary.

    Attributes:
        name: the registered name.
        fn: the entry point that builds the model.
        module: the module that defines the entry point.
        summary: the first line of the entry point's docstring.
        args: the pydantic model of its declared arguments, if any.

    Examples:
        >>> from nefl_zoo.models import model_info
        >>> model_info("resnet20").summary
        'CIFAR ResNet-20 (3 stages x 3 basic blocks, 16/32/64 channels).'
    """

    name: str
    fn: Callable[..., nn.Module]
    module: str
    summary: str  # first line of the entry point's docstring
    args: type[ModelArgs] | None = None  # the declared arguments, validated before construction


_MODELS: dict[str, ModelInfo] = {}
_SOURCES: dict[str, Callable[[str], ModelInfo]] = {}


class UnknownModelError(ValueError):
    """Raised when a model name is not in the registry."""


class NestError(ValueError):
    """A network that cannot be nested: one line naming the construct. Raised by the sources
    that nest networks automatically (``torchvision:NAME``, ``timm:NAME``, ``nz.nest``); a spec
    reports it against its ``model``."""


def register_model(fn: Callable[..., nn.Module] | None = None, *, args: type[ModelArgs] | None = None):
    """Register a model entry point under its function name (warns when it replaces one).

    Use as ``@register_model``, or ``@register_model(args=MyArgs)`` to declare the entry
    point's arguments (validated by :func:`create_model` before construction).

    Args:
        fn: the entry point: a function that takes the model's arguments and returns it.
        args: a pydantic model (:class:`~nefl_zoo.models.ModelArgs`) of its arguments.

    Returns:
        ``fn`` itself, or with ``args`` only, a decorator that registers its function.
    """
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
    """Names of registered models matching a shell-style ``pattern``.

    Args:
        pattern: a shell-style pattern (``*`` matches anything).

    Returns:
        The matching names, sorted. ``torchvision:`` and ``timm:`` names are not listed.

    Examples:
        >>> import nefl_zoo as nz
        >>> nz.list_models("resnet*")
        ['resnet110', 'resnet18', 'resnet20', 'resnet32', 'resnet34', 'resnet44', 'resnet56']
    """
    return sorted(n for n in _MODELS if fnmatch.fnmatch(n, pattern))


def register_source(prefix: str, resolve: Callable[[str], ModelInfo]) -> None:
    """Resolve every model named ``PREFIX:NAME`` with ``resolve(name)`` (the whole name), which
    returns its :class:`ModelInfo` or raises :class:`UnknownModelError` (warns when it replaces
    one).

    Args:
        prefix: the source's prefix, without the colon (``timm``).
        resolve: builds the :class:`ModelInfo` of a name with that prefix.
    """
    if prefix in _SOURCES and _SOURCES[prefix] is not resolve:
        warnings.warn(f"model source {prefix!r} from {resolve.__module__} replaces the one from "
                      f"{_SOURCES[prefix].__module__}", stacklevel=2)
    _SOURCES[prefix] = resolve


def _source(name: str) -> Callable[[str], ModelInfo] | None:
    """The resolver of ``name``'s prefix (``None``: no prefix, or none registered for it)."""
    prefix, sep, _ = name.partition(":")
    if not sep:
        return None
    if prefix not in _SOURCES:
        plugins.load(plugins.MODEL_SOURCES)
    return _SOURCES.get(prefix)


def is_model(name: str) -> bool:
    """Whether ``name`` is a registered model, or ``PREFIX:NAME`` of an existing model of a
    registered source (``torchvision:NAME`` / ``timm:NAME``: nested automatically,
    :mod:`nefl_zoo.nesting`).

    Args:
        name: a model name.

    Returns:
        ``True`` when :func:`create_model` can build it.

    Examples:
        >>> from nefl_zoo.models import is_model
        >>> is_model("resnet20"), is_model("torchvision:resnet18"), is_model("resnet21")
        (True, True, False)
    """
    if name in _MODELS:
        return True
    resolve = _source(name)
    if resolve is None:
        return False
    try:
        resolve(name)
    except UnknownModelError:
        return False
    return True


def model_info(name: str) -> ModelInfo:
    """Registry metadata of a model (``PREFIX:NAME`` of a registered source: built on demand).

    Args:
        name: a model name.

    Returns:
        Its entry point, module, summary and declared arguments.

    Raises:
        UnknownModelError: no such model (the message lists the registered ones).
    """
    if name in _MODELS:
        return _MODELS[name]
    resolve = _source(name)
    if resolve is not None:
        return resolve(name)
    sources = "".join(f", {prefix}:NAME" for prefix in sorted(_SOURCES))
    raise UnknownModelError(f"unknown model {name!r}; available: {', '.join(list_models())}{sources}")


def check_model_args(name: str, kwargs: dict[str, Any]) -> None:
    """Validate ``kwargs`` against the arguments ``name`` declares (nothing when it declares
    none); :class:`~nefl_zoo.models.args.ModelArgsError` names the first bad argument.

    Args:
        name: a model name.
        kwargs: the arguments to check.

    Raises:
        ModelArgsError: the first argument out of its declared range.

    Examples:
        >>> from nefl_zoo.models import ModelArgsError, check_model_args
        >>> try:
        ...     check_model_args("resnet20", {"num_classes": 0})
        ... except ModelArgsError as error:
        ...     print(error)
        num_classes: Input should be greater than or equal to 1
    """
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

    Args:
        name: a registered model name, or ``torchvision:NAME`` / ``timm:NAME``.
        pretrained: weights to load after construction.
        **kwargs: the model's arguments.

    Returns:
        The model: a :class:`~nefl_zoo.models.NestedNet`.

    Raises:
        UnknownModelError: no such model.
        ModelArgsError: an argument out of its declared range.

    Examples:
        >>> import nefl_zoo as nz
        >>> model = nz.create_model("resnet20", num_classes=10, gamma_w=0.25)
        >>> model.conv1, model.num_classes
        (Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False), 10)
    """
    check_model_args(name, kwargs)
    model = model_info(name).fn(**kwargs)
    if pretrained:
        from .pretrained import load_pretrained

        load_pretrained(model, pretrained)
    return model

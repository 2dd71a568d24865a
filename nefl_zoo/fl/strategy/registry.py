"""The method registry: methods register themselves by name; the built-in ones are found.

Every module (or subpackage) of :mod:`nefl_zoo.fl.methods` is imported by name, in sorted
order, the first time the registry is read, and registers its methods with
:func:`register_method`; so a new built-in method is one new file there and nothing else. The
discovery imports modules by name (``importlib``), not by an import statement: the methods
depend on this module, never the reverse.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Mapping, TypeVar

from .base import MethodSettings, Strategy

BUILTIN = "nefl_zoo.fl.methods"

_METHODS: dict[str, type[Strategy]] = {}
S = TypeVar("S", bound=type[Strategy])


def register_method(name: str, label: str, settings: type[MethodSettings] = MethodSettings) -> Callable[[S], S]:
    """Class decorator: register a :class:`~nefl_zoo.fl.strategy.Strategy` under ``name`` with a
    table ``label`` and its settings model (validated from ``method_args``).

    Args:
        name: what ``method:`` and ``compare --methods`` take.
        label: the method's row in results tables.
        settings: the pydantic model of its ``method_args``.

    Returns:
        The decorator; it returns the class unchanged.

    Raises:
        ValueError: ``name`` is registered already.
    """

    def wrap(cls: S) -> S:
        if name in _METHODS:
            raise ValueError(f"method {name!r} is registered twice ({_METHODS[name].__qualname__}, {cls.__qualname__})")
        cls.name, cls.label, cls.Settings = name, label, settings
        _METHODS[name] = cls
        return cls

    return wrap


_BUILTIN_MODULES: list[str] = []


def _discover() -> None:
    if not _BUILTIN_MODULES:
        package = importlib.import_module(BUILTIN)
        for module in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
            importlib.import_module(f"{BUILTIN}.{module}")
            _BUILTIN_MODULES.append(f"{BUILTIN}.{module}")


def _rank(cls: type[Strategy]) -> int:
    """Position of the built-in module defining ``cls`` (after them all: defined elsewhere)."""
    for i, module in enumerate(_BUILTIN_MODULES):
        if cls.__module__ == module or cls.__module__.startswith(module + "."):
            return i
    return len(_BUILTIN_MODULES)


def registered_methods() -> dict[str, type[Strategy]]:
    """Every registered method by name: the built-in ones in sorted module order (within a
    module in registration order), then those registered elsewhere; the same order whatever
    was imported first.

    Returns:
        The methods' classes, by name.

    Examples:
        >>> from nefl_zoo.fl import registered_methods
        >>> list(registered_methods())[:3]
        ['depthfl', 'fedavg', 'fedavg_min']
    """
    _discover()
    return dict(sorted(_METHODS.items(), key=lambda item: _rank(item[1])))


def get_method(name: str) -> type[Strategy]:
    """The method registered as ``name``.

    Args:
        name: a method's name.

    Returns:
        The method's class.

    Raises:
        KeyError: no such method; the message lists the known names.

    Examples:
        >>> from nefl_zoo.fl import get_method
        >>> get_method("nefl").__name__
        'NeFL'
    """
    known = registered_methods()
    if name not in known:
        raise KeyError(f"unknown method {name!r}; one of {', '.join(known)}")
    return known[name]


def parse_settings(name: str, args: Mapping[str, Any]) -> MethodSettings:
    """Validate ``method_args`` for method ``name`` (pydantic ``ValidationError`` on a problem)."""
    return get_method(name).Settings.model_validate(dict(args))

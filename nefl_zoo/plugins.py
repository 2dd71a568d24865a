"""Loaders that the package root declares for the layers below it: imports nothing, so it is
torch-free.

A lower layer never imports a higher one, not even by name. Where it serves what a higher layer
provides (the model registry, :mod:`nefl_zoo.models.registry`, resolving ``timm:NAME`` and
``torchvision:NAME`` through :mod:`nefl_zoo.nesting`), the higher layer registers with the lower
one, and the package root (:mod:`nefl_zoo`, which every import of the package runs first)
declares here, under a topic, the loader that imports it. The lower layer runs a topic's
loaders when it first needs them (:func:`load`), so ``import nefl_zoo`` imports nothing more.
"""

from __future__ import annotations

from typing import Callable

MODEL_SOURCES = "model sources"  # loaders of the layers that call models.registry.register_source

_PENDING: dict[str, list[Callable[[], object]]] = {}


def declare(topic: str, loader: Callable[[], object]) -> None:
    """Run ``loader`` (once) the first time :func:`load` is called for ``topic``."""
    _PENDING.setdefault(topic, []).append(loader)


def load(topic: str) -> None:
    """Run the loaders declared for ``topic`` that have not run yet (each once, in order; one
    that raises stays pending)."""
    pending = _PENDING.get(topic, [])
    while pending:
        pending[0]()
        pending.pop(0)

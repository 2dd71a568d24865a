"""nefl-zoo: nested federated learning and physically slimmed submodel extraction.

``import nefl_zoo as nz`` gives the everyday names: build models (``nz.create_model``,
``nz.nest``), write and compile specs (``nz.parse_spec``, ``nz.load_spec``,
``nz.compile_spec``), find a tier (``nz.auto_tier``) and move weights between a tier and the
global model (``nz.extract``, ``nz.scatter_``). Training is in :mod:`nefl_zoo.fl`, export in
:mod:`nefl_zoo.export` and the torch-free runtime in :mod:`nefl_zoo.runtime`.

The names are imported when first used, so ``import nefl_zoo`` does not import torch.

Examples:
    >>> import nefl_zoo as nz
    >>> spec = nz.parse_spec({"model": "resnet20", "tiers": [
    ...     {"name": "small", "gamma_w": 0.25}, {"name": "full"}]})
    >>> compiled = nz.compile_spec(spec)
    >>> small = compiled["small"].load(compiled.init_global_state())
    >>> sum(p.numel() for p in small.parameters())
    68795
"""

# This is where the layers are assembled: a layer that serves a higher one is told here which
# loader brings it in (:mod:`nefl_zoo.plugins`), instead of importing it by name. The model
# registry's ``torchvision:`` and ``timm:`` sources are :mod:`nefl_zoo.nesting`'s, loaded the
# first time a name of that form is looked up.

from __future__ import annotations

import importlib

from . import plugins
from .version import __version__ as __version__


def _load_nest_sources() -> None:
    """Import :mod:`nefl_zoo.nesting`, which registers the ``torchvision`` and ``timm`` model sources."""
    import nefl_zoo.nesting  # noqa: F401


plugins.declare(plugins.MODEL_SOURCES, _load_nest_sources)

_EXPORTS = {
    "create_model": "nefl_zoo.models",
    "list_models": "nefl_zoo.models",
    "load_pretrained": "nefl_zoo.models",
    "register_model": "nefl_zoo.models",
    "SubmodelSpec": "nefl_zoo.spec",
    "TierSpec": "nefl_zoo.spec",
    "SpecError": "nefl_zoo.spec",
    "load_spec": "nefl_zoo.spec",
    "parse_spec": "nefl_zoo.spec",
    "compile_spec": "nefl_zoo.slim",
    "build_submodel": "nefl_zoo.slim",
    "extract": "nefl_zoo.slim",
    "scatter_": "nefl_zoo.slim",
    "auto_tier": "nefl_zoo.auto",
    "nest": "nefl_zoo.nesting",
    "NestError": "nefl_zoo.nesting",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nefl_zoo' has no attribute {name!r}")


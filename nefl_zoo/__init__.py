"""nefl-zoo: nested federated learning and physically slimmed submodel extraction.

Attributes are imported lazily so that ``import nefl_zoo`` (and ``nefl_zoo.runtime``, which
needs only numpy and onnxruntime) does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

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
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nefl_zoo' has no attribute {name!r}")

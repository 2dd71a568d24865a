"""The model zoo: nested-ready networks registered by name."""

from . import resnet, vit  # noqa: F401  (registers the models)
from .base import NestedNet, scale_width
from .pretrained import load_pretrained
from .registry import UnknownModelError, create_model, is_model, list_models, register_model

__all__ = [
    "NestedNet",
    "UnknownModelError",
    "create_model",
    "is_model",
    "list_models",
    "load_pretrained",
    "register_model",
    "scale_width",
]

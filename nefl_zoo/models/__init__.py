"""The model zoo: nested-ready networks registered by name."""

from . import resnet, vit  # noqa: F401  (registers the models)
from .base import NestedNet, count_params, scale_width
from .pretrained import load_pretrained
from .registry import ModelInfo, UnknownModelError, create_model, is_model, list_models, model_info, register_model

__all__ = [
    "ModelInfo",
    "NestedNet",
    "UnknownModelError",
    "count_params",
    "create_model",
    "is_model",
    "list_models",
    "load_pretrained",
    "model_info",
    "register_model",
    "scale_width",
]

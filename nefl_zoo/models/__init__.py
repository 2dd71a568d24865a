"""The model zoo: nested-ready networks registered by name."""

from . import efficientnet, mobilenet, resnet, shufflenet, vit  # noqa: F401  (registers the models)
from .args import ModelArgs, ModelArgsError
from .base import NestedNet, count_params, scale_width
from .pretrained import load_pretrained
from .registry import (
    ModelInfo,
    NestError,
    UnknownModelError,
    check_model_args,
    create_model,
    is_model,
    list_models,
    model_info,
    register_model,
    register_source,
)

__all__ = [
    "ModelArgs",
    "ModelArgsError",
    "ModelInfo",
    "NestError",
    "NestedNet",
    "UnknownModelError",
    "check_model_args",
    "count_params",
    "create_model",
    "is_model",
    "list_models",
    "load_pretrained",
    "model_info",
    "register_model",
    "register_source",
    "scale_width",
]

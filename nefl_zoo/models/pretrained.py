"""Load torchvision (ResNet, Wide-ResNet) and timm (ViT) weights into zoo models."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from .base import NestedNet


class PretrainedError(ValueError):
    """Raised when weights cannot be loaded into a model."""


def _read_state_dict(source: str | Path) -> dict[str, torch.Tensor]:
    text = str(source)
    if text.startswith("torchvision:"):
        import torchvision

        weights = torchvision.models.get_model_weights(text.split(":", 1)[1]).DEFAULT
        return weights.get_state_dict(progress=False)
    if text.startswith("timm:"):
        import timm

        return timm.create_model(text.split(":", 1)[1], pretrained=True).state_dict()
    path = Path(source)
    if not path.is_file():
        raise PretrainedError(f"{path}: no such weights file (give a .pth/.pt/.safetensors file)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict):
        raise PretrainedError(f"{path}: expected a state_dict, got {type(state).__name__}")
    return state


def load_pretrained(
    model: NestedNet, source: str | Path | Mapping[str, torch.Tensor]
) -> list[str]:
    """Copy a torchvision/timm state dict into a full-size zoo ``model``.

    ``source`` is a state dict, a file (``.pth``, ``.pt``, ``.safetensors``) or
    ``torchvision:NAME`` / ``timm:NAME`` (downloads; needs a network). Step sizes absent from
    the source keep their value (1). A classifier of another size is left as initialised.
    Returns the keys that were not loaded.
    """
    state = dict(source) if isinstance(source, Mapping) else _read_state_dict(source)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    own = model.state_dict()
    steps = model.step_keys()
    classifier = set(model.get_classifier().state_dict(prefix=f"{model.default_cfg['classifier']}."))
    skipped: list[str] = []
    for key, target in own.items():
        if key not in state:
            if key in steps:
                skipped.append(key)
                continue
            raise PretrainedError(f"pretrained weights lack {key!r} (is this the right model?)")
        value = state[key]
        if value.shape != target.shape:
            if key in classifier:
                skipped.append(key)
                continue
            raise PretrainedError(
                f"{key}: pretrained shape {tuple(value.shape)} != model shape {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(value)
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise PretrainedError(f"pretrained weights have keys the model lacks: {unknown[:5]}")
    return skipped

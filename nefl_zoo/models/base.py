"""Shared pieces of every nested-ready network.

A nested-ready network is built from a width ratio ``gamma_w`` and per-block step sizes
``steps`` (one list per stage, 0 = block removed). The full model is ``gamma_w=1`` with every
step 1; a submodel is the same class built with smaller arguments, so a submodel's tensors
carry the same names as the global model's and differ only in shape.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

Steps = Sequence[Sequence[float]]
Index = tuple  # per-dimension ``slice`` or 1-D ``torch.LongTensor``


def scale_width(channels: int, gamma_w: float) -> int:
    """Channels kept for a parameter ratio ``gamma_w``: ``ceil(C * sqrt(gamma_w))``."""
    return max(1, math.ceil(channels * math.sqrt(gamma_w) - 1e-9))


def resolve_steps(steps: Steps | None, depths: Sequence[int]) -> list[list[float]]:
    """Return ``steps`` as lists of floats, or all ones when ``None``; check their shape."""
    if steps is None:
        return [[1.0] * d for d in depths]
    if len(steps) != len(depths):
        raise ValueError(f"expected {len(depths)} stages of steps, got {len(steps)}")
    out = []
    for i, (stage, d) in enumerate(zip(steps, depths)):
        if len(stage) != d:
            raise ValueError(f"stage {i + 1} has {d} blocks, got {len(stage)} steps")
        out.append([float(s) for s in stage])
    return out


class NestedNet(nn.Module):
    """Base class of the zoo's networks.

    Subclasses set ``stage_depths`` (blocks per stage of the FULL architecture),
    ``stage_names`` (module names of the stages) and ``input_size`` (C, H, W).
    """

    stage_depths: tuple[int, ...]
    stage_names: tuple[str, ...]
    input_size: tuple[int, int, int]
    norm_types: tuple[type, ...] = (nn.BatchNorm2d, nn.LayerNorm)

    def param_kinds(self) -> dict[str, str]:
        """Kind of every state-dict entry: ``steps``, ``norm`` or ``weight``."""
        kinds: dict[str, str] = {}
        for mname, module in self.named_modules():
            prefix = f"{mname}." if mname else ""
            is_norm = isinstance(module, self.norm_types)
            for pname, _ in module.named_parameters(recurse=False):
                kind = "steps" if pname.startswith("step") else ("norm" if is_norm else "weight")
                kinds[prefix + pname] = kind
            for bname, buf in module.named_buffers(recurse=False):
                if buf is not None:
                    kinds[prefix + bname] = "norm" if is_norm else "weight"
        return kinds

    def slice_index(self, key: str, slim_shape: torch.Size, full_shape: torch.Size) -> Index:
        """Where a submodel tensor of ``slim_shape`` sits in the global tensor ``key``.

        Nested width scaling keeps the first channels of every dimension, so the default is a
        prefix per dimension; models with packed or grouped dimensions override this.
        """
        return tuple(slice(0, n) for n in slim_shape)

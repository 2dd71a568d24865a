"""Checks of an automatically nested network against its global model."""

from __future__ import annotations

import torch
from torch import nn

from ..slim.slicemap import region_key


def zeroed_parity(compiled, tier: str, x: torch.Tensor) -> float:
    """Max |difference| between ``tier``'s slim module and the global model whose tensors are
    all zero except the tier's (placed through the compiler's slice map; BatchNorm variance 1
    elsewhere). Zero up to rounding means the removed channels and blocks contribute nothing.
    The tier's BatchNorm statistics and its parameters initialised to zero (a zero-initialised
    head, layer scale at zero) are randomised first, so that they are tested too."""
    with torch.no_grad():
        slim = randomise_zeros(compiled[tier].build().eval())
        for m in slim.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
        full = compiled.create_global_model().eval()
        state = {k: torch.zeros_like(v) for k, v in full.state_dict().items()}
        steps = set(full.step_keys())
        for key in compiled[tier].slice_map:
            if key in steps:
                state[key].fill_(slim.get_parameter(key).item())
            else:
                index = full.slice_index(key, slim.state_dict()[key].shape, state[key].shape)
                state[key][region_key(index)] = slim.state_dict()[key]
        for key, value in state.items():
            if key.endswith("running_var"):
                value[value == 0] = 1
        for key in steps - set(compiled[tier].slice_map):  # blocks the tier removed: step 0
            state[key].zero_()
        full.load_state_dict(state)
        return float((full(x) - slim(x)).abs().max())


def randomise_zeros(module: nn.Module) -> nn.Module:
    """``module`` with every all-zero floating parameter (a zero-initialised head or layer
    scale, which would hide a wrong slice) filled with small random values; returns it."""
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.numel() > 1 and not bool(p.any()):
                p.normal_(0, 0.02)
        return module

"""HeteroFL: width-only submodels, static BN and the width scaler."""

from __future__ import annotations

import math

from torch import nn

from ...slim import compile_spec
from ..strategy.base import MethodSettings, Run
from ..strategy.local_model import SubmodelLocal
from ..strategy.registry import register_method
from .common import Nested, width_spec

_STATS = ("running_mean", "running_var", "num_batches_tracked")


class _ScaledLocal(SubmodelLocal):
    """A slim submodel with static BN whose convolution outputs are divided by the width rate
    in training; it uploads everything but the (untouched) BN running statistics."""

    def __init__(self, net: nn.Module, rate: float):
        super().__init__(net)
        for module in net.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.track_running_stats = False  # static BN: batch statistics only
            if isinstance(module, nn.Conv2d):
                module.register_forward_hook(lambda m, i, out: out / rate if m.training else out)

    def state(self):
        return {k: v for k, v in super().state().items() if not k.endswith(_STATS)}


@register_method("heterofl", label="HeteroFL")
class HeteroFL(Nested):
    """HeteroFL (Diao et al.): shared BN affine, static BN, scaler, count-averaged slices.

    A client trains the width its environment gives it (``environment: fixed``: one width per
    client, HeteroFL's static setting; ``dynamic``: a random allowed width each round, as in
    HeteroFL's dynamic experiments and NeFL's comparison, so every width is trained). BN running
    statistics are not trained or sent, so evaluation always recomputes them (``eval.bn_batches``
    training batches, without the scaler, as at test time), whatever ``eval.bn`` says.
    """

    def __init__(self, run: Run, settings: MethodSettings | None = None):
        compiled = compile_spec(width_spec(run.spec, ["steps"]))

        def entries(tier: str):
            return {k: e for k, e in compiled[tier].slice_map.items() if not k.endswith(_STATS)}

        def client_model(tier: str, arrays) -> _ScaledLocal:
            return _ScaledLocal(self.submodel(tier, arrays), math.sqrt(compiled[tier].tier.gamma_w))

        super().__init__(run, settings, compiled=compiled, entries=entries, client_model=client_model, static_bn=True)

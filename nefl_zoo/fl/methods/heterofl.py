"""HeteroFL: width-only submodels, static BN and the width scaler."""

from __future__ import annotations

import math
from typing import Mapping

from torch import nn

from ...slim import SliceEntry
from ...spec import SubmodelSpec, TierSpec
from ..local import SubmodelLocal, load_entries
from ..strategy import register_method
from .nefl import Assignment, NeFL

_STATS = ("running_mean", "running_var", "num_batches_tracked")


def width_spec(spec: SubmodelSpec, inconsistent: list[str]) -> SubmodelSpec:
    """Width-only tiers with the parameter ratios of ``spec``'s tiers and fixed step sizes: a
    width-only tier keeps its ``gamma_w`` (the same widths as NeFL-W), a tier that skips blocks
    takes its nominal ``gamma`` as width ratio."""
    def skips(t: TierSpec) -> bool:
        return t.steps is not None and any(v == 0 for stage in t.steps for v in stage)

    tiers = [
        TierSpec(name=t.name, gamma_w=t.gamma if skips(t) and t.gamma is not None else t.gamma_w, learnable_steps=False,
                 gamma=t.gamma, channel_multiple=t.channel_multiple)
        for t in spec.tiers
    ]
    return SubmodelSpec(model=spec.model, model_args=spec.model_args, channel_multiple=spec.channel_multiple, tiers=tiers,
                        inconsistent=inconsistent)


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
class HeteroFL(NeFL):
    """HeteroFL (Diao et al.): shared BN affine, static BN, scaler, count-averaged slices.

    A client trains the width its environment gives it (``environment: fixed``: one width per
    client, HeteroFL's static setting; ``dynamic``: a random allowed width each round, as in
    HeteroFL's dynamic experiments and NeFL's comparison, so every width is trained). BN running
    statistics are not trained or sent, so evaluation always recomputes them (``eval.bn_batches``
    training batches, without the scaler, as at test time), whatever ``eval.bn`` says.
    """

    def method_spec(self, spec: SubmodelSpec) -> SubmodelSpec:
        return width_spec(spec, ["steps"])

    def entries(self, assignment: Assignment) -> Mapping[str, SliceEntry]:
        slice_map = self.compiled[assignment.tier].slice_map
        return {k: e for k, e in slice_map.items() if not k.endswith(_STATS)}

    def _rate(self, tier: str) -> float:
        return math.sqrt(self.compiled[tier].tier.gamma_w)

    def local_model(self, assignment, arrays):
        net = self.compiled[assignment.tier].build()
        load_entries(net, arrays)
        return _ScaledLocal(net, self._rate(assignment.tier))

    def with_bn(self, model, treatment, data):
        return super().with_bn(model, "recompute", data)

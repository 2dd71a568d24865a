"""FedAvg baselines on one model: the full one, the smallest one, or full-only clients.

Plain FedAvg has no step sizes to learn: the trained model keeps its spec's step sizes as
constants, and they are neither in the global state nor sent.
"""

from __future__ import annotations

from ...slim import compile_spec
from ..strategy.base import MethodSettings, Run
from ..strategy.registry import register_method
from .common import Nested, level_sizes, single_model


@register_method("fedavg", label="FedAvg (full model)")
class FedAvg(Nested):
    """``fedavg``: every sampled client trains the full model, ignoring its resources."""

    def __init__(self, run: Run, settings: MethodSettings | None = None):
        super().__init__(run, settings, **single_model(run, run.spec.full_tier))


@register_method("fedavg_min", label="FedAvg (smallest model)")
class FedAvgMin(Nested):
    """``fedavg_min``: everyone trains the smallest submodel, so every client can take part."""

    def __init__(self, run: Run, settings: MethodSettings | None = None):
        sizes = level_sizes(compile_spec(run.spec))
        super().__init__(run, settings, **single_model(run, run.spec.tier(min(sizes, key=sizes.__getitem__))))


@register_method("fedavg_full", label="FedAvg (full-model clients)")
class FedAvgFull(Nested):
    """``fedavg_full``: only clients whose environment allows the full model take part."""

    def __init__(self, run: Run, settings: MethodSettings | None = None):
        super().__init__(run, settings, **single_model(run, run.spec.full_tier, only_allowed=True))

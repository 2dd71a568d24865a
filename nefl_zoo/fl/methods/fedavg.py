"""FedAvg baselines on one model: the full one, the smallest one, or full-only clients."""

from __future__ import annotations

import random

from ...spec import SubmodelSpec, TierSpec
from ..strategy import register_method
from .nefl import Assignment, NeFL, single_tier_spec


@register_method("fedavg", label="FedAvg (full model)")
class FedAvg(NeFL):
    """``fedavg``: every sampled client trains the full model, ignoring its resources."""

    def method_spec(self, spec: SubmodelSpec) -> SubmodelSpec:
        return single_tier_spec(spec, self.trained_tier(spec))

    def trained_tier(self, spec: SubmodelSpec) -> TierSpec:
        """The one tier of the run's spec that every client trains."""
        return spec.full_tier

    def assign(self, levels: list[str], rng: random.Random) -> Assignment | None:
        return Assignment(self.tier_names[0], (self.tier_names[0],))


@register_method("fedavg_min", label="FedAvg (smallest model)")
class FedAvgMin(FedAvg):
    """``fedavg_min``: everyone trains the smallest submodel, so every client can take part."""

    def trained_tier(self, spec: SubmodelSpec) -> TierSpec:
        return spec.tier(min(self.level_size, key=self.level_size.__getitem__))


@register_method("fedavg_full", label="FedAvg (full-model clients)")
class FedAvgFull(FedAvg):
    """``fedavg_full``: only clients whose environment allows the full model take part."""

    def assign(self, levels: list[str], rng: random.Random) -> Assignment | None:
        if self.run_spec.full_tier.name not in levels:
            return None
        return super().assign(levels, rng)

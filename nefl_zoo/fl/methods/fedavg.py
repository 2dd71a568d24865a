"""FedAvg baselines on one model: the full one, the smallest one, or full-only clients."""

from __future__ import annotations

import random

from ...spec import SubmodelSpec
from .base import Assignment, Method, single_tier_spec


class FedAvg(Method):
    """``fedavg``: every sampled client trains the full model, ignoring its resources."""

    name = "fedavg"

    def method_spec(self, spec: SubmodelSpec) -> SubmodelSpec:
        return single_tier_spec(spec, self._tier(spec))

    def _tier(self, spec: SubmodelSpec):
        return spec.full_tier

    def map_tier(self, level: str) -> str | None:
        return self.tier_names[0]


class FedAvgMin(FedAvg):
    """``fedavg_min``: everyone trains the smallest submodel, so every client can take part."""

    name = "fedavg_min"

    def _tier(self, spec: SubmodelSpec):
        return spec.tier(min(self.level_size, key=self.level_size.__getitem__))


class FedAvgFull(FedAvg):
    """``fedavg_full``: only clients whose environment allows the full model take part."""

    name = "fedavg_full"

    def assign(self, allowed: list[str], rng: random.Random) -> Assignment | None:
        if self.run_spec.full_tier.name not in allowed:
            return None
        return Assignment(self.tier_names[0], (self.tier_names[0],))

"""FedAvg baselines on one model: the full one, the smallest one, or full-only clients.

Plain FedAvg has no step sizes to learn: the trained model keeps its spec's step sizes as
constants, and they are neither in the global state nor sent.
"""

from __future__ import annotations

import random
from typing import Mapping

import torch

from ...slim import SliceEntry, SliceMap
from ...spec import SubmodelSpec, TierSpec
from ..local import SubmodelLocal, load_entries
from ..strategy import register_method
from .nefl import Assignment, NeFL, single_tier_spec


class _ConstantSteps(SubmodelLocal):
    """A slim model trained with cross-entropy that returns everything but its step sizes."""

    def __init__(self, net: torch.nn.Module, steps: set[str]):
        super().__init__(net)
        self.steps = steps

    def state(self):
        return {k: v for k, v in super().state().items() if k not in self.steps}


@register_method("fedavg", label="FedAvg (full model)")
class FedAvg(NeFL):
    """``fedavg``: every sampled client trains the full model, ignoring its resources."""

    def method_spec(self, spec: SubmodelSpec) -> SubmodelSpec:
        tier = self.trained_tier(spec).model_copy(update={"learnable_steps": False})
        return single_tier_spec(spec, tier)

    def trained_tier(self, spec: SubmodelSpec) -> TierSpec:
        """The one tier of the run's spec that every client trains."""
        return spec.full_tier

    def assign(self, levels: list[str], rng: random.Random) -> Assignment | None:
        return Assignment(self.tier_names[0], (self.tier_names[0],))

    def entries(self, assignment: Assignment) -> Mapping[str, SliceEntry]:
        """The model's tensors without its (constant) step sizes."""
        return {k: e for k, e in self.compiled[assignment.tier].slice_map.items() if e.kind != "steps"}

    def init_global_state(self) -> dict[str, torch.Tensor]:
        keys = {e.global_key for e in self.entries(Assignment(self.tier_names[0], ())).values()}
        return {k: v for k, v in self.compiled.init_global_state().items() if k in keys}

    def _steps(self, tier: str) -> set[str]:
        return {k for k, e in self.compiled[tier].slice_map.items() if e.kind == "steps"}

    def _load(self, tier: str, arrays: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        net = self.compiled[tier].build()
        load_entries(net, arrays, unused=self._steps(tier))
        return net

    def local_model(self, assignment, arrays):
        return _ConstantSteps(self._load(assignment.tier, arrays), self._steps(assignment.tier))

    def eval_model(self, global_state, tier, data):
        return self._load(tier, SliceMap(dict(self.entries(Assignment(tier, (tier,))))).extract(global_state))


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

"""The strategy interface shared by every method, and the plain submodel client model.

A :class:`Method` decides only what differs between nested FL methods: its submodel spec, which
submodel a client trains given the tiers its environment allows, which tensors travel (an
``entries`` mapping of submodel key -> :class:`~nefl_zoo.slim.SliceEntry`), the client's local
model (its loss), and the model evaluated per tier. Sampling, local training, aggregation
(:func:`~nefl_zoo.fl.aggregate.nefedavg`) and evaluation are the engine's, the same for all.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ...slim import CompiledSpec, SliceEntry, compile_spec
from ...spec import SubmodelSpec, TierSpec
from ..config import RunConfig


@dataclass(frozen=True)
class Assignment:
    """What one client trains this round: its submodel and every tier whose tensors it updates."""

    tier: str
    tiers: tuple[str, ...]


class LocalModel(nn.Module, abc.ABC):
    """A client's trainable model: ``loss(x, y)`` for local training, ``state()`` to upload."""

    @abc.abstractmethod
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, logits)`` of one batch."""

    @abc.abstractmethod
    def state(self) -> dict[str, torch.Tensor]:
        """The tensors to return to the server, keyed like the method's ``entries``."""


class SubmodelLocal(LocalModel):
    """One slim submodel trained with cross-entropy (NeFL, FedAvg)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, x, y):
        logits = self(x)
        return F.cross_entropy(logits, y), logits

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}


def load_entries(module: nn.Module, state: Mapping[str, torch.Tensor], unused: Iterable[str] = ()) -> None:
    """Load ``state`` into ``module``; only buffers and the ``unused`` keys may be missing."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = set(missing) - {k for k, _ in module.named_buffers()} - set(unused)
    if unexpected or missing:
        raise KeyError(f"state does not fit the module: missing {sorted(missing)[:3]}, unexpected {unexpected[:3]}")


class Method:
    """Base strategy: NeFL's behaviour, which the other methods adjust.

    Args:
        spec: the run's submodel spec; its tiers are the environment's resource levels.
        config: the run configuration.
    """

    name = "nefl"

    def __init__(self, spec: SubmodelSpec, config: RunConfig):
        self.run_spec = spec
        self.config = config
        self.levels: CompiledSpec = compile_spec(spec)
        self.level_size = {name: ct.slice_map.numel() for name, ct in self.levels.tiers.items()}
        self.compiled: CompiledSpec = compile_spec(self.method_spec(spec))
        self.tier_names: list[str] = list(self.compiled.tiers)

    def largest(self, levels: list[str]) -> str:
        """The largest resource level among ``levels`` (by parameter count)."""
        return max(levels, key=self.level_size.__getitem__)

    # -- server side -------------------------------------------------------------------
    def method_spec(self, spec: SubmodelSpec) -> SubmodelSpec:
        """The spec this method trains (NeFL: the run's spec as written)."""
        return spec

    def map_tier(self, level: str) -> str | None:
        """This method's tier for a client at resource level ``level`` (None: sits out)."""
        return level

    def assign(self, allowed: list[str], rng: random.Random) -> Assignment | None:
        """NeFL's dynamic environment: a random allowed submodel each round."""
        tier = self.map_tier(rng.choice(allowed))
        return None if tier is None else Assignment(tier, (tier,))

    def init_global_state(self) -> dict[str, torch.Tensor]:
        """The initial global state (seeded by the caller)."""
        return self.compiled.init_global_state()

    def entries(self, assignment: Assignment) -> Mapping[str, SliceEntry]:
        """The tensors a client with ``assignment`` receives and returns."""
        return self.compiled[assignment.tier].slice_map

    # -- client side -------------------------------------------------------------------
    def local_model(self, assignment: Assignment, state: Mapping[str, torch.Tensor]) -> LocalModel:
        """The client's trainable model, loaded from the received tensors."""
        net = self.compiled[assignment.tier].build()
        load_entries(net, state)
        return SubmodelLocal(net)

    # -- evaluation --------------------------------------------------------------------
    def eval_model(self, global_state: Mapping[str, torch.Tensor], tier: str, bn_batches=None) -> nn.Module:
        """The model evaluated for ``tier`` (``bn_batches``: training batches, for static BN)."""
        return self.compiled[tier].load(global_state)


def single_tier_spec(spec: SubmodelSpec, tier: TierSpec) -> SubmodelSpec:
    """``spec`` reduced to one of its tiers."""
    return spec.model_copy(update={"tiers": [tier]})


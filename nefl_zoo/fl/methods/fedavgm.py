"""FedAvgM (Hsu et al., 2019): FedAvg with server momentum."""

from __future__ import annotations

from typing import Mapping

import torch
from pydantic import Field

from ...slim import split_tier_key
from ..strategy.base import Aggregate, MethodSettings, Reply, Run, State
from ..strategy.registry import register_method
from .common import Nested, single_model


class FedAvgMSettings(MethodSettings):
    """``method_args`` of ``fedavgm``."""

    server_lr: float = Field(1.0, gt=0, description="eta: server learning rate applied to the momentum")
    momentum: float = Field(0.9, ge=0, lt=1, description="beta: server momentum (0 with server_lr 1: FedAvg)")


@register_method("fedavgm", label="FedAvgM", settings=FedAvgMSettings)
class FedAvgM(Nested):
    """FedAvgM: every sampled client trains the full model as in ``fedavg``; the server averages
    the replies (by sample counts unless ``train.weighting`` says otherwise) into w_avg, takes the pseudo-gradient
    d = w - w_avg, keeps the momentum v = beta * v + d (v = d in the first round) and moves
    w <- w - eta * v. BN running statistics are averaged, not moved. The momentum is server state:
    checkpointed, so a resumed run is bit-identical."""

    def __init__(self, run: Run, settings: FedAvgMSettings | None = None):
        super().__init__(run, settings, **single_model(run, run.spec.full_tier))
        with torch.device("meta"):
            #: statistics (buffers), averaged as they are
            self.buffers = {k for k, _ in self.compiled.create_global_model().named_buffers()}
        self.velocity: State = {}

    def aggregate_train(self, server_round: int, global_state, replies: Mapping[int, Reply]) -> Aggregate:
        result = super().aggregate_train(server_round, global_state, replies)
        if not result.accepted:
            return result
        state = dict(result.state)
        for key, w in global_state.items():
            if split_tier_key(key)[0] in self.buffers:
                continue
            d = w - result.state[key]
            v = d if key not in self.velocity else self.settings.momentum * self.velocity[key] + d
            self.velocity[key] = v
            state[key] = w - self.settings.server_lr * v
        return Aggregate(state, result.accepted, result.rejected, result.metrics)

    def server_state(self) -> State:
        return dict(self.velocity)

    def load_server_state(self, state: Mapping[str, torch.Tensor]) -> None:
        unknown = sorted(set(state) - set(self.init_global_state()))
        if unknown:
            raise ValueError(f"{self.name}: server state holds {unknown[:3]}, not momentum of the global state")
        self.velocity = dict(state)

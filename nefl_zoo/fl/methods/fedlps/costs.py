"""What a FedLPS client of each resource level trains and computes, against full models."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from ....models import create_model


@dataclass(frozen=True)
class LevelCost:
    """What a client of one resource level trains: predictor parameters (all tasks) and the
    forward MACs of one image through the encoder and its pruned predictors, against one full
    model per task."""

    level: str
    rho: float
    predictor_params: int
    macs: int
    full_macs: int

    @property
    def macs_ratio(self) -> float:
        return self.macs / self.full_macs


def level_costs(method) -> list[LevelCost]:
    """Per resource level of ``method`` (a :class:`~.method.FedLPS`; spec order): trained predictor
    parameters and forward MACs of the encoder plus every task's pruned predictor, against one
    full model per task (fvcore)."""
    from ....profile import count_macs

    full_macs = 0
    for task in method.tasks:
        with torch.device("meta"):
            full = create_model(method.settings.backbone or method.run.spec.model,
                                **{**method.run.spec.model_args, **method.settings.backbone_args, "num_classes": method.task_classes[task]})
        full_macs += count_macs(full.to_empty(device="cpu"), method.info.input_size)
    out = []
    for level in method.level_size:
        masks = method.level_masks(level)
        predictors = {task: method.predictor(task, masks)[0].to_empty(device="cpu") for task in method.tasks}
        params = sum(p.numel() for p in chain.from_iterable(p.parameters() for p in predictors.values()))
        macs = count_macs(method.model(predictors), method.info.input_size)
        out.append(LevelCost(level, method.rho[level], params, macs, full_macs))
    return out

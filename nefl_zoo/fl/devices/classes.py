"""What each device class gets: ``eval.device_classes`` (runs with ``devices:`` and ``data.local_split``).

At every evaluation each device class of the population is scored on its clients' own held-out
test splits, pooled (every client of the class, online or not):

- ``tier``: each client's images on the tier it runs: the largest of the method's evaluated tiers
  that fits the client's memory and finishes a round within the deadline at its class's median
  speed (``devices.tiers: resources``; the clock's choice without the round's fluctuation), or the
  largest of its allowed levels (``tiers: environment``); the method's smallest when none does,
  so a method with one model (FedAvg) scores that model;
- ``full``: the same images on the full model (the spec's full tier);

with the BN treatment of the method's reported accuracies (``eval.bn``; static BN: recomputed).
The evaluated record gains ``device_accuracy`` (per class: ``tier``, ``full``, ``test_images``
and ``tiers``, its clients per tier they run), ``worst_device_class`` (the least ``tier``
accuracy over the classes) and ``device_class_spread`` (the largest minus the least). Every
round's record gains ``device_classes``: per class, the clients sent a model (``sampled``) and
their updates that ``arrived``, were ``dropped`` (late or out of memory) or ``lost`` (offline).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Subset

from ...data.loading import FederatedData
from ..strategy.base import ClientInfo, Instruction, Strategy
from ..training.client import correct
from .clock import RoundTiming, VirtualClock


def deployed_tiers(clock: VirtualClock, evaluated: Sequence[str], clients: Sequence[ClientInfo]) -> list[str]:
    """The tier each client runs (see the module docstring), among ``evaluated`` (tiers of the clock's costs)."""
    order = [n for n in clock.costs.names if n in evaluated]  # smallest first
    if clock.devices.tiers == "resources":
        fit = clock.median_fit()[:, [clock.costs.names.index(n) for n in order]]
    else:
        fit = np.array([[n in c.levels for n in order] for c in clients], dtype=bool).reshape(len(clients), len(order))
    best = fit.shape[1] - 1 - np.argmax(fit[:, ::-1], axis=1)
    return [order[b] if ok else order[0] for b, ok in zip(best, fit.any(axis=1))]


class DeviceClasses:
    """Scores each device class of a run (see the module docstring).

    Args:
        strategy: the run's method; it must score its tiers on the server (a nested method or FedAvg).
        clock: the run's virtual clock (its population deals the classes).
        clients: the engine's clients (their allowed levels).
        data: the run's data, with every client's held-out split.
    """

    def __init__(self, strategy: Strategy, clock: VirtualClock, clients: Sequence[ClientInfo], data: FederatedData):
        if not hasattr(strategy, "evaluated_model"):
            raise ValueError(f"eval.device_classes: {strategy.name} does not score its tiers on the server; "
                             "device classes are scored for the nested methods and FedAvg")
        if data.holdout is None:
            raise ValueError("eval.device_classes: needs data.local_split (each client's held-out data)")
        evaluated = [n for n in strategy.info.eval_names if n in clock.costs.names]
        self.full = strategy.run.spec.full_tier.name
        if not evaluated or self.full not in strategy.info.eval_names:
            raise ValueError(f"eval.device_classes: {strategy.name} does not score the spec's tiers by name")
        self.names = [c.name for c in clock.devices.classes]
        self.kind = clock.population.kind
        self.tier = deployed_tiers(clock, evaluated, clients)
        #: per tier: the held-out images of the clients that run it, in client order, and each image's class
        self.groups: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for t in dict.fromkeys(self.tier):
            who = [c for c, tier in enumerate(self.tier) if tier == t]
            images = [data.holdout[c][1] for c in who]
            self.groups[t] = (np.concatenate(images), np.repeat(self.kind[who], [len(i) for i in images]))
        self.everyone = (np.concatenate([data.holdout[c][1] for c in range(len(self.tier))]),
                         np.repeat(self.kind, [len(data.holdout[c][1]) for c in range(len(self.tier))]))
        self.strategy = strategy

    def _correct_per_class(self, state: Mapping[str, torch.Tensor], name: str, images: np.ndarray, kinds: np.ndarray,
                           data: FederatedData) -> np.ndarray:
        """The images of each class that model ``name`` gets right."""
        model = self.strategy.evaluated_model(state, name, data, self.strategy.run.eval.bn)
        flags = correct(model, Subset(data.train_eval, images.tolist()), self.strategy.run.eval.batch_size).numpy()
        return np.bincount(kinds, weights=flags, minlength=len(self.names))

    def evaluate(self, state: Mapping[str, torch.Tensor], data: FederatedData) -> dict:
        """``device_accuracy``, ``worst_device_class`` and ``device_class_spread`` of ``state``."""
        right = sum(self._correct_per_class(state, t, images, kinds, data) for t, (images, kinds) in self.groups.items())
        right_full = self._correct_per_class(state, self.full, *self.everyone, data)
        images = np.bincount(self.everyone[1], minlength=len(self.names))
        accuracy = {}
        for k, name in enumerate(self.names):
            if images[k]:
                tiers = [t for c, t in enumerate(self.tier) if self.kind[c] == k]
                accuracy[name] = {"tier": float(right[k] / images[k]), "full": float(right_full[k] / images[k]),
                                  "test_images": int(images[k]), "tiers": {t: tiers.count(t) for t in self.groups if t in tiers}}
        scores = [a["tier"] for a in accuracy.values()]
        return {"device_accuracy": accuracy, "worst_device_class": min(scores), "device_class_spread": max(scores) - min(scores)}

    def participation(self, instructions: Mapping[int, Instruction], timing: RoundTiming) -> dict[str, dict[str, int]]:
        """Per class, the clients sent a model this round and their updates that arrived, were dropped or lost."""
        out = {name: {"sampled": 0, "arrived": 0, "dropped": 0, "lost": 0} for name in self.names}
        for cid in instructions:
            counts = out[self.names[self.kind[cid]]]
            status = timing.status[cid]
            counts["sampled"] += 1
            counts["dropped" if status in ("late", "memory") else status] += 1
        return out

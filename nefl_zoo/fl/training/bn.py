"""BatchNorm statistics at evaluation: ``eval.bn: running | recompute``, the same for every method.

``running``: the model is evaluated with the running statistics in the global state (averaged
from the clients that trained each submodel). ``recompute``: every BN layer's statistics are
reset and recomputed as a cumulative average over ``eval.bn_batches`` training batches without
augmentation (HeteroFL's "static BN"), drawn in the same order for every method and submodel.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.utils.data import Dataset

from .batches import shuffled_batches
from .device import placement

BN_TREATMENTS = ("running", "recompute")


def recompute_batches(dataset: Dataset, batch_size: int, seed: int, batches: int) -> Iterator:
    """The first ``batches`` batches of ``dataset`` shuffled with ``seed`` (the same batches on
    every call with the same arguments; the global RNG is not used), on the current
    placement's device."""
    return itertools.islice(shuffled_batches(dataset, batch_size, seed, 1, placement().device), batches)


@torch.no_grad()
def recompute_bn(net: nn.Module, batches: Iterable) -> None:
    """Reset every BN layer's statistics and recompute them as a cumulative average over
    ``batches`` of ``(x, y)`` (on the current placement's device, where ``net`` is moved);
    ``net`` is left in eval mode."""
    where = placement()
    net.to(where.device)
    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    net.train()
    for x, _ in batches:
        with where.autocast():
            net(x.to(where.device))
    net.eval()

"""Server aggregation as pure functions over state dicts and slice maps.

Every client update carries the mapping (submodel key -> :class:`~nefl_zoo.slim.SliceEntry`)
of the tensors it trained. :func:`nefedavg` averages every element of the global state over the
updates whose entries contain it, so one function covers both rules of the paper:

* consistent tensors (shared, stored once at full size): NeFedAvg, an element averaged over
  every client whose submodel holds it;
* inconsistent tensors (``KEY@TIER``: step sizes, norms): only clients of that tier hold them,
  so the same rule is FedAvg per tier.

Elements no accepted update holds keep their previous value (the paper's code zeroes them).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from ...slim import SliceEntry

log = logging.getLogger(__name__)


@dataclass
class Update:
    """One client's returned tensors, where they live globally and the client's weight.

    Attributes:
        entries: where each returned tensor lives in the global state (a slice map).
        state: the returned tensors, by the submodel's keys.
        weight: the client's weight in the average.
        client: the client's id, for logs and rejections.
    """

    entries: Mapping[str, SliceEntry]
    state: Mapping[str, torch.Tensor]
    weight: float = 1.0
    client: int | str = field(default="?")


def check_update(update: Update) -> str | None:
    """Why ``update`` cannot be aggregated (missing/extra keys, wrong shape, NaN/Inf), or ``None``.

    Args:
        update: a client's update.

    Returns:
        The reason, in one line, or ``None`` when it can be aggregated.
    """
    if not (math.isfinite(update.weight) and update.weight > 0):
        return f"weight {update.weight} is not a positive number"
    missing = update.entries.keys() - update.state.keys()
    if missing:
        return f"missing tensors: {', '.join(sorted(missing)[:3])}"
    extra = update.state.keys() - update.entries.keys()
    if extra:
        return f"unexpected tensors: {', '.join(sorted(extra)[:3])}"
    for key, entry in update.entries.items():
        tensor = update.state[key]
        if tuple(tensor.shape) != tuple(entry.shape):
            return f"{key}: shape {tuple(tensor.shape)}, expected {tuple(entry.shape)}"
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"{key}: contains NaN or Inf"
    return None


@dataclass
class Sums:
    """Updates in global coordinates: per global key, the weighted sum of the values the accepted
    updates hold (``total``) and the summed weight per element (``weight``, zero where no update
    holds the element). A client's own :class:`Sums` is what secure aggregation adds up.

    Attributes:
        total: per global key, the weighted sum of the updates' values.
        weight: per global key, the summed weight of each element.
        rejected: ``(client, reason)`` of each update left out.
    """

    total: dict[str, torch.Tensor] = field(default_factory=dict)
    weight: dict[str, torch.Tensor] = field(default_factory=dict)
    rejected: list[tuple[int | str, str]] = field(default_factory=list)


def accumulate(global_state: Mapping[str, torch.Tensor], updates: list[Update], sums: Sums | None = None) -> Sums:
    """Add ``updates`` (weighted, scattered into the global shapes) to ``sums`` (new when None).

    Updates that fail :func:`check_update` are logged, listed in ``rejected`` and left out.
    Sums are float64 for integer tensors and the tensor's own dtype otherwise.

    Args:
        global_state: the global state (for the shapes).
        updates: the clients' updates.
        sums: sums to add to (new ones when ``None``).

    Returns:
        The sums, with these updates added.
    """
    sums = Sums() if sums is None else sums
    for update in updates:
        reason = check_update(update)
        if reason is not None:
            log.warning("client %s: update rejected: %s", update.client, reason)
            sums.rejected.append((update.client, reason))
            continue
        for key, entry in update.entries.items():
            gk = entry.global_key
            if gk not in sums.total:
                current = global_state[gk]
                dtype = current.dtype if current.is_floating_point() else torch.float64
                sums.total[gk] = torch.zeros(current.shape, dtype=dtype)
                sums.weight[gk] = torch.zeros(current.shape, dtype=dtype)
            entry.add_(sums.total[gk], update.state[key].to(sums.total[gk].dtype) * update.weight)
            entry.add_(sums.weight[gk], update.weight)
    return sums


def weighted_mean(global_state: Mapping[str, torch.Tensor], sums: Sums) -> dict[str, torch.Tensor]:
    """The new global state from ``sums``: each element's weighted mean where some update held
    it, its previous value elsewhere (integer tensors rounded). Untouched keys keep their objects.

    Args:
        global_state: the previous global state.
        sums: the round's sums (:func:`accumulate`).

    Returns:
        The new global state.
    """
    new_state = dict(global_state)
    for gk, total in sums.total.items():
        count = sums.weight[gk]
        held = count > 0
        mean = total / count.clamp_min(torch.finfo(count.dtype).tiny)
        current = global_state[gk]
        if not current.is_floating_point():
            mean = mean.round()
        new_state[gk] = torch.where(held, mean.to(current.dtype), current)
    return new_state


def nefedavg(
    global_state: Mapping[str, torch.Tensor], updates: list[Update]
) -> tuple[dict[str, torch.Tensor], list[tuple[int | str, str]]]:
    """Nested federated averaging of ``updates`` into a new global state.

    Returns ``(new_state, rejected)`` where ``rejected`` lists ``(client, reason)`` for updates
    that failed :func:`check_update` (they are logged and left out; the round goes on). Tensors no
    update touches are returned as the same objects; touched ones are new tensors.

    Args:
        global_state: the previous global state.
        updates: the clients' updates.

    Returns:
        ``(new_state, rejected)``.

    Examples:
        Two clients hold a 4-element tensor: one its first two elements, one all of it. The
        first two elements are averaged over both, the last two come from the second alone:

        >>> import torch
        >>> from nefl_zoo.fl import Update, nefedavg
        >>> from nefl_zoo.slim import SliceEntry
        >>> state = {"w": torch.zeros(4)}
        >>> half = {"w": SliceEntry("w", (slice(0, 2),), (2,), "weight", True)}
        >>> whole = {"w": SliceEntry("w", (slice(0, 4),), (4,), "weight", True)}
        >>> updates = [Update(half, {"w": torch.tensor([2.0, 2.0])}, client="a"),
        ...            Update(whole, {"w": torch.tensor([4.0, 4.0, 4.0, 4.0])}, client="b")]
        >>> new, rejected = nefedavg(state, updates)
        >>> new["w"], rejected
        (tensor([3., 3., 4., 4.]), [])
    """
    sums = accumulate(global_state, updates)
    return weighted_mean(global_state, sums), sums.rejected

"""Robust aggregation of nested updates as pure functions: norm bounding and element-wise
median or trimmed mean over the updates that hold each element.

A nested update holds a slice of the global state, so the clients behind one element differ
from element to element: every rule here works element by element over that element's holders
(its ``k`` updates), in global coordinates.

* :func:`clip_update` bounds a client's update ``delta = trained - global`` (over every
  floating-point tensor it returns, in global coordinates) to an L2 norm ``max_norm``: the
  delta is scaled by ``min(1, max_norm / ||delta||)``. Integer tensors (BN batch counters) are
  left as they are.
* :func:`coordinate_rule` takes per element the median of its ``k`` holders' values (the mean
  of the two middle ones for even ``k``) or the trimmed mean, which drops ``floor(trim * k)``
  values from each end and averages the rest. Both are unweighted (as Flower's FedMedian and
  FedTrimmedAvg), and both are shift-invariant, so values or deltas give the same result.
  Elements no update holds keep their previous value; integer tensors are rounded.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

import torch

from .nefedavg import Update


def update_norm(global_state: Mapping[str, torch.Tensor], update: Update) -> float:
    """The L2 norm of ``update``'s delta from ``global_state`` over its floating-point tensors."""
    squares = 0.0
    for key, entry in update.entries.items():
        value = update.state[key]
        if value.is_floating_point():
            delta = value.double() - entry.gather(global_state[entry.global_key]).double()
            squares += float((delta * delta).sum())
    return math.sqrt(squares)


def clip_update(global_state: Mapping[str, torch.Tensor], update: Update, max_norm: float) -> tuple[Update, bool]:
    """``update`` with its delta scaled to L2 norm at most ``max_norm`` and whether it was scaled
    (an update within the bound is returned as it is)."""
    norm = update_norm(global_state, update)
    if norm <= max_norm:
        return update, False
    scale = max_norm / norm
    state = {}
    for key, entry in update.entries.items():
        value = update.state[key]
        if value.is_floating_point():
            received = entry.gather(global_state[entry.global_key]).to(value.dtype)
            value = received + (value - received) * scale
        state[key] = value
    return replace(update, state=state), True


def _kept_mean(values: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """Per element, the mean of ``values`` (holders along dim 0, NaN where an update does not hold
    the element) after dropping ``cut`` values from each end of its sorted holders."""
    held = ~values.isnan()
    count = held.sum(0)
    ordered = values.sort(0).values  # NaN sort last
    position = torch.arange(values.shape[0]).view(-1, *([1] * (values.dim() - 1)))
    keep = (position >= cut) & (position < count - cut)
    total = torch.where(keep, ordered, torch.zeros((), dtype=values.dtype)).sum(0)
    return total / (count - 2 * cut).clamp_min(1)


def coordinate_rule(global_state: Mapping[str, torch.Tensor], updates: list[Update], rule: str,
                    trim: float = 0.0) -> dict[str, torch.Tensor]:
    """The new global state: per element, ``rule`` (``median`` or ``trimmed_mean`` cutting
    ``floor(trim * k)`` of its ``k`` holders from each end) over the values ``updates`` hold
    (all valid: see :func:`~.nefedavg.check_update`); elsewhere the previous value. Untouched
    keys keep their objects."""
    if rule not in ("median", "trimmed_mean"):
        raise ValueError(f"unknown coordinate rule {rule!r}")
    holders: dict[str, list[tuple[Update, str]]] = {}
    for update in updates:
        for key, entry in update.entries.items():
            holders.setdefault(entry.global_key, []).append((update, key))
    new_state = dict(global_state)
    for gk, held in holders.items():
        current = global_state[gk]
        dtype = current.dtype if current.is_floating_point() else torch.float64
        values = torch.full((len(held), *current.shape), math.nan, dtype=dtype)
        for row, (update, key) in zip(values, held):
            update.entries[key].put_(row, update.state[key].to(dtype))
        count = (~values.isnan()).sum(0)
        cut = (count - 1) // 2 if rule == "median" else (count.double() * trim).floor().long()  # as Python's int(trim * k)
        result = _kept_mean(values, cut)
        if not current.is_floating_point():
            result = result.round()
        new_state[gk] = torch.where(count > 0, result.to(current.dtype), current)
    return new_state

"""Secure aggregation of nested updates: the ``secure_aggregation:`` settings and the one flat
vector each client contributes, so that the server learns only the round's sums.

A client's vector is its own :class:`~.nefedavg.Sums` (what :func:`~.nefedavg.accumulate`
makes of its update alone) in the global shapes, flattened in a fixed key order
(:class:`Layout`): per element the weighted change ``w (u - g)`` it made (changes, not values,
so a small clipping range holds them), then its weight ``w`` (zero where its submodel does not
reach). Flower's SecAgg+ (:mod:`nefl_zoo.fl.flower.secure`) adds the vectors up without
revealing any; :meth:`Layout.sums` rebuilds the round's sums (``total = sum w (u - g) + W g``)
and :func:`~.nefedavg.weighted_mean` finishes them: NeFedAvg, FedAvg per tier, exactly the
method's own aggregation up to SecAgg+'s quantisation (:func:`sum_error`).

Weights are scaled into ``(0, 1]`` (``scale``: 1 per client, or ``1 / largest partition`` with
sample weights), so they and changes within ``clipping_range`` are quantised without clipping.
Integer tensors (BN's batch counters) change by whole batches: their changes travel in units of
:data:`INT_UNIT` counts, so counters up to ``1024 c`` fit the range (exactly, with the default
ranges and weights 1).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import numpy as np
import torch
from pydantic import Field, model_validator

from ...slim import SliceEntry
from ...userfiles import Strict, field_error
from .nefedavg import Sums, Update, accumulate, check_update

INT_UNIT = 1024  # counts per unit of an integer tensor's change in a client's vector


class LeveledMethod(Protocol):
    """What :class:`Layout` reads of a method (:class:`~nefl_zoo.fl.methods.common.Nested`): its
    levels (``info.levels``) and where each level's tensors lie in the global state."""

    info: Any

    def entries(self, level: str) -> Mapping[str, SliceEntry]: ...


class SecureAggregation(Strict):
    """``secure_aggregation:``: Flower's SecAgg+ on every round's updates (``--engine flower``
    and deployments). The fields are ``SecAggPlusWorkflow``'s (the ranges with Flower's defaults)."""

    num_shares: int | float = Field(1.0, description="shares of each client's keys: an int > 2, or a share in (0, 1] of the round's clients")
    reconstruction_threshold: int | float = Field(
        0.5, description="shares needed to unmask: an int >= 2 below num_shares, or a share in (0, 1] of num_shares (at least 2)")
    clipping_range: float = Field(8.0, gt=0, description="each element of a client's vector is clipped to [-c, c] before quantisation")
    quantization_range: int = Field(2**22, gt=0, description="elements are quantised to integers in [0, Q] (+c becomes Q)")
    modulus_range: int = Field(2**32, description="masks and sums are modulo M: a power of 2 above quantization_range, at most 2**32")

    @model_validator(mode="after")
    def _check(self) -> "SecureAggregation":
        for name in ("num_shares", "reconstruction_threshold"):
            value = getattr(self, name)
            if isinstance(value, float) and not 0 < value <= 1:
                raise field_error(name, f"a share must be in (0, 1], got {value}")
        if isinstance(self.num_shares, int) and self.num_shares <= 2:
            raise field_error("num_shares", f"an integer must be above 2, got {self.num_shares}")
        threshold = self.reconstruction_threshold
        if isinstance(threshold, int) and (threshold < 2 or isinstance(self.num_shares, int) and threshold >= self.num_shares):
            raise field_error("reconstruction_threshold", f"an integer must be at least 2 and below num_shares, got {threshold}")
        m, q = self.modulus_range, self.quantization_range
        if m > 2**32 or m & (m - 1) or m <= q:
            raise field_error("modulus_range", f"must be a power of 2 above quantization_range ({q}) and at most 2**32, got {m}")
        return self

    def step(self) -> float:
        """One quantisation step, ``2 c / Q``: a client's element is off by less than this."""
        return 2 * self.clipping_range / self.quantization_range


def sum_error(settings: SecureAggregation, clients: int) -> float:
    """Bound on the error of every summed element (a weighted change or a weight) of a round of
    ``clients``: SecAgg+ rounds each client's element stochastically to a step of ``2 c / Q``
    and sums exactly modulo M, so the sum is off by less than ``clients * 2 c / Q``. The mean of
    an element held with summed weight ``W`` and mean change ``d`` is then off by at most
    ``e (1 + |d|) / (W - e)`` for ``e = sum_error`` (integer tensors: ``e`` times
    :data:`INT_UNIT` counts, then rounded)."""
    return clients * settings.step()


class Layout:
    """Where each global tensor a method's clients can train lies in a client's flat vector
    (every global key some level's entries reach, sorted).

    Args:
        strategy: a method aggregating with :class:`~nefl_zoo.fl.methods.common.Nested`'s ``aggregate_train``.
        global_state: a global state of the method (only keys and shapes are read).
    """

    def __init__(self, strategy: LeveledMethod, global_state: Mapping[str, torch.Tensor]):
        reached = {e.global_key for level in strategy.info.levels for e in strategy.entries(level).values()}
        self.strategy = strategy
        self.shapes = {k: tuple(global_state[k].shape) for k in sorted(reached)}
        self.units = {k: 1.0 if global_state[k].is_floating_point() else float(INT_UNIT) for k in self.shapes}

    def client_vector(self, sent: Mapping[str, torch.Tensor], returned: Mapping[str, torch.Tensor], level: str,
                      weight: float, clip: float) -> tuple[list[np.ndarray], int]:
        """A client's ``[weighted changes, weights]`` (float64, the layout's order) for the
        tensors it was ``sent`` and ``returned`` at ``level`` with (scaled) ``weight``, and how
        many elements exceed ``clip`` (SecAgg+'s ``clipping_range``); ``ValueError`` for an
        update the method would reject (:func:`~.nefedavg.check_update`)."""
        entries = self.strategy.entries(level)
        reason = check_update(Update(entries, returned, weight))
        if reason is not None:
            raise ValueError(f"update rejected: {reason}")
        change = {k: returned[k].to(torch.float64) - sent[k].to(torch.float64) for k in entries}
        template = {k: torch.zeros(s, dtype=torch.float64) for k, s in self.shapes.items()}
        own = accumulate(template, [Update(entries, change, weight)])
        total = np.concatenate([own.total.get(k, template[k]).reshape(-1).numpy() / self.units[k] for k in self.shapes])
        weights = np.concatenate([own.weight.get(k, template[k]).reshape(-1).numpy() for k in self.shapes])
        return [total, weights], int((np.abs(total) > clip).sum() + (weights > clip).sum())

    def sums(self, global_state: Mapping[str, torch.Tensor], total: np.ndarray, weights: np.ndarray, error: float) -> Sums:
        """The round's :class:`~.nefedavg.Sums` from the summed vector: summed weights within
        ``error`` of zero are zero (no client held the element; a held one has at least the
        smallest scaled weight, far above it), totals are changes plus ``W g``."""
        weights = np.where(weights > error, weights, 0.0)
        sums, at = Sums(), 0
        for key, shape in self.shapes.items():
            n = int(np.prod(shape))
            w = torch.from_numpy(weights[at: at + n].reshape(shape).copy())
            t = torch.from_numpy(np.array(total[at: at + n].reshape(shape) * self.units[key]))
            sums.total[key] = t * (w > 0) + w * global_state[key].to(torch.float64)
            sums.weight[key] = w
            at += n
        return sums

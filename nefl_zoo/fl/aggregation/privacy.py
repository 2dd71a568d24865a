"""Client-level differential privacy of nested updates (DP-FedAvg, McMahan et al., ICLR 2018),
as pure functions: the noisy mean with fixed denominators and the privacy accountant.

A round: every client's update ``delta_k = trained - global`` is clipped in global coordinates
to L2 norm ``C`` (:func:`~.robust.clip_update`; every floating-point tensor it returns, BN
statistics included), so one client changes the vector of per-element sums by at most ``C``.
Gaussian noise ``N(0, (z C)^2)`` is added to every element of that sum, and element ``e`` of
the global state moves by ``(sum_k delta_k[e] + noise[e]) / D_e``, where the fixed denominator
``D_e`` is the number of this round's sampled clients the server assigned a submodel holding
``e`` (DP-FedAvg's fixed denominator, per element: a client that fails or is rejected still
counts, so ``D_e`` does not depend on any client's data). Every client weighs 1. The noise on
the new value of ``e`` thus has standard deviation ``z C / D_e``: an element held by few clients
(the widest channels) gets noise relative to that count, larger than a shared element's. Elements
no assigned client holds, and integer tensors (BN batch counters), keep their values.

The noise is drawn from a generator seeded by the run seed and the round, so a resumed run is
bit-identical. The accountant is ``dp-accounting``'s RDP accountant composing, once per round,
the Poisson-subsampled Gaussian mechanism with sampling rate ``q = clients.fraction`` and noise
multiplier ``z`` (the standard DP-FedAvg accounting; the engine samples a fixed number of
clients, which this treats as Poisson sampling at that rate, as DP-FedAvg and Flower do).
"""

from __future__ import annotations

import logging
from typing import Mapping

import numpy as np
import torch

from ...slim import SliceEntry
from .nefedavg import Update


def noise_generator(seed: int, server_round: int) -> torch.Generator:
    """The generator of one round's noise, seeded by the run seed and the (1-based) round."""
    state = np.random.SeedSequence([seed, server_round - 1, 0xD9]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def private_mean(global_state: Mapping[str, torch.Tensor], updates: list[Update], assigned: list[Mapping[str, SliceEntry]],
                 clip: float, noise_multiplier: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The new global state: ``global + (sum of deltas + N(0, (noise_multiplier * clip)^2)) / D``
    per element (see the module docstring), from ``updates`` already clipped to ``clip`` (all
    valid) and the slice entries of every assigned client (``assigned``, the denominators).
    Keys are noised in sorted order; keys no assigned client holds keep their objects."""
    denominators: dict[str, torch.Tensor] = {}
    for entries in assigned:
        for entry in entries.values():
            current = global_state[entry.global_key]
            if current.is_floating_point():
                count = denominators.setdefault(entry.global_key, torch.zeros(current.shape, dtype=current.dtype))
                entry.add_(count, 1.0)
    totals = {gk: torch.zeros_like(count) for gk, count in denominators.items()}
    for update in updates:
        for key, entry in update.entries.items():
            if entry.global_key in totals:
                received = entry.gather(global_state[entry.global_key])
                entry.add_(totals[entry.global_key], update.state[key].to(received.dtype) - received)
    new_state = dict(global_state)
    std = noise_multiplier * clip
    for gk in sorted(totals):
        current, count = global_state[gk], denominators[gk]
        noise = torch.randn(current.shape, generator=generator, dtype=current.dtype) * std
        step = (totals[gk] + noise) / count.clamp_min(1)
        new_state[gk] = torch.where(count > 0, current + step, current)
    return new_state


def epsilon(rate: float, noise_multiplier: float, rounds: int, delta: float) -> float:
    """The epsilon at ``delta`` after ``rounds`` rounds of the Poisson-subsampled Gaussian
    mechanism (sampling ``rate``, ``noise_multiplier``), by ``dp-accounting``'s RDP accountant."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # it warns for every RDP order whose series does not converge (left out, as it says)
    try:
        accountant = RdpAccountant()
        accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(noise_multiplier)), rounds)
        return float(accountant.get_epsilon(delta))
    finally:
        absl.setLevel(level)

"""Pick a tier (width ratio and kept blocks) that reaches a target parameter ratio."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from .models import NestedNet, count_params, create_model
from .spec import TierSpec

Mode = Literal["balanced", "width", "depth"]
TOLERANCE = 0.01  # relative
MIN_BALANCED_GAMMA = 0.005**2  # below it, balanced mode's width ratio round(sqrt(gamma), 2) is 0


@dataclass
class AutoTier:
    """The chosen tier, its measured parameter ratio and whether it is within 1% of the target."""

    tier: TierSpec
    params_ratio: float
    within_tolerance: bool
    note: str


def _meta_model(name: str, model_args: dict, gamma_w: float = 1.0) -> NestedNet:
    with torch.device("meta"):
        return create_model(name, **model_args, gamma_w=gamma_w)


def _block_params(model: NestedNet) -> tuple[int, list[list[int]]]:
    """Parameters outside residual branches, and each branch's parameters per stage."""
    per_block = [[0] * d for d in model.stage_depths]
    for stage, block, module in model.residual_blocks():
        per_block[stage][block] = sum(p.numel() for _, p in module.branch_parameters())
    return count_params(model) - sum(map(sum, per_block)), per_block


def _width_search(name: str, model_args: dict, target: float, full: int) -> tuple[float, float]:
    """``gamma_w`` on a 0.001 grid whose width-only ratio is closest to ``target``.

    The parameter count grows with ``gamma_w``, so a bisection finds the first grid point at
    or above the target; it or its predecessor is the closest.
    """
    @functools.cache
    def ratio(k: int) -> float:
        return count_params(_meta_model(name, model_args, k / 1000)) / full

    lo, hi = 1, 1000
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ratio(mid) < target else (lo, mid)
    candidates = [(abs(ratio(k) - target), k) for k in {lo, max(1, lo - 1)}]
    _, k = min(candidates)
    return k / 1000, ratio(k)


def _depth_search(name: str, model_args: dict, gamma_w: float, target: float, full: int):
    """Kept-prefix length per stage: the most balanced within tolerance, else the closest."""
    base, blocks = _block_params(_meta_model(name, model_args, gamma_w))
    prefix = [list(itertools.accumulate(stage)) for stage in blocks]
    best = None
    for kept in itertools.product(*(range(1, len(stage) + 1) for stage in blocks)):
        ratio = (base + sum(prefix[s][k - 1] for s, k in enumerate(kept))) / full
        fractions = [k / len(stage) for k, stage in zip(kept, blocks)]
        miss = abs(ratio - target)
        spread = max(fractions) - min(fractions)
        # within tolerance, prefer stages kept in equal proportion; else the closest ratio
        key = (0, spread, miss) if miss <= TOLERANCE * target else (1, miss, spread)
        if best is None or key < best[0]:
            best = (key, kept, ratio)
    _, kept, ratio = best
    steps = [[1.0 if j < k else 0.0 for j in range(len(stage))] for k, stage in zip(kept, blocks)]
    return steps, ratio


def auto_tier(model: str, gamma: float, mode: Mode = "balanced", name: str | None = None, **model_args) -> AutoTier:
    """A tier of ``model`` whose measured parameter ratio is closest to ``gamma``.

    ``width`` narrows only, ``depth`` removes trailing blocks of each stage only, and
    ``balanced`` narrows to ``gamma_w ~ sqrt(gamma)`` and removes blocks for the rest, so
    that gamma_W ~ gamma_D as in the NeFL paper.
    """
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if mode not in ("balanced", "width", "depth"):
        raise ValueError(f"mode must be balanced, width or depth, got {mode!r}")
    if mode == "balanced" and round(math.sqrt(gamma), 2) == 0:
        raise ValueError(
            f"gamma {gamma:g} is too small for balanced mode (its width ratio sqrt(gamma) rounds to 0): "
            f"give a gamma of at least {MIN_BALANCED_GAMMA:g}, or use width or depth mode"
        )
    full = count_params(_meta_model(model, model_args))
    name = name or f"g{gamma:g}"
    if gamma == 1:
        steps, gamma_w, ratio = None, 1.0, 1.0
    elif mode == "width":
        steps = None
        gamma_w, ratio = _width_search(model, model_args, gamma, full)
    else:
        gamma_w = 1.0 if mode == "depth" else round(math.sqrt(gamma), 2)
        steps, ratio = _depth_search(model, model_args, gamma_w, gamma, full)
    within = abs(ratio - gamma) <= TOLERANCE * gamma
    note = "" if within else (
        f"{model} cannot reach parameter ratio {gamma:g} within 1% in {mode} mode; "
        f"closest is {ratio:.4f}"
    )
    tier = TierSpec(name=name, gamma_w=gamma_w, steps=steps, gamma=gamma)
    return AutoTier(tier=tier, params_ratio=ratio, within_tolerance=within, note=note)

"""Pick a tier (width ratio and kept blocks) that reaches a target parameter ratio
(:func:`auto_tier`), or the largest that meets a latency budget on this machine
(:func:`latency_tier`)."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from .models import NestedNet, count_params, create_model
from .models.registry import default_channel_multiple
from .spec import SubmodelSpec, TierSpec

Mode = Literal["balanced", "width", "depth"]
TOLERANCE = 0.01  # relative
ALIGNED_TOLERANCE = 0.02  # relative, with channel_multiple > 1 (widths move in steps)


def tolerance_for(channel_multiple: int) -> float:
    """Relative tolerance of a tier's parameter ratio: 1%, or 2% with aligned widths.

    Args:
        channel_multiple: the multiple widths are rounded to (1: the paper's widths).

    Returns:
        The tolerance, as a fraction of the target ratio.

    Examples:
        >>> from nefl_zoo.auto import tolerance_for
        >>> tolerance_for(1), tolerance_for(8)
        (0.01, 0.02)
    """
    return TOLERANCE if channel_multiple == 1 else ALIGNED_TOLERANCE
MIN_BALANCED_GAMMA = 0.005**2  # below it, balanced mode's width ratio round(sqrt(gamma), 2) is 0


@dataclass
class AutoTier:
    """The chosen tier, its measured parameter ratio and whether it is within tolerance of the
    target (1%, or 2% with aligned widths). What :func:`auto_tier` returns.

    Attributes:
        tier: the tier, ready for a spec's ``tiers`` list.
        params_ratio: its parameters over the full model's, as measured.
        within_tolerance: whether ``params_ratio`` is within tolerance of the target.
        note: why not, when it is not (empty otherwise).
    """

    tier: TierSpec
    params_ratio: float
    within_tolerance: bool
    note: str


def _meta_model(name: str, model_args: dict, gamma_w: float = 1.0, channel_multiple: int = 1) -> NestedNet:
    with torch.device("meta"):
        return create_model(name, **model_args, gamma_w=gamma_w, channel_multiple=channel_multiple)


def _block_params(model: NestedNet) -> tuple[int, list[list[int]]]:
    """Parameters outside residual branches, and each branch's parameters per stage."""
    per_block = [[0] * d for d in model.stage_depths]
    for stage, block, module in model.residual_blocks():
        per_block[stage][block] = sum(p.numel() for _, p in module.branch_parameters())
    return count_params(model) - sum(map(sum, per_block)), per_block


def _width_search(name: str, model_args: dict, target: float, full: int, multiple: int) -> tuple[float, float]:
    """``gamma_w`` on a 0.001 grid whose width-only ratio is closest to ``target``.

    The parameter count grows with ``gamma_w``, so a bisection finds the first grid point at
    or above the target; it or its predecessor is the closest.
    """
    @functools.cache
    def ratio(k: int) -> float:
        return count_params(_meta_model(name, model_args, k / 1000, multiple)) / full

    lo, hi = 1, 1000
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ratio(mid) < target else (lo, mid)
    candidates = [(abs(ratio(k) - target), k) for k in {lo, max(1, lo - 1)}]
    _, k = min(candidates)
    return k / 1000, ratio(k)


def _depth_search(name: str, model_args: dict, gamma_w: float, target: float, full: int, multiple: int):
    """Kept-prefix length per stage: the most balanced within tolerance, else the closest."""
    tolerance = tolerance_for(multiple)
    model = _meta_model(name, model_args, gamma_w, multiple)
    base, blocks = _block_params(model)
    prefix = [list(itertools.accumulate(stage)) for stage in blocks]
    fixed = model.fixed_blocks()  # a kept prefix holds every block that cannot be skipped
    least = [1 + max((j for s_, j in fixed if s_ == s), default=0) for s in range(len(blocks))]
    best = None
    for kept in itertools.product(*(range(least[s], len(stage) + 1) for s, stage in enumerate(blocks))):
        ratio = (base + sum(prefix[s][k - 1] for s, k in enumerate(kept))) / full
        fractions = [k / len(stage) for k, stage in zip(kept, blocks)]
        miss = abs(ratio - target)
        spread = max(fractions) - min(fractions)
        # within tolerance, prefer stages kept in equal proportion; else the closest ratio
        key = (0, spread, miss) if miss <= tolerance * target else (1, miss, spread)
        if best is None or key < best[0]:
            best = (key, kept, ratio)
    _, kept, ratio = best
    steps = [[1.0 if j < k else 0.0 for j in range(len(stage))] for k, stage in zip(kept, blocks)]
    return steps, ratio


def _balanced_search(name: str, model_args: dict, gamma: float, full: int, multiple: int):
    """``gamma_w ~ sqrt(gamma)`` and the depth for the rest. With aligned widths the rounded
    width may not leave the depth search a solution; then the other widths are tried, nearest
    ``gamma_w`` first (0.01 grid), until one lands within tolerance, else the closest is kept."""
    tolerance = tolerance_for(multiple)
    start = round(math.sqrt(gamma), 2)
    best, seen = None, set()
    grid = sorted(range(1, 101), key=lambda k: abs(k - start * 100))
    for gamma_w in ([start] if multiple == 1 else [k / 100 for k in grid]):
        widths = tuple(info["num_chs"] for info in _meta_model(name, model_args, gamma_w, multiple).feature_info)
        if widths in seen:
            continue
        seen.add(widths)
        steps, ratio = _depth_search(name, model_args, gamma_w, gamma, full, multiple)
        if best is None or abs(ratio - gamma) < abs(best[2] - gamma):
            best = (gamma_w, steps, ratio)
        if abs(ratio - gamma) <= tolerance * gamma:
            return gamma_w, steps, ratio
    return best


def auto_tier(
    model: str, gamma: float, mode: Mode = "balanced", name: str | None = None, channel_multiple: int | None = None, **model_args
) -> AutoTier:
    """A tier of ``model`` whose measured parameter ratio is closest to ``gamma``.

    ``width`` narrows only, ``depth`` removes trailing blocks of each stage only, and
    ``balanced`` narrows to ``gamma_w ~ sqrt(gamma)`` and removes blocks for the rest, so
    that gamma_W ~ gamma_D as in the NeFL paper. ``channel_multiple`` > 1 rounds every width
    to a multiple of it (:func:`~nefl_zoo.models.base.scale_width`); the tolerance is then 2%.
    ``None``: the model's own rule (1, or 8 for the mobile families). Blocks the model cannot
    skip (:meth:`~nefl_zoo.models.NestedNet.fixed_blocks`) are always kept.

    Args:
        model: a registered model name (``resnet20``, ``torchvision:resnet18``, ...).
        gamma: the target parameter ratio, in (0, 1].
        mode: ``balanced``, ``width`` or ``depth``.
        name: the tier's name (default ``g{gamma}``).
        channel_multiple: round every width to a multiple of this (default: the model's rule).
        **model_args: ``create_model`` arguments of the model (``num_classes``, ...).

    Returns:
        The tier, its measured parameter ratio, and whether that is within tolerance.

    Raises:
        ValueError: ``gamma`` outside (0, 1], an unknown ``mode``, a ``channel_multiple``
            below 1, or a ``gamma`` too small for balanced mode.

    Examples:
        >>> import nefl_zoo as nz
        >>> found = nz.auto_tier("resnet20", 0.5, num_classes=10)
        >>> found.tier.gamma_w, found.tier.steps
        (0.71, [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
        >>> round(found.params_ratio, 3), found.within_tolerance
        (0.497, True)
    """
    default_multiple = default_channel_multiple(model)
    channel_multiple = default_multiple if channel_multiple is None else channel_multiple
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if mode not in ("balanced", "width", "depth"):
        raise ValueError(f"mode must be balanced, width or depth, got {mode!r}")
    if channel_multiple < 1:
        raise ValueError(f"channel_multiple must be >= 1, got {channel_multiple}")
    if mode == "balanced" and round(math.sqrt(gamma), 2) == 0:
        raise ValueError(
            f"gamma {gamma:g} is too small for balanced mode (its width ratio sqrt(gamma) rounds to 0): "
            f"give a gamma of at least {MIN_BALANCED_GAMMA:g}, or use width or depth mode"
        )
    full = count_params(_meta_model(model, model_args))
    name = name or f"g{gamma:g}"
    tolerance = tolerance_for(channel_multiple)
    if gamma == 1:
        steps, gamma_w, ratio = None, 1.0, 1.0
    elif mode == "width":
        steps = None
        gamma_w, ratio = _width_search(model, model_args, gamma, full, channel_multiple)
    elif mode == "depth":
        gamma_w = 1.0
        steps, ratio = _depth_search(model, model_args, gamma_w, gamma, full, channel_multiple)
    else:
        gamma_w, steps, ratio = _balanced_search(model, model_args, gamma, full, channel_multiple)
    within = abs(ratio - gamma) <= tolerance * gamma
    aligned = f" with channels a multiple of {channel_multiple}" if channel_multiple > 1 else ""
    note = "" if within else (
        f"{model} cannot reach parameter ratio {gamma:g} within {tolerance:.0%} in {mode} mode{aligned}; "
        f"closest is {ratio:.4f}"
    )
    tier = TierSpec(
        name=name, gamma_w=gamma_w, steps=steps, gamma=gamma,
        channel_multiple=channel_multiple if channel_multiple != default_multiple else None,
    )
    return AutoTier(tier=tier, params_ratio=ratio, within_tolerance=within, note=note)


@dataclass
class LatencyTier:
    """The largest tier found within a latency budget, with its measured latency and every
    candidate measured on the way. What :func:`latency_tier` returns.

    Attributes:
        tier: the tier, ready for a spec's ``tiers`` list.
        params_ratio: its parameters over the full model's.
        latency_ms: its measured onnxruntime latency.
        budget_ms: the budget it was found for.
        candidates: every candidate measured, as ``(gamma, params ratio, ms)``.
    """

    tier: TierSpec
    params_ratio: float
    latency_ms: float
    budget_ms: float
    candidates: list[tuple[float, float, float]]


def latency_tier(
    model: str,
    budget_ms: float,
    batch: int = 1,
    threads: int | None = 1,
    mode: Mode = "balanced",
    channel_multiple: int | None = None,
    runs: int = 20,
    **model_args,
) -> LatencyTier:
    """The largest tier of ``model`` whose onnxruntime latency at ``batch`` with ``threads``
    on this machine is within ``budget_ms``, by measurement.

    Candidates are :func:`auto_tier` tiers for a target ``gamma`` on a 0.01 grid; each is
    exported as ``nefl-zoo export`` would (BatchNorm folded) and timed (median of ``runs``,
    :func:`~nefl_zoo.export.onnx_file.onnx_latency_ms`). The full model is tried first, then a
    bisection over ``gamma`` between the smallest candidate (0.02) and 1, which assumes that
    latency grows with ``gamma`` (aligned widths make it so).

    Args:
        model: a registered model name.
        budget_ms: the latency budget in milliseconds.
        batch: the batch the latency is measured at.
        threads: onnxruntime intra-op threads (``None``: one per core).
        mode: how candidates are made smaller, as in :func:`auto_tier`.
        channel_multiple: round every width to a multiple of this (default: the model's rule).
        runs: timed runs per candidate (the median counts).
        **model_args: ``create_model`` arguments of the model.

    Returns:
        The largest tier within the budget, its latency and every candidate measured.

    Raises:
        ValueError: a budget that is not positive, or one that even the smallest candidate
            misses.
    """
    from .export.onnx_file import onnx_latency_ms
    from .slim import compile_spec

    if not budget_ms > 0:
        raise ValueError(f"latency budget must be > 0 ms, got {budget_ms:g}")
    measured: dict[int, tuple[AutoTier, float]] = {}
    by_tier: dict[str, float] = {}  # neighbouring gammas often give the same tier

    def fits(k: int) -> bool:
        found = auto_tier(model, k / 100, mode, channel_multiple=channel_multiple, **model_args)
        spec = SubmodelSpec(model=model, model_args=model_args, tiers=[found.tier])
        key = repr(spec.tier_args(found.tier))
        if key not in by_tier:
            module = compile_spec(spec)[found.tier.name].build()
            by_tier[key] = onnx_latency_ms(module, tuple(module.default_cfg["input_size"]), batch, threads, runs)
        measured[k] = (found, by_tier[key])
        return by_tier[key] <= budget_ms

    lo, hi = 2, 100
    if fits(hi):
        lo = hi
    elif not fits(lo):
        found, ms = measured[lo]
        raise ValueError(
            f"no tier of {model} meets {budget_ms:g} ms at batch {batch}: the smallest tried "
            f"({found.tier.name}, parameter ratio {found.params_ratio:.3f}) takes {ms:.3f} ms"
        )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    found, ms = measured[lo]
    candidates = [(k / 100, f.params_ratio, t) for k, (f, t) in sorted(measured.items())]
    return LatencyTier(tier=found.tier, params_ratio=found.params_ratio, latency_ms=ms, budget_ms=budget_ms, candidates=candidates)

"""The budget-driven selector of :class:`~.tiers.TierRuntime`: the most accurate (tier,
precision) within every budget, and why, in one line."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..bounds import MAX_MS, MIN_MS, number
from ..manifest import TierEntry

Cost = Callable[[TierEntry], float]  # what an entry costs, in a budget's unit
Check = tuple[str, Cost, float]  # a budget: its description, the cost it limits, the limit


class NoTierFits(ValueError):
    """No tier of the manifest meets the budget."""


@dataclass(frozen=True)
class Selection:
    """The (tier, precision) :meth:`TierRuntime.select` chose, and why.

    Attributes:
        tier: the chosen tier's name.
        reason: why, in one line (the budget, what fits, its latency).
        fitting: the labels of every entry within the budget.
        precision: the chosen entry's precision.
        label: the chosen entry's label (``NAME`` or ``NAME:PRECISION``).
    """

    tier: str
    reason: str
    fitting: tuple[str, ...]
    precision: str
    label: str  # the entry's label: the tier name for FP32, else NAME:PRECISION


@dataclass(frozen=True)
class Budget:
    """The limits an entry must meet (``None``: no limit), the latency and memory ones at
    ``batch``; ``ValueError`` when made with a limit that is negative or not finite, or a batch
    below 1."""

    latency_ms: float | None = None
    max_macs: float | None = None
    max_params: float | None = None
    max_memory_mb: float | None = None
    max_file_mb: float | None = None
    batch: int = 1

    def __post_init__(self) -> None:
        for name in ("latency_ms", "max_macs", "max_params", "max_memory_mb", "max_file_mb"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch: must be an integer >= 1, got {self.batch}")

    def checks(self, latency: Cost) -> list[Check]:
        """Each limit given, with the cost it limits (``latency``: an entry's expected latency)."""
        batch, checks = self.batch, []
        if self.latency_ms is not None:
            checks.append((f"latency <= {self.latency_ms:g} ms", latency, self.latency_ms))
        if self.max_macs is not None:
            checks.append((f"MACs <= {self.max_macs:,.0f}", lambda t: t.macs, self.max_macs))
        if self.max_params is not None:
            checks.append((f"params <= {self.max_params:,.0f}", lambda t: t.params, self.max_params))
        if self.max_memory_mb is not None:
            checks.append((f"memory <= {self.max_memory_mb:g} MB at batch {batch}", lambda t: t.memory_mb(batch),
                           self.max_memory_mb))
        if self.max_file_mb is not None:
            checks.append((f"file <= {self.max_file_mb:g} MB", lambda t: t.weights_mb, self.max_file_mb))
        return checks


def expected_latency(entries: Sequence[TierEntry], latencies: Mapping[str, float] | None,
                     latency_source: str) -> tuple[Cost, str]:
    """The latency each of ``entries`` is judged by, and where it was measured: ``latencies``
    (label -> ms, measured ``latency_source``) when given, else the manifest's, ``on export``.
    ``ValueError`` for ``latencies`` missing an entry, or with a latency the adaptive policy
    would refuse as an estimate (below a microsecond or above a day)."""
    if latencies is None:
        return (lambda t: t.latency.median_ms), "on export"
    missing = [t.label for t in entries if t.label not in latencies]
    if missing:
        raise ValueError(f"latencies: no latency for {', '.join(missing)} (measured {latency_source})")
    for t in entries:  # what the adaptive policy takes as an estimate, no less
        number(f"latencies[{t.label}]", latencies[t.label], MIN_MS, MAX_MS)
    return (lambda t: latencies[t.label]), latency_source


def _best(fitting: Sequence[TierEntry]) -> tuple[TierEntry, str]:
    """The most accurate of ``fitting`` (ties: fewer MACs, then the smaller file), or the largest
    by MACs when some entry has no measured accuracy; and why, in words."""
    if all(t.accuracy is not None for t in fitting):
        best = max(fitting, key=lambda t: (t.accuracy, -t.macs, -t.weights_mb))
        return best, f"most accurate (accuracy {best.accuracy:.4g})"
    best = max(fitting, key=lambda t: (t.macs, t.params, t.weights_mb))
    return best, f"largest ({best.macs:,} MACs; accuracy not measured for every tier)"


def select_entry(entries: Sequence[TierEntry], budget: Budget, latencies: Mapping[str, float] | None = None,
                 latency_source: str = "on export") -> Selection:
    """The best of ``entries`` within ``budget`` (:func:`_best`), latencies judged as
    :func:`expected_latency` says; :class:`NoTierFits`, naming what the smallest entry needs,
    when none fits."""
    latency, latency_source = expected_latency(entries, latencies, latency_source)
    checks = budget.checks(latency)
    fitting = [t for t in entries if all(cost(t) <= limit for _, cost, limit in checks)]
    described = " and ".join(label for label, _, _ in checks) or "no budget"
    if not fitting:
        cheapest = min(entries, key=lambda t: (t.macs, t.weights_mb))
        needs = ", ".join(f"{label.split(' <=')[0]} {cost(cheapest):,.4g}" for label, cost, _ in checks)
        raise NoTierFits(f"no tier fits {described}; the smallest, {cheapest.label}, needs {needs}")
    best, why = _best(fitting)
    at = budget.batch if latencies is not None else best.latency.batch
    reason = (
        f"{best.label}: {why} of {len(fitting)}/{len(entries)} tiers within {described}; "
        f"{latency(best):.3g} ms at batch {at} {latency_source}"
    )
    return Selection(best.name, reason, tuple(t.label for t in fitting), best.precision, best.label)

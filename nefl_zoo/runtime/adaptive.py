"""AdaptivePolicy: serve each request with the most accurate entry expected to meet a deadline.

Pure and deterministic (standard library only, no threads, no randomness): the same
``observe`` calls at the same clock values give the same choices. Per request::

    label = policy.choose()            # the entry that serves this request
    ...                                # run it, time it
    policy.observe(label, elapsed_ms)

Rules:

* Ladder: the candidates that no other candidate dominates (at least as accurate and
  expected no slower; ties go to fewer MACs, then the label), fastest first, so each step up
  is more accurate and slower. Accuracy ranks them when every candidate has one, else MACs.
  Counted from the start entry, each rung kept is at least ``min_speedup`` times faster than
  the kept rung above it (and slower than the one below): a step down must buy more latency
  than the noise between two entries of about equal speed.
* Slowdown: every observation becomes a ratio, ``ms / expected_ms`` of the entry that ran it
  (its baseline: the idle latency it was given, never refined, so a uniform error in the
  baselines is absorbed by the slowdown). :attr:`AdaptivePolicy.slowdown` is the
  ``percentile`` of the last ``window`` ratios (1 before any), and an entry's expected
  latency is its baseline times the slowdown.
* Start: the most accurate entry whose baseline is within ``headroom * ms``, else the fastest.
* Threat: an observation after which both that request and the percentile put the current
  entry over ``headroom * ms``. A single slow request among ``window`` is what
  ``percentile`` allows (a jitter outlier does not move the policy); the second one within
  the window makes the percentile the new load's; a fast request is never a threat, however
  slow the older ones in the window were. On a threat the policy steps down at once to the
  most accurate entry within ``headroom * ms`` under the slowdown (several steps if need
  be; the fastest if none).
* Probe: after a quiet period (``probe_after_s * backoff`` seconds of the clock with no
  threat and no switch, and at least one observation since the last switch) one step up,
  only when that entry, slowed as much as the slowest of the last ``recent`` requests, is
  expected within ``up_margin * headroom * ms``: stricter than the step-down rule
  (hysteresis), and as quick to see a load end as ``recent`` requests.
* Backoff: the start and every probe are on trial until they go ``probe_after_s`` without a
  threat (which resets the backoff to 1); a threat while on trial doubles the backoff (at
  most ``max_backoff``), so an entry that fails at a boundary is probed ever more rarely.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from ..bounds import MAX_MS, MAX_WAIT_S, MAX_WINDOW, MIN_MS, number

MAX_BACKOFF = 1_000_000  # probes at most once per million quiet periods
MAX_SPEEDUP = 1_000  # a ladder spaced wider than that has a single rung


@dataclass(frozen=True)
class Candidate:
    """One (tier, precision) entry: its label (``g0.6``, ``g0.6:int8``), accuracy (``None``:
    not measured), MACs and its latency on this device at the request batch when idle (from a
    microsecond to a day).

    Attributes:
        label: the entry's label.
        accuracy: its accuracy, or ``None`` when not measured.
        macs: its MACs per image.
        expected_ms: its latency when the device is idle, in milliseconds.
    """

    label: str
    accuracy: float | None
    macs: int
    expected_ms: float

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"Candidate.label: must be a non-empty string, got {self.label!r}")
        if self.accuracy is not None and not (
            isinstance(self.accuracy, (int, float)) and math.isfinite(self.accuracy)
        ):
            raise ValueError(f"Candidate {self.label!r}: accuracy must be a finite number or None, got {self.accuracy!r}")
        number(f"Candidate {self.label!r} macs", self.macs, 0, integer=True)
        number(f"Candidate {self.label!r} expected_ms", self.expected_ms, MIN_MS, MAX_MS)


@dataclass(frozen=True)
class Deadline:
    """The policy's settings: each request should finish within ``ms``.

    ``percentile`` (%) of the recent slowdowns is the one estimates use; ``window`` is how
    many recent observations they keep; an entry is served only when its expected latency is
    within ``headroom * ms``, and probed only when within ``up_margin * headroom * ms`` at the
    slowdown of the slowest of the last ``recent`` requests; ``probe_after_s`` is the quiet
    period before a probe, multiplied by a backoff of at most ``max_backoff`` after failed
    probes; ``min_speedup`` is the least latency ratio between neighbouring rungs.

    Every setting is checked (``ValueError`` naming it): ``ms`` from a microsecond to a day,
    ``window`` and ``recent`` at most 10000, ``probe_after_s`` at most a day, ``max_backoff``
    at most a million and ``min_speedup`` at most 1000, so no product of them overflows and no
    quiet period is endless.

    Attributes:
        ms: the deadline, in milliseconds.
        percentile: the percentile of recent slowdowns that estimates use.
        window: how many recent observations are kept.
        headroom: the share of ``ms`` an entry's expected latency may take.
        probe_after_s: the quiet period before probing a step up, in seconds.
        up_margin: the stricter share (of ``headroom * ms``) a probe must fit.
        max_backoff: the largest factor failed probes multiply the quiet period by.
        recent: how many of the last requests a probe's estimate considers.
        min_speedup: the least latency ratio between neighbouring rungs of the ladder.
    """

    ms: float
    percentile: float = 95.0
    window: int = 20
    headroom: float = 0.9
    probe_after_s: float = 0.5
    up_margin: float = 0.9
    max_backoff: float = 32.0
    recent: int = 3
    min_speedup: float = 1.2

    def __post_init__(self) -> None:
        def check(name: str, low: float, high: float, **kind: bool) -> None:
            number(f"Deadline.{name}", getattr(self, name), low, high, **kind)

        check("ms", MIN_MS, MAX_MS)
        check("percentile", 0, 100, open_low=True)
        check("window", 1, MAX_WINDOW, integer=True)
        check("recent", 1, MAX_WINDOW, integer=True)
        check("headroom", 0, 1, open_low=True)
        check("probe_after_s", 0, MAX_WAIT_S)
        check("up_margin", 0, 1, open_low=True, open_high=True)
        check("max_backoff", 1, MAX_BACKOFF)
        check("min_speedup", 1, MAX_SPEEDUP)


class Switch(NamedTuple):
    """One change of the served entry: when (clock time), from and to which label, and why."""

    at: float
    from_label: str
    to_label: str
    reason: str


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (%) of ``values``, interpolated linearly between the closest
    ranks (numpy's default)."""
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def build_ladder(candidates: Sequence[Candidate], budget_ms: float = math.inf, min_speedup: float = 1.0) -> list[Candidate]:
    """The candidates no other dominates, fastest first, spaced ``min_speedup`` apart from the
    most accurate one within ``budget_ms`` (see the module docstring)."""
    by_accuracy = all(c.accuracy is not None for c in candidates)

    def rank(candidate: Candidate) -> float:
        return candidate.accuracy if by_accuracy and candidate.accuracy is not None else candidate.macs

    front: list[Candidate] = []
    for candidate in sorted(candidates, key=lambda c: (c.expected_ms, -rank(c), c.macs, c.label)):
        if not front or rank(candidate) > rank(front[-1]):
            front.append(candidate)
    start = max([i for i, c in enumerate(front) if c.expected_ms <= budget_ms], default=0)
    below, above = [front[start]], [front[start]]
    for candidate in reversed(front[:start]):
        if candidate.expected_ms * min_speedup <= below[-1].expected_ms:
            below.append(candidate)
    for candidate in front[start + 1:]:
        if candidate.expected_ms >= above[-1].expected_ms * min_speedup:
            above.append(candidate)
    return below[::-1] + above[1:]


class AdaptivePolicy:
    """Chooses, request by request, the most accurate candidate expected to meet ``deadline``
    from the latencies it observes (rules in the module docstring).

    Args:
        candidates: the entries it may serve; at least one, labels unique.
        deadline: the deadline and the policy's settings.
        clock: seconds, monotonic (injectable for tests).

    Raises:
        ValueError: no candidate, or two with one label.

    Examples:
        >>> from nefl_zoo.runtime import AdaptivePolicy, Candidate, Deadline
        >>> now = [0.0]
        >>> policy = AdaptivePolicy([Candidate("g0.2", 0.6, 1_000_000, 2.0),
        ...                          Candidate("g0.6", 0.75, 6_000_000, 7.0),
        ...                          Candidate("g1", 0.8, 12_000_000, 12.0)],
        ...                         Deadline(ms=10), clock=lambda: now[0])
        >>> policy.ladder, policy.choose()
        (('g0.2', 'g0.6', 'g1'), 'g0.6')
        >>> for _ in range(19):  # requests as fast as expected
        ...     policy.observe("g0.6", 7.0)
        >>> policy.observe("g0.6", 14.0)  # one slow request in 20: an outlier
        >>> policy.choose()
        'g0.6'
        >>> policy.observe("g0.6", 15.0)  # a second: the deadline is threatened
        >>> policy.choose()
        'g0.2'
    """

    def __init__(
        self, candidates: Sequence[Candidate], deadline: Deadline, clock: Callable[[], float] = time.monotonic
    ):
        if not candidates:
            raise ValueError("candidates: must hold at least one Candidate, got none")
        labels = [c.label for c in candidates]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise ValueError(f"candidates: duplicate labels {', '.join(duplicates)}")
        self.deadline = deadline
        self._clock = clock
        self._baseline = {c.label: c.expected_ms for c in candidates}
        self._ladder = build_ladder(candidates, deadline.headroom * deadline.ms, deadline.min_speedup)
        self._ratios: deque[float] = deque(maxlen=deadline.window)
        self._recent: deque[float] = deque(maxlen=deadline.recent)
        self._slowdown = 1.0
        self._index = self._fitting_index(1.0)
        self._quiet_since = clock()
        self._on_trial = True  # the start is a guess from the idle estimates, like a probe
        self._backoff = 1.0
        self._observed_since_switch = False
        self.switches: list[Switch] = []

    @property
    def current(self) -> str:
        """The label now served."""
        return self._ladder[self._index].label

    @property
    def ladder(self) -> tuple[str, ...]:
        """The labels the policy may serve, fastest (least accurate) first."""
        return tuple(c.label for c in self._ladder)

    @property
    def slowdown(self) -> float:
        """The ``percentile`` of the recent latency / baseline ratios (1 before any observation)."""
        return self._slowdown

    @property
    def backoff(self) -> float:
        """The factor of ``probe_after_s`` the next quiet period lasts."""
        return self._backoff

    def expected_ms(self, label: str) -> float:
        """The latency of ``label`` expected at ``percentile`` now: its baseline times the slowdown.

        Args:
            label: a candidate's label.

        Returns:
            The expected latency, in milliseconds.

        Raises:
            ValueError: an unknown label.
        """
        return self._baseline[self._known(label)] * self._slowdown

    def choose(self) -> str:
        """The label to serve the next request with; probes one step up when due.

        Returns:
            A candidate's label.
        """
        now = self._clock()
        quiet = now - self._quiet_since
        if not self._observed_since_switch:
            return self.current
        if self._on_trial and quiet >= self.deadline.probe_after_s:
            self._on_trial, self._backoff = False, 1.0  # a sustained success
        if quiet >= self.deadline.probe_after_s * self._backoff:
            up = self._index + 1
            limit = self.deadline.up_margin * self.deadline.headroom * self.deadline.ms
            expected = self._ladder[up].expected_ms * max(self._recent) if up < len(self._ladder) else math.inf
            if expected <= limit:
                self._switch(now, up, f"probe: expected {expected:.3g} ms <= {limit:.3g} ms after {quiet:.3g} s quiet")
                self._on_trial = True
        return self.current

    def observe(self, label: str, ms: float) -> None:
        """Record that ``label`` served a request in ``ms`` milliseconds; steps down at once
        when that threatens the deadline.

        Args:
            label: the candidate that served the request.
            ms: how long it took, in milliseconds.

        Raises:
            ValueError: an unknown label, or a latency that is not a number from 0 to a day.
        """
        baseline = self._baseline[self._known(label)]
        number("ms", ms, 0, MAX_MS)
        now = self._clock()
        ratio = ms / baseline
        self._ratios.append(ratio)
        self._recent.append(ratio)
        self._slowdown = percentile(self._ratios, self.deadline.percentile)
        self._observed_since_switch = True
        slowdown = self._slowdown
        budget = self.deadline.headroom * self.deadline.ms
        current = self._ladder[self._index].expected_ms
        expected = current * slowdown
        if expected <= budget or current * ratio <= budget:
            return
        missed = ms > self.deadline.ms
        self._quiet_since = now
        if self._on_trial:
            self._on_trial = False
            self._backoff = min(2 * self._backoff, self.deadline.max_backoff)
        target = self._fitting_index(slowdown)
        if target < self._index:
            why = f"miss: {label} took {ms:.3g} ms > {self.deadline.ms:.3g} ms" if missed else (
                f"threat: {self.current} expected {expected:.3g} ms > {budget:.3g} ms")
            self._switch(now, target, f"{why} (slowdown x{slowdown:.3g})")

    def _known(self, label: str) -> str:
        if label not in self._baseline:
            raise ValueError(f"label: {label!r} is not a candidate ({', '.join(self._baseline)})")
        return label

    def _fitting_index(self, slowdown: float) -> int:
        """The most accurate ladder step expected within ``headroom * ms`` under ``slowdown``; 0 if none."""
        budget = self.deadline.headroom * self.deadline.ms
        fitting = [i for i, c in enumerate(self._ladder) if c.expected_ms * slowdown <= budget]
        return fitting[-1] if fitting else 0

    def _switch(self, now: float, index: int, reason: str) -> None:
        self.switches.append(Switch(now, self.current, self._ladder[index].label, reason))
        self._index = index
        self._quiet_since = now
        self._observed_since_switch = False

"""AdaptivePolicy driven by a fake clock and a simulated device whose load changes by phases."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import pytest

from nefl_zoo.runtime.adaptive import AdaptivePolicy, Candidate, Deadline, Switch, build_ladder, percentile

CANDIDATES = (
    Candidate("g0.25", 0.60, 10_000_000, 2.0),
    Candidate("g0.5", 0.75, 40_000_000, 4.0),
    Candidate("g0.75", 0.85, 90_000_000, 5.5),  # 1.27x faster than g1.0: a rung (min_speedup 1.2)
    Candidate("g0.75:int8", 0.84, 90_000_000, 6.5),  # dominated by g0.75: less accurate and slower
    Candidate("g1.0", 0.90, 160_000_000, 7.0),
)
ACCURACY = {c.label: c.accuracy for c in CANDIDATES}
DEADLINE_MS = 10.0
JITTER = 0.04  # each latency is the entry's idle latency x load x uniform(1 - JITTER, 1 + JITTER)
SETTLE = 5  # requests at the start of a phase left out of its miss rate


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Policy(Protocol):
    def choose(self) -> str: ...
    def observe(self, label: str, ms: float) -> None: ...


@dataclass(frozen=True)
class Served:
    label: str
    ms: float
    load: float


def simulate(
    policy: Policy, clock: FakeClock, loads: Sequence[float], dt: float = 0.05, jitter: float = JITTER,
    extra: Mapping[str, float] | None = None, seed: int = 0, start: int = 0,
) -> list[Served]:
    """Request i (from ``start``) arrives at clock i * dt and takes base[label] * loads[i] * jitter
    (* extra[label])."""
    noise = random.Random(seed)
    base = {c.label: c.expected_ms for c in CANDIDATES}
    served = []
    for i, load in enumerate(loads[start:], start):
        clock.now = i * dt
        label = policy.choose()
        ms = base[label] * load * noise.uniform(1 - jitter, 1 + jitter) * (extra or {}).get(label, 1.0)
        policy.observe(label, ms)
        served.append(Served(label, ms, load))
    return served


def phases(*spec: tuple[float, int]) -> list[float]:
    return [load for load, count in spec for _ in range(count)]


def best_fitting(load: float, headroom: float = 0.9) -> str:
    """The most accurate ladder entry whose slowest jittered latency is within headroom * deadline."""
    fits = [c for c in CANDIDATES if c.expected_ms * load * (1 + JITTER) <= headroom * DEADLINE_MS]
    return max(fits, key=lambda c: c.accuracy).label


def phase_report(served: list[Served]) -> list[tuple[float, float, float]]:
    """Per phase (a run of equal loads): (load, miss rate after SETTLE requests, share served by best_fitting)."""
    report, start = [], 0
    for end in range(1, len(served) + 1):
        if end == len(served) or served[end].load != served[start].load:
            phase = served[start:end]
            misses = sum(s.ms > DEADLINE_MS for s in phase[SETTLE:]) / len(phase[SETTLE:])
            best = sum(s.label == best_fitting(phase[0].load) for s in phase) / len(phase)
            report.append((phase[0].load, misses, best))
            start = end
    return report


def assert_meets_deadline(served: list[Served]) -> None:
    for load, misses, best in phase_report(served):
        assert misses <= 0.05, f"load x{load}: {misses:.1%} of requests missed the deadline"
        assert best >= 0.95, f"load x{load}: the best fitting entry served only {best:.1%}"


LOAD_PHASES = phases((1.0, 1000), (2.0, 1000), (3.0, 1000), (1.0, 2000))  # idle, busy, very busy, idle


def run_phases() -> tuple[AdaptivePolicy, list[Served]]:
    clock = FakeClock()
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS, probe_after_s=1.0), clock)
    return policy, simulate(policy, clock, LOAD_PHASES)


def test_phases_meet_the_deadline_with_the_most_accurate_fitting_entry():
    policy, served = run_phases()
    report = phase_report(served)
    assert [load for load, _, _ in report] == [1.0, 2.0, 3.0, 1.0]
    assert [best_fitting(load) for load in (1.0, 2.0, 3.0)] == ["g1.0", "g0.5", "g0.25"]
    assert_meets_deadline(served)
    assert report[0][2] == 1.0  # the start fits the idle machine at once
    assert sum(s.ms > DEADLINE_MS for s in served) <= 4  # only the first two requests of each heavier phase
    assert len(policy.switches) == 5  # down twice, then up the three steps one at a time


class AlwaysMostAccurate:
    def choose(self) -> str:
        return "g1.0"

    def observe(self, label: str, ms: float) -> None:
        pass


def test_the_deadline_check_catches_a_policy_that_ignores_the_deadline():
    served = simulate(AlwaysMostAccurate(), FakeClock(), LOAD_PHASES)
    with pytest.raises(AssertionError, match="missed the deadline"):
        assert_meets_deadline(served)
    assert [misses for _, misses, _ in phase_report(served)] == [0.0, 1.0, 1.0, 0.0]


def test_dominated_entries_and_non_candidates_are_never_chosen():
    policy, served = run_phases()
    assert policy.ladder == ("g0.25", "g0.5", "g0.75", "g1.0")
    assert {s.label for s in served} <= set(policy.ladder)
    assert all(s.to_label in policy.ladder for s in policy.switches)


def test_determinism():
    (first, served_first), (second, served_second) = run_phases(), run_phases()
    assert first.switches == second.switches and served_first == served_second


def test_steps_down_on_the_second_missed_request_straight_to_the_fitting_entry():
    """One miss in twenty requests is what the 95th percentile allows (a jitter outlier does
    not move the policy); the second makes the percentile the new load's."""
    clock = FakeClock()
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS), clock)
    served = simulate(policy, clock, phases((1.0, 100), (2.0, 100)), jitter=0.0)
    assert [s.label for s in served[:102]] == ["g1.0"] * 102  # requests 100 and 101 take 14 ms: misses
    assert {s.label for s in served[102:]} == {"g0.5"}  # skips g0.75 (12 ms at x2)
    assert policy.switches == [Switch(101 * 0.05, "g1.0", "g0.5", policy.switches[0].reason)]
    assert policy.switches[0].reason.startswith("miss: g1.0 took 14 ms > 10 ms")
    assert policy.expected_ms("g1.0") == pytest.approx(14.0) and policy.slowdown == pytest.approx(2.0)


def test_steps_down_when_the_percentile_crosses_the_headroom_without_a_miss():
    clock = FakeClock()
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS), clock)
    served = simulate(policy, clock, phases((1.0, 100), (9.5 / 7.0, 100)), jitter=0.0)  # g1.0: 9.5 ms
    assert max(s.ms for s in served) < DEADLINE_MS
    # request 100 alone is one sample in twenty, below the 95th percentile; request 101 is not
    assert [s.label for s in served[:102]] == ["g1.0"] * 102 and served[102].label == "g0.75"
    assert len(policy.switches) == 1 and policy.switches[0].reason.startswith("threat: g1.0 expected 9.5 ms > 9 ms")


def test_probes_up_one_step_per_quiet_period_only():
    clock, dt = FakeClock(), 0.125
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS, probe_after_s=5.0), clock)
    served = simulate(policy, clock, phases((1.0, 64), (3.0, 8), (1.0, 200)), dt=dt, jitter=0.0)
    # the threat at request 65 (t = 8.125 s, the second slow one); idle again from request 72,
    # the slowdown back to 1 from request 91, but the first probe only once 5 s passed without
    # a threat
    assert [(s.at, s.from_label, s.to_label) for s in policy.switches] == [
        (8.125, "g1.0", "g0.25"), (13.125, "g0.25", "g0.5"), (18.125, "g0.5", "g0.75"), (23.125, "g0.75", "g1.0"),
    ]
    assert [s.reason.split(":")[0] for s in policy.switches] == ["miss", "probe", "probe", "probe"]
    labels = [s.label for s in served]
    assert set(labels[66:105]) == {"g0.25"} and labels[105] == "g0.5"
    assert labels.index("g0.75") == 145 and labels.index("g1.0", 105) == 185 and set(labels[185:]) == {"g1.0"}


def test_recovers_as_soon_as_recent_requests_are_fast_not_when_the_window_forgets_the_load():
    """After a heavy phase the window still holds its slow ratios for 19 requests; the first
    probe comes once the last three requests (``recent``) were fast, and fast requests on the
    new entry are no threat, however slow the window's older ones."""
    clock = FakeClock()
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS), clock)
    loads = phases((1.0, 100), (3.0, 100), (1.0, 100))
    simulate(policy, clock, loads[:206], jitter=0.0)
    assert policy.current == "g0.5" and policy.slowdown == 3.0  # g0.5 x3 = 12 ms > 9: stale, no threat
    simulate(policy, clock, loads, jitter=0.0, start=206)
    assert [(round(s.at / 0.05), s.to_label) for s in policy.switches] == [
        (101, "g0.25"), (203, "g0.5"), (213, "g0.75"), (223, "g1.0"),  # then one step per 0.5 s quiet
    ]
    assert policy.slowdown == 1.0


def test_never_probes_while_the_recent_requests_say_the_load_stays():
    clock = FakeClock()
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS), clock)
    served = simulate(policy, clock, phases((1.0, 100), (3.0, 2000)))  # 100 s at x3: g0.25 fits, quiet
    assert [(round(s.at / 0.05), s.to_label) for s in policy.switches] == [(101, "g0.25")]
    assert sum(s.ms > DEADLINE_MS for s in served) == 2


def test_ladder_rungs_are_min_speedup_apart_counted_from_the_start():
    def labels(budget: float, speedup: float) -> list[str]:
        return [c.label for c in build_ladder(CANDIDATES, budget, speedup)]

    assert labels(9.0, 1.0) == labels(9.0, 1.2) == ["g0.25", "g0.5", "g0.75", "g1.0"]  # 7 / 5.5 = 1.27
    assert labels(9.0, 1.3) == ["g0.25", "g0.5", "g1.0"]  # g0.75 is within 1.3x of the start g1.0
    assert labels(5.6, 1.3) == ["g0.25", "g0.5", "g0.75"]  # start g0.75: g1.0 above is within 1.3x
    assert labels(4.5, 1.5) == ["g0.25", "g0.5", "g1.0"]  # start g0.5: above it 5.5 < 6, 7 >= 6
    assert labels(1.0, 4.0) == ["g0.25"]  # nothing fits: the fastest starts; 8 ms is < 4 x 2.0
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS, min_speedup=1.3), FakeClock())
    assert policy.ladder == ("g0.25", "g0.5", "g1.0")


BIG_SLOWER = {"g1.0": 1.4}  # memory-bound: the largest entry slows down more than the others predict


def test_failed_probes_back_off_doubling_to_the_cap_and_a_success_resets_it():
    clock, dt = FakeClock(), 0.05
    deadline = Deadline(DEADLINE_MS, probe_after_s=5.0, max_backoff=8.0)
    policy = AdaptivePolicy(CANDIDATES, deadline, clock)
    simulate(policy, clock, [1.0] * 3000, dt=dt, extra=BIG_SLOWER)  # 150 s; g1.0 takes ~9.8 ms
    ups = [s for s in policy.switches if s.reason.startswith("probe")]
    downs = [s for s in policy.switches if not s.reason.startswith("probe")]
    assert all(s.to_label == "g1.0" for s in ups) and all(s.to_label == "g0.75" for s in downs)
    quiet = [up.at - down.at for down, up in zip(downs, ups)]
    # the start failed too (backoff 2); each failed probe doubles it, capped at 8 x 5 s
    assert quiet == pytest.approx([10.0, 20.0, 40.0, 40.0], abs=dt * 1.01)
    assert policy.backoff == 8.0
    probe_at = clock.now = clock.now + 40.0  # the load that slowed g1.0 is gone
    assert policy.choose() == "g1.0"
    for i in range(100):  # g1.0 fits now: no threat for 5 s is a sustained success
        clock.now = probe_at + i * dt
        policy.observe(policy.choose(), 7.0)
    assert policy.backoff == 8.0
    clock.now = probe_at + 5.0
    assert policy.choose() == "g1.0" and policy.backoff == 1.0


@pytest.mark.parametrize("loads, extra, most", [
    ([9.0 / 7.0] * 1000, None, 1),  # g1.0 right at the headroom, jitter across it
    ([9.0 / 7.0 * (1 + 0.08 * math.sin(i / 60)) for i in range(1000)], None, 1),  # wandering around it
    # g1.0 looks like it fits but does not: failed probes 1, 2, 4, 8, 16, 16 s apart (0.5 s doubling,
    # capped at 32 x 0.5 s), each a step up and one down, after the start's own step down
    ([1.0] * 1000, BIG_SLOWER, 13),
], ids=["at-headroom", "wandering", "failing-probes"])
def test_a_load_at_a_boundary_does_not_oscillate(loads: list[float], extra: dict | None, most: int):
    clock = FakeClock()
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS), clock)
    served = simulate(policy, clock, loads, extra=extra)
    assert len(policy.switches) <= most
    assert sum(s.ms > DEADLINE_MS for s in served) <= 5
    assert sum(s.label == "g0.75" for s in served) >= 0.95 * len(served)


def test_start_without_a_fitting_entry_serves_the_fastest():
    assert AdaptivePolicy(CANDIDATES, Deadline(1.0), FakeClock()).current == "g0.25"
    assert AdaptivePolicy(CANDIDATES, Deadline(7.5), FakeClock()).current == "g0.75"  # 6 ms <= 7.5 * 0.9


def test_ladder_ties_and_unmeasured_accuracy():
    same = [Candidate("b", 0.8, 20, 5.0), Candidate("a", 0.8, 10, 5.0), Candidate("slow", 0.8, 5, 6.0)]
    assert [c.label for c in build_ladder(same)] == ["a"]  # equally accurate: faster, then fewer MACs
    unmeasured = [Candidate("x", None, 30, 3.0), Candidate("y", 0.9, 10, 4.0), Candidate("z", None, 50, 2.0)]
    assert [c.label for c in build_ladder(unmeasured)] == ["z"]  # ranked by MACs: z is largest and fastest
    by_macs = [Candidate("s", None, 10, 1.0), Candidate("m", None, 20, 2.0), Candidate("l", 0.9, 40, 3.0)]
    assert [c.label for c in build_ladder(by_macs)] == ["s", "m", "l"]


RULES = {
    "ms": "a number in [0.001, 86400000]", "percentile": "a number in (0, 100]", "window": "an integer in 1..10000",
    "recent": "an integer in 1..10000", "headroom": "a number in (0, 1]", "probe_after_s": "a number in [0, 86400]",
    "up_margin": "a number in (0, 1)", "max_backoff": "a number in [1, 1000000]", "min_speedup": "a number in [1, 1000]",
}


@pytest.mark.parametrize("field, value", [
    ("ms", 0.0), ("ms", math.nan), ("ms", math.inf), ("ms", 0.0009), ("ms", 86_400_001), ("ms", 1e300),
    ("percentile", 0.0), ("percentile", 101.0), ("percentile", math.nan), ("percentile", -math.inf),
    ("window", 0), ("window", 2.5), ("window", 1.0), ("window", True), ("window", 10_001), ("window", 10**30),
    ("headroom", 0.0), ("headroom", 1.5), ("headroom", math.nan), ("probe_after_s", -1.0), ("probe_after_s", math.inf),
    ("probe_after_s", 86_401.0), ("probe_after_s", math.nan), ("up_margin", 1.0), ("up_margin", 0.0),
    ("max_backoff", 0.5), ("max_backoff", math.inf), ("max_backoff", 1e6 + 1), ("recent", 0), ("recent", 1.5),
    ("recent", 10_001), ("min_speedup", 0.9), ("min_speedup", math.inf), ("min_speedup", 1000.5), ("min_speedup", "2"),
])
def test_bad_deadline_settings_name_the_field_and_the_rule(field: str, value: object):
    with pytest.raises(ValueError) as error:
        Deadline(**{"ms": DEADLINE_MS, field: value})
    assert str(error.value) == f"Deadline.{field}: must be {RULES[field]}, got {value!r}"


def test_deadline_settings_at_their_bounds_are_accepted():
    edge = Deadline(ms=0.001, percentile=100, window=1, headroom=1, probe_after_s=0, up_margin=1e-9, max_backoff=1,
                    recent=1, min_speedup=1)
    assert (edge.percentile, edge.window, edge.recent, edge.headroom, edge.max_backoff, edge.min_speedup) == (100, 1, 1, 1, 1, 1)
    assert Deadline(ms=1.0, percentile=1e-9, probe_after_s=0.0, up_margin=0.999).probe_after_s == 0.0
    top = Deadline(ms=86_400_000, window=10_000, recent=10_000, probe_after_s=86_400, max_backoff=1_000_000, min_speedup=1000)
    assert (top.ms, top.window, top.probe_after_s * top.max_backoff) == (86_400_000, 10_000, 86_400_000_000)


def test_the_largest_settings_and_latencies_keep_every_estimate_finite():
    """At the limits (a 1 us baseline, a day-long observation, the widest window) the slowdown,
    the expected latencies and a probe's quiet period stay finite numbers."""
    clock = FakeClock()
    deadline = Deadline(ms=86_400_000, window=10_000, probe_after_s=86_400, max_backoff=1_000_000, percentile=50)
    policy = AdaptivePolicy([Candidate("fast", 0.1, 1, 0.001), Candidate("slow", 0.9, 2, 86_400_000)], deadline, clock)
    for ms in (86_400_000, 0.0, 86_400_000):
        policy.observe(policy.current, ms)
        assert math.isfinite(policy.slowdown) and all(math.isfinite(policy.expected_ms(c)) for c in ("fast", "slow"))
    assert policy.slowdown == 86_400_000 / 0.001 and policy.current == "fast"


@pytest.mark.parametrize("make, message", [
    (lambda: Candidate("g1.0", 0.9, 1, 0.0), "Candidate 'g1.0' expected_ms: must be a number in [0.001, 86400000], got 0.0"),
    (lambda: Candidate("g1.0", 0.9, 1, -2.0), "Candidate 'g1.0' expected_ms: must be a number in [0.001, 86400000], got -2.0"),
    (lambda: Candidate("g1.0", 0.9, 1, math.nan), "Candidate 'g1.0' expected_ms: must be a number in [0.001, 86400000], got nan"),
    (lambda: Candidate("g1.0", 0.9, 1, 5e-324), "Candidate 'g1.0' expected_ms: must be a number in [0.001, 86400000], got 5e-324"),
    (lambda: Candidate("g1.0", 0.9, 1, 1e20), "Candidate 'g1.0' expected_ms: must be a number in [0.001, 86400000], got 1e+20"),
    (lambda: Candidate("g1.0", 0.9, -1, 1.0), "Candidate 'g1.0' macs: must be an integer >= 0, got -1"),
    (lambda: Candidate("g1.0", 0.9, True, 1.0), "Candidate 'g1.0' macs: must be an integer >= 0, got True"),
    (lambda: Candidate("g1.0", 0.9, 2.0, 1.0), "Candidate 'g1.0' macs: must be an integer >= 0, got 2.0"),
    (lambda: Candidate("g1.0", math.nan, 1, 1.0), "Candidate 'g1.0': accuracy must be a finite number or None, got nan"),
    (lambda: Candidate("", 0.9, 1, 1.0), "Candidate.label: must be a non-empty string, got ''"),
    (lambda: AdaptivePolicy([], Deadline(DEADLINE_MS)), "candidates: must hold at least one Candidate, got none"),
    (lambda: AdaptivePolicy([CANDIDATES[0], CANDIDATES[0], CANDIDATES[1], CANDIDATES[1]], Deadline(DEADLINE_MS)),
     "candidates: duplicate labels g0.25, g0.5"),
])
def test_bad_candidates_raise_one_line(make: Callable[[], object], message: str):
    with pytest.raises(ValueError) as error:
        make()
    assert str(error.value) == message


def test_a_candidate_may_have_zero_macs_and_no_accuracy():
    assert Candidate("stub", None, 0, 0.5).macs == 0


@pytest.mark.parametrize("label, ms, message", [
    ("g2.0", 1.0, "label: 'g2.0' is not a candidate (g0.25, g0.5, g0.75, g0.75:int8, g1.0)"),
    ("g1.0", -1.0, "ms: must be a number in [0, 86400000], got -1.0"),
    ("g1.0", math.nan, "ms: must be a number in [0, 86400000], got nan"),
    ("g1.0", True, "ms: must be a number in [0, 86400000], got True"),
    ("g1.0", 1e308, "ms: must be a number in [0, 86400000], got 1e+308"),
])
def test_bad_observations_raise(label: str, ms: float, message: str):
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS), FakeClock())
    with pytest.raises(ValueError) as error:
        policy.observe(label, ms)
    assert str(error.value) == message
    with pytest.raises(ValueError, match="label"):
        policy.expected_ms("g2.0")
    assert policy.switches == [] and policy.slowdown == 1.0


def test_a_request_of_zero_or_half_a_millisecond_is_an_observation():
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS), FakeClock())
    policy.observe("g1.0", 0.0)
    policy.observe("g1.0", 0.5)
    assert policy.slowdown == pytest.approx(0.5 / 7.0 * 0.95)  # 95th percentile of (0, 0.5/7)


@pytest.mark.parametrize("values, q, expected", [
    ([4.0, 1.0, 10.0, 3.0, 2.0], 50, 3.0), ([4.0, 1.0, 10.0, 3.0, 2.0], 95, 8.8), ([4.0, 1.0, 10.0, 3.0, 2.0], 100, 10.0),
    ([4.0, 1.0, 10.0, 3.0, 2.0], 62.5, 3.5), ([4.0, 1.0, 10.0, 3.0, 2.0], 80, 5.2), ([5.0], 95, 5.0), ([1.0, 3.0], 50, 2.0),
])
def test_percentile_interpolates_between_the_closest_ranks_like_numpy(values: list[float], q: float, expected: float):
    assert percentile(values, q) == pytest.approx(expected, abs=1e-12)


def test_ladder_bounds_are_inclusive():
    a, b, c = Candidate("a", 0.5, 1, 2.0), Candidate("b", 0.8, 2, 7.0), Candidate("c", 0.9, 3, 8.0)
    assert [x.label for x in build_ladder([a, b, c], 8.0, 1.2)] == ["a", "c"]  # c at the budget starts; b is 1.14x
    assert [x.label for x in build_ladder([a, b, c], 7.9, 1.2)] == ["a", "b"]  # b starts; c is 1.14x above it
    low, mid, high = Candidate("low", 0.5, 1, 3.0), Candidate("mid", 0.8, 2, 6.0), Candidate("high", 0.9, 3, 12.0)
    assert [x.label for x in build_ladder([low, mid, high], 6.0, 2.0)] == ["low", "mid", "high"]  # exactly 2x apart: kept
    assert [x.label for x in build_ladder([low, mid, high], 3.0, 2.0)] == ["low", "mid", "high"]
    twin = Candidate("twin", 0.7, 1, 2.0)  # as fast as a, more accurate: a is dominated whatever the input order
    assert [x.label for x in build_ladder([a, twin])] == ["twin"] == [x.label for x in build_ladder([twin, a])]


def small_big(**settings) -> tuple[FakeClock, AdaptivePolicy]:
    clock = FakeClock()
    candidates = [Candidate("small", 0.6, 1, 2.0), Candidate("big", 0.9, 2, 4.0)]
    return clock, AdaptivePolicy(candidates, Deadline(**settings), clock)


def test_an_estimate_or_a_request_exactly_at_the_budget_is_no_threat():
    clock, policy = small_big(ms=4.0, headroom=1.0, window=3, percentile=75)
    assert policy.current == "big"  # 4.0 ms fits a 4.0 ms budget
    for ms in (0.5, 0.5, 7.5):  # ratios 1/8, 1/8, 15/8: the 75th percentile is 1, the estimate 4.0 = budget
        policy.observe("big", ms)
    assert policy.switches == [] and policy.slowdown == 1.0 and policy.backoff == 1.0  # no threat: the start's trial holds
    policy.observe("big", 4.0)  # a fast ratio leaves: the estimate is over, the latest request at the budget
    assert policy.switches == [] and policy.slowdown == 1.4375
    policy.observe("big", 4.5)
    assert [s.to_label for s in policy.switches] == ["small"] and policy.switches[0].reason.startswith("miss")


def test_a_request_exactly_at_the_deadline_is_not_called_a_miss():
    clock, policy = small_big(ms=4.0, headroom=0.9, window=3, percentile=50)
    assert policy.current == "small"  # 4.0 > 0.9 x 4
    clock, policy = small_big(ms=5.0, headroom=0.9, window=3, percentile=50)
    for ms in (5.0, 5.0):
        policy.observe("big", ms)
    assert policy.switches[0].reason.startswith("threat: big expected 5 ms > 4.5 ms")


def test_a_probe_exactly_at_the_margin_goes_up():
    clock, policy = small_big(ms=8.0, headroom=1.0, up_margin=0.5)
    for ms in (10.0, 10.0):  # two misses: down to small
        policy.observe("big", ms)
    assert policy.current == "small" and policy.backoff == 2.0  # the start was on trial
    for ms in (2.0, 2.0, 2.0):
        policy.observe("small", ms)
    clock.now = 1.0
    assert policy.choose() == "big"  # 4.0 ms x 1 = 0.5 x 8 ms
    assert policy.switches[-1].reason == "probe: expected 4 ms <= 4 ms after 1 s quiet"


def test_no_probe_before_an_observation_of_the_entry_in_service():
    clock = FakeClock()
    policy = AdaptivePolicy(CANDIDATES, Deadline(6.0), clock)  # starts on g0.5: g0.75 is over 5.4 ms
    clock.now = 100.0
    assert policy.choose() == "g0.5" and policy.choose() == "g0.5"
    clock = FakeClock()
    policy = AdaptivePolicy(CANDIDATES, Deadline(DEADLINE_MS), clock)
    simulate(policy, clock, phases((1.0, 100), (3.0, 100), (1.0, 3)), jitter=0.0)
    clock.now = 203 * 0.05
    assert policy.choose() == "g0.5" and policy.switches[-1].reason.startswith("probe")
    clock.now += 100.0  # long quiet, but nothing served on g0.5 yet
    assert policy.choose() == "g0.5" and policy.choose() == "g0.5"


def test_a_single_entry_under_load_never_switches():
    clock = FakeClock()
    policy = AdaptivePolicy(CANDIDATES[:1], Deadline(1.0), clock)
    served = simulate(policy, clock, phases((1.0, 50), (3.0, 50), (1.0, 50)), jitter=0.0)
    assert policy.switches == [] and {s.label for s in served} == {"g0.25"}
    assert policy.slowdown == 1.0

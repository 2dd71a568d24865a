"""Latency traces and the Python adaptive policy's decisions on them, frozen in
``tests/data/policy_traces.json`` for the Python and JavaScript ports to reproduce.

Each case simulates requests against :class:`nefl_zoo.runtime.adaptive.AdaptivePolicy` on an
injected clock: ``choose`` at the request's time, then ``observe`` of the chosen label when it
ends, its latency the label's idle baseline times the case's load (a deterministic function of
the request's number, time and label). The steps, their outcomes (the label chosen, the label
served after each observation), the ladder and, after the run, the switches, slowdown and
backoff go to the file::

    python tools/policy_traces.py           # regenerate tests/data/policy_traces.json
    python tools/policy_traces.py --check   # exit 1 if the file differs from what it would write
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from nefl_zoo.runtime.adaptive import AdaptivePolicy, Candidate, Deadline, percentile

PATH = Path(__file__).resolve().parent.parent / "tests" / "data" / "policy_traces.json"

TIERS = [  # label, accuracy, MACs, idle ms: each step up more accurate and slower
    ("g0.2", 0.60, 1_000_000, 2.0),
    ("g0.4", 0.70, 3_000_000, 4.0),
    ("g0.6", 0.75, 6_000_000, 7.0),
    ("g1.0", 0.80, 12_000_000, 12.0),
]


def jitter(i: int) -> float:
    """A small deterministic wobble (within +-3%) so that no two latencies are equal."""
    return 1 + 0.03 * (((i * 7) % 5) - 2) / 2


def steady(i, t, label):
    return jitter(i)


def sudden_slowdown(i, t, label):
    return jitter(i) * (2.0 if t >= 1.0 else 1.0)


def outliers(i, t, label):
    return 3.0 if i % 25 == 22 else jitter(i)  # the first once the window is full


def load_ends(i, t, label):
    return jitter(i) * (3.0 if t < 2.0 else 1.0)


def heavy_interference(i, t, label):
    """Interference that slows only the entries above g0.4 (memory bound): each probe up fails."""
    return jitter(i) * (1.6 if label in ("g0.6", "g1.0") else 1.0)


def overload(i, t, label):
    return jitter(i) * (4.0 if t >= 1.0 else 1.0)


def exact_load(i, t, label):
    """No jitter: latencies that meet the budgets exactly."""
    return 4.0 if t < 1.0 else 1.0


def tiers(*labels, accuracy=True):
    return [{"label": l, "accuracy": a if accuracy else None, "macs": m, "expected_ms": ms}
            for l, a, m, ms in TIERS if l in labels]


CASES = [
    dict(name="steady", about="a steady load: the start entry (g0.6) is served throughout, no probe fits",
         candidates=tiers("g0.2", "g0.4", "g0.6", "g1.0"), deadline={"ms": 10.0},
         requests=40, every=0.05, load=steady),
    dict(name="sudden_slowdown_miss",
         about="the load doubles at 1 s: the first slow request is an outlier, the second a miss that steps down",
         candidates=tiers("g0.2", "g0.4", "g0.6", "g1.0"), deadline={"ms": 10.0},
         requests=40, every=0.05, load=sudden_slowdown),
    dict(name="jitter_outliers", about="one 3x outlier every 25 requests (fewer than one per window): no switch",
         candidates=tiers("g0.2", "g0.4", "g0.6", "g1.0"), deadline={"ms": 10.0},
         requests=80, every=0.05, load=outliers),
    dict(name="load_ends_probe_up",
         about="a 3x load from the start steps down to g0.2; it ends at 2 s and probes climb back to g0.6",
         candidates=tiers("g0.2", "g0.4", "g0.6", "g1.0"), deadline={"ms": 10.0},
         requests=60, every=0.1, load=load_ends),
    dict(name="backoff_failed_probes",
         about="only g0.6 and above are slowed: every probe of g0.6 fails, doubling the backoff up to max_backoff",
         candidates=tiers("g0.2", "g0.4", "g0.6", "g1.0"), deadline={"ms": 10.0, "max_backoff": 8.0},
         requests=160, every=0.1, load=heavy_interference),
    dict(name="overload_jumps_down", about="a 4x load at 1 s: an outlier, then two rungs down in one switch",
         candidates=tiers("g0.2", "g0.4", "g0.6", "g1.0"), deadline={"ms": 20.0},
         requests=40, every=0.05, load=overload),
    dict(name="ranked_by_macs",
         about="one candidate without accuracy: all ranked by MACs; an INT8 entry of equal MACs and lower "
               "latency drops the FP32 one, and a slower entry with fewer MACs is dominated",
         candidates=[
             {"label": "g0.2", "accuracy": 0.6, "macs": 1_000_000, "expected_ms": 2.0},
             {"label": "g0.6", "accuracy": None, "macs": 6_000_000, "expected_ms": 7.0},
             {"label": "g0.6:int8", "accuracy": 0.74, "macs": 6_000_000, "expected_ms": 5.0},
             {"label": "g0.4", "accuracy": 0.7, "macs": 3_000_000, "expected_ms": 5.5},
             {"label": "g1.0:int8", "accuracy": 0.79, "macs": 12_000_000, "expected_ms": 8.5},
         ],
         deadline={"ms": 10.0}, requests=40, every=0.05, load=load_ends),
    dict(name="min_speedup_pruning",
         about="close rungs pruned from the start entry out (min_speedup 1.2, boundaries met exactly); ties on "
               "latency and accuracy go to fewer MACs, then the label",
         candidates=[
             {"label": "a", "accuracy": 0.50, "macs": 100, "expected_ms": 2.0},
             {"label": "b", "accuracy": 0.55, "macs": 200, "expected_ms": 2.2},
             {"label": "c", "accuracy": 0.60, "macs": 300, "expected_ms": 2.6},
             {"label": "d2", "accuracy": 0.65, "macs": 400, "expected_ms": 3.0},
             {"label": "d1", "accuracy": 0.65, "macs": 400, "expected_ms": 3.0},
             {"label": "d0", "accuracy": 0.65, "macs": 500, "expected_ms": 3.0},
             {"label": "e", "accuracy": 0.70, "macs": 500, "expected_ms": 3.3},
             {"label": "f", "accuracy": 0.72, "macs": 600, "expected_ms": 3.6},
             {"label": "g", "accuracy": 0.75, "macs": 700, "expected_ms": 4.5},
             {"label": "h", "accuracy": 0.78, "macs": 800, "expected_ms": 5.0},
             {"label": "i", "accuracy": 0.60, "macs": 900, "expected_ms": 6.0},
         ],
         deadline={"ms": 4.0}, requests=40, every=0.1, load=load_ends),
    dict(name="fastest_rung_overloaded",
         about="a deadline nothing meets: the fastest entry is served, threats cannot step lower",
         candidates=tiers("g0.2", "g0.4", "g0.6"), deadline={"ms": 1.5},
         requests=30, every=0.1, load=steady),
    dict(name="slowest_rung_idle", about="a loose deadline: the slowest (most accurate) entry, nothing above to probe",
         candidates=tiers("g0.2", "g0.4", "g0.6", "g1.0"), deadline={"ms": 100.0},
         requests=30, every=0.1, load=steady),
    dict(name="exact_boundaries",
         about="latencies equal to the budgets: the start, the step down and the probe up all meet theirs exactly",
         candidates=[{"label": "s", "accuracy": 0.6, "macs": 1, "expected_ms": 2.5},
                     {"label": "m", "accuracy": 0.7, "macs": 2, "expected_ms": 5.0},
                     {"label": "l", "accuracy": 0.8, "macs": 4, "expected_ms": 10.0}],
         deadline={"ms": 10.0, "headroom": 1.0, "up_margin": 0.5},
         requests=30, every=0.1, load=exact_load),
    dict(name="custom_settings",
         about="every setting changed: median of a 5-request window, recent 1, no quiet period before probes",
         candidates=tiers("g0.2", "g0.4", "g0.6", "g1.0"),
         deadline={"ms": 10.0, "percentile": 50.0, "window": 5, "headroom": 0.8, "probe_after_s": 0,
                   "up_margin": 0.7, "max_backoff": 4.0, "recent": 1, "min_speedup": 1.0},
         requests=50, every=0.05, load=load_ends),
]

PERCENTILES = [([3.0], 95.0), ([1.0, 2.0], 50.0), ([5.0, 1.0, 4.0, 2.0, 3.0], 95.0),
               ([1.0, 1.0, 1.03, 0.97, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0], 95.0), ([2.0, 4.0, 8.0], 100.0),
               ([0.5, 0.25, 0.125], 1.0)]

INVALID_DEADLINES = [{"ms": 0}, {"ms": -1.0}, {"ms": 10.0, "percentile": 0}, {"ms": 10.0, "percentile": 101},
                     {"ms": 10.0, "window": 0}, {"ms": 10.0, "recent": 0}, {"ms": 10.0, "window": 2.5},
                     {"ms": 10.0, "headroom": 1.5}, {"ms": 10.0, "probe_after_s": -0.1},
                     {"ms": 10.0, "up_margin": 1.0}, {"ms": 10.0, "max_backoff": 0.5},
                     {"ms": 10.0, "min_speedup": 0.9}, {"ms": 86_400_001}, {"ms": 0.0005},
                     {"ms": 10.0, "window": 10_001}, {"ms": 10.0, "recent": 10_001},
                     {"ms": 10.0, "probe_after_s": 86_401}, {"ms": 10.0, "max_backoff": 1_000_001},
                     {"ms": 10.0, "min_speedup": 1_001}]

INVALID_CANDIDATES = [{"label": "", "accuracy": 0.5, "macs": 1, "expected_ms": 1.0},
                      {"label": "x", "accuracy": 0.5, "macs": -1, "expected_ms": 1.0},
                      {"label": "x", "accuracy": 0.5, "macs": 1.5, "expected_ms": 1.0},
                      {"label": "x", "accuracy": 0.5, "macs": 1, "expected_ms": 0},
                      {"label": "x", "accuracy": 0.5, "macs": 1, "expected_ms": 0.0005},
                      {"label": "x", "accuracy": 0.5, "macs": 1, "expected_ms": 86_400_001}]


def run_case(case: dict) -> dict:
    """Simulate one case on the Python policy; its inputs and every outcome, JSON-ready."""
    now = [0.0]
    policy = AdaptivePolicy([Candidate(**c) for c in case["candidates"]], Deadline(**case["deadline"]), lambda: now[0])
    baseline = {c["label"]: c["expected_ms"] for c in case["candidates"]}
    out = {key: case[key] for key in ("name", "about", "candidates", "deadline")}
    out.update(ladder=list(policy.ladder), start=policy.current, steps=[])
    for i in range(case["requests"]):
        now[0] = t = round(i * case["every"], 6)
        label = policy.choose()
        out["steps"].append({"at": t, "op": "choose", "expect": label})
        ms = round(baseline[label] * case["load"](i, t, label), 6)
        now[0] = end = round(t + ms / 1000, 6)
        policy.observe(label, ms)
        out["steps"].append({"at": end, "op": "observe", "label": label, "ms": ms, "current": policy.current})
    out["switches"] = [{"at": s.at, "from": s.from_label, "to": s.to_label, "reason": s.reason}
                       for s in policy.switches]
    out.update(slowdown=policy.slowdown, backoff=policy.backoff)
    return out


def generate() -> str:
    """The file's text."""
    data = {
        "about": "Generated by tools/policy_traces.py from nefl_zoo/runtime/adaptive.py; do not edit by hand. "
                 "Replay: a clock at 0 when the policy is made, then each step at its time.",
        "deadline_defaults": {f.name: f.default for f in dataclasses.fields(Deadline) if f.name != "ms"},
        "percentile": [{"values": v, "q": q, "expect": percentile(v, q)} for v, q in PERCENTILES],
        "invalid_deadlines": INVALID_DEADLINES,
        "invalid_candidates": INVALID_CANDIDATES,
        "cases": [run_case(case) for case in CASES],
    }
    # One step per line: readable diffs when a decision changes.
    steps = {}
    for case in data["cases"]:
        for n, step in enumerate(case["steps"]):
            key = f"@@step{len(steps)}@@"
            steps[key] = json.dumps(step)
            case["steps"][n] = key
    text = json.dumps(data, indent=2)
    for key, step in steps.items():
        text = text.replace(f'"{key}"', step, 1)
    return text + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        if not PATH.exists() or PATH.read_text() != text:
            print(f"{PATH} is out of date: run python tools/policy_traces.py", file=sys.stderr)
            return 1
        print(f"{PATH}: up to date")
        return 0
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(text)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Python adaptive policy reproduces every decision frozen in tests/data/policy_traces.json
(the same file web/test/policy.test.mjs replays on the JavaScript port)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nefl_zoo.runtime.adaptive import AdaptivePolicy, Candidate, Deadline, percentile

TRACES = json.loads((Path(__file__).parent / "data" / "policy_traces.json").read_text())


def test_deadline_defaults_and_percentiles():
    assert {f.name: f.default for f in dataclasses.fields(Deadline) if f.name != "ms"} == TRACES["deadline_defaults"]
    for case in TRACES["percentile"]:
        assert percentile(case["values"], case["q"]) == case["expect"], case


@pytest.mark.parametrize("settings", TRACES["invalid_deadlines"], ids=json.dumps)
def test_invalid_deadline(settings):
    with pytest.raises(ValueError, match="Deadline"):
        Deadline(**settings)


@pytest.mark.parametrize("fields", TRACES["invalid_candidates"], ids=json.dumps)
def test_invalid_candidate(fields):
    with pytest.raises(ValueError, match="Candidate"):
        Candidate(**fields)


@pytest.mark.parametrize("case", TRACES["cases"], ids=lambda case: case["name"])
def test_trace(case):
    now = [0.0]
    policy = AdaptivePolicy([Candidate(**c) for c in case["candidates"]], Deadline(**case["deadline"]), lambda: now[0])
    assert list(policy.ladder) == case["ladder"]
    assert policy.current == case["start"]
    for n, step in enumerate(case["steps"]):
        now[0] = step["at"]
        if step["op"] == "choose":
            assert policy.choose() == step["expect"], f"step {n}: {step}"
        else:
            policy.observe(step["label"], step["ms"])
            assert policy.current == step["current"], f"step {n}: {step}"
    switches = [{"at": s.at, "from": s.from_label, "to": s.to_label, "reason": s.reason} for s in policy.switches]
    assert switches == case["switches"]
    assert policy.slowdown == case["slowdown"]
    assert policy.backoff == case["backoff"]


def test_cases_cover_the_rules():
    """The traces exercise what they claim: misses, probes, a capped backoff, pruned and
    MACs-ranked ladders, and a run without switches under outliers."""
    by_name = {case["name"]: case for case in TRACES["cases"]}
    reasons = [s["reason"].split(":")[0] for case in TRACES["cases"] for s in case["switches"]]
    assert {"miss", "probe"} <= set(reasons)
    assert by_name["jitter_outliers"]["switches"] == [] and any(
        step.get("ms", 0) > 20 for step in by_name["jitter_outliers"]["steps"])
    assert by_name["backoff_failed_probes"]["backoff"] == by_name["backoff_failed_probes"]["deadline"]["max_backoff"]
    assert len(by_name["min_speedup_pruning"]["ladder"]) < len(by_name["min_speedup_pruning"]["candidates"])
    assert [s["to"] for s in by_name["load_ends_probe_up"]["switches"]] == ["g0.2", "g0.4", "g0.6"]


def test_the_file_is_what_the_generator_writes():
    """tools/policy_traces.py --check: the frozen file and its generator agree."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "tools" / "policy_traces.py"), "--check"], cwd=root,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

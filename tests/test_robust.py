"""Robust aggregation of nested updates (issue 52): element-wise median and trimmed mean over the
clients holding each element, norm bounding in global coordinates, attackers, the config's
refusals and a bit-identical resume."""

import pytest
import torch

from nefl_zoo.fl.aggregation.nefedavg import Update, nefedavg
from nefl_zoo.fl.aggregation.rules import AggregationConfig, aggregate_updates
from nefl_zoo.fl.config import ConfigError
from nefl_zoo.fl.engine import Engine
from nefl_zoo.fl.aggregation.robust import clip_update, coordinate_rule, update_norm
from nefl_zoo.slim import SliceEntry

from .conftest import crash_in_round, records, same_tensors, tiny

torch.set_num_threads(1)
GLOBAL = {"w": torch.full((5,), 9.0), "n": torch.tensor([7], dtype=torch.int64)}


def nested(values, client, counter=None):
    """A client holding the first len(values) elements of ``w`` (and the counter ``n``)."""
    entries = {"w": SliceEntry("w", (slice(0, len(values)),), (len(values),), "weight", True)}
    state = {"w": torch.tensor(values, dtype=torch.float32)}
    if counter is not None:
        entries["n"] = SliceEntry("n", (), (1,), "norm", True)
        state["n"] = torch.tensor([counter], dtype=torch.int64)
    return Update(entries, state, 1.0, client)


# element 0: 5 holders {1,2,3,4,100}; 1: 4 holders {10,20,30,-40}; 2: {5,6}; 3: {7}; 4: none
CLIENTS = [nested([1, 10, 5, 7], "a", 1), nested([2, 20, 6], "b", 2), nested([3, 30], "c"), nested([4, -40], "d"), nested([100], "e")]


@pytest.mark.parametrize("rule, trim, expected", [
    ("median", 0.0, [3, 15, 5.5, 7, 9]),
    ("trimmed_mean", 0.2, [3, 5, 5.5, 7, 9]),  # cuts floor(0.2 k): 1 of 5, 0 of 4, 2, 1
    ("trimmed_mean", 0.25, [3, 15, 5.5, 7, 9]),  # 1 of 5, 1 of 4
    ("trimmed_mean", 0.4, [3, 15, 5.5, 7, 9]),  # 2 of 5, 1 of 4
])
def test_coordinate_rules_over_each_elements_own_holders(rule, trim, expected):
    new = coordinate_rule(GLOBAL, CLIENTS, rule, trim)
    assert torch.equal(new["w"], torch.tensor(expected, dtype=torch.float32))
    assert new["n"].dtype == torch.int64 and int(new["n"]) == 2  # {1, 2}: 1.5 rounded half to even


def test_a_key_no_update_holds_keeps_its_object_and_index_entries_work():
    glob = {"w": torch.zeros(4), "untouched": torch.ones(2)}
    picks = [Update({"w": SliceEntry("w", (torch.tensor([0, 3]),), (2,), "weight", True)}, {"w": torch.tensor([v, -v])}, 1.0, i)
             for i, v in enumerate([1.0, 2.0, 30.0])]
    new = coordinate_rule(glob, picks, "median")
    assert torch.equal(new["w"], torch.tensor([2.0, 0.0, 0.0, -2.0])) and new["untouched"] is glob["untouched"]


def test_norm_bounding_is_exact_in_global_coordinates():
    glob = {"w": torch.tensor([1.0, 1.0, 1.0]), "b": torch.tensor([2.0]), "n": torch.tensor([3], dtype=torch.int64)}
    entries = {"w": SliceEntry("w", (slice(1, 3),), (2,), "weight", True), "b": SliceEntry("b", (), (1,), "weight", True),
               "n": SliceEntry("n", (), (1,), "norm", True)}
    update = Update(entries, {"w": torch.tensor([4.0, 1.0]), "b": torch.tensor([6.0]), "n": torch.tensor([9], dtype=torch.int64)})
    assert update_norm(glob, update) == 5.0  # delta (3, 0) and (4): the integer counter does not count
    clipped, scaled = clip_update(glob, update, 1.0)
    assert scaled and torch.allclose(clipped.state["w"], torch.tensor([1.6, 1.0])) and torch.allclose(clipped.state["b"], torch.tensor([2.8]))
    assert torch.equal(clipped.state["n"], update.state["n"]) and update.state["w"][0] == 4.0  # the original is untouched
    same, scaled = clip_update(glob, update, 5.0)
    assert same is update and not scaled
    state, rejected, metrics = aggregate_updates(glob, [update], AggregationConfig(clip=2.5))
    assert torch.allclose(state["b"], torch.tensor([4.0])) and metrics == {"clipped": 1} and not rejected


def test_a_bound_never_reached_and_the_default_are_plain_nefedavg_bit_for_bit():
    plain, _ = nefedavg(GLOBAL, CLIENTS)
    for config in (AggregationConfig(), AggregationConfig(clip=1e6)):
        state, _, _ = aggregate_updates(GLOBAL, CLIENTS, config)
        assert all(torch.equal(state[k], plain[k]) for k in plain)


def test_invalid_updates_are_rejected_before_any_rule(caplog):
    bad = nested([float("nan"), 1.0], "bad")
    with caplog.at_level("WARNING", logger="nefl_zoo.fl.aggregation"):
        state, rejected, _ = aggregate_updates(GLOBAL, [*CLIENTS, bad], AggregationConfig(rule="median", clip=1e3))
    assert [r.getMessage() for r in caplog.records] == ["client bad: update rejected: w: contains NaN or Inf"]
    assert rejected == [("bad", "w: contains NaN or Inf")] and torch.equal(state["w"], coordinate_rule(GLOBAL, CLIENTS, "median")["w"])


@pytest.mark.parametrize("attack", ["sign_flip", "scale50"])
def test_attackers_move_robust_rules_less_than_the_mean(attack):
    """8 honest nested clients move every element by about +1, 2 attackers flip or scale their update."""
    generator = torch.Generator().manual_seed(0)
    glob = {"w": torch.zeros(6)}
    updates = []
    for i in range(10):
        width = 3 + i % 4
        delta = 1 + 0.1 * torch.randn(width, generator=generator)
        if i < 2:
            delta = -delta if attack == "sign_flip" else 50 * delta
        updates.append(Update({"w": SliceEntry("w", (slice(0, width),), (width,), "weight", True)}, {"w": delta}, 1.0, i))
    honest, _ = nefedavg(glob, updates[2:])
    error = {}
    for name, config in {"mean": AggregationConfig(), "median": AggregationConfig(rule="median"),
                         "trimmed": AggregationConfig(rule="trimmed_mean", trim=0.2), "clip": AggregationConfig(clip=2.0)}.items():
        state, _, _ = aggregate_updates(glob, updates, config)
        error[name] = float((state["w"] - honest["w"]).abs().max())
    assert error["median"] < 0.5 * error["mean"] and error["trimmed"] < 0.5 * error["mean"], error
    if attack == "scale50":
        assert error["clip"] < 0.2 * error["mean"], error


@pytest.mark.parametrize("section, field", [
    ({"clip": -1.0}, "aggregation.clip"),
    ({"dp": {"noise_multiplier": 1.0}}, "aggregation.clip"),
    ({"rule": "trimmed_mean", "trim": 0.5}, "aggregation.trim"),
    ({"rule": "trimmed_mean"}, "aggregation.trim"),
    ({"trim": 0.1}, "aggregation.trim"),
    ({"rule": "median", "clip": 1.0, "dp": {"noise_multiplier": 1.0}}, "aggregation.rule"),
    ({"clip": 1.0, "dp": {"noise_multiplier": 0}}, "aggregation.dp.noise_multiplier"),
    ({"clip": 1.0, "dp": {"noise_multiplier": 1.0, "delta": 1.5}}, "aggregation.dp.delta"),
    ({"rule": "krum"}, "aggregation.rule"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_field(section, field):
    with pytest.raises(ConfigError) as err:
        tiny(aggregation=section)
    assert err.value.field == field and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("method", ["fedgh", "fedlps"])
def test_methods_with_their_own_aggregation_refuse_the_section(method):
    with pytest.raises(ValueError, match=f"^aggregation: {method} does not average nested updates") as err:
        tiny(method=method, aggregation={"rule": "median"}).build_strategy()
    assert "\n" not in str(err.value)


def test_median_with_norm_bounding_resumes_bit_for_bit(tmp_path, monkeypatch):
    config = tiny(rounds=2, checkpoint_every=1, eval__every=2, clients__fraction=0.75, train__local_epochs=1,
                  data__max_test_samples=16, aggregation={"rule": "median", "clip": 0.5})
    Engine(config, tmp_path / "straight").run()
    crash_in_round(config, tmp_path / "resumed", monkeypatch, 1)
    Engine(config, tmp_path / "resumed").run(resume=True)
    assert same_tensors(tmp_path / "straight", tmp_path / "resumed")
    straight = records(tmp_path / "straight")
    assert records(tmp_path / "resumed") == straight and [r["clipped"] for r in straight] == [3, 3]

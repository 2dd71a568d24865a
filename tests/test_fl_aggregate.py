"""NeFedAvg: the paper's worked example element by element, FedAvg equivalence, rejection."""

import math

import pytest
import torch

from nefl_zoo.fl.aggregation.nefedavg import Update, nefedavg
from nefl_zoo.slim import compile_spec, tier_key
from nefl_zoo.spec import parse_spec

KEY = "layer1.0.conv1.weight"


@pytest.fixture(scope="module")
def compiled():
    spec = parse_spec({
        "model": "resnet20", "model_args": {"in_chans": 1, "img_size": 8},
        "tiers": [{"name": f"s{i}", "gamma_w": g} for i, g in enumerate([0.2, 0.4, 0.6, 0.8, 1.0], 1)],
    })
    return compile_spec(spec)


def _client(compiled, tier, seed):
    gen = torch.Generator().manual_seed(seed)
    slice_map = compiled[tier].slice_map
    state = {
        k: torch.tensor(seed, dtype=torch.long) if k.endswith("num_batches_tracked") else torch.randn(e.shape, generator=gen)
        for k, e in slice_map.items()
    }
    return Update(slice_map, state, 1.0, seed)


def test_worked_example_element_by_element(compiled):
    """Submodels 1, 3, 5 hold the layer, trained by 2, 3 and 2 clients."""
    plan = ["s1", "s1", "s3", "s3", "s3", "s5", "s5"]
    updates = [_client(compiled, tier, seed) for seed, tier in enumerate(plan)]
    glob = compiled.init_global_state()
    new, rejected = nefedavg(glob, updates)
    assert rejected == []

    out_ch = {t: compiled[t].slice_map[KEY].shape[0] for t in ("s1", "s3", "s5")}
    in_ch = {t: compiled[t].slice_map[KEY].shape[1] for t in ("s1", "s3", "s5")}
    assert out_ch["s1"] < out_ch["s3"] < out_ch["s5"] == glob[KEY].shape[0]
    expected = torch.empty_like(glob[KEY])
    for o in range(glob[KEY].shape[0]):
        for i in range(glob[KEY].shape[1]):
            holders = [u for u, t in zip(updates, plan) if o < out_ch[t] and i < in_ch[t]]
            expected[o, i] = sum(u.state[KEY][o, i] for u in holders) / len(holders)
    torch.testing.assert_close(new[KEY], expected)
    # the narrowest slice is averaged over 7 updates, the next ring over 5, the widest over 2
    o1, i1, o3 = out_ch["s1"], in_ch["s1"], out_ch["s3"]
    torch.testing.assert_close(new[KEY][:o1, :i1], sum(u.state[KEY][:o1, :i1] for u in updates) / 7)
    torch.testing.assert_close(new[KEY][o1:o3, :i1], sum(u.state[KEY][o1:o3, :i1] for u in updates[2:]) / 5)
    torch.testing.assert_close(new[KEY][o3:, :i1], sum(u.state[KEY][o3:, :i1] for u in updates[5:]) / 2)
    # inconsistent tensors: FedAvg within each tier; tiers nobody trained keep their values
    bn = "layer1.0.bn1.weight"
    torch.testing.assert_close(new[tier_key(bn, "s3")], sum(u.state[bn] for u in updates[2:5]) / 3)
    assert new[tier_key(bn, "s2")] is glob[tier_key(bn, "s2")]
    assert new[tier_key("layer1.0.step", "s4")] is glob[tier_key("layer1.0.step", "s4")]


def test_single_tier_equals_fedavg(compiled):
    updates = [_client(compiled, "s3", seed) for seed in range(3)]
    for u, n in zip(updates, (10, 30, 60)):
        u.weight = float(n)
    new, _ = nefedavg(compiled.init_global_state(), updates)
    for key, entry in compiled["s3"].slice_map.items():
        reference = sum(u.weight * u.state[key].double() for u in updates) / 100
        got = entry.gather(new[entry.global_key])
        if got.is_floating_point():
            torch.testing.assert_close(got.double(), reference, rtol=1e-6, atol=1e-6)
        else:
            assert int(got) == round(float(reference))


def test_untouched_elements_keep_their_values(compiled):
    glob = compiled.init_global_state()
    before = {k: v.clone() for k, v in glob.items()}
    new, _ = nefedavg(glob, [_client(compiled, "s1", 0)])
    region = compiled["s1"].slice_map[KEY]
    outside = torch.ones_like(glob[KEY], dtype=torch.bool)
    region.put_(outside, torch.zeros(region.shape, dtype=torch.bool))
    assert torch.equal(new[KEY][outside], before[KEY][outside])
    assert not torch.equal(new[KEY], before[KEY])
    fc_in = compiled["s1"].slice_map["fc.weight"].shape[1]
    assert torch.equal(new["fc.weight"][:, fc_in:], before["fc.weight"][:, fc_in:])
    for key in glob:
        if key.endswith(("@s2", "@s3", "@s4", "@s5")):
            assert torch.equal(new[key], before[key])


@pytest.mark.parametrize("corrupt", ["nan", "inf", "shape", "missing"])
def test_bad_update_is_rejected_and_round_goes_on(compiled, corrupt, caplog):
    good, bad = _client(compiled, "s5", 1), _client(compiled, "s5", 2)
    bad.client = "bad"
    if corrupt == "nan":
        bad.state[KEY][0, 0, 0, 0] = math.nan
    elif corrupt == "inf":
        bad.state["fc.weight"][0, 0] = math.inf
    elif corrupt == "shape":
        bad.state[KEY] = torch.zeros(3, 3)
    else:
        del bad.state[KEY]
    glob = compiled.init_global_state()
    new, rejected = nefedavg(glob, [good, bad])
    alone, _ = nefedavg(glob, [good])
    assert [c for c, _ in rejected] == ["bad"]
    assert "rejected" in caplog.text
    for key in glob:
        assert torch.equal(new[key], alone[key])


# ---- train.weighting through the engine, against a hand-written weighted mean (issue 13) ----
@pytest.mark.parametrize("weighting", ["clients", "samples"])
def test_weighting_through_the_engine_is_the_weighted_mean_of_the_replies(tmp_path, weighting):
    """One round, clients 0-1 train g0.5 and 2-3 train g1 on Dirichlet shards of unequal size:
    every global element is the mean of the replies holding it, weighted 1 per client or by the
    client's sample count, computed here from the replies alone (no slice map)."""
    from nefl_zoo.fl.engine import Engine
    from tests.conftest import tiny

    spec = {"model": "resnet20", "model_args": {"in_chans": 1, "img_size": 8},
            "tiers": [{"name": "g0.5", "gamma_w": 0.5}, {"name": "g1", "gamma_w": 1.0}]}
    config = tiny(rounds=1, spec=spec, clients__groups=[["g0.5"], ["g1"]], data__partition="dirichlet",
                  train__local_epochs=1, train__weighting=weighting, data__max_test_samples=32, eval__every=1)
    engine = Engine(config, tmp_path)
    replies = {}
    exchange = engine.exchange

    def keep_replies(kind, instructions):
        out = exchange(kind, instructions)
        replies.update({cid: ({k: v.clone() for k, v in r.arrays.items()}, {"tier": r.level, "num_samples": r.num_samples})
                        for cid, r in out.items()})
        return out

    engine.exchange = keep_replies
    engine.run()
    assert sorted(replies) == [0, 1, 2, 3] and [replies[c][1]["tier"] for c in range(4)] == ["g0.5", "g0.5", "g1", "g1"]
    samples = [replies[c][1]["num_samples"] for c in range(4)]
    assert max(samples) > 2 * min(samples), samples  # unequal enough for the weighting to matter
    weight = {c: 1.0 if weighting == "clients" else float(samples[c]) for c in range(4)}
    state = engine.state

    def weighted_mean(clients, key):
        """Element-wise: sum of w * value over the clients whose tensor reaches the element,
        divided by the sum of their w (tensors of narrower clients are corners of wider ones)."""
        full = max((replies[c][0][key] for c in clients), key=lambda t: t.numel())
        total, norm = torch.zeros(full.shape, dtype=torch.float64), torch.zeros(full.shape, dtype=torch.float64)
        for c in clients:
            t = replies[c][0][key].double()
            corner = tuple(slice(0, n) for n in t.shape)
            total[corner] += weight[c] * t
            norm[corner] += weight[c]
        return total / norm

    for key in ("conv1.weight", "layer1.0.conv1.weight", "layer3.2.conv2.weight", "fc.weight", "fc.bias"):
        expected = weighted_mean(range(4), key)
        torch.testing.assert_close(state[key].double(), expected, rtol=1e-6, atol=1e-7)
        narrow = replies[0][0][key].shape
        assert tuple(narrow) != tuple(state[key].shape) or key == "fc.bias"  # g0.5's corner is smaller
    for tier, clients in (("g0.5", [0, 1]), ("g1", [2, 3])):
        for key in ("bn1.weight", "layer2.1.bn2.running_var", "layer1.0.step"):
            torch.testing.assert_close(state[f"{key}@{tier}"].double(), weighted_mean(clients, key), rtol=1e-6, atol=1e-7)
        batches = [int(replies[c][0]["bn1.num_batches_tracked"]) for c in clients]
        expected = sum(weight[c] * b for c, b in zip(clients, batches)) / sum(weight[c] for c in clients)
        assert int(state[f"bn1.num_batches_tracked@{tier}"]) == round(expected)
    # the two rules give different global states here, so each assertion above can fail
    unweighted = sum(replies[c][0]["fc.bias"].double() for c in range(4)) / 4
    assert (float((state["fc.bias"].double() - unweighted).abs().max()) > 1e-4) == (weighting == "samples")


# ---- nefedavg on hand-made tensors: weights, exact reasons, integer counters (issue 13) ------
from nefl_zoo.slim import SliceEntry  # noqa: E402


def hand_update(value, weight=1.0, client="c", narrow=False, n=None):
    """``w`` (2x3, float32; ``narrow``: its 1x2 corner only) filled with ``value``, and the counter ``n``."""
    entries = {"w": SliceEntry("w", (slice(0, 1), slice(0, 2)) if narrow else (), (1, 2) if narrow else (2, 3), "weight", True)}
    state = {"w": torch.full(entries["w"].shape, float(value))}
    if n is not None:
        entries["n"] = SliceEntry("n", (), (), "norm", False)
        state["n"] = torch.tensor(n, dtype=torch.long)
    return Update(entries, state, weight, client)


def test_nefedavg_by_hand_with_weights_and_large_integer_counters():
    glob = {"w": torch.full((2, 3), -1.0), "n": torch.tensor(5, dtype=torch.long), "other": torch.ones(1)}
    big = 2**40
    updates = [hand_update(2.0, 1.0, n=big + 1), hand_update(6.0, 3.0, narrow=True), hand_update(10.0, 0.5, n=big + 4)]
    new, rejected = nefedavg(glob, updates)
    assert rejected == []
    # the 1x2 corner: (1*2 + 3*6 + 0.5*10) / 4.5; elsewhere (1*2 + 0.5*10) / 1.5
    assert new["w"].dtype == torch.float32
    torch.testing.assert_close(new["w"], torch.tensor([[25 / 4.5, 25 / 4.5, 7 / 1.5], [7 / 1.5] * 3]), rtol=1e-7, atol=0)
    # an integer counter: the weighted mean, rounded, exact far beyond float32's 2**24
    assert new["n"].dtype == torch.long and int(new["n"]) == round((1 * (big + 1) + 0.5 * (big + 4)) / 1.5) == big + 2
    assert new["other"] is glob["other"]
    assert torch.equal(glob["w"], torch.full((2, 3), -1.0))  # the input state is not modified


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda u: setattr(u, "weight", 0.0), "weight 0.0 is not a positive number"),
        (lambda u: setattr(u, "weight", -2.0), "weight -2.0 is not a positive number"),
        (lambda u: setattr(u, "weight", math.inf), "weight inf is not a positive number"),
        (lambda u: setattr(u, "weight", math.nan), "weight nan is not a positive number"),
        (lambda u: u.state.update({f"x{i}": torch.zeros(1) for i in range(5)}), "unexpected tensors: x0, x1, x2"),
        (lambda u: u.state.update(n=torch.zeros(3)), "n: shape (3,), expected ()"),
        (lambda u: u.state["w"].__setitem__((0, 1), math.nan), "w: contains NaN or Inf"),
    ],
)
def test_rejected_update_reasons_and_the_others_still_count(edit, reason, caplog):
    glob = {"w": torch.zeros(2, 3), "n": torch.tensor(0, dtype=torch.long)}
    bad = hand_update(100.0, client="bad", n=7)
    edit(bad)
    good = [hand_update(2.0, 1.0, "g1", n=1), hand_update(4.0, 3.0, "g2", n=3)]
    with caplog.at_level("WARNING"):
        new, rejected = nefedavg(glob, [bad, *good])  # the bad update first: the ones after it count
    assert rejected == [("bad", reason)]
    assert caplog.messages == [f"client bad: update rejected: {reason}"]
    torch.testing.assert_close(new["w"], torch.full((2, 3), 3.5))  # (2 + 3*4) / 4
    assert int(new["n"]) == round(10 / 4)


def test_missing_tensors_are_named_in_order_first_three():
    entries = {k: SliceEntry(k, (), (1,), "weight", True) for k in "edcba"}
    update = Update(entries, {"e": torch.zeros(1)}, 1.0, "m")
    _, rejected = nefedavg({k: torch.zeros(1) for k in "abcde"}, [update])
    assert rejected == [("m", "missing tensors: a, b, c")]

"""NeFedAvg: the paper's worked example element by element, FedAvg equivalence, rejection."""

import math

import pytest
import torch

from nefl_zoo.fl.aggregate import Update, nefedavg
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

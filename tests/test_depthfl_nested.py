"""DepthFL as the NeFL paper's appendix reads it (``depthfl`` variant ``nefl`` with ``nested``
on ``resnet20/depthfl-nested``): contiguous depth prefixes, each submodel a subset of the next,
so every tensor of a smaller submodel is averaged over the clients of every larger one too."""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from nefl_zoo.fl.config import ConfigError, parse_config
from nefl_zoo.fl.engine import Engine
from nefl_zoo.fl.methods.depthfl import nested_prefixes
from nefl_zoo.fl.strategy.base import Reply
from nefl_zoo.slim import SliceMap
from nefl_zoo.spec import load_spec, shipped_specs_dir
from nefl_zoo_cli.app import app

from .conftest import records, tiny

torch.set_num_threads(1)
LEVELS = ["g0.2", "g0.4", "g0.6", "g0.8", "g1"]
NESTED = shipped_specs_dir() / "resnet20/depthfl-nested.yaml"
NEFL_D = shipped_specs_dir() / "resnet20/nefl-d.yaml"
APPENDIX = {"variant": "nefl", "nested": True}


def strategy(spec=NESTED, **method_args):
    return parse_config({"method": "depthfl", "spec": str(spec), "method_args": method_args, "data": {"augment": False}}, "<test>").build_strategy()


def kept(spec, tier):
    """The (stage, block) pairs ``tier`` of ``spec`` keeps."""
    t = spec.tier(tier)
    return {(s, j) for s, stage in enumerate(t.steps or [[1] * 3] * 3) for j, v in enumerate(stage) if v}


def test_the_spec_keeps_contiguous_prefixes_each_within_the_next_near_the_nefl_d_gammas():
    spec = load_spec(NESTED)
    assert [t.name for t in spec.tiers] == LEVELS == [t.name for t in load_spec(NEFL_D).tiers]
    order = [(s, j) for s in range(3) for j in range(3)]  # resnet20's 9 blocks in stage order
    blocks = [len(kept(spec, t)) for t in LEVELS]
    assert blocks == [5, 7, 8, 8, 9]
    for tier, k in zip(LEVELS, blocks):
        assert kept(spec, tier) == set(order[:k]), tier  # the first k blocks: contiguous
    assert all(kept(spec, a) <= kept(spec, b) for a, b in zip(LEVELS, LEVELS[1:]))  # each a subset of the next
    assert nested_prefixes(spec) == dict(zip(LEVELS, blocks))
    # each tier is the prefix nearest its NeFL-D tier's gamma: the prefixes DepthFL's original variant picks
    assert strategy(NEFL_D).prefixes.bounds == dict(zip(LEVELS, blocks))
    # the NeFL-D tiers are not nested: g0.8 keeps [2, 0, 3] blocks per stage, g0.6 [3, 1, 2]
    nefl_d = load_spec(NEFL_D)
    assert not kept(nefl_d, "g0.6") <= kept(nefl_d, "g0.8")


def test_appendix_variant_holds_nested_tensors_and_averages_each_over_every_larger_submodel():
    method = strategy(**APPENDIX)
    assert method.prefix_blocks == {"g0.2": 5, "g0.4": 7, "g0.6": 8, "g0.8": 8, "g1": 9}
    held = {t: set(method.entries(t)) for t in LEVELS}
    assert all(held[a] <= held[b] for a, b in zip(LEVELS, LEVELS[1:]))  # one shared classifier, BN, no exits
    assert held["g0.6"] == held["g0.8"]
    # g0.2 ends in stage 2; stage 3's projection shortcut (a downsampling layer to the classifier's input) stays
    assert {"layer3.0.downsample.0.weight", "fc.weight"} <= held["g0.2"] and "layer3.0.conv1.weight" not in held["g0.2"]
    assert method.settings.variant == "nefl" and not any("@" in k or k.startswith("exits") for k in held["g1"])
    # one reply per tier, every tensor filled with the tier's index: NeFedAvg averages each tensor over
    # the tiers holding it, which for nested prefixes are the tier that first holds it and all larger ones
    torch.manual_seed(0)
    state = method.init_global_state()
    replies = {}
    for i, tier in enumerate(LEVELS):
        arrays = {k: torch.full_like(v, float(i)) for k, v in SliceMap(dict(method.entries(tier))).extract(state).items()}
        replies[i] = Reply(arrays, num_samples=10, loss=1.0, level=tier)
    new = method.aggregate_train(1, state, replies).state
    first = {"conv1.weight": 0, "layer1.0.conv1.weight": 0, "layer3.0.downsample.0.weight": 0, "fc.weight": 0,
             "layer2.2.conv1.weight": 1, "layer3.0.conv1.weight": 1, "layer3.1.conv1.weight": 2, "layer3.2.conv1.weight": 4}
    for key, start in first.items():
        assert [t for t in LEVELS if key in held[t]] == LEVELS[start:], key
        assert torch.allclose(new[key], torch.full_like(new[key], sum(range(start, 5)) / (5 - start))), key


def test_appendix_variant_is_the_nefl_variant_on_the_nested_spec_with_the_check_on():
    plain, checked = strategy(variant="nefl"), strategy(**APPENDIX)
    assert plain.prefix_blocks is None
    def layout(method, tier):
        return {k: (e.global_key, e.index, e.shape, e.kind) for k, e in method.entries(tier).items()}

    assert all(layout(plain, t) == layout(checked, t) for t in LEVELS)  # the same training: nested only checks
    per_tier = strategy(**APPENDIX, bn="per_tier")  # the appendix's BN decoupling
    entries = per_tier.entries("g0.2")
    assert entries["bn1.weight"].global_key == "bn1.weight@g0.2" and entries["conv1.weight"].global_key == "conv1.weight"
    assert {e.global_key for e in per_tier.entries("g0.6").values()} != {e.global_key for e in per_tier.entries("g0.8").values()}


def test_two_rounds_of_the_appendix_variant_train_every_tier_and_g06_equals_g08(tmp_path):
    spec = yaml.safe_load(NESTED.read_text())
    spec["model_args"] = {**spec["model_args"], "img_size": 8}
    config = tiny(method="depthfl", method_args=APPENDIX, spec=spec, rounds=2, eval__every=2, eval__bn_both=False,
                  clients__num_clients=5, clients__environment="fixed", train__local_epochs=1, data__max_test_samples=64)
    result = Engine(config, tmp_path).run()
    rec = records(tmp_path)
    assert [r["round"] for r in rec] == [1, 2]
    assert sorted(c["tier"] for c in rec[0]["per_client"].values()) == LEVELS  # fixed: client i trains tier i
    assert set(result.acc) == set(LEVELS) and result.worst_case == "g0.2"
    assert result.acc["g0.6"] == result.acc["g0.8"]  # the same blocks, classifier and BN: the same submodel
    state = load_file(str(tmp_path / "global.safetensors"))
    assert not any("@" in k or k.startswith("exits") for k in state)
    assert json.loads((tmp_path / "summary.json").read_text())["worst_case"] == "g0.2"


def test_a_spec_claimed_nested_but_not_is_refused_in_one_line_naming_the_tier_and_the_fix():
    with pytest.raises(ValueError) as err:
        strategy(NEFL_D, **APPENDIX)
    message = str(err.value)
    assert "\n" not in message and message.startswith("depthfl nested: tier g0.4 keeps blocks per stage [3, 2, 1], not a contiguous")
    assert "[[1, 1, 1], [1, 1, 1], [0, 0, 0]]" in message and "resnet20/depthfl-nested" in message
    strategy(NEFL_D, variant="nefl")  # unclaimed: the NeFL paper's footnote reading, non-contiguous, as before
    # prefixes listed largest first: the subset order is refused
    spec = yaml.safe_load(NESTED.read_text())
    spec["tiers"] = spec["tiers"][::-1]
    with pytest.raises(ValueError, match=r"^depthfl nested: tier g0.8 keeps the first 8 blocks, fewer than tier g1 before it \(9\)"):
        parse_config({"method": "depthfl", "spec": spec, "method_args": APPENDIX}, "<test>").build_strategy()
    for args, what in (({"nested": True}, "nested"), ({"bn": "per_tier"}, "bn")):
        with pytest.raises(ConfigError, match=rf"method_args: depthfl: {what}: variant original"):
            strategy(**args)


def test_train_refuses_the_claim_on_nefl_d_with_one_error_line(tmp_path):
    config = shipped_specs_dir() / "train/digits-quick.yaml"
    result = CliRunner().invoke(app, ["train", str(config), "-o", str(tmp_path / "run"), "--quiet", "--set", "method=depthfl",
                                      "--set", "method_args.variant=nefl", "--set", "method_args.nested=true",
                                      "--set", f"spec={NEFL_D}"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: depthfl nested: tier g0.4 keeps blocks per stage [3, 2, 1]"), lines

"""The edge families (MobileNetV2/V3, EfficientNet-B0, ShuffleNetV2) beyond the model contract:
torchvision's logits after ``load_pretrained``, their width rule, blocks that cannot be skipped,
ShuffleNetV2's non-prefix nesting proved exact, fvcore's MACs of one block counted by hand, and a
short NeFL run on digits."""

from __future__ import annotations

import math

import pytest
import torch

from nefl_zoo.models import ModelArgsError, create_model, load_pretrained
from nefl_zoo.profile import count_macs
from nefl_zoo.slim import SliceEntry, compile_spec
from nefl_zoo.spec import SpecError, parse_spec

EDGE = ["mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small", "efficientnet_b0", "shufflenet_v2_x1_0", "shufflenet_v2_x0_5"]
SMALL = dict(num_classes=10, in_chans=1, img_size=32)


def _randomise_norms(model: torch.nn.Module) -> None:
    """Non-trivial BatchNorm statistics and affine parameters, so that a misplaced one shows."""
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.1)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.normal_(1, 0.1)
            m.bias.data.normal_(0, 0.1)


@pytest.mark.parametrize("name", EDGE)
@torch.no_grad()
def test_torchvision_weights_give_torchvision_logits(name):
    import torchvision

    torch.manual_seed(0)
    theirs = getattr(torchvision.models, name)().eval()
    _randomise_norms(theirs)
    ours = create_model(name).eval()
    skipped = load_pretrained(ours, theirs.state_dict())
    assert set(skipped) == set(ours.step_keys())  # torchvision has no step sizes
    x = torch.randn(2, 3, 64, 64)
    assert (ours(x) - theirs(x)).abs().max().item() <= 1e-5


def test_default_width_rule_is_make_divisible_by_8_and_channel_multiple_overrides_it():
    with torch.device("meta"):
        aligned = create_model("mobilenet_v2", gamma_w=0.4)
        paper = create_model("mobilenet_v2", gamma_w=0.4, channel_multiple=1)
    # last stage: 320 * sqrt(0.4) = 202.4 -> nearest multiple of 8 is 200 (not below 90%); ceil: 203
    assert aligned.feature_info[-1]["num_chs"] == 200 and paper.feature_info[-1]["num_chs"] == 203
    # the depthwise convolution's groups follow its sliced channels: 6 * 160 = 960 -> 960 * 0.632 = 607.2 -> 608
    dw = aligned.features[17].conv[1][0]
    assert (dw.in_channels, dw.out_channels, dw.groups) == (608, 608, 608)
    # MobileNetV3's classifier hidden layer is narrowed too: 1280 * 0.632 = 809.5 -> 808
    with torch.device("meta"):
        v3 = create_model("mobilenet_v3_large", gamma_w=0.4)
    assert (v3.classifier[0].out_features, v3.classifier[3].in_features, v3.num_features) == (808, 808, 808)
    spec = parse_spec({"model": "mobilenet_v2", "tiers": [{"name": "a", "gamma_w": 0.4}]})
    assert spec.tier_args(spec.tiers[0])["channel_multiple"] == 8


def test_a_block_without_identity_shortcut_cannot_be_skipped():
    steps = [[1], [0, 1], [1, 1, 1], [1, 1, 1, 1], [1, 1, 1], [1, 1, 1], [1]]
    with pytest.raises(SpecError) as err:
        parse_spec({"model": "mobilenet_v2", "tiers": [{"name": "a", "steps": steps}]}, "x.yaml")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("x.yaml: tiers[0].steps[1][0]: mobilenet_v2 stage 2 block 0 has no identity shortcut")
    with pytest.raises(ModelArgsError, match=r"steps\[0\]\[1\]: shufflenet_v2 .* nests by width only"):
        create_model("shufflenet_v2_x0_5", steps=[[1, 0, 1, 1], [1] * 8, [1] * 4])
    steps[1] = [1, 0]  # an identity block: removed
    with torch.device("meta"):
        model = create_model("mobilenet_v2", steps=steps)
    assert "2" in model.features._modules and "3" not in model.features._modules


@pytest.mark.parametrize("name, gamma_w", [("shufflenet_v2_x1_0", 0.3), ("shufflenet_v2_x0_5", 0.5), ("mobilenet_v3_small", 0.3)])
@torch.no_grad()
def test_a_slim_tier_is_the_global_model_with_the_removed_channels_zeroed(name, gamma_w):
    """Each slim tensor placed at its slice region of an all-zero global model (BN variance 1
    elsewhere): the removed channels contribute nothing, and the logits are the tier's."""
    torch.manual_seed(0)
    compiled = compile_spec(parse_spec({"model": name, "model_args": SMALL, "tiers": [{"name": "t", "gamma_w": gamma_w}]}))
    slim = compiled["t"].build().eval()
    _randomise_norms(slim)
    full = compiled.create_global_model().eval()
    state = {k: torch.zeros_like(v) for k, v in full.state_dict().items()}
    prefixes = True
    for key, value in slim.state_dict().items():
        index = full.slice_index(key, value.shape, state[key].shape)
        prefixes &= all(isinstance(i, slice) for i in index)
        SliceEntry(key, index, tuple(value.shape), "weight", True).put_(state[key], value)
    for key, value in state.items():
        if key.endswith("running_var"):
            value[value == 0] = 1
    full.load_state_dict(state)
    assert prefixes == name.startswith("mobilenet")  # ShuffleNetV2's stream channels are not a prefix
    x = torch.randn(2, *compiled.input_size)
    expected = slim(x)
    torch.testing.assert_close(full(x), expected, atol=1e-6 * max(1.0, expected.abs().max().item()), rtol=1e-5)


def test_fvcore_counts_one_block_with_depthwise_conv_squeeze_excitation_and_hard_swish_as_by_hand():
    """MobileNetV3-Large's features.13 (112 -> 672 expansion, 5x5 stride-2 depthwise, SE to 168,
    hard-swish, projection to 160) on a 112x4x4 input (output 2x2). One multiply-add is one;
    BatchNorm (affine, eval) two per element (fvcore's rule), the SE's average pool one per input element, its scaling multiply
    one per output element; activations (hard-swish, hard-sigmoid) none (profile.MACS_NOTE)."""
    block = create_model("mobilenet_v3_large").features[13]
    expand = 112 * 672 * 4 * 4 + 2 * 672 * 4 * 4  # 1x1 convolution, then its BatchNorm
    depthwise = 672 * 5 * 5 * 2 * 2 + 2 * 672 * 2 * 2  # one 5x5 filter per channel at 2x2, BatchNorm
    se = 672 * 2 * 2 + 672 * 168 + 168 * 672 + 672 * 2 * 2  # pool, fc1, fc2, scaling
    project = 672 * 160 * 2 * 2 + 2 * 160 * 2 * 2
    assert count_macs(block, (112, 4, 4)) == expand + depthwise + se + project


def test_nefl_trains_a_shufflenet_on_digits(tmp_path):
    """Two NeFL rounds on digits, one client training the narrowest tier of the smallest ShuffleNet
    (non-prefix slices, extracted from and written back to the global state): its training loss
    goes down and both tiers evaluate (the 10-round runs of every family are in benchmarks/README.md)."""
    from nefl_zoo.fl import parse_config, train

    torch.set_num_threads(1)
    name = "shufflenet_v2_x0_5"
    config = parse_config({
        "name": name, "method": "nefl", "seed": 0, "rounds": 2,
        "spec": {"model": name, "model_args": {"num_classes": 10, "in_chans": 1, "img_size": 16},
                 "tiers": [{"name": "g0.2", "gamma": 0.2, "gamma_w": 0.2}, {"name": "g1", "gamma": 1.0}]},
        "data": {"dataset": "digits", "partition": "iid", "augment": False, "max_test_samples": 128},
        "clients": {"num_clients": 4, "fraction": 0.25, "groups": [["g0.2"]]},
        "train": {"local_epochs": 2, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        "eval": {"every": 2},
    })
    result = train(config, tmp_path / name)
    assert set(result.acc) >= {"g0.2", "g1"} and all(math.isfinite(a) for a in result.acc.values())
    losses = _train_losses(tmp_path / name)
    assert len(losses) == 2 and losses[1] < losses[0], losses


def _train_losses(run_dir) -> list[float]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["train_loss"] for row in rows if "train_loss" in row]


def test_depthfl_keeps_to_prefixes_that_skip_only_skippable_blocks():
    """DepthFL skips trailing blocks: on a family whose last block has no identity shortcut it is a
    one-line error naming the model; on MobileNetV3-Small (last stage: a fixed block, then two
    identity blocks) every submodel keeps at least the fixed block, and its exits train."""
    from nefl_zoo.fl import parse_config

    def depthfl(name):
        spec = {"model": name, "model_args": {"num_classes": 10, "in_chans": 1, "img_size": 16},
                "tiers": [{"name": "g0.2", "gamma": 0.2, "gamma_w": 0.2}, {"name": "g1", "gamma": 1.0}]}
        return parse_config({"method": "depthfl", "spec": spec, "data": {"dataset": "digits"}}, "<test>").build_strategy()

    with pytest.raises(ValueError, match=r"^depthfl needs .*: mobilenet_v2's last block \(stage 7 block 0\) cannot be") as err:
        depthfl("mobilenet_v2")
    assert "\n" not in str(err.value)
    prefixes = depthfl("mobilenet_v3_small").prefixes
    assert prefixes.bounds == {"g0.2": 9, "g1": 11}  # 11 blocks; the 9th, stage 5 block 0, has no shortcut
    torch.manual_seed(0)
    net = prefixes.eval_model(prefixes.init_global_state(), "g1", None).train()
    x, y = torch.randn(4, 1, 16, 16), torch.arange(4)
    loss, logits = net.loss(x, y)
    loss.backward()
    assert logits.shape == (4, 10) and len(net.all_logits(x)) == 2 and math.isfinite(loss.item())

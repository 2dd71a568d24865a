"""The edge families (MobileNetV2/V3, EfficientNet-B0, ShuffleNetV2) beyond the model contract:
torchvision's logits after ``load_pretrained``, their width rule, blocks that cannot be skipped,
ShuffleNetV2's non-prefix nesting proved exact, fvcore's MACs of one block counted by hand, and a
short NeFL run on digits."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from nefl_zoo.fl.strategy.registry import registered_methods
from nefl_zoo.models import ModelArgsError, create_model, load_pretrained
from nefl_zoo.models.shufflenet import ShuffleNetV2
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


@torch.no_grad()
def _calibrate_norms(model: torch.nn.Module, images: torch.Tensor) -> None:
    """BatchNorm statistics of ``images`` with random affine parameters: at initialisation with
    made-up statistics a deep network's output hardly depends on its input, so a wrong stride or
    kernel would go unseen; with statistics of real activations it does not."""
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # a cumulative average
            m.weight.data.normal_(1, 0.1)
            m.bias.data.normal_(0, 0.1)
    model.eval()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.train()  # statistics only: stochastic depth and dropout stay off
    model(images)
    model.eval()


@pytest.mark.parametrize("name", EDGE)
@torch.no_grad()
def test_torchvision_weights_give_torchvision_logits(name):
    import torchvision

    torch.manual_seed(0)
    theirs = getattr(torchvision.models, name)().eval()
    _calibrate_norms(theirs, torch.randn(16, 3, 64, 64))
    ours = create_model(name).eval()
    skipped = load_pretrained(ours, theirs.state_dict())
    assert set(skipped) == set(ours.step_keys())  # torchvision has no step sizes
    x = torch.randn(2, 3, 64, 64)
    expected = theirs(x)
    assert (expected[0] - expected[1]).abs().max().item() > 1e-2  # the logits depend on the image
    assert (ours(x) - expected).abs().max().item() <= 1e-5


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
    assert message == ("x.yaml: tiers[0].steps[1][0]: mobilenet_v2 stage 2 block 0 has no identity shortcut (it changes "
                       "the stride or the channels), so it cannot be skipped: give it a nonzero step")
    with pytest.raises(ModelArgsError, match=r"steps\[0\]\[1\]: shufflenet_v2 .* nests by width only"):
        create_model("shufflenet_v2_x0_5", steps=[[1, 0, 1, 1], [1] * 8, [1] * 4])
    with pytest.raises(ModelArgsError) as built:  # the module itself refuses, not only its registered args
        ShuffleNetV2((48, 96, 192), steps=[[1, 1, 1, 1], [1] * 8, [1, 1, 0, 1]])
    assert str(built.value) == ("steps[2][2]: shufflenet_v2 stage 3 block 2 has no identity shortcut (a channel split and "
                                "shuffle; ShuffleNetV2 nests by width only), so it cannot be skipped: give it a nonzero step")
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
    goes down and both tiers evaluate (the 10-round runs of every family are in docs/benchmarks/edge.md)."""
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
    """On MobileNetV3-Small (last stage: a fixed block, then two identity blocks) every DepthFL
    submodel keeps at least the fixed block, and its exits train."""
    from nefl_zoo.fl import parse_config

    spec = {"model": "mobilenet_v3_small", "model_args": {"num_classes": 10, "in_chans": 1, "img_size": 16},
            "tiers": [{"name": "g0.2", "gamma": 0.2, "gamma_w": 0.2}, {"name": "g1", "gamma": 1.0}]}
    prefixes = parse_config({"method": "depthfl", "spec": spec, "data": {"dataset": "digits"}}, "<test>").build_strategy().prefixes
    assert prefixes.bounds == {"g0.2": 9, "g1": 11}  # 11 blocks; the 9th, stage 5 block 0, has no shortcut
    torch.manual_seed(0)
    net = prefixes.eval_model(prefixes.init_global_state(), "g1", None).train()
    x, y = torch.randn(4, 1, 16, 16), torch.arange(4)
    loss, logits = net.loss(x, y)
    loss.backward()
    assert logits.shape == (4, 10) and len(net.all_logits(x)) == 2 and math.isfinite(loss.item())


# Every registered method on the edge families, one round each: each method on one family, each
# family under at least one method (the contract test covers every family's model contract). A
# method added later is tried on the families in turn. DepthFL needs a last block it can skip to,
# FedLPS a backbone whose forward_norm is a chain of its top-level modules: elsewhere both are the
# one-line errors checked below.
METHOD_FAMILY = {
    "depthfl": "mobilenet_v3_small", "fedavg": "mobilenet_v3_large", "fedavg_full": "mobilenet_v3_small",
    "fedavg_min": "efficientnet_b0", "fedavgm": "shufflenet_v2_x1_0", "fedgh": "shufflenet_v2_x0_5",
    "fedlps": "shufflenet_v2_x0_5", "fedprox": "mobilenet_v3_small", "fjord": "mobilenet_v2",
    "heterofl": "mobilenet_v3_large", "nefl": "shufflenet_v2_x1_0",
}
METHOD_FAMILIES = {m: METHOD_FAMILY.get(m, EDGE[i % len(EDGE)]) for i, m in enumerate(sorted(registered_methods()))}


@pytest.mark.parametrize("method, name", sorted(METHOD_FAMILIES.items()))
def test_every_method_trains_one_round_on_an_edge_family(tmp_path, method, name):
    from nefl_zoo.fl import train

    from .conftest import tiny

    torch.set_num_threads(1)
    spec = {"model": name, "model_args": {"num_classes": 10, "in_chans": 1, "img_size": 8},
            "tiers": [{"name": "g0.2", "gamma": 0.2, "gamma_w": 0.2}, {"name": "g0.4", "gamma": 0.4, "gamma_w": 0.4}]}
    config = tiny(method=method, spec=spec, rounds=1, eval__every=1, eval__bn="recompute", eval__bn_batches=1,
                  clients__num_clients=40, clients__fraction=0.05, train__local_epochs=1, train__batch_size=64,
                  data__max_test_samples=32, data__local_split=[0.8, 0.1, 0.1],
                  method_args={"levels": [0.0, 0.5], "pretrained": "none"} if method == "fedlps" else {})  # two clients, one batch each
    result = train(config, tmp_path / method)
    losses = _train_losses(tmp_path / method)
    assert len(losses) == 1 and math.isfinite(losses[0]) and 0 < losses[0] < 10, losses
    assert result.acc and all(0 <= a <= 1 for a in result.acc.values())


@pytest.mark.parametrize("name, applies", [("mobilenet_v2", False), ("mobilenet_v3_large", True), ("mobilenet_v3_small", True),
                                           ("efficientnet_b0", False), ("shufflenet_v2_x1_0", False), ("shufflenet_v2_x0_5", False)])
def test_depthfl_applies_exactly_where_the_last_block_can_be_skipped(name, applies):
    from nefl_zoo.fl import parse_config

    spec = {"model": name, "model_args": {"num_classes": 10, "in_chans": 1, "img_size": 8},
            "tiers": [{"name": "g0.2", "gamma": 0.2, "gamma_w": 0.2}, {"name": "g1", "gamma": 1.0}]}
    config = parse_config({"method": "depthfl", "spec": spec, "data": {"dataset": "digits"}}, "<test>")
    if applies:
        assert config.build_strategy().prefixes.bounds["g1"] == sum(create_model(name, **spec["model_args"]).stage_depths)
        return
    expected = rf"^depthfl needs .*: {name}'s last block \(stage \d block \d\) cannot be, so its only depth prefix is the full model"
    with pytest.raises(ValueError, match=expected) as err:
        config.build_strategy()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["mobilenet_v2", "efficientnet_b0"])
def test_fedlps_on_an_inverted_residual_family_is_a_one_line_error(name):
    """FedLPS runs its predictor's last convolution as a top-level module; these families keep it
    inside ``features`` (torchvision's names), so FedLPS says it cannot split them."""
    from nefl_zoo.fl import parse_config

    spec = {"model": name, "model_args": {"num_classes": 10, "in_chans": 1, "img_size": 8},
            "tiers": [{"name": "g0.2", "gamma": 0.2, "gamma_w": 0.2}, {"name": "g1", "gamma": 1.0}]}
    config = parse_config({"method": "fedlps", "method_args": {"levels": [0.0, 0.5]}, "spec": spec,
                           "data": {"dataset": "digits"}}, "<test>")
    with pytest.raises(ValueError, match=r"^fedlps: InvertedResidualNet.forward_norm is not a chain of its modules") as err:
        config.build_strategy()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", EDGE)
def test_first_conv_and_feature_info_describe_the_module(name):
    """timm's metadata: ``default_cfg["first_conv"]`` names the first convolution, and each
    ``feature_info`` entry names a module whose output has its channels and reduction."""
    model = create_model(name, num_classes=10, img_size=64).eval()
    first = model.get_submodule(model.default_cfg["first_conv"])
    assert first is next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    shapes = {}

    def record(key, module, args, out):
        shapes.setdefault(key, out.shape)

    for info in model.feature_info:
        model.get_submodule(info["module"]).register_forward_hook(functools.partial(record, info["module"]))
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 64))
    assert [(shapes[i["module"]][1], 64 // shapes[i["module"]][-1]) for i in model.feature_info] == \
        [(i["num_chs"], i["reduction"]) for i in model.feature_info]


@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v3_small"])
def test_pre_logits_keep_the_classifiers_dropout_in_training(name):
    """FedGH trains on ``forward_head(pre_logits=True)``: every classifier layer but the last,
    dropout included (random in training, the identity in eval)."""
    model = create_model(name, num_classes=10, img_size=32).eval()
    with torch.no_grad():
        features = model.forward_features(torch.randn(2, 3, 32, 32))
    model.train()
    assert not torch.equal(model.forward_head(features, pre_logits=True), model.forward_head(features, pre_logits=True))
    model.eval()
    assert torch.equal(model.forward_head(features, pre_logits=True), model.forward_head(features, pre_logits=True))

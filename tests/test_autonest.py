"""Automatic nesting (nefl_zoo.nesting): torchvision networks and a user's module behind the spec
compiler, checked as the model contract checks the zoo, and against the hand-written zoo."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nefl_zoo.models import count_params, create_model
from nefl_zoo.nesting import NestError, nest
from nefl_zoo.nesting.verify import zeroed_parity
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import SpecError, parse_spec

SMALL = dict(num_classes=10, in_chans=1, img_size=32)


def compiled_with_tiers(name: str, gamma_w: float = 0.3):
    """``narrow`` (gamma_w, every other skippable block removed) and ``full``."""
    with torch.device("meta"):
        depths = create_model(name, **SMALL).stage_depths
    steps = [[0.0 if j % 2 else 1.0 for j in range(d)] for d in depths] or None  # None: no skippable block
    return compile_spec(parse_spec({"model": name, "model_args": SMALL,
                                    "tiers": [{"name": "narrow", "gamma_w": gamma_w, "steps": steps}, {"name": "full"}]}))


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    compiled = compiled_with_tiers("torchvision:resnet18")
    full = compiled.create_global_model().eval()
    return compiled, full, compiled.init_global_state(full)


@torch.no_grad()
def test_full_tier_is_the_global_model_bit_for_bit_and_extract_scatter_is_the_identity(resnet):
    compiled, full, state = resnet
    sub = compiled["full"].load(state).eval()
    assert list(sub.state_dict()) == list(full.state_dict())
    x = torch.randn(2, *compiled.input_size)
    assert torch.equal(sub(x), full(x))
    copy = {k: v.clone() for k, v in state.items()}
    shapes = compiled.global_shapes()
    for ct in compiled.tiers.values():
        ct.slice_map.check(shapes)
        ct.scatter_(copy, ct.extract(copy))
    assert all(torch.equal(copy[k], state[k]) for k in state)


def test_resnet18_blocks_widths_and_reported_projection_blocks(resnet):
    compiled, full, _ = resnet
    # 8 basic blocks, the first of stages 2-4 with a projection shortcut: 5 skippable
    assert full.stage_depths == (2, 1, 1, 1) and compiled.stage_names == ("layer1", "layer2", "layer3", "layer4")
    assert sorted(full.step_keys()) == ["layer1.0.step", "layer1.1.step", "layer2.1.step", "layer3.1.step", "layer4.1.step"]
    assert [u.split(":")[0] for u in full.plan.unskippable] == ["layer2.0", "layer3.0", "layer4.0"]
    # each stage's module and its reduction of the 32-pixel input (stem and max pool: 4)
    assert [(i["module"], i["reduction"]) for i in full.feature_info] == [("layer1", 4), ("layer2", 8), ("layer3", 16), ("layer4", 32)]
    narrow = compiled["narrow"].build()
    # ceil(C * sqrt(0.3)) of 64/128/256/512, the paper's rule, and blocks layer1.1 removed
    assert [i["num_chs"] for i in narrow.feature_info] == [36, 71, 141, 281]
    assert "layer1.1.conv1.weight" not in narrow.state_dict() and narrow.conv1.weight.shape == (36, 1, 7, 7)


@torch.no_grad()
def test_torchvisions_own_weights_load_and_give_torchvisions_logits(resnet):
    import copy

    import torchvision

    from nefl_zoo.models import load_pretrained

    _, full, _ = resnet
    theirs = torchvision.models.resnet18(num_classes=10).eval()
    theirs.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)  # in_chans 1, as automatic nesting replaces it
    ours = copy.deepcopy(full)
    assert sorted(load_pretrained(ours, theirs.state_dict())) == sorted(full.step_keys())  # steps stay 1
    x = torch.randn(2, 1, 32, 32)
    assert torch.equal(ours(x), theirs(x))


def test_a_slim_tier_is_the_global_model_with_the_removed_channels_and_blocks_zeroed(resnet):
    """The contract test's exactness (every model of the coverage table is checked the same way
    by benchmarks/bench_autonest.py)."""
    compiled, _, _ = resnet
    assert zeroed_parity(compiled, "narrow", torch.randn(2, *compiled.input_size)) < 1e-5


@pytest.mark.parametrize("statistic", ["running_mean", "running_var"])
def test_the_parity_check_catches_running_statistics_in_the_wrong_channels(resnet, monkeypatch, statistic):
    """The check randomises the tier's BatchNorm statistics, so statistics that the slice map
    places in the wrong channels of the global model (here: the kept ones, reversed) show."""
    from nefl_zoo.nesting.net import AutoNestedNet
    from nefl_zoo.slim.slicemap import region_key

    compiled, _, _ = resnet
    place = AutoNestedNet.slice_index

    def reversed_statistics(self, key, slim_shape, full_shape):
        index = place(self, key, slim_shape, full_shape)
        if key.endswith(statistic) and tuple(slim_shape) != tuple(full_shape):
            return (torch.arange(full_shape[0])[region_key(index)].flip(0),)
        return index

    x = torch.randn(2, *compiled.input_size)
    monkeypatch.setattr(AutoNestedNet, "slice_index", reversed_statistics)
    assert zeroed_parity(compiled, "narrow", x) > 1e-2


@torch.no_grad()
@pytest.mark.parametrize("zoo, auto, args", [
    ("resnet18", "torchvision:resnet18", dict(stem="imagenet", gamma_w=0.25)),
    ("mobilenet_v2", "torchvision:mobilenet_v2", dict(gamma_w=0.5, channel_multiple=8)),
])
def test_the_automatic_tier_is_the_hand_written_tier(zoo, auto, args):
    """Same widths: the same parameters (bar the step sizes the zoo also gives projection
    blocks) and, with the same weights, the same logits."""
    torch.manual_seed(0)
    hand = create_model(zoo, **SMALL, **args).eval()
    made = create_model(auto, **SMALL, **{k: v for k, v in args.items() if k != "stem"}).eval()
    no_steps = lambda m: count_params(m) - sum(p.numel() for k, p in m.named_parameters() if "step" in k.rsplit(".", 1)[-1])
    assert no_steps(made) == no_steps(hand)
    assert made.load_state_dict(hand.state_dict(), strict=False).missing_keys == []
    x = torch.randn(2, *made.default_cfg["input_size"])
    assert (made(x) - hand(x)).abs().max() <= 1e-5


class _SqueezeExcite(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // 2, 1), nn.Conv2d(c // 2, c, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True)))))


class _Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv, self.bn, self.se = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), _SqueezeExcite(c)

    def forward(self, x):
        return x + self.se(self.bn(self.conv(x)))


class TinyNet(nn.Module):
    """Concatenation, grouped convolution, squeeze-excitation, residual adds, flatten into linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.a, self.b = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.blocks = nn.Sequential(_Block(16), _Block(16))
        self.head = nn.Linear(16 * 2 * 2, 5)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = self.blocks(torch.cat([self.a(x), self.b(x)], 1))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 2), 1))


def test_a_users_module_nests_with_its_own_weights():
    torch.manual_seed(0)
    net = TinyNet().eval()
    name = nest(net, (1, 1, 8, 8), name="tiny_user_net")
    compiled = compile_spec(parse_spec({"model": name, "tiers": [{"name": "t", "gamma_w": 0.3, "steps": [[1, 0]]}, {"name": "f"}]}))
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(compiled.create_global_model().eval()(x), net(x))  # the user's weights
    assert zeroed_parity(compiled, "t", x) < 1e-6
    t = compiled["t"].slice_map
    # The residual adds tie the 16 concatenated channels into one group: a's 8 (positions 0-7)
    # and b's 8 (8-15), which are the stem's (b is grouped, 8 -> 8). Ordered stem first (it
    # was created first), ceil(16 * sqrt(0.3)) = 9 kept, rounded up to whole groups of b (4): 12,
    # so all of the stem's and a's first 4.
    kept = [0, 1, 2, 3, *range(8, 16)]
    assert t["blocks.0.conv.weight"].index[1].tolist() == kept
    # flatten of 16 channels x 4 positions into the head: the kept channels' 4 positions each
    assert t["head.weight"].index[1].tolist() == [4 * c + p for c in kept for p in range(4)]
    assert compiled["t"].build().b.groups == 2


def test_what_cannot_be_nested_is_one_line_naming_the_construct():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 6, 3)

        def forward(self, x):
            return torch.sort(self.conv(x), dim=1).values.mean((2, 3))  # sorted across channels

    with pytest.raises(NestError, match=r"^sort \(sort\): an operation nesting does not know$") as err:
        nest(Bad(), (1, 2, 8, 8))
    assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match=r"^x.yaml: model: unknown model 'torchvision:resnet_nope'"):
        parse_spec({"model": "torchvision:resnet_nope", "tiers": [{"name": "a"}]}, "x.yaml")
    with pytest.raises(SpecError, match=r"tiers\[0\].steps\[0\]: torchvision:resnet18 stage 1 has 2 blocks, got 3"):
        parse_spec({"model": "torchvision:resnet18", "model_args": SMALL, "tiers": [{"name": "a", "steps": [[1, 1, 1], [1], [1], [1]]}]})


def test_auto_tier_halves_regnet_y_400mf_with_whole_groups_and_squeeze_excitation():
    """Balanced mode: gamma_w ~ sqrt(0.5), then blocks removed (``nefl-zoo build
    torchvision:regnet_y_400mf --gamma 0.5`` runs this at 224x224)."""
    from nefl_zoo.auto import auto_tier

    found = auto_tier("torchvision:regnet_y_400mf", 0.5, **SMALL)
    assert abs(found.params_ratio - 0.5) <= 0.03 and found.tier.gamma_w == 0.71
    with torch.device("meta"):
        tier = create_model("torchvision:regnet_y_400mf", **SMALL, gamma_w=0.71, steps=found.tier.steps)
    for m in tier.modules():  # group width 8: the 3x3 convolutions keep whole groups of 8
        if isinstance(m, nn.Conv2d) and m.groups > 1:
            assert m.in_channels == 8 * m.groups


class Adds(nn.Module):
    """Residual adds of every kind: blocks through a dropout, ``contiguous`` or ``clone`` shortcut, and adds
    that are no block (a projection shortcut, a branch without parameters, a branch that feeds
    a later layer, a squeeze-and-excitation gate of another shape)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.a, self.drop, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Dropout(0.1), nn.Conv2d(8, 8, 3, padding=1)
        self.proj, self.d = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1)
        self.e, self.gate = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = self.stem(x)
        x = self.drop(x) + self.a(x)
        x = x.contiguous() + self.b(x)
        x = x.clone() + self.c(x)
        x = self.d(x) + self.proj(x)
        x = x + torch.relu(x)
        h = self.e(x)
        x = x + h
        x = x + self.gate(x.mean((2, 3), keepdim=True))
        return self.fc((x + h).mean((2, 3)))


def test_each_residual_add_is_a_block_or_reported_with_why_not():
    plan = create_model(nest(Adds(), (1, 1, 8, 8), name="adds")).plan
    assert [b.add for b in plan.blocks] == ["add", "add_1", "add_2", "add_7"]  # the last: h plus the gated path from it
    assert plan.unskippable == ["add_3: its shortcut is not the block's input (a projection shortcut)",
                                "add_4: its branch has no parameters", "add_5: its branch feeds other nodes",
                                "add_6: its inputs have different shapes"]
    assert plan.stage_modules == [""] and plan.stage_reductions == [1] and type(plan.stage_reductions[0]) is int


class SplitNet(nn.Module):
    """A channel split into 4 + 8, a concatenation and a fixed channel slice ``[:, 2:10]``."""

    def __init__(self):
        super().__init__()
        self.stem, self.a, self.b = nn.Conv2d(1, 12, 3, padding=1), nn.Conv2d(4, 4, 1), nn.Conv2d(8, 8, 1)
        self.out = nn.Conv2d(8, 6, 1)

    def forward(self, x):
        left, right = torch.split(self.stem(x), [4, 8], 1)
        y = torch.cat([self.a(left), self.b(right)], 1)
        return self.out(y[:, 2:10]).mean((2, 3))


class ShuffleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 8, 1), nn.Linear(8, 3)

    def forward(self, x):
        x = self.conv(x)
        n, c, h, w = x.shape
        return self.fc(x.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w).mean((2, 3)))


def test_channel_splits_and_slices_are_recut_in_kept_channels_and_a_shuffle_is_refused():
    torch.manual_seed(0)
    name = nest(SplitNet(), (1, 1, 4, 4), name="split_net")
    compiled = compile_spec(parse_spec({"model": name, "tiers": [{"name": "t", "gamma_w": 0.3}, {"name": "f"}]}))
    x = torch.randn(2, 1, 4, 4)
    assert zeroed_parity(compiled, "t", x) < 1e-6
    # ceil(C * sqrt(0.3)) kept in each part of the split: stem 3 of the left 4 and 5 of the right 8
    # (full positions 0-2 and 4-8), a 3 of 4, b 5 of 8; the slice [2:10] of the concatenation
    # (full positions 0-2 and 4-8 kept) holds full 2, 4, 5, 6, 7, 8: its positions 0, 2-6
    t = compiled["t"]
    assert t.slice_map["stem.weight"].index[0].tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    assert t.slice_map["b.weight"].index[1] == slice(0, 5) and t.slice_map["a.weight"].index[:2] == (slice(0, 3), slice(0, 3))
    assert t.slice_map["out.weight"].index[1].tolist() == [0, 2, 3, 4, 5, 6]
    code = t.build().plan.graph.python_code("self").src  # the plan's (full) graph keeps the full cut
    assert "[4, 8]" in code
    shuffle = nest(ShuffleNet(), (1, 1, 4, 4), name="shuffle_net")
    create_model(shuffle)  # full width: nothing to mix
    with pytest.raises(NestError, match=r"^view: a view that splits the channels \(channel shuffle\)"):
        create_model(shuffle, gamma_w=0.5)
    with pytest.raises(SpecError, match=r"^x.yaml: tiers\[1\].gamma_w: view: a view that splits the channels"):
        parse_spec({"model": shuffle, "tiers": [{"name": "full"}, {"name": "half", "gamma_w": 0.5}]}, "x.yaml")


@pytest.mark.parametrize("method", ["fedgh", "depthfl", "fedlps"])
def test_methods_that_split_the_network_refuse_an_automatically_nested_one_in_one_line(method):
    from nefl_zoo.fl.config import load_config

    extra = ["method_args.levels=[0.0, 0.4, 0.8]"] if method == "fedlps" else []
    config = load_config("specs/train/digits-auto-resnet18.yaml", [f"method={method}", "spec.model_args.img_size=8", *extra])
    with pytest.raises(ValueError, match=rf"^{method}: torchvision:resnet18 runs only whole \(nested automatically\), "
                                         rf"but {method} needs its stages and head apart; use a zoo model") as refused:
        config.build_strategy()
    assert "\n" not in str(refused.value)


def test_randomise_zeros_fills_only_all_zero_tensors_with_small_values():
    from nefl_zoo.nesting.verify import randomise_zeros

    torch.manual_seed(0)
    head = nn.Linear(8, 64)
    nn.init.zeros_(head.weight)  # a zero-initialised head would hide a wrong slice
    kept = head.bias.detach().clone()
    module = nn.Module()
    module.head, module.scale = head, nn.Parameter(torch.zeros(1))  # a scalar (a step size at 0): left alone
    module.pair = nn.Parameter(torch.zeros(2))
    assert randomise_zeros(module) is module
    assert torch.equal(head.bias, kept) and float(module.scale) == 0.0
    assert bool(head.weight.ne(0).all()) and bool(module.pair.ne(0).all())
    assert 0.01 < float(head.weight.std()) < 0.03 and abs(float(head.weight.mean())) < 0.005


def test_a_library_model_at_its_defaults_is_the_library_model_with_timms_metadata():
    import torchvision

    with torch.device("meta"):
        made = create_model("torchvision:mobilenet_v2", num_classes=10)  # gamma_w 1 by default: the full model
        reference = torchvision.models.mobilenet_v2(num_classes=10)
    assert count_params(made) == count_params(reference) + len(made.step_keys())  # plus a step per skippable block
    assert made.default_cfg["first_conv"] == "features.0.0" and made.default_cfg["classifier"] == "classifier.1"
    assert made.num_features == 1280
    with pytest.raises(SpecError, match=r"model_args"):
        parse_spec({"model": "torchvision:mobilenet_v2", "model_args": {"depth": 3}, "tiers": [{"name": "full"}]})

"""Automatic nesting never crashes (issue 30, item 1): a narrow tier either builds and runs its
first forward, or the network is refused in one line naming the construct, before any forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nefl_zoo.models import create_model
from nefl_zoo.nesting import NestError, nest
from nefl_zoo.nesting.verify import zeroed_parity
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec


def narrow_and_full(name: str, model_args: dict | None = None):
    tiers = [{"name": "narrow", "gamma_w": 0.5}, {"name": "full"}]
    return compile_spec(parse_spec({"model": name, **({"model_args": model_args} if model_args else {}), "tiers": tiers}))


@torch.no_grad()
@pytest.mark.parametrize("name, img_size, refusal", [
    # a channels-last split (torch.split(x, [...], dim=-1)): re-cut in kept channels
    ("timm:mambaout_femto", 32, None),
    # a concatenation tied to a layer scale nests the newest layer's channels last: zero width at 0.5
    ("timm:rdnet_tiny", 32, r"^dense_stages\.0\.0\.dense_block2\.gamma: gamma_W 0\.5 keeps none of its 64 channels "
                            r"\(its channel group nests them last\); the least gamma_W that keeps some of every layer is 0\.69$"),
    # its constructor runs its backbone (a raw meta-device RuntimeError before); a functional group norm
    ("timm:vit_tiny_r_s16_p8_224", 224, None),
    # fixed position embeddings (before: a position-embedding add of 5 and 197 tokens, naming no construct)
    ("timm:vit_tiny_patch16_224", 32, r"^timm:vit_tiny_patch16_224: a network of fixed input size 224 \(position "
                                      r"embeddings or windows\), but img_size 32$"),
])
def test_a_narrow_tier_runs_its_first_forward_or_is_refused_in_one_line(name, img_size, refusal):
    args = dict(num_classes=10, in_chans=3, img_size=img_size)
    if refusal is None:
        tier = narrow_and_full(name, args)["narrow"].build().eval()
        assert tier(torch.randn(2, 3, img_size, img_size)).shape == (2, 10)
        return
    with pytest.raises(NestError, match=refusal) as refused, torch.device("meta"):
        create_model(name, **args, gamma_w=0.5)
    assert "\n" not in str(refused.value)


class ChannelsLast(nn.Module):
    """A channels-last split (MambaOut) and a scale viewed to a fixed shape (MetaFormer)."""

    def __init__(self):
        super().__init__()
        self.stem, self.fc = nn.Conv2d(1, 12, 3, padding=1), nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.rand(8))
        self.head = nn.Conv2d(8, 3, 1)

    def forward(self, x):
        x = self.stem(x).permute(0, 2, 3, 1)
        a, b = torch.split(x, [4, 8], dim=-1)
        y = (b * self.fc(a).sum(-1, keepdim=True)).permute(0, 3, 1, 2)
        return self.head(y * self.scale.view(8, 1, 1)).mean((2, 3))


class PositionEmbedding(nn.Module):
    """A position embedding of a fixed size: its shapes depend on the input size."""

    def __init__(self):
        super().__init__()
        self.patch, self.pos, self.fc = nn.Conv2d(1, 8, 32, 32), nn.Parameter(torch.rand(1, 8, 5, 5)), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc((self.patch(x) + self.pos).mean((2, 3)))


class FixedExpand(nn.Module):
    """A channel count written into ``expand``: it compiles, but no narrower tier can run."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 8, 3, padding=1), nn.Linear(8, 3)

    def forward(self, x):
        x = self.conv(x)
        return self.fc((x + x.mean(1, keepdim=True).expand(-1, 8, -1, -1)).mean((2, 3)))


def test_channel_splits_on_any_dimension_and_fixed_view_shapes_are_recut_exactly():
    torch.manual_seed(0)
    compiled = narrow_and_full(nest(ChannelsLast(), (1, 1, 6, 6), name="channels_last_net"))
    tier = compiled["narrow"].build()
    assert tier.scale.shape == (6,) and tier.fc.weight.shape == (3, 3)  # ceil(8 * sqrt(0.5)), ceil(4 * sqrt(0.5))
    assert zeroed_parity(compiled, "narrow", torch.randn(2, 1, 6, 6)) < 1e-6


def test_a_network_whose_shapes_depend_on_the_input_size_is_analysed_at_its_own():
    torch.manual_seed(0)
    compiled = narrow_and_full(nest(PositionEmbedding(), (1, 1, 160, 160), name="position_embedding_net"))
    assert compiled["narrow"].build().pos.shape == (1, 6, 5, 5)
    assert zeroed_parity(compiled, "narrow", torch.randn(2, 1, 160, 160)) < 1e-6


def test_a_tier_that_would_fail_at_its_first_forward_is_refused_when_built_naming_the_node():
    name = nest(FixedExpand(), (1, 1, 6, 6), name="fixed_expand_net")
    with torch.device("meta"):
        create_model(name, gamma_w=0.5)  # shapes only: nothing runs
    with pytest.raises(NestError, match=r"^module:fixed_expand_net: add \(add\): RuntimeError: ") as refused:
        create_model(name, gamma_w=0.5)
    assert "\n" not in str(refused.value)


def test_library_names_split_at_the_first_colon_and_only_for_known_libraries():
    from nefl_zoo.nesting.sources import split_name

    assert split_name("torchvision:resnet18") == ("torchvision", "resnet18")
    assert split_name("timm:hf-hub:org/model") == ("timm", "hf-hub:org/model")
    assert [split_name(n) for n in ("resnet20", "keras:resnet50", "timm:")] == [None, None, None]


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 4, 1), nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a value: torch.fx cannot follow it
            x = -x
        return self.fc(self.conv(x).mean((2, 3)))


class OptionalArguments(nn.Module):
    """``forward(x, mask=None, flip=False)``: traced as the plain call ``model(x)``."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 4, 1), nn.Linear(4, 2)

    def forward(self, x, mask=None, flip=False):
        y = self.conv(x if mask is None else x * mask)
        return self.fc((y.flip(-1) if flip else y).mean((2, 3)))


def test_a_forward_torch_fx_cannot_follow_is_one_line_and_optional_arguments_take_their_defaults():
    with pytest.raises(NestError, match=r"^module:data_dependent: torch\.fx cannot trace it: TraceError: symbolically "
                                        r"traced variables cannot be used as inputs to control flow$"):
        create_model(nest(DataDependent(), (1, 1, 2, 2), name="data_dependent"))
    torch.manual_seed(0)
    module = OptionalArguments().eval()
    x = torch.randn(2, 1, 2, 2)
    made = create_model(nest(module, (1, 1, 2, 2), name="optional_arguments")).eval()
    with torch.no_grad():
        assert torch.equal(made(x), module(x))

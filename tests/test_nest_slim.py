"""How a tier's graph is cut (nefl_zoo/nesting/slim.py): widths written into functional calls
(convolutions, layer and group norms), channel selections on the first dimension or by a
split size, norms without running statistics, sequence-first multi-head attention and heads
moved into the batch through ``size()``, each checked against the full model with the
dropped channels zeroed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from nefl_zoo.nesting import nest
from nefl_zoo.nesting.verify import zeroed_parity
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec


def narrow_and_full(name: str, gamma_w: float = 0.5):
    return compile_spec(parse_spec({"model": name, "tiers": [{"name": "narrow", "gamma_w": gamma_w}, {"name": "full"}]}))


def nested_as_is(module: nn.Module, size: int, name: str):
    """``module`` nested (tiers ``narrow`` and ``full``), its full tier checked against it; and an input."""
    torch.manual_seed(0)
    compiled = narrow_and_full(nest(module.eval(), (1, 1, size, size), name=name))
    x = torch.randn(2, 1, size, size)
    with torch.no_grad():
        assert torch.equal(compiled.create_global_model().eval()(x), module(x))
    return compiled, x


class Functional(nn.Module):
    """Grouped functional convolutions (groups given by position and by keyword, the bias a
    parameter of another name), a GroupNorm module and a functional one (groups of 2 and of 4
    channels) and a BatchNorm without running statistics."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 1)
        self.w, self.b = nn.Parameter(torch.randn(16, 4, 3, 3) / 6), nn.Parameter(torch.randn(16))
        self.w2 = nn.Parameter(torch.randn(16, 4, 1, 1) / 2)
        self.gn, self.bn = nn.GroupNorm(8, 16), nn.BatchNorm2d(16, track_running_stats=False)
        self.gn_w, self.gn_b = nn.Parameter(torch.linspace(0.5, 2, 16)), nn.Parameter(torch.linspace(-1, 1, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        x = F.conv2d(self.stem(x), self.w, self.b, 1, 1, 1, 4)
        x = self.bn(self.gn(F.conv2d(x, self.w2, None, groups=4)))
        return self.head(F.group_norm(x, 4, self.gn_w, self.gn_b).mean((2, 3)))


class ChannelsLastNorm(nn.Module):
    """Functional LayerNorms over channels last (ConvNeXt; ``F.layer_norm`` passes its weight by
    keyword, ``torch.layer_norm`` by position): a tier normalises over its kept channels."""

    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Conv2d(1, 8, 1), nn.Linear(8, 3)
        self.ln_w, self.ln_b = nn.Parameter(torch.linspace(0.5, 2, 8)), nn.Parameter(torch.linspace(-1, 1, 8))

    def forward(self, x):
        x = F.layer_norm(self.stem(x).permute(0, 2, 3, 1), (8,), self.ln_w, self.ln_b)
        return self.head(torch.layer_norm(x, (8,), self.ln_b, self.ln_w).mean((1, 2)))  # weight by position


class Selections(nn.Module):
    """A split by size (``x.split(4, 1)``) and a channel slice taken on the first dimension."""

    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Conv2d(1, 8, 1), nn.Linear(6, 3)

    def forward(self, x):
        left, right = self.stem(x).split(4, 1)
        x = torch.cat([left * 2, right], 1)
        x = x.transpose(0, 1)[1:7].transpose(0, 1)
        return self.head(x.mean((2, 3)))


def test_functional_layers_and_norms_are_cut_to_the_kept_channels_exactly():
    torch.manual_seed(0)
    compiled, x = nested_as_is(Functional(), 4, "functional_layers")
    assert zeroed_parity(compiled, "narrow", x) < 1e-5
    tier = compiled["narrow"].build()
    assert tier.w.shape == (12, 4, 3, 3) and tier.w2.shape == (12, 4, 1, 1)  # ceil(16 sqrt(0.5)): 3 of 4 groups
    assert (tier.gn.num_channels, tier.gn.num_groups) == (12, 6) and type(tier.gn.num_groups) is int
    assert tier.bn.num_features == 12 and tier.bn.running_mean is None and tier.b.shape == (12,)


@torch.no_grad()
def test_a_functional_layer_norm_normalises_the_kept_channels_with_their_weights():
    torch.manual_seed(0)
    module = ChannelsLastNorm().eval()
    compiled = narrow_and_full(nest(module, (1, 1, 2, 2), name="channels_last_norm"))
    full = compiled.create_global_model().eval()
    tier = compiled["narrow"].load(compiled.init_global_state(full)).eval()
    assert compiled["narrow"].slice_map["stem.weight"].index[0] == slice(0, 6)  # the first 6 channels
    x = torch.randn(2, 1, 2, 2)
    h = F.layer_norm(module.stem(x)[:, :6].permute(0, 2, 3, 1), (6,), module.ln_w[:6], module.ln_b[:6])
    h = F.layer_norm(h, (6,), module.ln_b[:6], module.ln_w[:6])
    assert torch.allclose(tier(x), F.linear(h.mean((1, 2)), module.head.weight[:, :6], module.head.bias), atol=1e-6)


def test_a_split_by_size_and_a_slice_of_the_first_dimension_are_recut():
    torch.manual_seed(0)
    compiled = narrow_and_full(nest(Selections().eval(), (1, 1, 2, 2), name="first_dim_selections"))
    assert compiled["narrow"].build().head.weight.shape == (3, 5)  # 3 + 3 kept of 4 + 4 (0-2, 4-6): 5 in 1-6
    assert zeroed_parity(compiled, "narrow", torch.randn(2, 1, 2, 2)) < 1e-6


class SequenceFirst(nn.Module):
    """``nn.MultiheadAttention`` with sequence-first tensors (``batch_first=False``), 4 heads of 2."""

    def __init__(self):
        super().__init__()
        self.stem, self.attn, self.head = nn.Conv2d(1, 8, 1), nn.MultiheadAttention(8, 4), nn.Linear(8, 3)

    def forward(self, x):
        t = self.stem(x).flatten(2).permute(2, 0, 1)  # (tokens, batch, channels)
        return self.head((t + self.attn(t, t, t, need_weights=False)[0]).mean(0))


class HeadsInBatchBySize(nn.Module):
    """Heads moved into the batch (``reshape(B * heads, ...)``) with every size read by ``size()``."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Conv2d(1, 24, 1), nn.Conv2d(8, 3, 1)

    def forward(self, x):
        b, h, w = x.size(0), x.size(2), x.size(3)
        q, k, v = torch.split(self.qkv(x), [8, 8, 8], dim=1)
        q = q.reshape(b * 4, 2, -1).transpose(-1, -2)
        k, v = k.reshape(b * 4, 2, -1), v.reshape(b * 4, 2, -1).transpose(-1, -2)
        q = q.reshape(q.size(0), h, w, -1).reshape(q.size(0), h * w, -1)
        out = ((q @ k).softmax(-1) @ v).transpose(-1, -2).reshape(b, 8, h, w)
        return self.out(out).mean((2, 3))


@pytest.mark.parametrize("module, narrowed", [
    (SequenceFirst, {"attn.in_proj_weight": (18, 6), "attn.out_proj.weight": (6, 6)}),  # 3 of 4 heads of 2
    (HeadsInBatchBySize, {"qkv.weight": (18, 1, 1, 1), "out.weight": (3, 6, 1, 1)}),
])
def test_attention_heads_nest_exactly_sequence_first_and_in_the_batch(module, narrowed):
    torch.manual_seed(0)
    compiled = narrow_and_full(nest(module().eval(), (1, 1, 2, 2), name=f"sliced_{module.__name__.lower()}"))
    tier = compiled["narrow"].build()
    assert {key: tuple(tier.state_dict()[key].shape) for key in narrowed} == narrowed
    assert zeroed_parity(compiled, "narrow", torch.randn(2, 1, 2, 2)) < 1e-6



class OverChannels(nn.Module):
    """Normalised over the channels (``F.normalize``, ``F.softmax`` and ``Tensor.softmax`` by
    keyword, ``torch.log_softmax`` by position): each layer's channels are kept or dropped
    together; and functional linear layers, one with its own bias by position, one with a
    bias of another name by keyword."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Conv2d(1, 4, 1) for _ in range(4))
        self.fc = nn.Linear(16, 8)
        self.w, self.b2 = nn.Parameter(torch.randn(3, 8) / 3), nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = torch.cat([F.normalize(self.a(x), dim=1), F.softmax(self.b(x), 1), torch.log_softmax(self.c(x), 1),
                       self.d(x).softmax(dim=1)], 1).mean((2, 3))
        return F.linear(torch.relu(F.linear(h, self.fc.weight, self.fc.bias)), weight=self.w, bias=self.b2)


def test_what_is_normalised_over_channels_stays_whole_and_functional_linear_layers_are_cut():
    torch.manual_seed(0)
    compiled, x = nested_as_is(OverChannels(), 2, "over_channels")
    tier = compiled["narrow"].build()
    assert {k: tuple(v.shape) for k, v in tier.state_dict().items()} == {
        "a.weight": (4, 1, 1, 1), "a.bias": (4,), "b.weight": (4, 1, 1, 1), "b.bias": (4,), "c.weight": (4, 1, 1, 1),
        "c.bias": (4,), "d.weight": (4, 1, 1, 1), "d.bias": (4,), "fc.weight": (6, 16), "fc.bias": (6,), "w": (3, 6), "b2": (3,)}
    assert zeroed_parity(compiled, "narrow", x) < 1e-6

"""Automatic nesting of transformers (issue 30, item 2): whole heads, MLP hidden units and depth,
with the embedding (and so every LayerNorm) kept whole, exact under the zero-embedding check."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nefl_zoo.models import count_params, create_model
from nefl_zoo.nesting import NestError, nest
from nefl_zoo.nesting.verify import zeroed_parity
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec


def shape(module: nn.Module, key: str) -> tuple[int, ...]:
    return tuple(module.state_dict()[key].shape)


def tiers(name: str, gamma_w: float, steps=None, model_args: dict | None = None):
    spec = {"model": name, "tiers": [{"name": "narrow", "gamma_w": gamma_w, "steps": steps}, {"name": "full"}]}
    return compile_spec(parse_spec(spec | ({"model_args": model_args} if model_args else {})))


class Attention(nn.Module):
    """Multi-head attention with a query/key norm over each head's dimensions and a rotary-like
    buffer of sines and cosines shared by every head; ``bias``: a relative position table per
    head, gathered by an index buffer and added to the scores (as the attention mask of fused
    attention when ``bias`` is false)."""

    def __init__(self, dim: int, heads: int, tokens: int, bias: bool):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.q_norm, self.k_norm = nn.LayerNorm(self.head_dim), nn.LayerNorm(self.head_dim)
        self.table, self.manual = nn.Parameter(torch.randn(2 * tokens - 1, heads)), bias
        self.register_buffer("index", torch.arange(tokens)[:, None] - torch.arange(tokens)[None, :] + tokens - 1)
        self.register_buffer("rope", torch.rand(tokens, 2 * self.head_dim), persistent=False)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        sin, cos = self.rope.chunk(2, -1)
        q, k = q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin
        bias = self.table[self.index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        if not self.manual:
            x = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            scores = (q * self.head_dim ** -0.5) @ k.transpose(-2, -1)
            x = (scores + bias).softmax(-1) @ v
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, tokens: int, bias: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, tokens, bias)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))  # layer scale
        self.gain = nn.Parameter(torch.ones(1))  # one scalar over every channel: kept whole

    def forward(self, x):
        x = x + self.gamma * self.attn(self.norm1(x))
        return x + self.gain * self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class TinyTransformer(nn.Module):
    """Patches, a class token, position embeddings, one block with fused attention and one
    with a relative position bias, class-token pooling."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.patch = nn.Conv2d(1, dim, 4, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim))
        self.blocks = nn.Sequential(Block(dim, heads, 5, False), Block(dim, heads, 5, True))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 3)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    net = TinyTransformer().eval()
    return net, tiers(nest(net, (1, 1, 8, 8), name="tiny_transformer"), 0.5, [[1, 1, 1, 0]])


@torch.no_grad()
def test_a_transformer_nests_by_whole_heads_and_mlp_units_with_its_embedding_whole(tiny):
    net, compiled = tiny
    x = torch.randn(2, 1, 8, 8)
    assert torch.equal(compiled.create_global_model().eval()(x), net(x))  # the user's weights
    narrow = compiled["narrow"].build()
    heads, hidden = math.ceil(4 * math.sqrt(0.5)), math.ceil(32 * math.sqrt(0.5))  # 3 of 4 heads, 23 of 32 units
    assert shape(narrow, "blocks.0.attn.qkv.weight") == (3 * heads * 4, 16)
    assert shape(narrow, "blocks.0.attn.proj.weight") == (16, heads * 4)
    assert shape(narrow, "blocks.0.fc1.weight") == (hidden, 16)
    assert shape(narrow, "blocks.1.attn.table") == (9, heads)  # the relative position table: by heads
    assert shape(narrow, "blocks.0.attn.table") == (9, heads)  # also as fused attention's mask
    # the embedding, every LayerNorm (q/k norms over a head's dimensions too), the class token,
    # the position embedding, the layer scale and the scalar gain stay whole
    assert shape(narrow, "cls_token") == (1, 1, 16) and shape(narrow, "pos_embed") == (1, 5, 16)
    assert shape(narrow, "blocks.0.norm1.weight") == (16,) and shape(narrow, "blocks.0.attn.q_norm.weight") == (4,)
    assert shape(narrow, "blocks.0.gamma") == (16,) and shape(narrow, "blocks.0.gain") == (1,)
    # q, k and v of the kept heads: the first 3 heads of each
    rows = compiled["narrow"].slice_map["blocks.0.attn.qkv.weight"].index[0].tolist()
    assert rows == [part * 16 + i for part in range(3) for i in range(heads * 4)]
    assert "blocks.1.fc1.weight" not in narrow.state_dict()  # the second block's MLP branch removed
    assert zeroed_parity(compiled, "narrow", x) < 1e-6


def test_a_transformer_tier_exports_to_onnx_with_equal_logits(tiny, tmp_path):
    from nefl_zoo.export.onnx_file import write_onnx
    from nefl_zoo.export.verify import check_parity
    from nefl_zoo.runtime.session import session_from_bytes

    tier = tiny[1]["narrow"].build().eval()
    write_onnx(tier, tmp_path / "t.onnx", (1, 8, 8), 2, False, None)
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        reference = tier(x)
    assert check_parity("narrow", session_from_bytes((tmp_path / "t.onnx").read_bytes(), "t.onnx"), x, reference) < 1e-5


class TalkingHeads(nn.Module):
    """Attention whose heads a linear layer mixes (CaiT): q/k heads and v heads nest apart."""

    def __init__(self):
        super().__init__()
        self.qkv, self.mix, self.proj = nn.Linear(8, 24), nn.Linear(4, 4), nn.Linear(8, 3)

    def forward(self, x):
        x = x.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(x).reshape(x.shape[0], -1, 3, 4, 2).permute(2, 0, 3, 1, 4).unbind(0)
        attn = self.mix((q @ k.transpose(-2, -1)).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(x.shape[0], -1, 8)).mean(1)


def test_heads_that_a_layer_mixes_are_refused_when_narrowed_in_one_line():
    name = nest(TalkingHeads(), (1, 8, 2, 2), name="talking_heads")
    create_model(name)  # full width: nothing to cut
    with pytest.raises(NestError, match=r"^reshape: a view that splits the channels into several dimensions "
                                        r"\(heads\) of narrowed channels$"):
        create_model(name, gamma_w=0.5)


class Mixer(nn.Module):
    """MLP-Mixer's token mixing (a linear over the tokens, shared by every channel), a
    depthwise convolution with a channel multiplier (8 -> 16 channels in 8 groups) and a
    scalar gain over every channel (ReZero: it ties no channels together)."""

    def __init__(self):
        super().__init__()
        self.stem, self.dw = nn.Conv2d(1, 8, 1), nn.Conv2d(8, 16, 3, padding=1, groups=8)
        self.bn = nn.BatchNorm2d(16)
        self.tokens, self.channels = nn.Linear(16, 16), nn.Linear(16, 12)
        self.head = nn.Linear(12, 3)
        self.gain = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x):
        x = self.bn(self.dw(self.stem(x) * self.gain)).flatten(2)  # (B, 16 channels, 16 tokens)
        x = x + self.tokens(x)  # mixes tokens
        return self.head(torch.relu(self.channels(x.transpose(1, 2))).mean(1))


def test_token_mixing_and_a_depthwise_multiplier_nest_exactly_by_whole_groups():
    torch.manual_seed(0)
    compiled = tiers(nest(Mixer().eval(), (1, 1, 4, 4), name="mixer_net"), 0.5)
    narrow = compiled["narrow"].build()
    # 6 of the 8 input channels (ceil(8 sqrt(0.5))), each with both of its outputs: 12 of 16
    assert narrow.dw.weight.shape == (12, 1, 3, 3) and narrow.dw.groups == 6 and narrow.bn.weight.shape == (12,)
    assert narrow.tokens.weight.shape == (16, 16) and narrow.gain.shape == (1,)  # over tokens, over channels: whole
    assert zeroed_parity(compiled, "narrow", torch.randn(2, 1, 4, 4)) < 1e-6


def test_the_zoo_vit_by_heads_and_timm_vit_nested_automatically_have_equal_parameter_counts():
    for gamma_w in (1.0, 0.5, 0.3):
        with torch.device("meta"):
            zoo = create_model("vit_tiny_16", num_classes=10, width="heads", gamma_w=gamma_w,
                               steps=[[0.0 if i % 3 == 0 else 1.0 for i in range(12)]])
            timm = create_model("timm:vit_tiny_patch16_224", num_classes=10, gamma_w=gamma_w,  # a step per branch
                                steps=[[0.0 if i // 2 % 3 == 0 else 1.0 for i in range(24)]])
        assert count_params(zoo) == count_params(timm)


@torch.no_grad()
def test_timms_vit_nests_exactly_and_its_full_tier_is_timms_model_with_timms_weights():
    import timm

    from nefl_zoo.models import load_pretrained

    torch.manual_seed(0)
    compiled = tiers("timm:vit_tiny_patch16_224", 0.3, [[0.0 if i % 4 == 3 else 1.0 for i in range(24)]],
                     {"num_classes": 10})
    narrow = compiled["narrow"].build()
    assert shape(narrow, "blocks.0.attn.qkv.weight") == (3 * 2 * 64, 192)  # 2 of 3 heads, whole
    assert shape(narrow, "blocks.0.mlp.fc1.weight") == (421, 192)  # ceil(768 sqrt(0.3))
    x = torch.randn(2, 3, 224, 224)
    assert zeroed_parity(compiled, "narrow", x) < 1e-5
    theirs = timm.create_model("vit_tiny_patch16_224", num_classes=10).eval()
    ours = compiled.create_global_model().eval()
    load_pretrained(ours, theirs.state_dict())
    assert torch.equal(ours(x), theirs(x))


@torch.no_grad()
def test_torchvisions_vit_nests_its_multihead_attention_by_whole_heads_exactly():
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    net = VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=4, hidden_dim=16, mlp_dim=32,
                            num_classes=3).eval()
    compiled = tiers(nest(net, (1, 3, 16, 16), name="torchvision_small_vit"), 0.5, [[1, 1, 1, 0]])
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(compiled.create_global_model().eval()(x), net(x))
    narrow = compiled["narrow"].build().eval()
    attention = narrow.get_submodule("encoder.layers.encoder_layer_0.self_attention")
    assert type(attention).__name__ == "HeadsAttention" and attention.num_heads == 3  # ceil(4 sqrt(0.5))
    assert shape(narrow, "encoder.layers.encoder_layer_0.self_attention.in_proj_weight") == (3 * 3 * 4, 16)
    assert shape(narrow, "encoder.layers.encoder_layer_0.self_attention.out_proj.weight") == (16, 12)
    assert zeroed_parity(compiled, "narrow", x) < 1e-6


class StandardisedConv(nn.Module):
    """A convolution whose weight is standardised in the forward (NF-Nets)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 1, 3, 3))

    def forward(self, x):
        w = self.weight - self.weight.mean((1, 2, 3), keepdim=True)
        return nn.functional.conv2d(x, w / w.std((1, 2, 3), keepdim=True)).mean((2, 3))


def test_a_weight_standardised_in_the_forward_is_refused_naming_the_construct():
    with pytest.raises(NestError, match=r"^conv2d \(conv2d\): a weight computed in the forward \(weight standardisation"):
        nest(StandardisedConv(), (1, 1, 6, 6), name="standardised_conv")


class EinsumAttention(nn.Module):
    """Attention written with ``einsum`` (SAM, MaxViT) plus a relative position term as a product
    of the queries with a parameter shared by every head (BoTNet), over 4 tokens."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv, self.proj = nn.Linear(1, 8), nn.Linear(8, 24), nn.Linear(8, 3)
        self.rel = nn.Parameter(torch.randn(4, 2))  # (tokens, head_dim)

    def forward(self, x):
        x = self.embed(x.flatten(2).transpose(1, 2))  # (B, 4 tokens, 8)
        q, k, v = self.qkv(x).reshape(x.shape[0], 4, 3, 4, 2).permute(2, 0, 3, 1, 4).unbind(0)
        scores = torch.einsum("bhnd,bhmd->bhnm", q, k) + q @ self.rel.transpose(0, 1)
        out = torch.einsum("bhnm,bhmd->bhnd", scores.softmax(-1), v)
        return self.proj(out.transpose(1, 2).reshape(x.shape[0], 4, 8)).mean(1)


def test_einsum_attention_and_a_relative_position_product_nest_by_whole_heads_exactly():
    torch.manual_seed(0)
    compiled = tiers(nest(EinsumAttention().eval(), (1, 1, 2, 2), name="einsum_attention"), 0.5)
    narrow = compiled["narrow"].build()
    # 3 of 4 heads; the embedding, which no LayerNorm normalises, narrows too: 6 of 8
    assert narrow.qkv.weight.shape == (3 * 3 * 2, 6) and narrow.proj.weight.shape == (3, 6)
    assert narrow.rel.shape == (4, 2)  # shared by every head: whole
    assert zeroed_parity(compiled, "narrow", torch.randn(2, 1, 2, 2)) < 1e-6


class CrossAttention(nn.Module):
    """``nn.MultiheadAttention`` called as other than plain self-attention (queries from one
    sequence, keys and values from another; a mask, by keyword or position): kept whole; the
    layers around it still nest."""

    def __init__(self, call: str = "cross"):
        super().__init__()
        self.a, self.b = nn.Linear(1, 8), nn.Linear(1, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.register_buffer("none_masked", torch.zeros(4, 4, dtype=torch.bool))  # (tokens, tokens) of a 2 x 2 input
        self.call = call

    def forward(self, x):
        tokens = x.flatten(2).transpose(1, 2)
        q, kv = self.a(tokens), self.b(tokens)
        padding = lambda: tokens[..., 0] != tokens[..., 0]  # noqa: E731 - masks that mask nothing
        args, kwargs = {
            "cross": lambda: ((q, self.b(tokens), self.b(tokens)), {}),
            "shared_kv": lambda: ((q, kv, kv), {}),
            "query_as_value": lambda: ((q, kv, q), {}),
            "attn_mask": lambda: ((q, q, q), {"attn_mask": self.none_masked}),
            "key_padding_mask": lambda: ((q, q, q), {"key_padding_mask": padding()}),
            "positional_key_padding_mask": lambda: ((q, q, q, padding()), {}),
        }[self.call]()
        y = self.attn(*args, need_weights=False, **kwargs)[0]
        return self.fc2(torch.relu(self.fc1(y))).mean(1)


@pytest.mark.parametrize("call", ["cross", "shared_kv", "query_as_value", "attn_mask", "key_padding_mask", "positional_key_padding_mask"])
def test_attention_other_than_plain_unmasked_self_attention_is_kept_whole_and_the_rest_nests_exactly(call):
    torch.manual_seed(0)
    compiled = tiers(nest(CrossAttention(call).eval(), (1, 1, 2, 2), name=f"cross_attention_{call}"), 0.5)
    narrow = compiled["narrow"].build()
    assert isinstance(narrow.attn, nn.MultiheadAttention) and narrow.attn.in_proj_weight.shape == (24, 8)
    assert narrow.fc1.weight.shape == (12, 8)  # ceil(16 sqrt(0.5))
    assert zeroed_parity(compiled, "narrow", torch.randn(2, 1, 2, 2)) < 1e-6


class PickedChannels(nn.Module):
    """Channels picked by an index tensor: which ones depends on positions nesting would move."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 8, 1), nn.Linear(3, 2)
        self.register_buffer("picks", torch.tensor([5, 1, 6]))

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3))[:, self.picks])


def test_channels_picked_by_an_index_tensor_are_refused_in_one_line():
    with pytest.raises(NestError, match=r"^getitem \(getitem\): an index tensor that picks channels by position$"):
        nest(PickedChannels(), (1, 1, 4, 4), name="picked_channels")


class HeadsInBatch(nn.Module):
    """BoTNet's attention: the heads moved into the batch (``reshape(B * heads, ...)``), and a
    second view whose first size is read back from that tensor."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Conv2d(1, 24, 1), nn.Conv2d(8, 3, 1)

    def forward(self, x):
        b, _, h, w = x.shape
        q, k, v = torch.split(self.qkv(x), [8, 8, 8], dim=1)
        q = q.reshape(b * 4, 2, -1).transpose(-1, -2)
        k, v = k.reshape(b * 4, 2, -1), v.reshape(b * 4, 2, -1).transpose(-1, -2)
        q = q.reshape(q.shape[0], h, w, -1).reshape(q.shape[0], h * w, -1)  # size from the narrowed tensor
        out = ((q @ k).softmax(-1) @ v).transpose(-1, -2).reshape(b, 8, h, w)
        return self.out(out).mean((2, 3))


class StackedBranches(nn.Module):
    """Selective kernels' fusion: two branches stacked and summed over the branch dimension, so
    channel c of one branch meets channel c of the other (here b's channels are reversed)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Conv2d(1, 8, 1), nn.Conv2d(1, 8, 3, padding=1), nn.Linear(8, 3)

    def forward(self, x):
        stacked = torch.stack([self.a(x), self.b(x).flip(1)], 1)  # (B, 2 branches, 8, H, W)
        return self.head(stacked.sum(1).mean((2, 3)))


class ProjectedClassToken(nn.Module):
    """CrossViT: a class token projected by its own layer beside tokens of another layer, both
    under one LayerNorm (so channel c of each is one channel)."""

    def __init__(self):
        super().__init__()
        self.patch, self.cls = nn.Linear(1, 8), nn.Linear(1, 8)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 3)
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        tokens = x.flatten(2).transpose(1, 2)  # (B, 4, 1)
        t = torch.cat([self.cls(tokens[:, :1]), self.patch(tokens)], 1)
        q, k, v = self.qkv(self.norm(t)).chunk(3, -1)
        t = t + (q @ k.transpose(1, 2)).softmax(-1) @ v
        return self.fc2(torch.relu(self.fc1(t[:, 0])))


@pytest.mark.parametrize("module, narrowed", [
    (HeadsInBatch, {"qkv.weight": (18, 1, 1, 1), "out.weight": (3, 6, 1, 1)}),  # 3 of 4 heads of 2
    (StackedBranches, {"a.weight": (6, 1, 1, 1), "b.weight": (6, 1, 3, 3), "head.weight": (3, 6)}),  # b: its last 6
    (ProjectedClassToken, {"cls.weight": (8, 1), "norm.weight": (8,), "fc1.weight": (12, 8)}),
])
def test_heads_in_the_batch_stacked_branches_and_projected_class_tokens_nest_exactly(module, narrowed):
    torch.manual_seed(0)
    compiled = tiers(nest(module().eval(), (1, 1, 2, 2), name=f"nested_{module.__name__.lower()}"), 0.5)
    tier = compiled["narrow"].build()
    assert {key: shape(tier, key) for key in narrowed} == narrowed
    assert tier.plan.channels.channel_stats == [] or module is ProjectedClassToken  # branches summed channel by channel
    if module is ProjectedClassToken:  # the norm's weight belongs to the channels of both layers, not kept whole
        assert [d is not None for d in tier.plan.dims["norm.weight"]] == [True]
    assert zeroed_parity(compiled, "narrow", torch.randn(2, 1, 2, 2)) < 1e-6

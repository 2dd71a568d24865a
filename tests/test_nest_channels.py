"""How the channel analysis (nefl_zoo/nesting/channels.py) reads each form of an operation:
pooling and convolution over tensors whose positions hold different layers' channels, rows of
parameter elements beside a layer's rows, functional pads, folds, unfolds, index selections,
einsums with their operands in a list, functional linear layers of nested modules, a linear
layer over a size-1 last dimension, optional forward arguments, layers kept whole, functions
the tracer keeps whole, and the one-line refusals naming the node."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.nn import functional as F

from nefl_zoo.models import create_model
from nefl_zoo.nesting import NestError, nest
from nefl_zoo.nesting.channels import ShapeError, analyse
from nefl_zoo.nesting.verify import zeroed_parity
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec


def tiers(module: nn.Module, size: int, name: str):
    """``module`` nested (tiers ``narrow``, gamma_W 0.5: ceil(8 sqrt(0.5)) = 6 of 8 channels, and
    ``full``, checked equal to ``module``): the narrow tier's tensor shapes and its distance
    from the full model with the removed channels zeroed."""
    torch.manual_seed(0)
    compiled = compile_spec(parse_spec({"model": nest(module.eval(), (1, 1, size, size), name=name),
                                        "tiers": [{"name": "narrow", "gamma_w": 0.5}, {"name": "full"}]}))
    x = torch.randn(2, 1, size, size)
    with torch.no_grad():
        assert torch.equal(compiled.create_global_model().eval()(x), module(x))
    shapes = {k: tuple(v.shape) for k, v in compiled["narrow"].build().state_dict().items()}
    return shapes, zeroed_parity(compiled, "narrow", x)


def two_convs():
    return nn.Conv2d(1, 8, 1), nn.Conv2d(1, 8, 1)


class SideBySide(nn.Module):
    """Two layers' outputs side by side along the width, pooled by a module (``a`` and ``b``)
    or convolved (``c`` and ``d``): column i of each is one channel, so channel i of ``a``
    lives and dies with channel i of ``b``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = two_convs()
        self.c, self.d = two_convs()
        self.pool, self.conv, self.head = nn.AvgPool2d((1, 2)), nn.Conv2d(8, 8, 1), nn.Linear(16, 3)

    def forward(self, x):
        pooled = self.pool(torch.cat([self.a(x), self.b(x)], 3)).mean((2, 3))
        return self.head(torch.cat([pooled, self.conv(torch.cat([self.c(x), self.d(x)], 3)).mean((2, 3))], 1))


def test_positions_holding_two_layers_channels_unite_them_through_a_pool_and_a_convolution():
    shapes, parity = tiers(SideBySide(), 2, "side_by_side")
    assert shapes["a.weight"] == shapes["b.weight"] == shapes["c.weight"] == shapes["d.weight"] == (6, 1, 1, 1)
    assert shapes["conv.weight"] == (6, 6, 1, 1) and shapes["head.weight"] == (3, 12)
    assert parity < 1e-6


class TokenRow(nn.Module):
    """A learned row of parameter elements beside a layer's rows (a class token along the
    width), through a functional pool and a functional instance norm: each element joins its
    column's channel."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 8, 1), nn.Linear(16, 3)
        self.token = nn.Parameter(torch.randn(1, 8, 2, 1))

    def forward(self, x):
        h = torch.cat([self.conv(x), self.token.expand(x.shape[0], -1, -1, -1)], 3)
        return self.head(torch.cat([F.avg_pool2d(h, (1, 3)).mean((2, 3)), F.instance_norm(h).amax((2, 3))], 1))


def test_a_row_of_parameter_elements_joins_its_columns_channels_in_functional_pools_and_norms():
    shapes, parity = tiers(TokenRow(), 2, "token_row")
    assert shapes["conv.weight"] == (6, 1, 1, 1) and shapes["token"] == (1, 6, 2, 1) and shapes["head.weight"] == (3, 12)
    assert parity < 1e-5


class Moves(nn.Module):
    """Positions moved by ``F.pad`` (its pads by position and by keyword), ``torch.index_select`` over rows,
    ``Tensor.unfold`` windows, and ``F.unfold`` / ``F.fold`` by keyword."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 8, 1), nn.Linear(32, 3)
        self.register_buffer("rows", torch.tensor([3, 0, 1]))

    def forward(self, x):
        h = F.pad(F.pad(self.conv(x), (1, 1, 0, 1)), pad=(0, 0, 0, 1))  # 2 x 2 -> 4 x 4
        rows = torch.index_select(h, 2, self.rows)  # 3 x 4
        rows = rows / (1 + rows.abs().amax((2, 3), True))  # keepdim by position: broadcast back
        windows = rows.unfold(3, 2, 2)  # 3 x 2 x 2
        patches = F.unfold(h, kernel_size=2, stride=2)  # 32 x 4
        back = F.fold(patches, output_size=(4, 4), kernel_size=2, stride=2)
        return self.head(torch.cat([windows.mean((2, 3, 4)), rows.amax((2, 3)), back.mean(dim=(2, 3)), back.amin((2, 3))], 1))


def test_pads_index_selections_and_windows_move_positions_and_keep_channels():
    shapes, parity = tiers(Moves(), 2, "moves")
    assert shapes["conv.weight"] == (6, 1, 1, 1) and shapes["head.weight"] == (3, 24) and shapes["rows"] == (3,)
    assert parity < 1e-6


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)


class LinearForms(nn.Module):
    """Functional layers: a linear layer with a nested module's weight and bias by position,
    a hidden one whose bias is a parameter of another name (by keyword), one without bias, a 1-d
    convolution; squeeze-excitation as an einsum whose operands come in a list, and
    ``torch.addcmul`` of three layers' outputs (their channels meet one by one)."""

    def __init__(self):
        super().__init__()
        self.conv, self.block, self.head = nn.Conv2d(1, 8, 1), Inner(), nn.Linear(8, 3)
        self.w, self.b = nn.Parameter(torch.randn(8, 8) / 3), nn.Parameter(torch.randn(8))
        self.plain, self.w1d = nn.Parameter(torch.randn(8, 8) / 3), nn.Parameter(torch.randn(8, 8, 3) / 5)
        self.p, self.q = nn.Conv2d(1, 8, 1), nn.Conv2d(1, 8, 1)

    def forward(self, x):
        h = torch.addcmul(self.conv(x), self.p(x), self.q(x), value=0.5)
        gate = torch.sigmoid(F.linear(h.mean((2, 3)), self.block.fc.weight, self.block.fc.bias))
        h = torch.einsum("bchw,bc->bchw", [h, gate])
        h = F.conv1d(h.flatten(2), self.w1d, None, 1, 1, 1).mean(2)  # groups by default: six arguments
        return self.head(F.linear(torch.relu(F.linear(h, self.w, bias=self.b)), self.plain))


def test_functional_layers_of_every_call_form_and_einsum_operand_lists_are_cut():
    shapes, parity = tiers(LinearForms(), 2, "linear_forms")
    assert shapes == {"conv.weight": (6, 1, 1, 1), "conv.bias": (6,), "block.fc.weight": (6, 6), "block.fc.bias": (6,),
                      "head.weight": (3, 6), "head.bias": (3,), "w": (6, 6), "b": (6,), "plain": (6, 6),
                      "w1d": (6, 6, 3), "p.weight": (6, 1, 1, 1), "p.bias": (6,), "q.weight": (6, 1, 1, 1), "q.bias": (6,)}
    assert parity < 1e-6


class PerChannelMLP(nn.Module):
    """A linear layer over a size-1 last dimension: the same small MLP on every channel's
    value, so its weight is shared by every channel and the channels nest through it."""

    def __init__(self):
        super().__init__()
        self.conv, self.each, self.head = nn.Conv2d(1, 8, 1), nn.Linear(1, 4), nn.Linear(32, 3)

    def forward(self, x):
        h = torch.relu(self.each(self.conv(x).mean((2, 3)).unsqueeze(-1)))  # (B, 8, 4)
        return self.head(h.flatten(1))


def test_a_linear_layer_over_a_size_one_last_dimension_keeps_its_weight_whole_and_the_channels_nest():
    shapes, parity = tiers(PerChannelMLP(), 2, "per_channel_mlp")
    assert shapes["conv.weight"] == (6, 1, 1, 1) and shapes["each.weight"] == (4, 1) and shapes["head.weight"] == (3, 24)
    assert parity < 1e-6


class Scaled(nn.Module):
    """Optional forward arguments (one fixed by the tracer, one a second placeholder): traced
    at their defaults, not as second inputs."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 8, 1), nn.Linear(8, 3)

    def forward(self, x, scale=None, gain=2.0):
        h = self.conv(x) * gain
        if scale is not None:
            h = h * scale
        return self.head(h.mean((2, 3)))


def test_an_optional_argument_keeps_its_default():
    shapes, parity = tiers(Scaled(), 2, "scaled")
    assert shapes["conv.weight"] == (6, 1, 1, 1) and parity < 1e-6


@fx.wrap
def swap_halves(x):
    """Moves positions only: the tracer keeps it as one call; nesting runs it on the ids."""
    return torch.cat([x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]], -1)


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 8, 1), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(swap_halves(self.conv(x))[..., 0, 0])


def test_a_function_the_tracer_keeps_whole_is_accepted_where_it_only_moves_ids():
    shapes, parity = tiers(Wrapped(), 2, "wrapped")
    assert shapes["conv.weight"] == (6, 1, 1, 1) and parity < 1e-6


class CrossAttention(nn.Module):
    """``nn.MultiheadAttention`` between two inputs (kept whole, with its attention weights used
    downstream) beside a convolution that nests."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.conv = nn.Conv2d(1, 8, 1), nn.Conv2d(1, 8, 1), nn.Conv2d(1, 8, 1)
        self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(16, 3)

    def forward(self, x):
        q, kv = self.q(x).flatten(2).transpose(1, 2), self.kv(x).flatten(2).transpose(1, 2)
        out, weights = self.attn(q, kv, kv)
        return self.head(torch.cat([out.mean(1) + weights.mean(), self.conv(x).mean((2, 3))], 1))


def test_a_layer_kept_whole_returns_its_input_ids_and_no_channel_for_its_other_outputs():
    shapes, parity = tiers(CrossAttention(), 2, "cross_attention")
    assert shapes["q.weight"] == shapes["kv.weight"] == (8, 1, 1, 1) and shapes["attn.in_proj_weight"] == (24, 8)
    assert shapes["conv.weight"] == (6, 1, 1, 1) and shapes["head.weight"] == (3, 14)
    assert parity < 1e-6


class Encoder(nn.Module):
    """``nn.TransformerEncoderLayer``: a torch.nn layer whose parameters are all its children's,
    kept whole with the channels it reads."""

    def __init__(self):
        super().__init__()
        self.q, self.conv, self.head = nn.Conv2d(1, 8, 1), nn.Conv2d(1, 8, 1), nn.Linear(16, 3)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        tokens = self.encoder(self.q(x).flatten(2).transpose(1, 2))
        return self.head(torch.cat([tokens.mean(1), self.conv(x).mean((2, 3))], 1))


def test_a_layer_whose_parameters_are_its_childrens_is_kept_whole():
    shapes, parity = tiers(Encoder(), 2, "encoder")
    assert shapes["q.weight"] == (8, 1, 1, 1) and shapes["encoder.linear1.weight"] == (16, 8)
    assert shapes["conv.weight"] == (6, 1, 1, 1) and parity < 1e-5


class BiasedAttention(nn.Module):
    """Attention of 4 heads of 2 with a learned bias per head as ``attn_mask`` (by keyword):
    the bias nests with its heads. Beside it layers normalised by their largest channel and by
    a functional group norm, whose width an attention network keeps (statistics over channels)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.other, self.grouped = nn.Conv2d(1, 24, 1), nn.Linear(8, 3), nn.Conv2d(1, 8, 1), nn.Conv2d(1, 8, 1)
        self.bias = nn.Parameter(torch.randn(1, 4, 4, 4))
        self.gw, self.gb = nn.Parameter(torch.linspace(0.5, 2, 8)), nn.Parameter(torch.linspace(-1, 1, 8))

    def forward(self, x):
        b = x.shape[0]
        q, k, v = self.qkv(x).flatten(2).transpose(1, 2).reshape(b, 4, 3, 4, 2).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias).transpose(1, 2).reshape(b, 4, 8)
        h = self.other(x)
        g = F.group_norm(self.grouped(x), 2, self.gw, self.gb)
        return self.out(o.mean(1)) + (h / h.abs().amax(1, keepdim=True) + g).mean((1, 2, 3)).unsqueeze(1)


def test_an_attention_bias_nests_with_its_heads_and_channel_statistics_keep_their_width():
    shapes, parity = tiers(BiasedAttention(), 2, "biased_attention")
    assert shapes["qkv.weight"] == (18, 1, 1, 1) and shapes["bias"] == (1, 3, 4, 4) and shapes["out.weight"] == (3, 6)
    assert shapes["other.weight"] == shapes["grouped.weight"] == (8, 1, 1, 1) and parity < 1e-5


class PositionTable(nn.Module):
    """A layer that makes a tensor from sizes alone (a learned position table)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, h, w):
        return self.scale.view(1, -1, 1, 1) * torch.ones(1, 8, h, w)


class Positioned(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.pos, self.other, self.head = nn.Conv2d(1, 8, 1), PositionTable(), nn.Conv2d(1, 8, 1), nn.Linear(16, 3)

    def forward(self, x):
        h = self.conv(x)
        return self.head(torch.cat([(h + self.pos(h.shape[2], h.shape[3])).mean((2, 3)), self.other(x).mean((2, 3))], 1))


def test_a_layer_made_from_sizes_alone_is_kept_whole_with_every_channel_it_meets():
    class Leaves(fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, PositionTable) or super().is_leaf_module(m, name)

    module = Positioned()
    ch = analyse(fx.GraphModule(module, Leaves().trace(module)), torch.Size((1, 1, 2, 2)), "positioned")
    assert ch.kept_whole == ["pos (PositionTable)"] and ch.dims["pos.scale"] == [None]
    roots = ch.roots()
    conv, other = ch.dims["conv.weight"][0], ch.dims["other.weight"][0]
    fixed = {int(roots[i]) for i in ch.fixed}
    assert all(int(roots[i]) in fixed for i in conv) and not any(int(roots[i]) in fixed for i in other)

    class Flat(PositionTable):  # a vector made from sizes: no channels to keep it with
        def forward(self, h, w):
            return self.scale * h * w

    module.pos = Flat()
    with pytest.raises(NestError, match=r"^pos \(Flat\): a layer with parameters that nesting does not know$"):
        analyse(fx.GraphModule(module, Leaves().trace(module)), torch.Size((1, 1, 2, 2)), "positioned")


class Fails(nn.Module):
    """Reads its activation as float32 (a no-op on real values, twice the elements on int64 ids)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 1)

    def forward(self, x):
        return self.conv(x).view(torch.float32).reshape(1, 8, 16).mean(-1)


class ComputedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 8, 1), nn.Linear(8, 3)

    def forward(self, x):
        return F.linear(self.conv(x).mean((2, 3)), self.fc.weight * 2)


class ImplicitEinsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 1)

    def forward(self, x):
        h = self.conv(x)
        return torch.einsum("bchw,bchw", [h, h]).view(1, 1)


class OverlappingFold(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 8, 1), nn.Linear(2, 3)

    def forward(self, x):
        return self.head(F.fold(self.conv(x).flatten(2), output_size=(5, 5), kernel_size=2).mean((2, 3)))


class Shuffled(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.shuffle = nn.Conv2d(1, 8, 1), nn.PixelShuffle(2)

    def forward(self, x):
        return self.shuffle(self.conv(x)).mean((1, 2, 3)).unsqueeze(1)


class MixedNorm(nn.Module):
    """An instance norm over positions that hold two layers' channels (nothing else unites them)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = two_convs()

    def forward(self, x):
        return F.instance_norm(torch.cat([self.a(x), self.b(x)], 3)).mean((1, 2, 3)).unsqueeze(1)


class Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.both = nn.Conv2d(1, 8, 1), nn.Bilinear(8, 8, 3)

    def forward(self, x):
        h = self.conv(x).mean((2, 3))
        return self.both(h, h)


class Fractional(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.pool = nn.Conv2d(1, 8, 1), nn.FractionalMaxPool2d(2, output_size=2, return_indices=True)

    def forward(self, x):
        return self.pool(self.conv(x))[0].mean((1, 2, 3)).unsqueeze(1)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 1)

    def forward(self, x):
        return F.glu(self.conv(x), 1).mean((1, 2, 3)).unsqueeze(1)


class VectorProduct(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 1)

    def forward(self, x):
        v = self.conv(x).mean((0, 2, 3))
        return (v @ v).view(1, 1)


@pytest.mark.parametrize("module, error, message", [
    (Fails, ShapeError, "module:fails: reshape (reshape): RuntimeError: shape '[1, 8, 16]' is invalid for input of size 256"),
    (ComputedWeight, NestError, "linear (linear): a weight computed in the forward (weight standardisation: statistics over its input channels)"),
    (ImplicitEinsum, NestError, "einsum (einsum): an einsum without an explicit output"),
    (OverlappingFold, NestError, "fold (fold): a fold that sums different channels"),
    (Shuffled, NestError, "shuffle (PixelShuffle): a layer that changes the shape (1, 8, 4, 4) -> (1, 2, 8, 8), which nesting does not know"),
    (MixedNorm, NestError, "instance_norm (instance_norm): its channels are mixed with other dimensions"),
    (Bilinear, NestError, "both (Bilinear): a layer with parameters that nesting does not know"),
    (Fractional, NestError, "pool (FractionalMaxPool2d): a layer that changes the shape (1, 8, 4, 4) -> tuple, which nesting does not know"),
    (Gated, NestError, "glu (glu): an operation nesting does not know"),
    (VectorProduct, NestError, "matmul (matmul): a product of vectors"),
])
def test_an_operation_that_cannot_be_nested_is_refused_in_one_line_naming_its_node(module, error, message):
    with pytest.raises(error) as refused:
        nest(module().eval(), (1, 1, 4, 4), name=module.__name__.lower())
    assert str(refused.value) == message


class Norms(nn.Module):
    """Statistics over channels in a CNN: a GroupNorm module, a functional one, a mean over channels."""

    def __init__(self):
        super().__init__()
        self.conv, self.gn, self.head = nn.Conv2d(1, 8, 1), nn.GroupNorm(4, 8), nn.Linear(8, 3)
        self.w, self.b = nn.Parameter(torch.linspace(0.5, 2, 8)), nn.Parameter(torch.linspace(-1, 1, 8))

    def forward(self, x):
        h = F.group_norm(self.gn(self.conv(x)), 2, self.w, self.b)
        return self.head((h - h.mean(1, keepdim=True)).mean((2, 3)))


def test_a_cnns_statistics_over_channels_are_listed_as_inexact_norms():
    model = create_model(nest(Norms().eval(), (1, 1, 2, 2), name="norms"))
    assert model.plan.inexact_norms == ["gn (GroupNorm)", "group_norm (group_norm)", "mean (mean)"]

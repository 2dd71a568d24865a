"""How data movement carries channel ids (nefl_zoo/nesting/movement.py), on id tensors made by hand:
every element holds the id of its channel, -1 for none."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nefl_zoo.nesting import NestError, nest
from nefl_zoo.nesting.ids import Channels, spread
from nefl_zoo.nesting.movement import branch_dim, channel_dim, folded, opaque, pad, unfolded
from nefl_zoo.nesting.verify import zeroed_parity
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec


def image_ids(channels: int = 2, size: int = 3) -> torch.Tensor:
    """(1, channels, size, size) ids: channel c holds c everywhere."""
    return spread(torch.arange(channels), (1, channels, size, size)).contiguous()


def test_padding_spreads_each_channel_over_the_pad_and_a_pad_of_the_channels_is_refused():
    x = image_ids()
    out = pad(x, (1, 2, 0, 1), "p", torch.Size((1, 2, 4, 6)))
    assert out.shape == (1, 2, 4, 6) and out[0, :, 3, 5].tolist() == [0, 1] and bool((out[0, 1] == 1).all())
    with pytest.raises(NestError, match=r"^p: a pad of the channels$"):
        pad(x, (0, 0, 0, 0, 1, 0), "p", torch.Size((1, 3, 3, 3)))


def test_unfold_moves_each_channel_into_its_kernel_positions_and_padding_holds_no_channel():
    x = image_ids()
    out = unfolded(x, nn.Unfold(2))
    assert out.shape == (1, 8, 4) and out[0, :, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    padded = unfolded(x, nn.Unfold(2, padding=1))
    assert padded[0, :, 0].tolist() == [-1, -1, -1, 0, -1, -1, -1, 1]  # the corner window: one pixel inside


def test_fold_gives_back_each_channel_and_refuses_to_sum_different_channels():
    x = image_ids()
    fold = nn.Fold(3, 2)
    assert torch.equal(folded(unfolded(x, nn.Unfold(2)), fold, "f"), x)
    mixed = unfolded(x, nn.Unfold(2)).clone()
    mixed[0, 1] = 1  # a kernel position of channel 0 now holds channel 1
    with pytest.raises(NestError, match=r"^f: a fold that sums different channels$"):
        folded(mixed, fold, "f")
    gaps = folded(unfolded(image_ids(size=4), nn.Unfold(1, stride=2)), nn.Fold(4, 1, stride=2), "f")
    assert gaps[0, 1].tolist() == [[1, -1, 1, -1], [-1, -1, -1, -1], [1, -1, 1, -1], [-1, -1, -1, -1]]  # no patch: no channel


def test_a_function_kept_whole_is_accepted_where_it_only_moves_ids_also_through_floats():
    x = image_ids()
    assert torch.equal(opaque(lambda t: t.flip(-1)[:, :, :2], (x,), {}, "o"), x[:, :, :2])
    resized = opaque(lambda t: nn.functional.interpolate(t, size=(5, 5), mode="bilinear"), (x,), {}, "o")
    assert resized.dtype == torch.long and torch.equal(resized, image_ids(size=5))  # an interpolation of one id
    with pytest.raises(NestError, match=r"^o: a function the tracer keeps whole that nesting does not know$"):
        opaque(lambda t: t * 2 + 1, (x,), {}, "o")  # computes new values


def test_a_function_kept_whole_gets_its_keyword_arguments_integer_arguments_and_non_tensor_outputs():
    x = image_ids(channels=3)
    assert torch.equal(opaque(torch.roll, (x,), {"shifts": 1, "dims": 1}, "o"), x.roll(1, 1))
    index = torch.tensor([2, 0])  # an index is no id: it must stay an integer (first try)
    assert torch.equal(opaque(lambda t, i: t.index_select(1, i), (x, index), {}, "o"), x[:, [2, 0]])
    resized, size = opaque(lambda t: (nn.functional.interpolate(t, size=(5, 5), mode="bilinear"), 5), (x,), {}, "o")
    assert size == 5 and torch.equal(resized, image_ids(channels=3, size=5))


def test_a_dimension_of_stacked_branches_or_tokens_is_no_channel_dimension():
    ch = Channels()
    ids = ch.new("conv", 3)
    branches = torch.stack([ids, ch.new("other", 3)]).view(1, 2, 3, 1)  # (B, branch, channel, 1)
    assert branch_dim(branches, 1) and not channel_dim(ch, branches, 1)
    cnn = spread(ids, (1, 3, 2, 2)).contiguous()
    assert not branch_dim(cnn, 1) and channel_dim(ch, cnn, 1)
    assert not channel_dim(ch, cnn, 2)  # the same channels at every row


class Strided(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 8, 1), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3))[:, ::2])


class Picked(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 8, 1), nn.Linear(9, 2)

    def forward(self, x):
        y = self.conv(x).mean((2, 3))
        return self.fc(torch.cat([y, y[:, 3].unsqueeze(1)], 1))  # channel 3 by its position


class Selections(nn.Module):
    """Tokens beside a class token, then channel selections a tier re-cuts: a ``chunk``, a
    ``split_with_sizes``, slices after an Ellipsis (one stopping before the end, one after a
    leading ``:``), a ``narrow`` and an integer index into stacked branches."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(1, 12, 2, 2)
        self.cls = nn.Parameter(torch.randn(1, 1, 12))
        self.gate = nn.Linear(6, 6)
        self.mix, self.tail, self.side = nn.Linear(5, 5), nn.Linear(4, 5), nn.Linear(3, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        t = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.embed(x).flatten(2).transpose(1, 2)], 1)
        left, right = t.chunk(2, -1)
        u, v = (self.gate(left) * torch.sigmoid(right)).split_with_sizes([2, 4], -1)
        h = self.mix(t[..., 1:6]) + self.tail(t[:, ..., 7:11]) + self.side(t.narrow(-1, 4, 3))
        pair = torch.stack([h, torch.cat([u, v[..., :3]], -1)])
        return self.head(pair[0] + pair[1]).mean(1)


def test_channel_selections_of_tokens_beside_a_class_token_are_recut_in_a_tier():
    torch.manual_seed(0)
    name = nest(Selections(), (1, 1, 4, 4), name="selections")
    compiled = compile_spec(parse_spec({"model": name, "tiers": [{"name": "t", "gamma_w": 0.3}, {"name": "f"}]}))
    t = compiled["t"].slice_map
    # each half of the chunk keeps 4 of 6 (full 0-3 and 6-9): [1:6] holds kept 1-3, [7:11] kept 7-9
    assert t["embed.weight"].index[0].tolist() == t["cls"].index[2].tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    assert t["mix.weight"].index == t["tail.weight"].index == (slice(0, 4), slice(0, 3))
    assert t["side.weight"].index[1].tolist() == [2]  # narrow(-1, 4, 3): full 4-6, of which 6 is kept (its position 2)
    x = torch.randn(2, 1, 4, 4)
    with torch.no_grad():
        assert float(compiled.create_global_model()(x).abs().max()) > 0.1
    assert zeroed_parity(compiled, "t", x) < 1e-6


@pytest.mark.parametrize("module, refusal", [
    (Strided, r"^getitem: a strided channel slice of narrowed channels$"),
    (Picked, r"^getitem: an index that picks channels by position of narrowed channels$"),
])
def test_selections_right_only_at_full_width_are_refused_in_a_narrower_tier(module, refusal):
    name = nest(module(), (1, 1, 2, 2), name=f"selection_{module.__name__.lower()}")
    compile_spec(parse_spec({"model": name, "tiers": [{"name": "full"}]}))
    with pytest.raises(Exception, match=refusal.replace("^", r"^(<spec>: tiers\[0\]\.gamma_w: )?")):
        compile_spec(parse_spec({"model": name, "tiers": [{"name": "half", "gamma_w": 0.5}]}))

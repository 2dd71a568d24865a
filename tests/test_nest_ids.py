"""Id tensors and the union-find over channel ids (nefl_zoo/nesting/ids.py): ids counted from 0
as :class:`Channels` hands them out, ``-1`` for no channel; and GroupNorm, whose groups a tier
keeps whole."""

from __future__ import annotations

import torch
from torch import nn

from nefl_zoo.nesting import nest
from nefl_zoo.nesting.ids import Channels, element_mask, roots_of
from nefl_zoo.nesting.verify import zeroed_parity
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec


def test_union_find_unites_the_first_id_either_way_and_leaves_no_channel_alone():
    for a, b in ((0, 1), (1, 0)):
        ch = Channels()
        ch.new("layer", 3)
        ch.union(torch.tensor([a, -1]), torch.tensor([b, 2]))  # -1 meets 2: nothing
        assert ch.roots().tolist() == [0, 0, 2] and ch.roots().dtype == torch.long
        assert roots_of(ch, torch.tensor([[1, -1], [2, 0]])).tolist() == [[0, -1], [2, 0]]


def test_element_mask_covers_every_parameter_used_element_wise():
    ch = Channels()
    ch.new("token", 2), ch.new("conv", 3), ch.new("table", 1)
    ch.element_ranges += [(0, 2), (5, 1)]
    assert element_mask(ch, torch.tensor([0, 1, 2, 4, 5, -1])).tolist() == [True, True, False, False, True, False]


class GroupNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(4, 8)
        self.conv2, self.norm2 = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.relu(self.norm1(self.conv1(x)))
        return self.fc(torch.relu(self.norm2(self.conv2(x))).mean((2, 3)))


def test_a_tier_keeps_whole_groups_of_every_group_norm_with_their_statistics():
    torch.manual_seed(0)
    compiled = compile_spec(parse_spec({"model": nest(GroupNormNet(), (1, 1, 4, 4), name="group_norm_net"),
                                        "tiers": [{"name": "half", "gamma_w": 0.5}, {"name": "full"}]}))
    half = compiled["half"].build()
    # ceil(8 sqrt(0.5)) = 6: whole groups of 2 (norm1: 3 of 4 groups) and of 4 (norm2: 8 / 4 = 2 groups kept)
    assert (half.norm1.num_channels, half.norm1.num_groups) == (6, 3)
    assert (half.norm2.num_channels, half.norm2.num_groups) == (8, 2)
    assert zeroed_parity(compiled, "half", torch.randn(2, 1, 4, 4)) < 1e-6

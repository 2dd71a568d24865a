"""How products of activations, einsums, index tensors and element-wise parameters carry
channel ids (nefl_zoo/nesting/attention.py), on id tensors made by hand: every element holds the
id of its channel, ids counted from 0 as :class:`Channels` hands them out."""

from __future__ import annotations

import pytest
import torch

from nefl_zoo.nesting import NestError
from nefl_zoo.nesting.attention import contract, einsum, gather, unite
from nefl_zoo.nesting.ids import Channels, roots_of, spread


def elements(ch: Channels, name: str, size: int) -> torch.Tensor:
    """Ids of a parameter used element-wise (a class token, a mask, a position table)."""
    ids = ch.new(name, size)
    ch.element_ranges.append((int(ids[0]), size))
    return ids


def test_attention_times_values_keeps_each_value_channel_the_first_id_included():
    ch = Channels()
    v, scores = ch.new("v", 3), ch.new("scores", 2)  # v holds ids 0, 1, 2
    out = contract(ch, spread(scores, (4, 2), 1), spread(v, (2, 3), 1), "c")
    assert torch.equal(out, spread(v, (4, 3), 1)) and ch.attention


def test_queries_times_keys_give_the_rows_class_and_unite_every_channel_they_meet():
    ch = Channels()
    q, k = ch.new("q", 2), ch.new("k", 2)  # a column [0, 1] of q is no single channel
    out = contract(ch, spread(k, (3, 2), 1), spread(q, (2, 4), 0), "c")
    assert out.shape == (3, 4) and bool((out == 3).all())
    assert len(roots_of(ch, torch.arange(4)).unique()) == 1
    ch = Channels()
    ch.new("zero", 1)  # rows of one channel, id 0
    k = ch.new("k", 2)
    out = contract(ch, torch.zeros(3, 2, dtype=torch.long), spread(k, (2, 4), 0), "c")
    assert bool((out == 0).all())
    with pytest.raises(NestError, match=r"^c: a product of vectors$"):
        contract(ch, k, spread(k, (2, 4), 0), "c")


def test_a_relative_position_product_joins_each_heads_rows_and_shares_the_table():
    ch = Channels()
    values = ch.new("v", 2 * 3).view(2, 1, 3).expand(2, 4, 3)  # (heads, K, N): a channel per head and column
    table = elements(ch, "table", 4 * 4).view(4, 4)  # (M, K) relative positions, every head alike
    out = contract(ch, table, values, "c")
    assert out.shape == (2, 4, 3) and torch.equal(out, values[:, :1].expand(2, 4, 3))
    assert ch.shared == set(table.flatten().tolist())


def test_einsum_reads_spaces_and_refuses_ellipses_and_repeated_letters():
    ch = Channels()
    a, b = spread(ch.new("a", 2), (3, 2), 1), spread(ch.new("b", 4), (2, 4), 1)
    spaced = einsum(ch, "ij, jk -> ik", [a, b], "e")
    assert torch.equal(spaced, einsum(ch, "ij,jk->ik", [a, b], "e")) and torch.equal(spaced, spread(torch.arange(2, 6), (3, 4), 1))
    with pytest.raises(NestError, match=r"^e: an einsum without an explicit output$"):
        einsum(ch, "...ij,...jk->...ik", [a, b], "e")
    with pytest.raises(NestError, match=r"^e: an einsum with a repeated letter$"):
        einsum(ch, "ii->i", [spread(ch.new("c", 2), (2, 2), 1)], "e")


def test_an_index_tensor_keeps_one_channel_per_position_and_refuses_to_pick_channels():
    ch = Channels()
    rows = spread(ch.new("c", 2), (2, 3), 0)  # channel 0 then 1 along dim 0, the same along dim 1
    out = gather(ch, rows, 1, torch.Size((4, 5)), "g")
    assert out.shape == (2, 4, 5) and torch.equal(out, spread(torch.arange(2), (2, 4, 5), 0))
    with pytest.raises(NestError, match=r"^g: an index tensor that picks channels by position$"):
        gather(ch, rows, 0, torch.Size((4,)), "g")
    table = elements(ch, "table", 3).view(1, 3)
    assert gather(ch, table, 1, torch.Size((2,)), "g").shape == (1, 2)
    assert len(roots_of(ch, table).unique()) == 1  # a parameter's positions: one class


def test_an_element_broadcast_over_several_classes_is_shared_and_over_one_class_joins_it():
    ch = Channels()
    heads = ch.new("heads", 2)  # ids 0 and 1, two classes
    mask = elements(ch, "mask", 1)
    out = unite(ch, spread(mask, (1, 2), 0), spread(heads, (1, 2), 1))
    assert ch.shared == {2} and torch.equal(out, spread(heads, (1, 2), 1)) and ch.find(1) != ch.find(0)
    ch = Channels()
    heads = ch.new("heads", 2)
    ch.union(heads[:1], heads[1:])  # one class
    gain = elements(ch, "gain", 1)
    unite(ch, spread(gain, (1, 2), 0), spread(heads, (1, 2), 1))
    assert not ch.shared and ch.find(2) == ch.find(0)

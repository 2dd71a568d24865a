"""Id-tensor rules for transformers: tokens, shared constants and products of two activations.

* A parameter used element-wise (a class token, a position embedding) has its own ids; where a
  row of it meets a channel of the stream (the class token concatenated to the patches) its
  elements join that channel (:func:`join_rows`). An element broadcast over several channels
  (an attention mask over every head, a scalar gain) is *shared*: it joins none and stays whole.
* ``a @ b`` between two activations (attention) mixes a whole row of ``a`` with a whole column
  of ``b``: each row (a query's head dimension) and column become one class, the classes a
  product meets are united, and the output keeps ``b``'s ids where a column of ``b`` is one
  channel (``attn @ v`` keeps v's channels). A head is then one class: whole heads nest.
"""

from __future__ import annotations

import torch

from .ids import element_mask, roots_of
from .sources import NestError


def unite(ch, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """An element-wise operation of two id tensors (residual add, gating, bias): their ids are
    united, except a parameter element broadcast over several channels (shared: kept whole)."""
    a, b = torch.broadcast_tensors(a, b)
    for mine, other in ((a, b), (b, a)):
        elements = element_mask(ch, mine)
        if not bool(elements.any()):
            continue
        pairs = torch.unique(torch.stack([mine[elements], other[elements]], 1), dim=0)
        pairs = pairs[pairs[:, 1] >= 0]
        if len(pairs) and len(torch.unique(pairs[:, 0])) < len(pairs):
            counts = torch.unique(torch.stack([pairs[:, 0], roots_of(ch, pairs[:, 1])], 1), dim=0)[:, 0]
            if len(torch.unique(counts)) < len(counts):  # an element meets several channels: shared
                ch.shared.update(int(i) for i in mine[elements].unique())
                return other
    ch.union(a, b)
    return torch.where(a >= 0, a, b)


def contract(ch, a: torch.Tensor, b: torch.Tensor, where: str) -> torch.Tensor:
    """Ids of ``a @ b`` (two activations, ``(..., M, K) @ (..., K, N)``)."""
    if a.ndim < 2 or b.ndim < 2:
        raise NestError(f"{where}: a product of vectors")
    if bool(element_mask(ch, b).all()) or bool(element_mask(ch, a).all()):  # relative position embeddings
        act, param, dim = (a, b, -1) if bool(element_mask(ch, b).all()) else (b, a, -2)
        ch.shared.update(int(i) for i in param.unique())  # shared by every head: whole; the rows it meets join
        rep = act.amax(dim, keepdim=True)
        ch.union(act, rep)
        shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        return rep.expand(shape)
    ch.attention = True
    row = a.amax(-1, keepdim=True)
    col = b.amax(-2, keepdim=True)
    ch.union(a, row)
    ch.union(b, col)
    ch.union(row, col)
    whole_column = ((b == col) | (b < 0)).all(-2, keepdim=True) & (col >= 0)  # padding (-1) aside
    return torch.where(whole_column, col, torch.where(row >= 0, row, col))


def einsum(ch, equation: str, operands: list[torch.Tensor], where: str) -> torch.Tensor:
    """Ids of ``torch.einsum(equation, *operands)`` (explicit output): each operand's summed
    letters join one class, the operands meet as in a product, and the output keeps the ids of
    the last operand that sums over no channels (else the first's)."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "..." in equation:
        raise NestError(f"{where}: an einsum without an explicit output")
    inputs, out = equation.split("->")
    reps, whole = [], []
    for letters, x in zip(inputs.split(","), operands):
        if len(set(letters)) != len(letters):
            raise NestError(f"{where}: an einsum with a repeated letter")
        summed = [d for d, letter in enumerate(letters) if letter not in out]
        rep = x.amax(summed, keepdim=True) if summed else x
        ch.union(x, rep)
        whole.append(bool((x == rep).all()))
        rep = rep.squeeze(summed) if summed else rep
        kept = [letter for letter in letters if letter in out]
        rep = rep.permute(*[kept.index(letter) for letter in out if letter in kept])
        reps.append(rep.reshape([x.shape[letters.index(letter)] if letter in kept else 1 for letter in out]))
    for rep in reps[1:]:
        ch.union(reps[0], rep)
    ch.attention = True
    chosen = next((r for r, w in zip(reversed(reps), reversed(whole)) if w), reps[0])
    shape = torch.broadcast_shapes(*[r.shape for r in reps])
    return chosen.expand(shape)


_MULTIHEAD_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")  # forward's order


def self_attention(m, args, kwargs) -> bool:
    """Whether an ``nn.MultiheadAttention`` call is plain self-attention with packed q, k, v
    projections and no mask, by keyword or position (what :func:`multihead` nests by heads)."""
    call = dict(zip(_MULTIHEAD_ARGS, args)) | kwargs
    query, key, value = (call.get(name) for name in _MULTIHEAD_ARGS[:3])
    return (query is not None and query is key is value and m._qkv_same_embed_dim and m.bias_k is None
            and not m.add_zero_attn and call.get("attn_mask") is None and call.get("key_padding_mask") is None)


def multihead(ch, owner: str, m, x: torch.Tensor, where: str):
    """Ids of ``nn.MultiheadAttention`` (self-attention): the packed q, k, v projection's
    outputs of each head are one class, the output projection reads v's."""
    from .ids import channel_vector, spread

    vec = channel_vector(x, x.ndim - 1, where, ch, shared=True)
    qkv = ch.new(f"{owner}.in_proj_weight", 3 * m.embed_dim)
    heads = qkv.view(3, m.num_heads, m.head_dim)
    ch.union(heads, heads[:1, :, :1])
    out = ch.new(f"{owner}.out_proj.weight", m.embed_dim)
    ch.dims[f"{owner}.in_proj_weight"], ch.dims[f"{owner}.out_proj.weight"] = [qkv, vec], [out, heads[2].reshape(-1)]
    if m.in_proj_bias is not None:
        ch.dims[f"{owner}.in_proj_bias"] = [qkv]
    if m.out_proj.bias is not None:
        ch.dims[f"{owner}.out_proj.bias"] = [out]
    ch.attention = True
    return spread(out, x.shape, x.ndim - 1), None


def attention(ch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, where: str) -> torch.Tensor:
    """Ids of ``scaled_dot_product_attention(q, k, v, mask)``."""
    scores = contract(ch, q, k.transpose(-2, -1), where)
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.long:
        scores = unite(ch, scores, mask)
    return contract(ch, scores, v, where)


def gather(ch, x: torch.Tensor, dim: int, index_shape: torch.Size, where: str) -> torch.Tensor:
    """Ids of ``x`` indexed along ``dim`` by a tensor of positions (a relative position table):
    the positions are not channels, so every entry along ``dim`` joins one class (a parameter's
    elements) or must already be one (else refused)."""
    if bool(element_mask(ch, x).all()):
        ch.union(x, x.narrow(dim, 0, 1))
    elif x.shape[dim] > 1 and not bool((x == x.narrow(dim, 0, 1)).all()):
        raise NestError(f"{where}: an index tensor that picks channels by position")
    first = x.narrow(dim, 0, 1).movedim(dim, 0)[0]
    shape = (*x.shape[:dim], *index_shape, *x.shape[dim + 1:])
    return first.reshape(*x.shape[:dim], *[1] * len(index_shape), *x.shape[dim + 1:]).expand(shape)

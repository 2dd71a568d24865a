"""How data movement carries channel ids: views and reshapes (a split into heads is recorded,
a channel count written into a shape is re-counted in a tier), selections and splits along
channels (re-cut in kept channels), padding, unfold / fold, and functions the tracer keeps whole."""

from __future__ import annotations

import torch

from .ids import Channels, channel_vector, element_mask, join_rows, roots_of, varies
from .sources import NestError


def record_move(ch: Channels, n, name: str, args, kwargs, out, where: str) -> None:
    """Record what a view or selection does to channels: a view that splits them into several
    dimensions (refused when narrowed), a channel count written into a view's shape and a
    selection along the channels (both re-cut when the tier is built)."""
    x = args[0]
    if name in ("view", "reshape", "unflatten", "reshape_as", "view_as") and isinstance(out, torch.Tensor):
        before = [d for d in range(x.ndim) if varies(x, d)]
        after = [d for d in range(out.ndim) if varies(out, d)]
        if not before or not after:
            return
        grid = out.permute(*[d for d in range(out.ndim) if d not in after], *after).reshape(-1, *[out.shape[d] for d in after]).amax(0)  # padding (-1) aside
        if len(after) > 1:
            kind = "(channel shuffle)" if before == [1] and after[:2] == [1, 2] else "into several dimensions (heads)"
            ch.splits.append((f"{n.name}: a view that splits the channels {kind}", grid))
        if name in ("view", "reshape"):  # channel counts in its shape: re-counted in the tier
            n.meta["nest_split"] = (after, grid)
    elif name in ("chunk", "split", "split_with_sizes", "narrow"):
        d = (args[1] if name == "narrow" else args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
        if varies(x, d):  # a channel split: each part nests on its own
            try:
                vec = channel_vector(x, d, where, ch)
            except NestError:  # different channels in each row (q, k, v within every head): never cut
                ch.channel_views.append((f"{n.name}: a {name} of channels that differ by row", x.contiguous(), d))
                return
            n.meta["nest_cut"] = (d, vec)
            if name != "narrow":
                ch.parts.append([channel_vector(o, d, where, ch) for o in out])
    elif name == "getitem" and isinstance(x, torch.Tensor):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        dims = sum(1 for i in index if i is not None and i is not Ellipsis)
        d = 0
        for p, i in enumerate(index):
            if i is Ellipsis:
                d += x.ndim - dims
                continue
            if i is not None and d < x.ndim and not (isinstance(i, slice) and i == slice(None)) and channel_dim(ch, x, d):
                if isinstance(i, slice) and i.step in (None, 1):
                    n.meta["nest_cut"] = (p, channel_vector(x, d, where, ch))
                else:  # right while this dimension keeps every position (q, k, v; a rotary pair)
                    kind = "an index that picks channels by position" if not isinstance(i, slice) else "a strided channel slice"
                    ch.channel_views.append((f"{n.name}: {kind}", x.contiguous(), d))
            d += i is not None

def channel_dim(ch: Channels, x: torch.Tensor, d: int) -> bool:
    """Whether positions along ``d`` are different channels: not tokens beside a class token,
    nor positions each of which holds channels along another dimension (a class token's
    element beside a channel's patch positions belongs to that channel)."""
    if not (varies(x, d) and varies(roots_of(ch, x), d)):
        return False
    rows = x.movedim(d, 0).reshape(x.shape[d], -1)
    elements = element_mask(ch, rows)
    own = torch.where(elements, -1, rows).amax(1, keepdim=True).expand_as(rows)
    return join_rows(ch, rows) is None and not branch_dim(torch.where(elements, own, rows), 0)


def branch_dim(x: torch.Tensor, d: int) -> bool:
    """Whether every position along ``d`` holds channels along another dimension (stacked
    branches, tokens): ``d`` itself is no channel dimension."""
    rows = x.movedim(d, 0).reshape(x.shape[d], -1)
    return bool((rows != rows[:, :1]).any(1).all())

def unfolded(x: torch.Tensor, unfold) -> torch.Tensor:
    """Ids through an unfold (patches to channels): computed exactly in float64; padding is -1."""
    return unfold((x + 1).double()).round().long() - 1

def folded(x: torch.Tensor, fold, where: str) -> torch.Tensor:
    """Ids through a fold (channels back to patches, overlaps summed): each output must sum
    entries of one channel (their mean id, computed in float64, is then that id)."""
    total, count = fold((x + 1).double()), fold(torch.ones_like(x, dtype=torch.float64))
    mean = torch.where(count > 0, total / count.clamp(min=1), 0)
    if not bool((mean == mean.round()).all()) or not bool((fold((x + 1).double() ** 2) == count * mean ** 2).all()):
        raise NestError(f"{where}: a fold that sums different channels")
    return mean.round().long() - 1

def opaque(target, args, kwargs, where: str):
    """A function the tracer kept whole, run on the ids (in float64 where it needs floats, an
    interpolation): accepted where every output is an id of its inputs (it only moves them)."""
    ids = torch.cat([a.reshape(-1) for a in args if isinstance(a, torch.Tensor)] + [torch.tensor([-1])])
    for as_float in (False, True):
        try:
            cast = (lambda a: (a + 1).double() if isinstance(a, torch.Tensor) else a) if as_float else (lambda a: a)  # noqa: E731
            out = target(*[cast(a) for a in args], **kwargs)
        except Exception:  # noqa: BLE001 - it computes with the ids (a layer inside), not only moves them
            continue
        if as_float:
            out = torch.utils._pytree.tree_map(
                lambda t: t.round().long() - 1 if isinstance(t, torch.Tensor) and bool(((t - t.round()).abs() < 1e-6).all()) else t, out)
        if all(not isinstance(t, torch.Tensor) or (t.dtype == torch.long and bool(torch.isin(t.unique(), ids).all()))
               for t in torch.utils._pytree.tree_leaves(out)):
            return out
    raise NestError(f"{where}: a function the tracer keeps whole that nesting does not know")


def pad(x: torch.Tensor, pads, where: str, out: torch.Size) -> torch.Tensor:
    """Padding along dimensions that carry no channels: the ids are spread over the pad."""
    ids = x
    for i in range(len(pads) // 2):
        d = x.ndim - 1 - i
        if pads[2 * i] or pads[2 * i + 1]:
            if varies(x, d):
                raise NestError(f"{where}: a pad of the channels")
            ids = ids.narrow(d, 0, 1)
    return ids.expand(out)

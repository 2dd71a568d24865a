"""Id tensors: every element of an activation holds the id of the channel it belongs to
(``-1``: no single channel); :class:`Channels` unites ids that must be kept together."""

from __future__ import annotations

import torch

from .sources import NestError


class Channels:
    """Union-find over channel ids, the spaces that created them and every parameter's ids."""

    def __init__(self):
        self.parent: list[int] = []
        self.spaces: list[tuple[str, int, int]] = []  # (name, first id, size)
        self.dims: dict[str, list[torch.Tensor | None]] = {}  # state key -> per dimension ids (None: whole)
        self.quantum: list[tuple[torch.Tensor, int]] = []  # ids whose kept count must be a multiple of q
        self.convs: dict[str, tuple[int, int, int]] = {}  # grouped conv weight key -> (groups, in, out channels)
        self.norm_groups: dict[str, int] = {}  # GroupNorm weight key -> channels per group
        self.channel_views: list[tuple[str, torch.Tensor, int]] = []  # (what, ids, dim): selections needing every position of dim
        self.splits: list[tuple[str, torch.Tensor]] = []  # (what, ids): views that split channels into dimensions
        self.parts: list[list[torch.Tensor]] = []  # the parts of every channel split
        self.channel_stats: list[tuple[str, torch.Tensor]] = []  # (where, ids): statistics over channels
        self.fixed: set[int] = set()  # ids that must stay (input and output channels)
        self.element_ranges: list[tuple[int, int]] = []  # ids of parameters and buffers used element-wise
        self.shared: set[int] = set()  # element ids broadcast over several channels (kept whole)
        self.attention = False  # a product of two activations (attention) was seen
        self.kept_whole: list[str] = []  # layers nesting does not know, kept whole with their channels

    def new(self, name: str, size: int) -> torch.Tensor:
        base = len(self.parent)
        self.parent.extend(range(base, base + size))
        self.spaces.append((name, base, size))
        return torch.arange(base, base + size)

    def find(self, i: int) -> int:
        parent = self.parent
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:
            parent[i], i = root, parent[i]
        return root

    def union(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a, b = torch.broadcast_tensors(a, b)
        a, b = a.reshape(-1), b.reshape(-1)
        valid = (a >= 0) & (b >= 0) & (a != b)
        n = len(self.parent)
        for key in (a[valid] * n + b[valid]).unique().tolist():  # one key per pair: faster than unique rows
            x, y = divmod(key, n)
            rx, ry = self.find(x), self.find(y)
            if rx != ry:
                self.parent[max(rx, ry)] = min(rx, ry)

    def roots(self) -> torch.Tensor:
        """The class (root id) of every id."""
        return torch.tensor([self.find(i) for i in range(len(self.parent))], dtype=torch.long)


def channel_vector(ids: torch.Tensor, dim: int, where: str, ch: Channels | None = None,
                   shared: bool = False) -> torch.Tensor:
    """The ids along ``dim``, which must not vary along the other dimensions (with ``ch``:
    except by parameter elements, which join their column's channel, :func:`join_rows`; with
    ``shared``, a weight shared by every row: each column's ids join, whatever they are)."""
    vec = ids.movedim(dim, -1).reshape(-1, ids.shape[dim])
    if bool((vec == vec[:1]).all()):
        return vec[0]
    joined = join_rows(ch, vec) if ch is not None else None
    if joined is None and shared and ch is not None:
        joined = vec.amax(0)
        ch.union(vec, joined.expand_as(vec))
    if joined is None:
        raise NestError(f"{where}: its channels are mixed with other dimensions")
    return joined


def one_space(ch: Channels, ids: torch.Tensor) -> bool:
    """Whether every channel id of ``ids`` comes from one layer (the heads of one projection),
    not from several (a class token projected apart beside the patch tokens)."""
    bases = torch.tensor([base for _, base, _ in ch.spaces])
    real = ids[ids >= 0].unique()
    return len(torch.searchsorted(bases, real, right=True).unique()) <= 1


def layer_norm_vector(ch: Channels, ids: torch.Tensor, dim: int, where: str) -> torch.Tensor | None:
    """The channel ids a LayerNorm over ``dim`` normalises, or ``None`` where its rows hold
    different channels of one layer (a query norm over every head): then each row is kept or
    removed whole and the norm's weight stays whole. Rows from several layers (a class token
    projected apart beside the patch tokens) join column by column."""
    try:
        return channel_vector(ids, dim, where, ch)
    except NestError:
        if not one_space(ch, ids):
            return channel_vector(ids, dim, where, ch, shared=True)
        ch.union(ids, ids.amax(dim, keepdim=True))
        return None


def varies(ids: torch.Tensor, dim: int) -> bool:
    return ids.shape[dim] > 1 and not bool((ids == ids.narrow(dim, 0, 1)).all())


def spread(vec: torch.Tensor, shape: torch.Size, dim: int = 1) -> torch.Tensor:
    """``vec`` along ``dim`` of a tensor of ``shape`` (a broadcast view)."""
    view = [1] * len(shape)
    view[dim] = -1
    return vec.view(view).expand(shape)


def meta_like(x):
    return torch.empty(x.shape, device="meta") if isinstance(x, torch.Tensor) else x


def _meta_args(args):
    return torch.utils._pytree.tree_map(meta_like, args)


def element_mask(ch, ids: torch.Tensor) -> torch.Tensor:
    """Whether each id belongs to a parameter or buffer used element-wise."""
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for base, size in ch.element_ranges:
        mask |= (ids >= base) & (ids < base + size)
    return mask


def roots_of(ch, ids: torch.Tensor) -> torch.Tensor:
    """The class (current union-find root) of each id; ``-1`` stays."""
    values, inverse = ids.unique(return_inverse=True)
    return torch.tensor([ch.find(v) if v >= 0 else -1 for v in values.tolist()], dtype=torch.long)[inverse]


def join_rows(ch, vec: torch.Tensor) -> torch.Tensor | None:
    """``vec`` (rows x channels): the channel ids when its rows differ only by parameter
    elements (a class token's row beside the patches' rows); the elements join their column's
    channel. ``None`` where two rows hold different channels in one column."""
    rows = torch.unique(vec, dim=0)
    elements = element_mask(ch, rows)
    roots = torch.where(elements | (rows < 0), -1, roots_of(ch, rows))
    top = roots.amax(0)
    low = torch.where(roots >= 0, roots, torch.iinfo(torch.long).max).amin(0)
    if not bool(((top == low) | (top < 0)).all()):
        return None
    rep = torch.where(top >= 0, top, rows.amax(0))
    ch.union(rows, rep.expand_as(rows))
    return rep

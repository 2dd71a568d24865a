"""A nesting plan: channel groups, their prefix widths per tier, and the skippable blocks.

A *group* is a set of channel spaces tied by element-wise operations (a stage's residual
stream, a block's inner width, a squeeze-excitation's squeeze). Its classes are ordered by
their first appearance, and a tier keeps the first ``k`` of them, ``k`` by the width rule
(:func:`~nefl_zoo.models.base.scale_width`, rounded up to whole groups of a grouped
convolution): a narrower tier's channels are a prefix of a wider tier's. A channel split
(``split``/``chunk``) cuts a group into parts, each nested the same way on its own. Groups holding
input or output channels keep them all. A tensor dimension that mixes groups (a concatenation, a flatten
into a linear layer) keeps a non-prefix set of positions, which the slice map records as an
index tensor. A tier that would leave a layer no channel (a group that a concatenation ties
together nests its newest layer's channels last) is refused, naming the least gamma_W that works.
The analysis runs at ``ANALYSIS_SIZE`` or less, else at ``img_size`` where shapes depend on it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..models.base import scale_width
from .channels import ShapeError, analyse
from .ids import Channels
from .residual import Block, find_blocks
from .sources import NestError, Source, construct, trace

ANALYSIS_SIZE = 128  # largest input height/width analysed first (img_size where shapes depend on it)


@dataclass
class NestPlan:
    """What the analysis found for one source network (shared by all its tiers)."""

    source: Source
    in_chans: int
    graph: "torch.fx.Graph"
    channels: Channels
    roots: torch.Tensor  # class of every id
    group_of: torch.Tensor  # group of every class root (-1 for non-roots)
    group_parts: list[list[torch.Tensor]]  # per group its classes in order, by the parts channel splits cut
    group_quantum: list[int]
    group_fixed: list[bool]
    dims: dict[str, list[torch.Tensor | None]]  # state key -> per dimension ids (None: whole)
    blocks: list[Block]  # skippable residual blocks, in order, with (stage, index)
    unskippable: list[str]  # residual adds that cannot be skipped, and why
    stage_modules: list[str]
    stage_reductions: list[int]
    classifier: str
    param_shapes: dict[str, tuple[int, ...]]  # every parameter of the full network (steps excluded)
    analysis_s: float
    index_cache: dict = field(default_factory=dict)
    tried: set = field(default_factory=set)  # tiers (kept ids, steps) whose first forward ran on meta
    constants: dict = field(default_factory=dict)  # tensors the tracer named (read from a list or a global)

    @property
    def inexact_norms(self) -> list[str]:
        """Norms whose statistics span channels a tier narrows (GroupNorm, a CNN's LayerNorm):
        the tier nests them, but not as the global model with those channels zeroed."""
        return [where for where, ids in self.channels.channel_stats
                if len(ids) and not self.group_fixed[int(self.group_of[self.roots[ids[0]]])]]

    @property
    def stage_depths(self) -> tuple[int, ...]:
        return tuple(sum(1 for b in self.blocks if b.stage == s) for s in range(len(self.stage_modules)))

    def keep(self, gamma_w: float, multiple: int) -> torch.Tensor:
        """Whether each id is kept, for a tier of width ratio ``gamma_w``: in every part of every
        group (a group is one part unless a channel split cuts it) the first ``k`` classes, ``k``
        by the width rule rounded up to the group's quantum (whole groups of a grouped conv)."""
        kept_root = torch.zeros(len(self.roots), dtype=torch.bool)
        for parts, q, fixed in zip(self.group_parts, self.group_quantum, self.group_fixed):
            for classes in parts:
                c = len(classes)
                k = c if fixed or gamma_w >= 1 else min(c, math.ceil(scale_width(c, gamma_w, multiple) / q) * q)
                kept_root[classes[:k]] = True
        return kept_root[self.roots]

    def index(self, key: str, keep: torch.Tensor) -> tuple:
        """Per dimension of state entry ``key``: ``None`` (all of it), a prefix ``slice`` or the
        kept positions (a LongTensor); ``()`` for entries no channel reaches."""
        out = []
        for d, ids in enumerate(self.dims.get(key, ())):
            if ids is None:
                out.append(None)
                continue
            pos = torch.nonzero(keep[ids]).flatten()
            out.append(slice(0, len(pos)) if torch.equal(pos, torch.arange(len(pos))) else pos)
        return tuple(out)

    def _empty(self, keep: torch.Tensor) -> tuple[str, int] | None:
        """The first state entry with a dimension that channels reach but ``keep`` leaves empty."""
        for key, dims in self.dims.items():
            for ids in dims:
                if ids is not None and len(ids) and not bool(keep[ids].any()):
                    return key, len(ids)
        return None

    def check_widths(self, keep: torch.Tensor, gamma_w: float, multiple: int) -> None:
        """No dimension that channels reach is left without any (a layer of zero width): else
        refused, naming the tensor and the least gamma_W (0.01 grid) that leaves none empty."""
        empty = self._empty(keep)
        if empty is None:
            return
        lo, hi = math.floor(gamma_w * 100), 100
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._empty(self.keep(mid / 100, multiple)) is None else (mid, hi)
        raise NestError(f"{empty[0]}: gamma_W {gamma_w} keeps none of its {empty[1]} channels (its channel group "
                        f"nests them last); the least gamma_W that keeps some of every layer is {hi / 100}")

    def check_groups(self, keep: torch.Tensor) -> None:
        """Kept channels of every grouped convolution are whole leading groups, and no view
        splits narrowed channels (a channel shuffle mixes them across the split)."""
        for what, ids, dim in self.channels.channel_views:
            if not bool(kept_ids(keep, ids).movedim(dim, 0).reshape(ids.shape[dim], -1).any(1).all()):
                raise NestError(f"{what} of narrowed channels")
        for what, grid in self.channels.splits:
            if split_sizes(keep, grid) is None:
                raise NestError(f"{what} of narrowed channels")
        for key, (groups, cin, cout) in self.channels.convs.items():
            if cin == groups:  # depthwise: any kept set
                continue
            pos = torch.nonzero(keep[self.dims[key][0]]).flatten()
            if not torch.equal(pos, torch.arange(len(pos))) or len(pos) % (cout // groups):
                raise NestError(f"{key}: the kept channels of this grouped convolution are not whole leading groups")


def kept_ids(keep: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Whether each of ``ids`` stays in the tier (``-1``, no single channel, always does)."""
    return keep[ids.clamp(min=0)] | (ids < 0)


def split_sizes(keep: torch.Tensor, grid: torch.Tensor) -> list[int] | None:
    """The kept size of each dimension of a view that splits channels into several (heads),
    or ``None`` where the kept channels are not every combination of kept positions per
    dimension (a view of them would scramble them). Positions holding no channel (``-1``,
    padding) always stay."""
    real = grid >= 0
    kept = keep[grid.clamp(min=0)] & real
    box, sizes = real.clone(), []
    for d in range(grid.ndim):
        along = lambda t: t.movedim(d, 0).reshape(grid.shape[d], -1)  # noqa: E731
        stays = along(kept).any(1) | ~along(real).any(1)
        sizes.append(int(stays.sum()))
        box &= stays.view([-1 if i == d else 1 for i in range(grid.ndim)])
    return sizes if torch.equal(box, kept) else None


def _elements_dims(key: str, ids: torch.Tensor, roots: torch.Tensor, sizes: torch.Tensor,
                   shared: set[int]) -> list[torch.Tensor | None]:
    """Per dimension ids of a parameter used element-wise (layer scale, position embedding);
    whole where no channel reaches it or it is shared by several channels (an attention mask)."""
    classes = roots[ids]
    if bool((sizes[classes] == 1).all()) or not shared.isdisjoint(ids.flatten().tolist()):
        return [None] * ids.ndim
    varying = [d for d in range(ids.ndim) if ids.shape[d] > 1 and not bool((classes == classes.narrow(d, 0, 1)).all())]
    if len(varying) > 1:
        raise NestError(f"{key}: a parameter whose elements belong to channels along {len(varying)} dimensions")
    dims: list[torch.Tensor | None] = [None] * ids.ndim
    for d in varying:
        dims[d] = ids.movedim(d, -1).reshape(-1, ids.shape[d])[0]
    return dims


def _groups(ch: Channels, roots: torch.Tensor):
    n = len(roots)
    space_of = torch.empty(n, dtype=torch.long)
    for s, (_, base, size) in enumerate(ch.spaces):
        space_of[base:base + size] = s
    parent = list(range(len(ch.spaces)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in torch.unique(torch.stack([space_of, space_of[roots]], 1), dim=0).tolist():
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    group_of_space = torch.tensor([find(s) for s in range(len(ch.spaces))])
    gid = group_of_space[space_of[roots]]  # group of each id (by its root's space)
    order = {}
    for g in gid.tolist():
        order.setdefault(g, len(order))
    gid = torch.tensor([order[g] for g in gid.tolist()]) if n else gid
    group_classes = []
    for g in range(len(order)):
        ids_in = torch.nonzero(gid == g).flatten()
        cls = roots[ids_in]
        seen, ordered = set(), []
        for r in cls.tolist():
            if r not in seen:
                seen.add(r)
                ordered.append(r)
        group_classes.append(torch.tensor(ordered, dtype=torch.long))
    group_of = torch.full((n,), -1, dtype=torch.long)
    for g, cls in enumerate(group_classes):
        group_of[cls] = g
    return group_of, group_classes


def make_plan(source: Source, in_chans: int, img_size: int) -> NestPlan:
    """Trace ``source`` on the meta device and analyse its channels and residual blocks; any
    error is one line naming the model."""
    try:
        return _make_plan(source, in_chans, img_size)
    except NestError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever building the network on the meta device does
        raise NestError(f"{source.name}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]) from None


def _fixed_size(source: Source, model) -> int | None:
    """The input size a network requires: timm's ``fixed_input_size`` models, torchvision's ViTs."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if cfg.get("fixed_input_size") and cfg.get("input_size"):
        return cfg["input_size"][-1]
    if not source.name.startswith("torchvision:"):
        return None
    size = 224 if type(model).__name__ == "MaxVit" else getattr(model, "image_size", None)  # MaxViT: partitions of 224
    return size if isinstance(size, int) else None


def _analysed(gm, source: Source, in_chans: int, img_size: int, fixed: int | None):
    """The channel analysis and every state entry's ids, at ``ANALYSIS_SIZE`` (or less), else
    at ``img_size`` where a network's shapes depend on the size; a fixed-size network (timm's
    ``fixed_input_size``) only at its own size."""
    if fixed and fixed != img_size:
        raise NestError(f"{source.name}: a network of fixed input size {fixed} (position embeddings or windows), "
                        f"but img_size {img_size}")
    sizes = list(dict.fromkeys([fixed or min(img_size, ANALYSIS_SIZE), img_size]))
    for size in sizes:
        try:
            ch = analyse(gm, torch.Size((1, in_chans, size, size)), source.name)
            return size, ch, _state_dims(gm, ch)
        except ShapeError:
            if size == sizes[-1]:
                raise


def _state_dims(gm, ch: Channels) -> dict[str, list[torch.Tensor | None]]:
    roots = ch.roots()
    sizes = torch.bincount(roots, minlength=len(roots))
    dims = {}
    for key, value in {**dict(gm.named_parameters()), **dict(gm.named_buffers())}.items():  # non-persistent too
        spec = ch.dims.get(key)
        if spec == ["elements"]:
            base = next(b for name, b, _ in ch.spaces if name == key)
            dims[key] = _elements_dims(key, torch.arange(base, base + value.numel()).view(value.shape), roots, sizes, ch.shared)
        elif spec is not None:
            for d, ids in enumerate(spec):
                if ids is not None and len(ids) != value.shape[d]:
                    raise ShapeError(f"{key}: dimension {d} has {value.shape[d]} entries but {len(ids)} channels reach "
                                     "it (a flatten whose size depends on the input size)")
            dims[key] = spec
    return dims


def _traced_and_analysed(source: Source, model, in_chans: int, img_size: int, fixed: int | None):
    """Trace with timm's whole ("notrace") modules and analyse; where one of them is refused or
    kept whole, trace through them too and keep that analysis if it succeeds."""
    gm, refused, found = trace(source, model), None, None
    try:
        found = _analysed(gm, source, in_chans, img_size, fixed)
    except NestError as exc:
        refused = exc
    if source.leaf_types and (found is None or found[1].kept_whole):
        try:
            inner = trace(source, model, leaves=False)
            return inner, _analysed(inner, source, in_chans, img_size, fixed)
        except NestError as exc:  # what stops nesting inside the whole module says more, where it was traced
            if found is None and "cannot trace" not in str(exc):
                refused = exc
    if found is None:
        raise refused
    return gm, found


def _make_plan(source: Source, in_chans: int, img_size: int) -> NestPlan:
    start = time.perf_counter()
    with torch.device("meta"):
        model = construct(source)
    fixed = _fixed_size(source, model)
    gm, (size, ch, dims) = _traced_and_analysed(source, model, in_chans, img_size, fixed)
    roots = ch.roots()
    group_of, group_classes = _groups(ch, roots)
    quantum = [1] * len(group_classes)
    for vec, q in ch.quantum:
        for g in set(group_of[roots[vec]].tolist()):
            quantum[g] = math.lcm(quantum[g], q)
    fixed_roots = {int(roots[i]) for i in ch.fixed}
    for name, base, count in ch.spaces:  # parameters kept whole (shared, or reached by no channel) keep their ids
        if ch.dims.get(name) == ["elements"] and name in dims and all(d is None for d in dims[name]):
            fixed_roots |= set(roots[base:base + count].unique().tolist())
    if ch.attention:  # a transformer's stream keeps its width: heads and MLP units nest, exactly
        fixed_roots |= {int(r) for _, ids in ch.channel_stats for r in roots[ids].unique()}
    group_fixed = [False] * len(group_classes)
    for r in fixed_roots:
        group_fixed[int(group_of[r])] = True
    blocks, unskippable, stage_modules, reductions = find_blocks(gm, size)
    classifier = _classifier(gm, dims, fixed_roots, roots)
    return NestPlan(source, in_chans, gm.graph, ch, roots, group_of, _parts(ch, roots, group_classes), quantum, group_fixed, dims,
                    blocks, unskippable, stage_modules, reductions, classifier,
                    {k: tuple(p.shape) for k, p in gm.named_parameters()}, time.perf_counter() - start,
                    constants={n.target: gm.get_buffer(n.target) for n in gm.graph.nodes
                               if n.op == "get_attr" and n.target.startswith("_tensor_constant")})


def _parts(ch: Channels, roots: torch.Tensor, group_classes: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each group's classes cut into the parts of the channel splits that cut it (in order; the
    classes no split reaches form one part)."""
    part_of = torch.full((len(roots),), -1, dtype=torch.long)
    for split in ch.parts:
        for seg in split:
            cls = roots[seg]
            fresh = part_of[cls] < 0
            part_of[cls[fresh]] = int(part_of.max()) + 1
    out = []
    for classes in group_classes:
        parts: dict[int, list[int]] = {}
        for c, p in zip(classes.tolist(), part_of[classes].tolist()):
            parts.setdefault(p, []).append(c)
        out.append([torch.tensor(v, dtype=torch.long) for v in parts.values()])
    return out


def _classifier(gm, dims, fixed_roots, roots) -> str:
    """The module whose weight produces the output classes."""
    owner = ""
    for key, spec in dims.items():
        if key.endswith("weight") and spec and spec[0] is not None and len(spec) >= 2 and spec[1] is not None:
            if int(roots[spec[0][0]]) in fixed_roots:
                owner = key.rpartition(".")[0]
    return owner


_PLANS: dict[tuple, NestPlan] = {}


def cached_plan(source_key: tuple, in_chans: int, img_size: int, make_source) -> NestPlan:
    """One plan per (source, in_chans, image size), kept for the process: a network's tiers
    and its full model share it (and the indices its tiers recorded)."""
    key = (source_key, in_chans, img_size)
    if key not in _PLANS:
        _PLANS[key] = make_plan(make_source(), in_chans, img_size)
    return _PLANS[key]


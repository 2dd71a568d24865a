"""Slice maps: where every tensor of a submodel lives in the global state.

The global state is a flat ``dict[str, Tensor]``. Consistent (shared) tensors are stored once
under their model key (``layer1.0.conv1.weight``) at full size; inconsistent tensors (per-tier
step sizes and norms) are stored per tier under ``KEY@TIER`` at the tier's size. A
:class:`SliceEntry` says, for one submodel tensor, which global key holds it and which index
region (a ``slice`` or an index tensor per dimension) it occupies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch

TIER_SEP = "@"


def tier_key(key: str, tier: str) -> str:
    """Global key of a per-tier (inconsistent) tensor."""
    return f"{key}{TIER_SEP}{tier}"


def split_tier_key(global_key: str) -> tuple[str, str | None]:
    """``(model_key, tier)`` of a global key; ``tier`` is ``None`` for shared tensors."""
    key, _, tier = global_key.partition(TIER_SEP)
    return key, tier or None


def region_key(index: tuple) -> tuple:
    """What indexes the region ``index`` (per dimension a ``slice`` or a 1-D LongTensor) of a
    tensor: the slices themselves, or an open mesh of index tensors, so that ``t[key]`` has one
    dimension per entry of ``index``."""
    if all(isinstance(i, slice) for i in index):
        return index
    n = len(index)
    return tuple((torch.arange(i.start or 0, i.stop) if isinstance(i, slice) else i).view([-1 if d == k else 1 for k in range(n)])
                 for d, i in enumerate(index))


@dataclass(frozen=True, eq=False)
class SliceEntry:
    """One submodel tensor: its global key, its index region and its kind."""

    global_key: str
    index: tuple  # per dimension a ``slice`` or a 1-D LongTensor; () = the whole tensor
    shape: tuple[int, ...]
    kind: str  # "weight", "norm" or "steps"
    consistent: bool
    _key: tuple = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_key", region_key(self.index))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The region of ``tensor`` (a view when the index is made of slices)."""
        return tensor[self._key]

    def put_(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` into the region of ``tensor``."""
        tensor[self._key] = value

    def add_(self, tensor: torch.Tensor, value: torch.Tensor | float) -> None:
        """Add ``value`` to the region of ``tensor``."""
        tensor[self._key] += value

    def fits(self, full_shape: torch.Size) -> bool:
        """Whether the region lies inside a tensor of ``full_shape``."""
        if len(self.index) not in (0, len(full_shape)):
            return False
        if not self.index:
            return tuple(full_shape) == self.shape
        for i, n, m in zip(self.index, full_shape, self.shape):
            if isinstance(i, slice):
                start, stop = i.start or 0, i.stop
                if start < 0 or stop > n or stop - start != m:
                    return False
            elif i.numel() != m or int(i.min()) < 0 or int(i.max()) >= n:
                return False
        return True


class SliceMap(Mapping[str, SliceEntry]):
    """Submodel key -> :class:`SliceEntry`, for every parameter and buffer of a submodel."""

    def __init__(self, entries: dict[str, SliceEntry]):
        self._entries = entries

    def __getitem__(self, key: str) -> SliceEntry:
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def numel(self, kinds: tuple[str, ...] | None = None) -> int:
        """Elements covered by the map (optionally of some kinds only)."""
        return sum(e.numel for e in self._entries.values() if kinds is None or e.kind in kinds)

    def extract(self, global_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gather a submodel state dict (fresh tensors) from the global state."""
        return {k: e.gather(global_state[e.global_key]).clone() for k, e in self._entries.items()}

    def scatter_(self, global_state: Mapping[str, torch.Tensor], sub_state: Mapping[str, torch.Tensor]) -> None:
        """Write a submodel state dict back into the global state, in place."""
        for k, e in self._entries.items():
            e.put_(global_state[e.global_key], sub_state[k].to(global_state[e.global_key].dtype))

    def check(self, global_shapes: Mapping[str, torch.Size]) -> None:
        """Raise ``ValueError`` if an entry names a missing key or leaves its tensor."""
        for k, e in self._entries.items():
            if e.global_key not in global_shapes:
                raise ValueError(f"{k}: global key {e.global_key!r} does not exist")
            if not e.fits(global_shapes[e.global_key]):
                raise ValueError(f"{k}: region {e.index} does not fit {tuple(global_shapes[e.global_key])}")

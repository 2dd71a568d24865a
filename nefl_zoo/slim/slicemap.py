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
    """Global key of a per-tier (inconsistent) tensor.

    Args:
        key: the tensor's key in the model (``bn1.weight``).
        tier: the tier's name.

    Returns:
        ``KEY@TIER``.

    Examples:
        >>> from nefl_zoo.slim import tier_key
        >>> tier_key("bn1.weight", "g0.2")
        'bn1.weight@g0.2'
    """
    return f"{key}{TIER_SEP}{tier}"


def split_tier_key(global_key: str) -> tuple[str, str | None]:
    """``(model_key, tier)`` of a global key; ``tier`` is ``None`` for shared tensors.

    Args:
        global_key: a key of the global state.

    Returns:
        The model key and the tier, or ``None`` for a shared tensor.

    Examples:
        >>> from nefl_zoo.slim import split_tier_key
        >>> split_tier_key("bn1.weight@g0.2"), split_tier_key("conv1.weight")
        (('bn1.weight', 'g0.2'), ('conv1.weight', None))
    """
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
    """One submodel tensor: its global key, its index region and its kind.

    Attributes:
        global_key: the key of the global tensor that holds it (``KEY@TIER`` for a per-tier
            tensor).
        index: per dimension, a ``slice`` or a 1-D index tensor; ``()`` is the whole tensor.
        shape: the submodel tensor's shape.
        kind: ``weight``, ``norm`` or ``steps``.
        consistent: whether the tensor is shared by every tier.

    Examples:
        >>> import nefl_zoo as nz
        >>> compiled = nz.compile_spec(nz.load_spec("specs/resnet20/nefl-w.yaml"))
        >>> entry = compiled["g0.2"].slice_map["conv1.weight"]
        >>> entry.global_key, entry.index[0], entry.shape, entry.consistent
        ('conv1.weight', slice(0, 7, None), (7, 1, 3, 3), True)
    """

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
        """The region of ``tensor`` (a view when the index is made of slices).

        Args:
            tensor: the global tensor.

        Returns:
            Its region, of the entry's ``shape``.
        """
        return tensor[self._key]

    def put_(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` into the region of ``tensor``.

        Args:
            tensor: the global tensor, changed in place.
            value: a tensor of the entry's ``shape``.
        """
        tensor[self._key] = value

    def add_(self, tensor: torch.Tensor, value: torch.Tensor | float) -> None:
        """Add ``value`` to the region of ``tensor``.

        Args:
            tensor: the global tensor, changed in place.
            value: a tensor of the entry's ``shape``, or a number.
        """
        tensor[self._key] += value

    def fits(self, full_shape: torch.Size) -> bool:
        """Whether the region lies inside a tensor of ``full_shape``.

        Args:
            full_shape: the global tensor's shape.

        Returns:
            ``True`` when every index of the region is inside it and the region's shape is
            the entry's.
        """
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
    """Submodel key -> :class:`SliceEntry`, for every parameter and buffer of a submodel.

    A read-only mapping; :class:`~nefl_zoo.slim.CompiledTier` holds one per tier.

    Args:
        entries: the entries, by the submodel's state-dict key.

    Examples:
        >>> import nefl_zoo as nz
        >>> compiled = nz.compile_spec(nz.load_spec("specs/resnet20/nefl-w.yaml"))
        >>> compiled["g0.2"].slice_map.numel()
        53401
    """

    def __init__(self, entries: dict[str, SliceEntry]):
        self._entries = entries

    def __getitem__(self, key: str) -> SliceEntry:
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def numel(self, kinds: tuple[str, ...] | None = None) -> int:
        """Elements covered by the map (optionally of some kinds only).

        Args:
            kinds: count only entries of these kinds (``weight``, ``norm``, ``steps``).

        Returns:
            The number of elements: what a client of the tier receives.
        """
        return sum(e.numel for e in self._entries.values() if kinds is None or e.kind in kinds)

    def extract(self, global_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gather a submodel state dict (fresh tensors) from the global state.

        Args:
            global_state: the global state.

        Returns:
            The submodel's state dict.
        """
        return {k: e.gather(global_state[e.global_key]).clone() for k, e in self._entries.items()}

    def scatter_(self, global_state: Mapping[str, torch.Tensor], sub_state: Mapping[str, torch.Tensor]) -> None:
        """Write a submodel state dict back into the global state, in place.

        Args:
            global_state: the global state, changed in place.
            sub_state: the submodel's state dict.
        """
        for k, e in self._entries.items():
            e.put_(global_state[e.global_key], sub_state[k].to(global_state[e.global_key].dtype))

    def check(self, global_shapes: Mapping[str, torch.Size]) -> None:
        """Raise ``ValueError`` if an entry names a missing key or leaves its tensor.

        Args:
            global_shapes: the global state's shapes
                (:meth:`~nefl_zoo.slim.CompiledSpec.global_shapes`).

        Raises:
            ValueError: an entry's global key is missing, or its region does not fit.
        """
        for k, e in self._entries.items():
            if e.global_key not in global_shapes:
                raise ValueError(f"{k}: global key {e.global_key!r} does not exist")
            if not e.fits(global_shapes[e.global_key]):
                raise ValueError(f"{k}: region {e.index} does not fit {tuple(global_shapes[e.global_key])}")

"""ShuffleNetV2 (x1.0, x0.5) with torchvision's names, nested by width through its channel shuffle.

A unit splits its input in two halves (stride 1: the first half passes, the second feeds
``branch2``; stride 2: ``branch1`` and ``branch2`` both read all of it), concatenates the two
results and shuffles them (output channel ``2i`` is the first half's ``i``, ``2i + 1`` the
second's). A slim tier is the same class with ``b`` channels per half instead of ``B``. It
computes exactly what the global model computes with the other channels' contributions zeroed
when every slim channel stands for a full channel on the same side of every later split: the
kept outputs of ``branch1`` / ``branch2`` are chosen band by band (:func:`_select`), and the
stream's channels then sit at known, non-prefix full positions (:func:`stream_maps`), which
the slice map records as index tensors (:meth:`ShuffleNetV2.slice_index`). Branch-inner
channels, the stem and the last convolution are prefixes. Not every ``b`` admits such a choice;
a tier takes the largest that does, at most the width rule's (:func:`branch_width`).

The units have no shortcut that could stand in for them, so no block can be skipped (no step
sizes): the family nests by width only.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from torch import nn

from .base import Index, NestedNet, Steps, resolve_steps, scale_width
from .mobile import EdgeArgs, check_fixed_blocks
from .registry import register_model

STEM, HEAD = 24, 1024
DEPTHS = (4, 8, 4)
NO_SKIP = "a channel split and shuffle; ShuffleNetV2 nests by width only"


def _band(x: float, n: int, depth: int) -> int:
    """How many of the next ``depth`` halvings of ``n`` keep position ``x`` below them."""
    s = 0
    while s < depth and x * 2 ** (s + 1) < n:
        s += 1
    return s


@functools.cache
def _select(b: int, full: int, depth: int, odd: bool) -> tuple[int, ...] | None:
    """Full channels (of ``full``) for the ``b`` outputs of a branch whose shuffled positions are
    even (``branch1``) or ``odd`` (``branch2``), so that each stays on the same side as its
    slim copy through ``depth`` more splits; ``None`` when there is no such choice."""
    off = 0.5 if odd else 0.0
    pool: dict[int, list[int]] = {}
    for p in range(full):
        pool.setdefault(_band(p + off, full, depth), []).append(p)
    out = []
    taken: dict[int, int] = {}
    for i in range(b):
        band = _band(i + off, b, depth)
        k = taken.get(band, 0)
        if k >= len(pool.get(band, ())):
            return None
        out.append(pool[band][k])
        taken[band] = k + 1
    return tuple(out)


def branch_width(full: int, depth: int, gamma_w: float, multiple: int) -> int:
    """Channels per half of a stage of ``depth`` units: the width rule's, else the largest
    smaller one (a multiple of ``multiple`` where one exists) that nests exactly."""
    rule = scale_width(full, gamma_w, multiple)
    feasible = [b for b in range(rule, 0, -1) if _select(b, full, depth - 1, False) and _select(b, full, depth - 1, True)]
    aligned = [b for b in feasible if b == rule or b % multiple == 0]
    return (aligned or feasible)[0]


@functools.cache
def stream_maps(b: int, full: int, depth: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None], torch.Tensor]:
    """For a stage of ``depth`` units with ``b`` of ``full`` channels per half: per unit, the
    kept outputs of ``branch2`` (full indices) and the full indices of the half ``branch2``
    reads (stride-1 units; ``None`` for unit 0); and the full stream channel of every slim
    channel the stage outputs."""
    kept_outs, reads, stream = [], [], None
    for j in range(depth):
        kept = torch.tensor(_select(b, full, depth - 1 - j, True))
        if stream is None:  # unit 0: the first half is branch1's output
            passed = torch.tensor(_select(b, full, depth - 1, False))
            reads.append(None)
        else:  # the slim split must cut the full stream where the full split does
            assert bool((stream[:b] < full).all() and (stream[b:] >= full).all()), "a split crosses the halves"
            passed = stream[:b]
            reads.append(stream[b:] - full)
        stream = torch.stack([2 * passed, 2 * kept + 1], 1).reshape(-1)  # concatenate, then shuffle
        kept_outs.append(kept)
    return kept_outs, reads, stream


def channel_shuffle(x: torch.Tensor) -> torch.Tensor:
    """Interleave the two halves of the channels (torchvision's ``channel_shuffle(x, 2)``)."""
    n, c, h, w = x.shape
    return x.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)


def _conv_bn(cin: int, cout: int, k: int = 1, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]


class ShuffleUnit(nn.Module):
    """torchvision's ShuffleNetV2 ``InvertedResidual``; ``inner``: branch2's hidden width."""

    step_names = ()

    def __init__(self, cin: int, half: int, inner: int, stride: int):
        super().__init__()
        self.stride = stride
        if stride > 1:
            self.branch1 = nn.Sequential(*_conv_bn(cin, cin, 3, stride, groups=cin), *_conv_bn(cin, half), nn.ReLU())
        self.branch2 = nn.Sequential(
            *_conv_bn(cin if stride > 1 else half, inner), nn.ReLU(),
            *_conv_bn(inner, inner, 3, stride, groups=inner), *_conv_bn(inner, half), nn.ReLU(),
        )

    def branch_parameters(self):
        """All of the unit (never removed)."""
        return self.named_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out)


class ShuffleNetV2(NestedNet):
    """A nested-ready ShuffleNetV2: stem, max-pool, ``stage2..4`` of 4/8/4 units, ``conv5``, ``fc``.

    Args:
        stage_channels: output channels of the three stages (full model).
        gamma_w, channel_multiple: width ratio and rounding (:func:`branch_width`).
        steps: one list per stage, every entry nonzero (no unit can be skipped).
    """

    def __init__(
        self,
        stage_channels: tuple[int, int, int],
        num_classes: int = 1000,
        in_chans: int = 3,
        gamma_w: float = 1.0,
        steps: Steps | None = None,
        img_size: int = 224,
        channel_multiple: int = 8,
    ):
        super().__init__()
        resolve_steps(steps, DEPTHS)
        check_fixed_blocks(steps, self.fixed_blocks(), "shufflenet_v2", NO_SKIP)
        self.stage_depths, self.stage_names, self.num_classes = DEPTHS, ("stage2", "stage3", "stage4"), num_classes
        self.halves = tuple(c // 2 for c in stage_channels)
        self.default_cfg = {"classifier": "fc", "first_conv": "conv1.0", "input_size": (in_chans, img_size, img_size)}
        stem = scale_width(STEM, gamma_w, channel_multiple)
        self.conv1 = nn.Sequential(*_conv_bn(in_chans, stem, 3, 2), nn.ReLU())
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin, self.feature_info = stem, []
        for i, (name, full, depth) in enumerate(zip(self.stage_names, self.halves, DEPTHS)):
            half = branch_width(full, depth, gamma_w, channel_multiple)
            inner = scale_width(full, gamma_w, channel_multiple)
            units = [ShuffleUnit(cin, half, inner, 2)] + [ShuffleUnit(2 * half, half, inner, 1) for _ in range(depth - 1)]
            self.add_module(name, nn.Sequential(*units))
            self.feature_info.append({"module": name, "num_chs": 2 * half, "reduction": 8 * 2**i})
            cin = 2 * half
        self.num_features = scale_width(HEAD, gamma_w, channel_multiple)
        self.conv5 = nn.Sequential(*_conv_bn(cin, self.num_features), nn.ReLU())
        self.fc = nn.Linear(self.num_features, num_classes)

    def fixed_blocks(self) -> set[tuple[int, int]]:
        return set(ShuffleNetArgs.FIXED)

    def forward_stem(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool(self.conv1(x))

    def forward_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last 1x1 convolution (``conv5``)."""
        return self.conv5(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x.mean([2, 3])  # global pooling, as torchvision
        return x if pre_logits else self.fc(x)

    def _stream(self, stage: int, channels: int) -> Index:
        """Full channels of a slim stream of ``channels`` entering stage ``stage`` (3: conv5)."""
        if stage == 0:
            return slice(0, channels)
        s = stage - 1
        return stream_maps(channels // 2, self.halves[s], DEPTHS[s])[2]

    def slice_index(self, key: str, slim_shape: torch.Size, full_shape: torch.Size) -> Index:
        """Stream channels sit where :func:`stream_maps` puts them; the rest are prefixes."""
        index = list(super().slice_index(key, slim_shape, full_shape))
        parts = key.split(".")
        if parts[0] == "conv5" and key.endswith("0.weight"):
            index[1] = self._stream(3, slim_shape[1])
        if parts[0] not in self.stage_names or not index:  # outside the stages, or a counter
            return tuple(index)
        s, j, branch, layer = self.stage_names.index(parts[0]), int(parts[1]), parts[2], int(parts[3])
        if branch == "branch1":
            if layer in (0, 1):  # depthwise over the stage input, its norm
                index[0] = self._stream(s, slim_shape[0])
            else:  # the 1x1 to the first half and its norm
                index[0] = torch.tensor(_select(slim_shape[0], self.halves[s], DEPTHS[s] - 1, False))
                if layer == 2:
                    index[1] = self._stream(s, slim_shape[1])
        elif layer == 0:  # branch2's first 1x1 reads the stage input (unit 0) or the second half
            if j == 0:
                index[1] = self._stream(s, slim_shape[1])
            else:
                index[1] = stream_maps(slim_shape[1], self.halves[s], DEPTHS[s])[1][j]
        elif layer in (5, 6):  # branch2's output 1x1 and its norm
            index[0] = stream_maps(slim_shape[0], self.halves[s], DEPTHS[s])[0][j]
        return tuple(index)


class ShuffleNetArgs(EdgeArgs):
    """Arguments of the ShuffleNetV2s (3 stages of 4/8/4 units, none skippable)."""

    FIXED: ClassVar = frozenset((s, j) for s, d in enumerate(DEPTHS) for j in range(d))
    MODEL: ClassVar = "shufflenet_v2"
    WHY: ClassVar = NO_SKIP


@register_model(args=ShuffleNetArgs)
def shufflenet_v2_x1_0(**kwargs) -> ShuffleNetV2:
    """ShuffleNetV2 x1.0 (torchvision's, 2.3M parameters at 1000 classes); width nesting only."""
    return ShuffleNetV2((116, 232, 464), **kwargs)


@register_model(args=ShuffleNetArgs)
def shufflenet_v2_x0_5(**kwargs) -> ShuffleNetV2:
    """ShuffleNetV2 x0.5 (torchvision's, 1.4M parameters at 1000 classes); width nesting only."""
    return ShuffleNetV2((48, 96, 192), **kwargs)

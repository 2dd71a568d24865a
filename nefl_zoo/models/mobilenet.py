"""MobileNetV2 and MobileNetV3 (large, small) with torchvision's names, nested by width and depth.

The tables below are the full architectures of torchvision's ``mobilenet_v2`` and
``mobilenet_v3_large`` / ``_small`` (width multiplier 1), grouped into stages of equal output
channels; :class:`~nefl_zoo.models.mobile.InvertedResidualNet` builds them (``features.{n}``,
one flat Sequential, as torchvision).
"""

from __future__ import annotations

from typing import ClassVar

from .mobile import BlockCfg, EdgeArgs, InvertedResidualNet, Style, fixed_blocks
from .registry import register_model


def _v2_stages() -> list[list[BlockCfg]]:
    """MobileNetV2's (expansion t, channels c, blocks n, stride s) table as blocks."""
    table = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    stages, cin = [], 32
    for t, c, n, s in table:
        stage = []
        for j in range(n):
            stage.append(BlockCfg(cin, round(cin * t), c, 3, s if j == 0 else 1, act="relu6"))
            cin = c
        stages.append(stage)
    return stages


def _v3(rows: list[tuple], boundaries: list[int]) -> list[list[BlockCfg]]:
    """Rows (cin, kernel, hidden, cout, squeeze, activation, stride) cut into stages at ``boundaries``."""
    blocks = [BlockCfg(cin, hid, cout, k, stride, se, act) for cin, k, hid, cout, se, act, stride in rows]
    return [blocks[a:b] for a, b in zip([0, *boundaries], [*boundaries, len(blocks)])]


HS = "hardswish"
V2_STAGES = _v2_stages()
V3_LARGE_STAGES = _v3([
    (16, 3, 16, 16, 0, "relu", 1),
    (16, 3, 64, 24, 0, "relu", 2), (24, 3, 72, 24, 0, "relu", 1),
    (24, 5, 72, 40, 24, "relu", 2), (40, 5, 120, 40, 32, "relu", 1), (40, 5, 120, 40, 32, "relu", 1),
    (40, 3, 240, 80, 0, HS, 2), (80, 3, 200, 80, 0, HS, 1), (80, 3, 184, 80, 0, HS, 1), (80, 3, 184, 80, 0, HS, 1),
    (80, 3, 480, 112, 120, HS, 1), (112, 3, 672, 112, 168, HS, 1),
    (112, 5, 672, 160, 168, HS, 2), (160, 5, 960, 160, 240, HS, 1), (160, 5, 960, 160, 240, HS, 1),
], [1, 3, 6, 10, 12])
V3_SMALL_STAGES = _v3([
    (16, 3, 16, 16, 8, "relu", 2),
    (16, 3, 72, 24, 0, "relu", 2), (24, 3, 88, 24, 0, "relu", 1),
    (24, 5, 96, 40, 24, HS, 2), (40, 5, 240, 40, 64, HS, 1), (40, 5, 240, 40, 64, HS, 1),
    (40, 5, 120, 48, 32, HS, 1), (48, 5, 144, 48, 40, HS, 1),
    (48, 5, 288, 96, 72, HS, 2), (96, 5, 576, 96, 144, HS, 1), (96, 5, 576, 96, 144, HS, 1),
], [1, 3, 6, 8])

V2_STYLE = Style(body="conv", flat_project=True, norm_eps=1e-5, norm_momentum=0.1, stem_act="relu6", head_act="relu6")
V3_STYLE = Style(body="block", flat_project=False, norm_eps=1e-3, norm_momentum=0.01, stem_act=HS, head_act=HS)


class MobileNetV2Args(EdgeArgs):
    """Arguments of mobilenet_v2 (7 stages: 1/2/3/4/3/3/1 blocks)."""

    FIXED: ClassVar = frozenset(fixed_blocks(V2_STAGES))
    MODEL: ClassVar = "mobilenet_v2"


class MobileNetV3LargeArgs(EdgeArgs):
    """Arguments of mobilenet_v3_large (6 stages: 1/2/3/4/2/3 blocks)."""

    FIXED: ClassVar = frozenset(fixed_blocks(V3_LARGE_STAGES))
    MODEL: ClassVar = "mobilenet_v3_large"


class MobileNetV3SmallArgs(EdgeArgs):
    """Arguments of mobilenet_v3_small (5 stages: 1/2/3/2/3 blocks)."""

    FIXED: ClassVar = frozenset(fixed_blocks(V3_SMALL_STAGES))
    MODEL: ClassVar = "mobilenet_v3_small"


@register_model(args=MobileNetV2Args)
def mobilenet_v2(**kwargs) -> InvertedResidualNet:
    """MobileNetV2 (torchvision's, 3.5M parameters at 1000 classes); identity blocks skippable."""
    return InvertedResidualNet(V2_STAGES, 32, 1280, V2_STYLE, flat=True, name="mobilenet_v2", **kwargs)


@register_model(args=MobileNetV3LargeArgs)
def mobilenet_v3_large(**kwargs) -> InvertedResidualNet:
    """MobileNetV3-Large (torchvision's: squeeze-excitation, hard-swish, a 1280-wide classifier layer)."""
    return InvertedResidualNet(V3_LARGE_STAGES, 16, 960, V3_STYLE, flat=True, name="mobilenet_v3_large", hidden=1280, **kwargs)


@register_model(args=MobileNetV3SmallArgs)
def mobilenet_v3_small(**kwargs) -> InvertedResidualNet:
    """MobileNetV3-Small (torchvision's: squeeze-excitation, hard-swish, a 1024-wide classifier layer)."""
    return InvertedResidualNet(V3_SMALL_STAGES, 16, 576, V3_STYLE, flat=True, name="mobilenet_v3_small", hidden=1024, **kwargs)

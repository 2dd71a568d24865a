"""EfficientNet-B0 with torchvision's names (``features.{stage}.{block}.block.{n}``), nested by
width and depth (:class:`~nefl_zoo.models.mobile.InvertedResidualNet`).

torchvision trains it with stochastic depth, which is the identity in eval mode; here the
learnable step of every identity block plays the depth role instead, so there is none.
"""

from __future__ import annotations

from typing import ClassVar

from .mobile import BlockCfg, EdgeArgs, InvertedResidualNet, Style, fixed_blocks
from .registry import register_model


def _b0_stages() -> list[list[BlockCfg]]:
    """The (expansion, kernel, stride, in, out, blocks) table of EfficientNet-B0 as blocks; the
    squeeze-excitation width is a quarter of the block's input channels (torchvision's rule)."""
    table = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
             (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1)]
    stages = []
    for t, k, s, cin, cout, n in table:
        stage = []
        for j in range(n):
            stage.append(BlockCfg(cin, cin * t, cout, k, s if j == 0 else 1, max(1, cin // 4), "silu"))
            cin = cout
        stages.append(stage)
    return stages


B0_STAGES = _b0_stages()
B0_STYLE = Style(body="block", flat_project=False, norm_eps=1e-5, norm_momentum=0.1, stem_act="silu",
                 head_act="silu", se_act="silu", se_gate="sigmoid")


class EfficientNetB0Args(EdgeArgs):
    """Arguments of efficientnet_b0 (7 stages: 1/2/2/3/3/4/1 blocks)."""

    FIXED: ClassVar = frozenset(fixed_blocks(B0_STAGES))
    MODEL: ClassVar = "efficientnet_b0"


@register_model(args=EfficientNetB0Args)
def efficientnet_b0(**kwargs) -> InvertedResidualNet:
    """EfficientNet-B0 (torchvision's, 5.3M parameters at 1000 classes); identity blocks skippable."""
    return InvertedResidualNet(B0_STAGES, 32, 1280, B0_STYLE, flat=False, name="efficientnet_b0", **kwargs)

"""Inverted-residual networks (MobileNetV2, MobileNetV3, EfficientNet-B0) on the model contract.

One builder, :class:`InvertedResidualNet`, makes all three from a table of blocks (full
architecture) and a :class:`Style` (torchvision's module names, activations, norm settings).
Parameter names are torchvision's: ``features.0`` (stem), the blocks, the last 1x1 convolution,
``classifier``. MobileNets keep their blocks in one flat ``features`` Sequential
(``features.{n}``), EfficientNet in one Sequential per stage (``features.{stage}.{block}``).

Width: every layer's width ``C`` becomes ``scale_width(C, gamma_w, channel_multiple)``, by
default ``make_divisible(C * sqrt(gamma_w), 8)`` (these families' own rule); expansion,
depthwise (its groups follow the kept channels), squeeze-excitation, projection and the
classifier's hidden layer (MobileNetV3) are all sliced to their first channels, so a narrower
tier is a prefix of a wider one. Depth: a block whose input and output have the same shape
(stride 1, equal channels) computes ``x + step * F(x)`` and can be removed (step 0); the
others compute ``F(x)``, have no step and cannot be removed (:func:`check_fixed_blocks`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, NamedTuple, Sequence

import torch
from pydantic import Field, StrictInt, model_validator
from torch import nn

from ..userfiles import field_error
from .args import ImageSize, ModelArgs, ModelArgsError
from .base import NestedNet, Steps, resolve_steps, scale_width


class BlockCfg(NamedTuple):
    """One inverted residual of the full architecture."""

    cin: int
    hidden: int  # expanded channels (== cin: no expansion convolution)
    cout: int
    kernel: int
    stride: int
    squeeze: int = 0  # squeeze-excitation channels (0: none)
    act: str = "relu"  # activation of the expansion and depthwise convolutions

    @property
    def identity(self) -> bool:
        """Whether the block keeps its input's shape (and so has an identity shortcut)."""
        return self.stride == 1 and self.cin == self.cout


def fixed_blocks(stages: Sequence[Sequence[BlockCfg]]) -> set[tuple[int, int]]:
    """(stage, block) of the blocks without an identity shortcut."""
    return {(s, j) for s, stage in enumerate(stages) for j, cfg in enumerate(stage) if not cfg.identity}


NO_SHORTCUT = "it changes the stride or the channels"  # why an inverted-residual block cannot be skipped


def check_fixed_blocks(steps: Steps | None, fixed: set[tuple[int, int]], model: str, why: str = NO_SHORTCUT) -> None:
    """:class:`ModelArgsError` naming the first block of ``fixed`` that ``steps`` removes."""
    for s, j in sorted(fixed):
        if steps is not None and s < len(steps) and j < len(steps[s]) and steps[s][j] == 0:
            raise ModelArgsError(
                f"steps[{s}][{j}]",
                f"{model} stage {s + 1} block {j} has no identity shortcut ({why}), so it cannot be skipped: "
                "give it a nonzero step",
            )


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU, "relu6": nn.ReLU6, "hardswish": nn.Hardswish, "silu": nn.SiLU,
    "sigmoid": nn.Sigmoid, "hardsigmoid": nn.Hardsigmoid,
}


@dataclass(frozen=True)
class Style:
    """What differs between the families besides their tables: torchvision's names and layers."""

    body: str  # the block's Sequential: "conv" (MobileNetV2) or "block"
    flat_project: bool  # projection as two entries (conv, norm) of the body (V2) or one ConvBNAct
    norm_eps: float
    norm_momentum: float
    stem_act: str
    head_act: str
    se_act: str = "relu"
    se_gate: str = "hardsigmoid"


class SqueezeExcite(nn.Module):
    """``x * gate(fc2(act(fc1(mean(x)))))`` (torchvision's ``SqueezeExcitation``)."""

    def __init__(self, channels: int, squeeze: int, act: str, gate: str):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = ACTIVATIONS[act]()
        self.scale_activation = ACTIVATIONS[gate]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc1(self.avgpool(x))
        scale = self.fc2(self.activation(scale))
        return self.scale_activation(scale) * x


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise, squeeze-excitation, project (1x1): ``F``.

    ``y = x + step * F(x)`` with an identity shortcut, else ``y = F(x)`` (no step)."""

    def __init__(self, body: str, layers: list[nn.Module], identity: bool, step: float):
        super().__init__()
        self.body = body
        self.add_module(body, nn.Sequential(*layers))  # torchvision's name: conv (V2) or block
        self.identity = identity
        self.step_names = ("step",) if identity else ()
        if identity:
            self.step = nn.Parameter(torch.tensor(float(step)))

    def branch_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """All of the block: a removed block leaves only its identity shortcut."""
        return self.named_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._modules[self.body](x)
        return x + self.step * out if self.identity else out


@dataclass(frozen=True)
class ScaledLayers:
    """Makes a family's layers (:class:`Style`) at one width: every width ``C`` becomes
    ``scale_width(C, gamma_w, channel_multiple)``."""

    style: Style
    gamma_w: float
    channel_multiple: int

    def width(self, c: int) -> int:
        return scale_width(c, self.gamma_w, self.channel_multiple)

    def norm(self, c: int) -> nn.BatchNorm2d:
        return nn.BatchNorm2d(c, eps=self.style.norm_eps, momentum=self.style.norm_momentum)

    def conv_bn(self, cin: int, cout: int, k: int = 1, stride: int = 1, groups: int = 1,
                act: str | None = None) -> nn.Sequential:
        """Convolution, BatchNorm and (``act``) an activation."""
        layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False), self.norm(cout)]
        return nn.Sequential(*layers, *([ACTIVATIONS[act]()] if act else []))

    def block(self, cfg: BlockCfg, step: float) -> InvertedResidual:
        """One inverted residual of ``cfg`` (full widths) at this width."""
        style, width = self.style, self.width
        cin, hid, cout = width(cfg.cin), width(cfg.hidden), width(cfg.cout)
        layers = [self.conv_bn(cin, hid, act=cfg.act)] if cfg.hidden != cfg.cin else []
        layers.append(self.conv_bn(hid, hid, cfg.kernel, cfg.stride, groups=hid, act=cfg.act))
        if cfg.squeeze:
            layers.append(SqueezeExcite(hid, width(cfg.squeeze), style.se_act, style.se_gate))
        if style.flat_project:
            layers += [nn.Conv2d(hid, cout, 1, bias=False), self.norm(cout)]
        else:
            layers.append(self.conv_bn(hid, cout))
        return InvertedResidual(style.body, layers, cfg.identity, step)


class InvertedResidualNet(NestedNet):
    """A nested-ready inverted-residual network built from ``stages`` (full architecture).

    Args:
        stages: per stage, its blocks' :class:`BlockCfg`.
        stem: stem width (3x3 stride-2 convolution); ``last``: width of the last 1x1 convolution.
        hidden: the classifier's hidden width (MobileNetV3), or ``None`` for a linear classifier.
        style: the family's names and layers; ``flat``: blocks in one ``features`` Sequential.
        gamma_w, channel_multiple: width ratio and rounding (:func:`scale_width`).
        steps: per stage, per block, the initial step (0 removes a block with identity shortcut).
    """

    def __init__(
        self,
        stages: Sequence[Sequence[BlockCfg]],
        stem: int,
        last: int,
        style: Style,
        flat: bool,
        name: str,
        hidden: int | None = None,
        num_classes: int = 1000,
        in_chans: int = 3,
        gamma_w: float = 1.0,
        steps: Steps | None = None,
        img_size: int = 224,
        channel_multiple: int = 8,
        dropout: float = 0.2,
    ):
        super().__init__()
        self._fixed = fixed_blocks(stages)
        check_fixed_blocks(steps, self._fixed, name)
        steps = resolve_steps(steps, [len(stage) for stage in stages])
        self.style, self.num_classes = style, num_classes
        self.stage_depths = tuple(len(stage) for stage in stages)
        layers = ScaledLayers(style, gamma_w, channel_multiple)
        self.features = self._features(layers, stages, steps, stem, last, in_chans, flat)
        self.flat = flat
        self.stage_names = tuple(info["module"] for info in self.feature_info)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = self._classifier(layers, last, hidden, dropout, num_classes)
        self.default_cfg = {
            "classifier": f"classifier.{len(self.classifier) - 1}",
            "first_conv": "features.0.0",
            "input_size": (in_chans, img_size, img_size),
        }
        self._init_weights()

    def _features(self, layers: ScaledLayers, stages: Sequence[Sequence[BlockCfg]], steps: Steps, stem: int, last: int,
                  in_chans: int, flat: bool) -> nn.Sequential:
        """The stem, the blocks (``step`` 0: left out) and the last 1x1 convolution, under
        torchvision's names; records each stage's blocks (``_layout``) and ``feature_info``."""
        width = layers.width
        features: OrderedDict[str, nn.Module] = OrderedDict()
        features["0"] = layers.conv_bn(in_chans, width(stem), 3, 2, act=self.style.stem_act)
        self._layout: list[list[str]] = []  # per stage, its blocks' names under features (flat)
        self.feature_info, reduction, n = [], 2, 1
        for s, (stage, stage_steps) in enumerate(zip(stages, steps)):
            blocks: OrderedDict[str, nn.Module] = OrderedDict()
            for j, (cfg, step) in enumerate(zip(stage, stage_steps)):
                if step != 0:
                    blocks[str(n + j) if flat else str(j)] = layers.block(cfg, step)
                reduction *= cfg.stride
            self._layout.append([str(n + j) for j in range(len(stage))])
            if flat:
                features.update(blocks)
                module = f"features.{n + len(stage) - 1}"
            else:
                features[str(s + 1)] = nn.Sequential(blocks)
                module = f"features.{s + 1}"
            self.feature_info.append({"module": module, "num_chs": width(stage[-1].cout), "reduction": reduction})
            n += len(stage)
        self._last = str(n if flat else len(stages) + 1)
        features[self._last] = layers.conv_bn(width(stages[-1][-1].cout), width(last), act=self.style.head_act)
        return nn.Sequential(features)

    def _classifier(self, layers: ScaledLayers, last: int, hidden: int | None, dropout: float,
                    num_classes: int) -> nn.Sequential:
        """The classifier (a hidden layer for MobileNetV3); sets ``num_features``, its input width."""
        width = layers.width
        head: list[nn.Module] = []
        self.num_features = width(last)
        if hidden is not None:
            head += [nn.Linear(width(last), width(hidden)), nn.Hardswish(), nn.Dropout(dropout)]
            self.num_features = width(hidden)
        else:
            head.append(nn.Dropout(dropout))
        head.append(nn.Linear(self.num_features, num_classes))
        return nn.Sequential(*head)

    def _init_weights(self) -> None:
        """torchvision's initialisation (kaiming fan-out convolutions, N(0, 0.01) linears)."""
        if self.classifier[-1].weight.is_meta:  # shape-only model
            return
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def fixed_blocks(self) -> set[tuple[int, int]]:
        return set(self._fixed)

    def stage_blocks(self, stage: int) -> Iterator[tuple[int, nn.Module]]:
        if not self.flat:
            yield from super().stage_blocks(stage)
            return
        for j, name in enumerate(self._layout[stage]):
            if name in self.features._modules:
                yield j, self.features._modules[name]

    def forward_stage(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        if not self.flat:
            return super().forward_stage(stage, x)
        for _, block in self.stage_blocks(stage):
            x = block(x)
        return x

    def forward_stem(self, x: torch.Tensor) -> torch.Tensor:
        return self.features[0](x)

    def forward_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last 1x1 convolution (torchvision's last entry of ``features``)."""
        return self.features._modules[self._last](x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = torch.flatten(self.avgpool(x), 1)
        for layer in list(self.classifier)[:-1]:
            x = layer(x)
        return x if pre_logits else self.classifier[-1](x)


class EdgeArgs(ModelArgs):
    """Arguments of the mobile families: ImageNet defaults, widths rounded to multiples of 8
    (``channel_multiple: 1`` gives the NeFL paper's ceil rule), blocks without an identity
    shortcut never skipped."""

    FIXED: ClassVar[frozenset[tuple[int, int]]] = frozenset()  # the family's blocks that cannot be skipped
    MODEL: ClassVar[str] = ""
    WHY: ClassVar[str] = NO_SHORTCUT

    num_classes: StrictInt = Field(1000, ge=1, le=1_000_000)
    img_size: ImageSize = 224
    channel_multiple: StrictInt = Field(8, ge=1, le=8192, description="round scaled widths to a multiple of this (default 8: make_divisible)")

    @model_validator(mode="after")
    def _skippable(self) -> "EdgeArgs":
        try:
            check_fixed_blocks(self.steps, set(self.FIXED), self.MODEL, self.WHY)
        except ModelArgsError as exc:
            raise field_error(exc.field, exc.message) from None
        return self

"""ResNets with learnable step sizes: CIFAR ResNet20-110, ResNet18/34, Wide-ResNet101-2.

Parameter names follow torchvision (``conv1``, ``bn1``, ``layer{i}.{j}.conv1``, ...,
``downsample.0/1``, ``fc``) plus one scalar ``layer{i}.{j}.step`` per block, so torchvision and
timm state dicts load directly. Removed blocks keep their original index in the name.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated, Iterator, Literal, Sequence

import torch
from pydantic import Field, StrictInt
from torch import nn

from .args import MAX_CHANNELS, ImageSize, ModelArgs
from .base import NestedNet, Steps, resolve_steps, scale_width
from .registry import register_model


def _conv(cin: int, cout: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)


class ResidualBlock(nn.Module):
    """``y = relu(shortcut(x) + step * F(x))``; with ``step == 0`` only the shortcut exists."""

    def __init__(self, branch: OrderedDict | None, step: float, shortcut: nn.Module | None):
        super().__init__()
        if branch is not None:
            for name, module in branch.items():
                self.add_module(name, module)
            self.step = nn.Parameter(torch.tensor(float(step)))
        self.has_branch = branch is not None
        self.step_names = ("step",) if self.has_branch else ()
        self.downsample = shortcut
        self.relu = nn.ReLU(inplace=True)

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def branch_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The step and the branch's layers: everything but the projection shortcut."""
        for name, child in self.named_children():
            if child is not self.downsample:
                yield from child.named_parameters(name)
        yield from self.named_parameters(recurse=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x if self.downsample is None else self.downsample(x)
        if self.has_branch:
            out = out + self.step * self.branch(x)
        return self.relu(out)


class BasicBlock(ResidualBlock):
    """Two 3x3 convolutions."""

    def __init__(self, cin: int, width: int, cout: int, stride: int, step: float, shortcut):
        branch = None
        if step != 0:
            branch = OrderedDict(
                conv1=_conv(cin, width, 3, stride), bn1=nn.BatchNorm2d(width),
                conv2=_conv(width, cout, 3), bn2=nn.BatchNorm2d(cout),
            )
        super().__init__(branch, step, shortcut)

    def branch(self, x):
        return self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))


class Bottleneck(ResidualBlock):
    """1x1 reduce, 3x3 (carrying the stride, as torchvision's v1.5), 1x1 expand."""

    def __init__(self, cin: int, width: int, cout: int, stride: int, step: float, shortcut):
        branch = None
        if step != 0:
            branch = OrderedDict(
                conv1=_conv(cin, width, 1), bn1=nn.BatchNorm2d(width),
                conv2=_conv(width, width, 3, stride), bn2=nn.BatchNorm2d(width),
                conv3=_conv(width, cout, 1), bn3=nn.BatchNorm2d(cout),
            )
        super().__init__(branch, step, shortcut)

    def branch(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.bn3(self.conv3(out))


class ResNet(NestedNet):
    """A nested-ready ResNet.

    Args:
        block: ``basic`` or ``bottleneck``.
        layers: blocks per stage of the full model.
        planes: base channels per stage (output channels are ``planes * expansion``).
        stem: ``cifar`` (3x3 stride 1), ``nefl`` (3x3 stride 1 + max-pool, the NeFL paper's)
            or ``imagenet`` (7x7 stride 2 + max-pool, torchvision's).
        width_multiplier: bottleneck inner width factor (2 for Wide-ResNets).
        gamma_w: width parameter ratio; every width becomes ``ceil(C * sqrt(gamma_w))``.
        channel_multiple: above 1, widths are rounded to a multiple of it instead
            (:func:`~nefl_zoo.models.base.scale_width`).
        steps: per-stage lists of initial step sizes, 0 removes the block.
    """

    def __init__(
        self,
        block: Literal["basic", "bottleneck"] = "basic",
        layers: Sequence[int] = (2, 2, 2, 2),
        planes: Sequence[int] = (64, 128, 256, 512),
        stem: Literal["cifar", "nefl", "imagenet"] = "imagenet",
        num_classes: int = 1000,
        in_chans: int = 3,
        width_multiplier: int = 1,
        gamma_w: float = 1.0,
        steps: Steps | None = None,
        img_size: int | None = None,
        channel_multiple: int = 1,
    ):
        super().__init__()
        if stem not in ("cifar", "nefl", "imagenet"):
            raise ValueError(f"stem must be cifar, nefl or imagenet, got {stem!r}")
        self.stage_depths = tuple(layers)
        self.stage_names = tuple(f"layer{i + 1}" for i in range(len(layers)))
        self.num_classes = num_classes
        size = img_size or (224 if stem == "imagenet" else 32)
        self.default_cfg = {"classifier": "fc", "first_conv": "conv1", "input_size": (in_chans, size, size)}
        steps = resolve_steps(steps, layers)
        block_cls, expansion = (BasicBlock, 1) if block == "basic" else (Bottleneck, 4)

        stem_width = scale_width(planes[0], gamma_w, channel_multiple)
        k, stride = (7, 2) if stem == "imagenet" else (3, 1)
        self.conv1 = nn.Conv2d(in_chans, stem_width, k, stride=stride, padding=k // 2, bias=False)
        self.bn1 = nn.BatchNorm2d(stem_width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1) if stem in ("nefl", "imagenet") else nn.Identity()

        cin = stem_width
        stem_reduction = {"cifar": 1, "nefl": 2, "imagenet": 4}[stem]
        self.feature_info = []
        for i, (p, stage_steps) in enumerate(zip(planes, steps)):
            width = scale_width(p * width_multiplier, gamma_w, channel_multiple)
            cout = scale_width(p * expansion, gamma_w, channel_multiple)
            full_in = planes[0] if i == 0 else planes[i - 1] * expansion
            # torchvision's names: blocks keyed by their index in the full stage, gaps where removed
            blocks = OrderedDict()
            for j, s in enumerate(stage_steps):
                stride = 2 if (j == 0 and i > 0) else 1
                needs_proj = j == 0 and (stride != 1 or full_in != p * expansion)
                if s == 0 and not needs_proj:
                    continue  # a removed block without projection is the identity
                shortcut = None
                if needs_proj:
                    shortcut = nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))
                blocks[str(j)] = block_cls(cin if j == 0 else cout, width, cout, stride, s, shortcut)
            self.add_module(self.stage_names[i], nn.Sequential(blocks))
            self.feature_info.append({"module": self.stage_names[i], "num_chs": cout, "reduction": stem_reduction * 2**i})
            cin = cout
        self.num_features = cin
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        if self.fc.weight.is_meta:  # shape-only model: nothing to initialise
            return
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward_stem(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        return self.maxpool(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = torch.flatten(self.avgpool(x), 1)
        return x if pre_logits else self.fc(x)


class CifarResNetArgs(ModelArgs):
    """Arguments of the CIFAR ResNets (resnet20 ... resnet110): 3 stages of 16/32/64 channels."""

    img_size: ImageSize | None = Field(None, description="input size (default 32)")


class WideResNetArgs(CifarResNetArgs):
    """Arguments of wide_resnet101_2: also the stem and the base channels of its 4 stages."""

    stem: Literal["cifar", "nefl", "imagenet"] = "imagenet"
    planes: Sequence[Annotated[StrictInt, Field(ge=1, le=MAX_CHANNELS)]] = Field(
        (64, 128, 256, 512), min_length=4, max_length=4, description="base channels of the 4 stages"
    )


class ResNetArgs(WideResNetArgs):
    """Arguments of resnet18/34: also the bottleneck width factor."""

    stem: Literal["cifar", "nefl", "imagenet"] = "nefl"
    width_multiplier: StrictInt = Field(1, ge=1, le=64)


def _cifar_resnet(depth: int, **kwargs) -> ResNet:
    n = (depth - 2) // 6
    kwargs.setdefault("num_classes", 10)
    return ResNet("basic", (n, n, n), (16, 32, 64), stem="cifar", **kwargs)


@register_model(args=CifarResNetArgs)
def resnet20(**kwargs) -> ResNet:
    """CIFAR ResNet-20 (3 stages x 3 basic blocks, 16/32/64 channels)."""
    return _cifar_resnet(20, **kwargs)


@register_model(args=CifarResNetArgs)
def resnet32(**kwargs) -> ResNet:
    """CIFAR ResNet-32 (3 x 5 blocks)."""
    return _cifar_resnet(32, **kwargs)


@register_model(args=CifarResNetArgs)
def resnet44(**kwargs) -> ResNet:
    """CIFAR ResNet-44 (3 x 7 blocks)."""
    return _cifar_resnet(44, **kwargs)


@register_model(args=CifarResNetArgs)
def resnet56(**kwargs) -> ResNet:
    """CIFAR ResNet-56 (3 x 9 blocks)."""
    return _cifar_resnet(56, **kwargs)


@register_model(args=CifarResNetArgs)
def resnet110(**kwargs) -> ResNet:
    """CIFAR ResNet-110 (3 x 18 blocks)."""
    return _cifar_resnet(110, **kwargs)


@register_model(args=ResNetArgs)
def resnet18(stem: str = "nefl", **kwargs) -> ResNet:
    """ResNet-18 (4 x 2 basic blocks); stem nefl (the paper's CIFAR setting), cifar or imagenet."""
    kwargs.setdefault("num_classes", 10 if stem != "imagenet" else 1000)
    return ResNet("basic", (2, 2, 2, 2), stem=stem, **kwargs)


@register_model(args=ResNetArgs)
def resnet34(stem: str = "nefl", **kwargs) -> ResNet:
    """ResNet-34 (3/4/6/3 basic blocks); stem as for resnet18."""
    kwargs.setdefault("num_classes", 10 if stem != "imagenet" else 1000)
    return ResNet("basic", (3, 4, 6, 3), stem=stem, **kwargs)


@register_model(args=WideResNetArgs)
def wide_resnet101_2(stem: str = "imagenet", **kwargs) -> ResNet:
    """Wide-ResNet-101-2 (bottleneck inner width x2), torchvision-compatible."""
    kwargs.setdefault("num_classes", 1000)
    return ResNet("bottleneck", (3, 4, 23, 3), stem=stem, width_multiplier=2, **kwargs)

"""Vision Transformer with one learnable step size for attention and one for the MLP.

Parameter names follow timm (``patch_embed.proj``, ``cls_token``, ``pos_embed``,
``blocks.{i}.norm1/attn.qkv/attn.proj/norm2/mlp.fc1/mlp.fc2``, ``norm``, ``head``) plus
``blocks.{i}.step_attn`` and ``blocks.{i}.step_mlp``. Width scaling narrows the embedding
dimension, every head (all heads are kept, each to its first ``ceil(head_dim * sqrt(gamma_w))``
dimensions, with q, k and v sliced separately) and the MLP hidden layer, as the NeFL paper does;
``width="heads"`` keeps the embedding (so LayerNorm is exact) and nests whole heads and the
MLP's hidden units instead, as automatic nesting does for timm's and torchvision's
transformers. ``channel_multiple`` rounds each of these widths as for the ResNets. The encoder is one
stage (``blocks``), whose output the final ``norm`` turns into the features.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Literal

import torch
from pydantic import Field, StrictInt, model_validator
from torch import nn

from ..userfiles import field_error
from .args import MAX_CHANNELS, ImageSize, ModelArgs
from .base import Index, NestedNet, Steps, resolve_steps, scale_width
from .registry import register_model

MAX_TOKENS = 4096  # patches per image: attention costs tokens^2 per head


class ViTArgs(ModelArgs):
    """Arguments of the ViTs (defaults: ViT-B/16's); checked together: ``embed_dim`` divisible
    by ``num_heads``, ``patch_size`` at most ``img_size``, at most :data:`MAX_TOKENS` patches."""

    num_classes: StrictInt = Field(1000, ge=1, le=1_000_000)
    img_size: ImageSize = 224
    patch_size: StrictInt = Field(16, ge=1, le=4096)
    embed_dim: StrictInt = Field(768, ge=1, le=MAX_CHANNELS)
    depth: StrictInt = Field(12, ge=1, le=1000)
    num_heads: StrictInt = Field(12, ge=1, le=MAX_CHANNELS)
    mlp_ratio: float = Field(4.0, gt=0, le=64, strict=True)
    width: Literal["embedding", "heads"] = "embedding"

    @model_validator(mode="after")
    def _consistent(self) -> "ViTArgs":
        if self.embed_dim % self.num_heads:
            raise field_error("num_heads", f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.patch_size > self.img_size:
            raise field_error("patch_size", f"{self.patch_size} is larger than img_size {self.img_size}")
        tokens = (self.img_size // self.patch_size) ** 2
        if tokens > MAX_TOKENS:
            raise field_error(
                "patch_size", f"img_size {self.img_size} / patch_size {self.patch_size} gives {tokens:,} patches; at most {MAX_TOKENS:,}"
            )
        return self


class ViTTinyArgs(ViTArgs):
    """Arguments of vit_tiny_16 (defaults: ViT-Ti/16's)."""

    embed_dim: StrictInt = Field(192, ge=1, le=MAX_CHANNELS)
    num_heads: StrictInt = Field(3, ge=1, le=MAX_CHANNELS)


class Attention(nn.Module):
    """Multi-head self-attention whose inner width ``num_heads * head_dim`` is independent of
    the embedding width, so that both can be narrowed."""

    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * num_heads * head_dim)
        self.proj = nn.Linear(num_heads * head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class EncoderBlock(nn.Module):
    """``x = x + s_attn * Attn(LN(x)); x = x + s_mlp * MLP(LN(x))``."""

    step_names = ("step_attn", "step_mlp")

    def __init__(self, dim: int, num_heads: int, head_dim: int, hidden: int, step: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, head_dim)
        self.step_attn = nn.Parameter(torch.tensor(float(step)))
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, hidden)
        self.step_mlp = nn.Parameter(torch.tensor(float(step)))

    def branch_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """All of the block: a removed block is absent."""
        return self.named_parameters()

    def forward(self, x):
        x = x + self.step_attn * self.attn(self.norm1(x))
        return x + self.step_mlp * self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, img_size: int, patch_size: int, in_chans: int, dim: int):
        super().__init__()
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, dim, patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(NestedNet):
    """ViT with class-token pooling, pre-norm blocks and a linear head (timm layout)."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        gamma_w: float = 1.0,
        steps: Steps | None = None,
        channel_multiple: int = 1,
        width: str = "embedding",
    ):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.stage_depths = (depth,)
        self.stage_names = ("blocks",)
        self.num_classes = num_classes
        self.default_cfg = {
            "classifier": "head", "first_conv": "patch_embed.proj", "input_size": (in_chans, img_size, img_size)
        }
        self.full_head_dim = embed_dim // num_heads
        (stage_steps,) = resolve_steps(steps, (depth,))
        self.width = width
        if width == "heads":  # the embedding whole, the first heads whole
            dim, heads, head_dim = embed_dim, scale_width(num_heads, gamma_w, channel_multiple), self.full_head_dim
        else:  # every dimension of every head, and the embedding
            dim, heads, head_dim = scale_width(embed_dim, gamma_w, channel_multiple), num_heads, scale_width(self.full_head_dim, gamma_w, channel_multiple)
        self.num_features = dim
        self.feature_info = [{"module": "blocks", "num_chs": dim, "reduction": patch_size}]
        hidden = scale_width(int(embed_dim * mlp_ratio), gamma_w, channel_multiple)

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(
            OrderedDict(
                (str(i), EncoderBlock(dim, heads, head_dim, hidden, s))
                for i, s in enumerate(stage_steps)
                if s != 0
            )
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        for m in self.modules() if not self.head.weight.is_meta else ():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward_stem(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed

    def forward_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0]  # class token
        return x if pre_logits else self.head(x)

    def slice_index(self, key: str, slim_shape: torch.Size, full_shape: torch.Size) -> Index:
        """q, k and v are sliced separately; every head keeps its first dimensions, or (``width
        heads``) the first heads are kept whole."""
        index = list(super().slice_index(key, slim_shape, full_shape))
        qkv = key.endswith("attn.qkv.weight") or key.endswith("attn.qkv.bias")
        if self.width == "heads":
            if qkv:
                inner, full_inner = slim_shape[0] // 3, full_shape[0] // 3
                index[0] = (torch.arange(3)[:, None] * full_inner + torch.arange(inner)[None, :]).reshape(-1)
            return tuple(index)
        if qkv:
            index[0] = self._head_index(slim_shape[0] // 3, full_shape[0] // 3, parts=3)
        elif key.endswith("attn.proj.weight"):
            index[1] = self._head_index(slim_shape[1], full_shape[1], parts=1)
        return tuple(index)

    def _head_index(self, slim_inner: int, full_inner: int, parts: int) -> torch.Tensor:
        heads = full_inner // self.full_head_dim
        kept = slim_inner // heads
        per_head = torch.arange(kept)
        starts = torch.arange(parts * heads) * self.full_head_dim
        return (starts[:, None] + per_head[None, :]).reshape(-1)


@register_model(args=ViTArgs)
def vit_b_16(**kwargs) -> VisionTransformer:
    """ViT-B/16 (768 wide, 12 blocks, 12 heads); keyword arguments override the defaults."""
    cfg = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12) | kwargs
    return VisionTransformer(**cfg)


@register_model(args=ViTTinyArgs)
def vit_tiny_16(**kwargs) -> VisionTransformer:
    """ViT-Ti/16 (192 wide, 12 blocks, 3 heads)."""
    cfg = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3) | kwargs
    return VisionTransformer(**cfg)

"""FedLPS's channel pruning, expressed as slice maps: L1 selection of the inner channels of
every predictor block, the pruned (physically smaller) predictor, and the
:class:`~nefl_zoo.slim.SliceEntry` (index-tensor regions) of each of its tensors in the global
state, so extraction and scatter are the slice maps' own."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from itertools import chain
from typing import Mapping

import torch
from torch import nn

from ....models.base import NestedNet
from ....slim import SliceEntry
from .networks import Predictor

Masks = Mapping[str, torch.Tensor]  # mask key -> kept channel indices (ascending)


def l1_channels(weight: torch.Tensor, rho: float) -> torch.Tensor:
    """Output channels of a convolution kept at pruning ratio ``rho``: the ``C - round(rho * C)``
    (at least one) with the largest L1 norm of their filter, ties to the lower index; ascending."""
    scores = weight.detach().abs().flatten(1).sum(1)
    channels = len(scores)
    keep = max(1, channels - round(rho * channels))
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:keep].sort().values


@dataclass(frozen=True)
class PrunableBlock:
    """A predictor block: its module path (the same in the backbone and every predictor), its
    branch's convolutions and their norms (child names, in order) and its inner widths (the
    outputs of every convolution but the last)."""

    path: str
    convs: tuple[str, ...]
    norms: tuple[str, ...]
    widths: tuple[int, ...]


def prunable_block(path: str, block: nn.Module) -> PrunableBlock:
    """Describe ``block``'s branch (its ``branch_parameters()``) as a chain of convolutions, each
    followed by a batch norm; ``ValueError`` for any other block."""
    branch = {id(p) for _, p in block.branch_parameters()}
    children = [(n, m) for n, m in block.named_children() if any(id(p) in branch for p in m.parameters())]
    convs = [(n, m) for n, m in children if isinstance(m, nn.Conv2d)]
    norms = [(n, m) for n, m in children if isinstance(m, nn.BatchNorm2d)]
    if (len(convs) < 2 or len(convs) != len(norms) or len(children) != 2 * len(convs)
            or any(c.groups != 1 or c.out_channels != b.num_features for (_, c), (_, b) in zip(convs, norms))):
        raise ValueError(f"fedlps: block {path} is not a chain of convolutions with batch norms (FedLPS prunes ResNet blocks)")
    return PrunableBlock(path, tuple(n for n, _ in convs), tuple(n for n, _ in norms), tuple(c.out_channels for _, c in convs[:-1]))


def mask_key(task: str, block: PrunableBlock, conv: int) -> str:
    """Key of a mask (kept channel indices) in client state and replies."""
    return f"mask.{task}.{block.path}.{conv}"


def _pruned_block(template: nn.Module, info: PrunableBlock, kept: list[torch.Tensor | None]) -> tuple[nn.Module, dict]:
    """A (meta) copy of ``template`` whose inner channels are ``kept`` (per inner width; None:
    all), and the index region of each replaced module: (output, input) indices."""
    block, regions = copy.deepcopy(template), {}
    kept = [*kept, None]  # the last convolution's outputs are the residual stream: never pruned
    for c, (conv_name, norm_name) in enumerate(zip(info.convs, info.norms)):
        out_idx, in_idx = kept[c], kept[c - 1] if c > 0 else None
        if out_idx is None and in_idx is None:
            continue
        conv, norm = block.get_submodule(conv_name), block.get_submodule(norm_name)
        with torch.device("meta"):
            new = nn.Conv2d(conv.in_channels if in_idx is None else len(in_idx), conv.out_channels if out_idx is None else len(out_idx),
                            conv.kernel_size, conv.stride, conv.padding, conv.dilation, bias=conv.bias is not None)
            block.add_module(conv_name, new)
            regions[new] = (out_idx, in_idx)
            if out_idx is not None:
                new = nn.BatchNorm2d(len(out_idx), norm.eps, norm.momentum, norm.affine, norm.track_running_stats)
                block.add_module(norm_name, new)
                regions[new] = (out_idx,)
    return block, regions


def slice_entries(module: nn.Module, regions: Mapping[nn.Module, tuple], prefix: str, kinds: Mapping[str, str]) -> dict[str, SliceEntry]:
    """The slice entry of every tensor of ``module`` in the global state (key ``PREFIX.KEY``): the
    whole tensor, or for a module in ``regions`` its (output, input) index tensors."""
    entries = {}
    for mname, sub in module.named_modules():
        region = regions.get(sub, ())
        for pname, t in chain(sub.named_parameters(recurse=False), sub.named_buffers(recurse=False)):
            key = f"{mname}.{pname}" if mname else pname
            index = ()
            if t.ndim and any(r is not None for r in region):
                index = tuple(region[d] if d < len(region) and region[d] is not None else slice(0, size) for d, size in enumerate(t.shape))
            entries[key] = SliceEntry(f"{prefix}.{key}", index, tuple(t.shape), kinds.get(key, "weight"), True)
    return entries


class Pruning:
    """The predictor blocks of a backbone (every block after the encoder's ``n``) and how a
    task's predictor is pruned to masks.

    Args:
        backbone: the full model (its blocks are the unpruned predictor's).
        template: the same architecture on the meta device (copied for every pruned predictor).
        n: blocks in the encoder.
    """

    def __init__(self, backbone: NestedNet, template: NestedNet, n: int):
        blocks = list(backbone.residual_blocks())[n:]
        self.keys = [(backbone.stage_names[st], str(j)) for st, j, _ in blocks]  # (stage module, index in it)
        self.blocks: list[PrunableBlock] = [prunable_block(f"{stage}.{j}", b) for (stage, j), (_, _, b) in zip(self.keys, blocks)]
        self.templates = [b for _, _, b in list(template.residual_blocks())[n:]]
        self.kinds = backbone.param_kinds()
        self.backbone = backbone

    def predictor(self, task: str, head: nn.Module, masks: Masks | None = None) -> tuple[nn.Module, dict[str, SliceEntry]]:
        """An uninitialised (meta) predictor of ``task`` with ``head``, pruned to ``masks``
        (None: full), and the slice entry of each of its tensors (global key ``TASK.KEY``)."""
        blocks, regions = [], {}
        for (stage, index), template, info in zip(self.keys, self.templates, self.blocks):
            kept = [None if masks is None else masks[mask_key(task, info, c)] for c in range(len(info.widths))]
            block, block_regions = _pruned_block(template, info, kept)
            blocks.append((stage, index, block))
            regions.update(block_regions)
        module = Predictor(self.backbone, blocks, head)
        return module, slice_entries(module, regions, task, self.kinds)

    def choose(self, tasks: list[str], arrays: Mapping[str, torch.Tensor], rho: float) -> dict[str, torch.Tensor]:
        """Every task's mask at ratio ``rho``, by L1 norm of the filters in ``arrays`` (global keys)."""
        return {
            mask_key(task, info, c): l1_channels(arrays[f"{task}.{info.path}.{conv}.weight"], rho)
            for task in tasks for info in self.blocks for c, conv in enumerate(info.convs[:-1])
        }

    def prefix(self, tasks: list[str], rho: float) -> dict[str, torch.Tensor]:
        """Masks of ratio ``rho``'s sizes keeping the first channels (costs do not depend on which)."""
        return {
            mask_key(task, info, c): torch.arange(max(1, width - round(rho * width)))
            for task in tasks for info in self.blocks for c, width in enumerate(info.widths)
        }

    def read(self, tasks: list[str], arrays: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The masks in a reply's ``arrays``; ``ValueError`` unless each is ascending distinct
        channel indices below its width."""
        masks = {}
        for task in tasks:
            for info in self.blocks:
                for c, width in enumerate(info.widths):
                    key = mask_key(task, info, c)
                    kept = arrays.get(key)
                    if (kept is None or kept.dtype != torch.int64 or kept.ndim != 1 or not len(kept)
                            or int(kept[0]) < 0 or int(kept[-1]) >= width or not bool((kept[1:] > kept[:-1]).all())):
                        raise ValueError(f"{key}: expected ascending distinct channel indices below {width}")
                    masks[key] = kept
        return masks

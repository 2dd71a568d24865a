"""FedLPS's channel pruning of every predictor layer, expressed as slice maps.

A predictor's channels fall into **spaces**, each pruned with one mask: the inner channels of
every block (the outputs of each branch convolution but the last) and the residual stream of
every stage that starts with a projection inside the predictor (the projection's and every
block's last convolution's outputs, which the residual additions tie together). Every layer's
output channels are its space's mask and its input channels the previous space's, so at ratio
rho a convolution keeps about ``(1 - rho)^2`` of its weights. Not pruned: the encoder's output
(the first predictor layer's inputs; the authors' code does the same), a stage's stream whose
first block lies in the encoder (identity shortcuts carry the encoder's channels), the task
heads' classes. A space's L1 score of a channel is the sum of the L1 norms of the filters that
write it. The pruned (physically smaller) predictor maps into the global one through
:class:`~nefl_zoo.slim.SliceEntry` index tensors, so extraction and scatter are the slice maps'.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Mapping

import torch
from torch import nn

from ....models.shufflenet import ShuffleUnit
from ....slim import SliceEntry

Masks = Mapping[str, torch.Tensor]  # mask key -> kept channel indices (ascending)


def kept(width: int, rho: float) -> int:
    """Channels of ``width`` kept at pruning ratio ``rho``: ``width - round(rho * width)``, at least one."""
    return max(1, width - round(rho * width))


def l1_channels(weight: torch.Tensor, rho: float) -> torch.Tensor:
    """Output channels kept at ratio ``rho`` by the L1 norm of their filter in ``weight`` (or
    by ``weight`` itself when it is a vector of scores): the :func:`kept` largest, ties to the
    lower index; ascending."""
    scores = weight.detach().abs().flatten(1).sum(1) if weight.ndim > 1 else weight.detach()
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:kept(len(scores), rho)].sort().values


@dataclass(frozen=True)
class Space:
    """Channels pruned with one mask: name, width and the weights (predictor keys) whose output
    channels they are (the L1 score sums their filters' norms)."""

    name: str
    width: int
    producers: tuple[str, ...]


@dataclass(frozen=True)
class Layer:
    """A predictor module (path) and the spaces of its output and input channels (None: whole)."""

    path: str
    out: str | None
    inp: str | None


def _chain(path: str, block: nn.Module) -> list[tuple[str, nn.Conv2d, str]]:
    """``block``'s branch as (conv name, conv, norm name) pairs; ``ValueError`` unless it is a
    chain of ungrouped convolutions each followed by a batch norm (a ResNet block)."""
    branch = {id(p) for _, p in block.branch_parameters()}
    children = [(n, m) for n, m in block.named_children() if any(id(p) in branch for p in m.parameters())]
    convs = [(n, m) for n, m in children if isinstance(m, nn.Conv2d)]
    norms = [(n, m) for n, m in children if isinstance(m, nn.BatchNorm2d)]
    if (len(convs) < 2 or len(convs) != len(norms) or len(children) != 2 * len(convs)
            or any(c.groups != 1 or c.out_channels != b.num_features for (_, c), (_, b) in zip(convs, norms))):
        raise ValueError(f"fedlps: block {path} is not a chain of convolutions with batch norms (FedLPS prunes ResNet and ShuffleNetV2 blocks)")
    return [(cn, c, bn) for (cn, c), (bn, _) in zip(convs, norms)]


def layout(blocks: list[tuple[str, nn.Module]], norms: list[tuple[str, nn.Module]] = ()) -> tuple[dict[str, Space], list[Layer]]:
    """The spaces and layers of a predictor made of ``blocks`` ((path, block), in order), the
    ``norms`` after them ((name, a sequence of convolutions each followed by a batch norm,
    e.g. ShuffleNetV2's ``conv5``) and a task ``head`` reading the last channels.

    ShuffleNetV2 units: only the inner channels of ``branch2`` (its first 1x1 convolution's
    outputs, the depthwise convolution, the last 1x1's inputs) are pruned; the stream, which
    the units split in halves and shuffle, stays whole."""
    widths: dict[str, int] = {}
    producers: dict[str, list[str]] = {}
    layers: list[Layer] = []
    stream = None  # the encoder's output is never pruned

    def space(name: str, width: int, producer: str) -> str:
        widths[name] = width
        producers.setdefault(name, []).append(producer)
        return name

    for path, block in blocks:
        if isinstance(block, ShuffleUnit):
            inner = space(f"{path}.branch2.0", block.branch2[0].out_channels, f"{path}.branch2.0.weight")
            layers += [Layer(f"{path}.branch2.{i}", inner, None) for i in (0, 1, 3, 4)] + [Layer(f"{path}.branch2.5", None, inner)]
            continue
        convs = _chain(path, block)
        inp = stream
        if block.downsample is not None:  # a projection starts a stream of its own
            proj = block.downsample[0]
            stream = space(f"{path}.stream", proj.out_channels, f"{path}.downsample.0.weight")
            layers += [Layer(f"{path}.downsample.0", stream, inp), Layer(f"{path}.downsample.1", stream, None)]
        prev = inp
        for c, (conv_name, conv, norm_name) in enumerate(convs):
            key = f"{path}.{conv_name}"
            if c < len(convs) - 1:
                out = space(key, conv.out_channels, f"{key}.weight")
            elif stream is not None:
                out = space(stream, conv.out_channels, f"{key}.weight")
            else:
                out = None
            layers += [Layer(key, out, prev), Layer(f"{path}.{norm_name}", out, None)]
            prev = out
    for name, seq in norms:
        for i, module in seq.named_children():
            if isinstance(module, nn.Conv2d):
                out = space(f"{name}.{i}", module.out_channels, f"{name}.{i}.weight")
                layers.append(Layer(f"{name}.{i}", out, stream))
                stream = out
            elif isinstance(module, nn.BatchNorm2d):
                layers.append(Layer(f"{name}.{i}", stream, None))
    layers.append(Layer("head", None, stream))
    return {n: Space(n, widths[n], tuple(producers[n])) for n in widths}, layers


def _shrunk(module: nn.Module, out: int | None, inp: int | None) -> nn.Module:
    """A (meta) copy of a convolution, batch norm or linear layer with ``out`` output and
    ``inp`` input channels (None: as before)."""
    with torch.device("meta"):
        if isinstance(module, nn.Conv2d) and module.groups > 1:  # depthwise: one filter per channel
            return nn.Conv2d(out, out, module.kernel_size, module.stride, module.padding, module.dilation, groups=out, bias=module.bias is not None)
        if isinstance(module, nn.Conv2d):
            return nn.Conv2d(module.in_channels if inp is None else inp, module.out_channels if out is None else out,
                             module.kernel_size, module.stride, module.padding, module.dilation, bias=module.bias is not None)
        if isinstance(module, nn.BatchNorm2d):
            return nn.BatchNorm2d(out, module.eps, module.momentum, module.affine, module.track_running_stats)
        if isinstance(module, nn.Linear):
            return nn.Linear(module.in_features if inp is None else inp, module.out_features if out is None else out, module.bias is not None)
    raise TypeError(f"fedlps: cannot prune a {type(module).__name__}")


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


def mask_key(task: str, space: str) -> str:
    """Key of a mask (kept channel indices) in client state and replies."""
    return f"mask.{task}.{space}"


class Pruning:
    """How a task's predictor is pruned to masks.

    Args:
        blocks: the predictor's blocks as (path, module) (the backbone's, for their structure).
        norms: the modules of the backbone's ``forward_norm`` as (name, module).
        kinds: the backbone's parameter kinds (:meth:`~nefl_zoo.models.base.NestedNet.param_kinds`).
    """

    def __init__(self, blocks: list[tuple[str, nn.Module]], norms: list[tuple[str, nn.Module]], kinds: Mapping[str, str]):
        self.spaces, self.layers = layout(blocks, norms)
        self.kinds = kinds

    def prune(self, task: str, predictor: nn.Module, masks: Masks | None) -> dict[str, SliceEntry]:
        """Replace, in the (meta) full ``predictor`` of ``task``, every layer by its pruned copy
        (``masks`` None: none) and return the slice entry of each of its tensors (global key
        ``TASK.KEY``)."""
        regions = {}
        for layer in self.layers if masks is not None else ():
            out, inp = (None if s is None else masks[mask_key(task, s)] for s in (layer.out, layer.inp))
            if out is None and inp is None:
                continue
            parent, _, name = layer.path.rpartition(".")
            new = _shrunk(predictor.get_submodule(layer.path), None if out is None else len(out), None if inp is None else len(inp))
            setattr(predictor.get_submodule(parent) if parent else predictor, name, new)
            regions[new] = (out, inp)
        return slice_entries(predictor, regions, task, self.kinds)

    def choose(self, tasks: list[str], arrays: Mapping[str, torch.Tensor], rho: float) -> dict[str, torch.Tensor]:
        """Every task's masks at ratio ``rho``, by L1 norm of the filters in ``arrays`` (global keys)."""
        return {
            mask_key(task, s.name): l1_channels(sum(arrays[f"{task}.{p}"].abs().flatten(1).sum(1) for p in s.producers), rho)
            for task in tasks for s in self.spaces.values()
        }

    def prefix(self, tasks: list[str], rho: float) -> dict[str, torch.Tensor]:
        """Masks of ratio ``rho``'s sizes keeping the first channels (costs do not depend on which)."""
        return {mask_key(task, s.name): torch.arange(kept(s.width, rho)) for task in tasks for s in self.spaces.values()}

    def read(self, tasks: list[str], arrays: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The masks in a reply's ``arrays``; ``ValueError`` unless each is ascending distinct
        channel indices below its width."""
        masks = {}
        for task in tasks:
            for s in self.spaces.values():
                key = mask_key(task, s.name)
                idx = arrays.get(key)
                if (idx is None or idx.dtype != torch.int64 or idx.ndim != 1 or not len(idx)
                        or int(idx[0]) < 0 or int(idx[-1]) >= s.width or not bool((idx[1:] > idx[:-1]).all())):
                    raise ValueError(f"{key}: expected ascending distinct channel indices below {s.width}")
                masks[key] = idx
        return masks

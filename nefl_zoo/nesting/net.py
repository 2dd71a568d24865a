"""``AutoNestedNet``: a traced torchvision / timm / user network that keeps the zoo's contract.

The tier's graph module (:func:`~nefl_zoo.nesting.slim.build_graph`) lends its layers to a
:class:`~nefl_zoo.models.NestedNet` under their original names (so torchvision's and timm's
state dicts load directly), plus ``{block}.step`` for every kept skippable block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from pydantic import Field, StrictInt
from torch import nn

from ..models.args import ImageSize, ModelArgs
from ..models.base import Index, NestedNet, resolve_steps
from ..models.registry import ModelInfo, UnknownModelError
from .plan import NestPlan, cached_plan
from .residual import is_parameter
from .slim import build_graph, dry_run
from .sources import NestError, Source, exists, library_source


class AutoArgs(ModelArgs):
    """Arguments of an automatically nested network."""

    num_classes: StrictInt = Field(1000, ge=1, le=1_000_000)
    img_size: ImageSize = 224


@dataclass
class BlockView:
    """A kept block of an :class:`AutoNestedNet`: its step and the parameters its branch holds."""

    net: "AutoNestedNet"
    keys: tuple[str, ...]
    step_names: tuple[str, ...]
    step_key: str

    def branch_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for key in (*self.keys, self.step_key):
            yield key, self.net.get_parameter(key)


class AutoNestedNet(NestedNet):
    """One tier of an automatically nested network (see the module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, plan: NestPlan, keep: torch.Tensor,
                 steps: list[list[float]], num_classes: int, img_size: int):
        super().__init__()
        for name, child in gm.named_children():
            self.add_module(name, child)
        for name, p in gm.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in gm.named_buffers(recurse=False):  # its own, and tensors fx named (a list's: _tensor_constant0)
            self.register_buffer(name, b)
        self._graph_forward: Callable = type(gm).forward
        self.plan, self._steps = plan, steps
        self.stage_names = tuple(plan.stage_modules)
        self.stage_depths = plan.stage_depths
        self.num_classes = num_classes
        ids = {n.name: n.meta.get("nest_ids") for n in plan.graph.nodes}
        self.feature_info = []
        for s, (module, reduction) in enumerate(zip(plan.stage_modules, plan.stage_reductions)):
            last = [b for b in plan.blocks if b.stage == s][-1]
            self.feature_info.append({"module": module, "num_chs": int(keep[ids[last.add]].sum()), "reduction": reduction})
        classifier = plan.classifier
        self.num_features = int(keep[plan.dims[f"{classifier}.weight"][1]].sum()) if classifier else 0
        first = next((k for k, d in plan.dims.items() if len(d) == 4 and d[1] is not None
                      and int(plan.roots[d[1][0]]) == int(plan.roots[0])), "")
        self.default_cfg = {"classifier": classifier, "first_conv": first.rpartition(".")[0],
                            "input_size": (plan.in_chans, img_size, img_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._graph_forward(self, x)

    runs_in_parts = False  # the traced graph runs whole (forward); no stem/stages/head apart

    def residual_blocks(self) -> Iterator[tuple[int, int, BlockView]]:
        nodes = {n.name: n for n in self.plan.graph.nodes}
        for b in self.plan.blocks:
            if self._steps[b.stage][b.index] == 0:
                continue
            keys = []
            for name in sorted(b.branch):
                n = nodes[name]
                if n.op == "call_module":
                    keys += [f"{n.target}.{k}" for k, _ in self.get_submodule(n.target).named_parameters()]
                elif n.op == "get_attr" and is_parameter(self, n.target):
                    keys.append(n.target)
            step_key = f"{b.owner}.{b.step}" if b.owner else b.step
            yield b.stage, b.index, BlockView(self, tuple(dict.fromkeys(keys)), (b.step,), step_key)

    def step_keys(self) -> dict[str, tuple[int, int]]:
        return {view.step_key: (s, j) for s, j, view in self.residual_blocks()}

    def slice_index(self, key: str, slim_shape: torch.Size, full_shape: torch.Size) -> Index:
        """Where a tier's tensor sits in this (full) model's: recorded when the tier was built."""
        found = self.plan.index_cache.get((key, tuple(slim_shape)))
        if found is not None:
            return found
        if tuple(slim_shape) == tuple(full_shape) or not self.plan.dims.get(key):
            return super().slice_index(key, slim_shape, full_shape)
        raise NestError(f"{key}: no tier of shape {tuple(slim_shape)} was built from this plan")


def build_tier(source_key: tuple, make_source: Callable[[], Source], in_chans: int, img_size: int, num_classes: int,
               gamma_w: float = 1.0, channel_multiple: int = 1, steps=None) -> AutoNestedNet:
    """A tier of the plan of ``source_key`` (analysed once per process), on the current
    default device; records where each of its tensors sits in the full model's."""
    device = torch.empty(0).device  # the caller's (meta for shape-only models); ids live on the CPU
    with torch.device("cpu"):
        plan = cached_plan(source_key, in_chans, img_size, make_source)
        steps = resolve_steps(steps, plan.stage_depths)
        keep = plan.keep(gamma_w, channel_multiple)
        plan.check_groups(keep)
        plan.check_widths(keep, gamma_w, channel_multiple)
        gm, where = build_graph(plan, keep, steps, device)
        tier = (hash(keep.numpy().tobytes()), str(steps))
        if device.type != "meta" and tier not in plan.tried:  # a tier with data: its forward must run
            dry_run(gm, (2, in_chans, img_size, img_size), plan.source.name)
            plan.tried.add(tier)
    for key, index in where.items():
        if index:
            shape = tuple(i.stop - (i.start or 0) if isinstance(i, slice) else len(i) for i in index)
            previous = plan.index_cache.setdefault((key, shape), index)
            if previous is not index and any(type(a) is not type(b) or (isinstance(a, torch.Tensor) and not torch.equal(a, b))
                                             for a, b in zip(previous, index)):
                raise NestError(f"{key}: two tiers of shape {shape} keep different channels")
    net = AutoNestedNet(gm, plan, keep, steps, num_classes, img_size)
    return net.train()  # in training mode throughout, as every created model, whatever mode a user's module was in


def library_entry(name: str) -> Callable[..., AutoNestedNet]:
    """The ``create_model`` entry point of ``torchvision:NAME`` / ``timm:NAME``."""

    def entry(num_classes: int = 1000, in_chans: int = 3, img_size: int = 224, gamma_w: float = 1.0,
              channel_multiple: int = 1, steps=None) -> AutoNestedNet:
        return build_tier((name, num_classes, in_chans), lambda: library_source(name, num_classes, in_chans),
                      in_chans, img_size, num_classes, gamma_w, channel_multiple, steps)

    entry.__name__ = name
    entry.__doc__ = f"{name}, nested automatically (channel-dependency graph)."
    return entry


def model_info(name: str):
    """Registry metadata of ``torchvision:NAME`` / ``timm:NAME`` (built on demand)."""
    if not exists(name):
        raise UnknownModelError(f"unknown model {name!r}: no such torchvision or timm model")
    entry = library_entry(name)
    return ModelInfo(name, entry, __name__, entry.__doc__, AutoArgs)


__all__ = ["AutoArgs", "AutoNestedNet", "library_entry", "model_info"]

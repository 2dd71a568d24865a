"""DepthFL: depth-prefix submodels with a bottleneck classifier at every exit and mutual
self-distillation between exits.

A submodel of depth d keeps the stem and the first d stages of a zoo model whose stages output
feature maps (the ResNets). Each stage's output (the model's ``feature_info`` stages) feeds its own exit
classifier, stored in the global state under the extra keys ``exits.{i}.*`` (consistent, so
every exit is averaged over the clients holding it). The model's own classifier and the stages
a client does not hold are neither sent nor trained. A submodel's prediction is its deepest exit.
"""

from __future__ import annotations

import random
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ...slim import SliceEntry, SliceMap
from ...spec import SubmodelSpec, TierSpec, stage_depths
from ..local import LocalModel, load_entries
from ..strategy import register_method
from .nefl import Assignment, NeFL

EXIT_PREFIX = "exits"


def exit_head(channels: int, num_classes: int) -> nn.Sequential:
    """A bottleneck classifier: 3x3 conv, BN, ReLU, global pooling, linear."""
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes),
    )


class _ExitsNet(LocalModel):
    """The first ``len(exits)`` stages of a slim model with an exit classifier after each."""

    def __init__(self, net: nn.Module, exits: nn.ModuleList, held: set[str]):
        super().__init__()
        self.net, self.exits, self.held = net, exits, held

    def all_logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        # each exit right after its stage (not all stages first, as forward_intermediates
        # would): the order of the backward pass, and so the float sums, stay those of the
        # runs in benchmarks/README.md
        x = self.net.forward_stem(x)
        out = []
        for info, head in zip(self.net.feature_info, self.exits):
            x = self.net.get_submodule(info["module"])(x)
            out.append(head(x))
        return out

    def forward(self, x):
        return self.all_logits(x)[-1]

    def loss(self, x, y):
        logits = self.all_logits(x)
        loss = sum(F.cross_entropy(z, y) for z in logits)
        if len(logits) > 1:  # mutual distillation: every exit learns from every other exit
            probs = [F.softmax(z.detach(), 1) for z in logits]
            for i, z in enumerate(logits):
                log_p = F.log_softmax(z, 1)
                loss = loss + sum(F.kl_div(log_p, probs[j], reduction="batchmean") for j in range(len(logits)) if j != i) / (len(logits) - 1)
        return loss, logits[-1]

    def state(self):
        out = {k: v.detach().clone() for k, v in self.net.state_dict().items() if k in self.held}
        out.update({f"{EXIT_PREFIX}.{k}": v.detach().clone() for k, v in self.exits.state_dict().items()})
        return out


@register_method("depthfl", label="DepthFL")
class DepthFL(NeFL):
    """DepthFL (Kim et al.): one tier per stage prefix (``d1`` .. ``dS``); a client trains the
    deepest prefix whose parameters (exits included) fit its largest allowed resource level."""

    def __init__(self, spec: SubmodelSpec, train, settings=None, **run):
        super().__init__(spec, train, settings, **run)
        self._check_feature_maps()
        self._widths = [info["num_chs"] for info in self.compiled.feature_info]
        self.depth = {t: i + 1 for i, t in enumerate(self.tier_names)}
        self._exit_entries = self._exit_slices()
        self.held = {t: self._held(t) for t in self.tier_names}
        self.size = {t: sum(e.numel for e in self.held[t].values()) for t in self.tier_names}

    def method_spec(self, spec: SubmodelSpec) -> SubmodelSpec:
        depths = stage_depths(spec.model, tuple(sorted(spec.model_args.items())))
        tiers = [
            TierSpec(name=f"d{d}", steps=[[1.0 if s < d else 0.0] * n for s, n in enumerate(depths)], learnable_steps=False)
            for d in range(1, len(depths) + 1)
        ]
        return SubmodelSpec(model=spec.model, model_args=spec.model_args, tiers=tiers, inconsistent=["steps"])

    def _check_feature_maps(self) -> None:
        with torch.device("meta"):
            net = self.compiled.create_global_model()
            features = net.forward_intermediates(torch.empty(2, *self.compiled.input_size), intermediates_only=True)
        if any(f.ndim != 4 for f in features):
            raise ValueError(f"depthfl needs a model whose stages output feature maps (a ResNet), got {self.run_spec.model}")

    def _exits(self, depth: int) -> nn.ModuleList:
        return nn.ModuleList(exit_head(c, self.compiled.num_classes) for c in self._widths[:depth])

    def _exit_slices(self) -> list[dict[str, SliceEntry]]:
        """Per exit, the entries of its tensors (keys ``exits.{i}.*``)."""
        with torch.device("meta"):
            heads = self._exits(len(self._widths))
        out = []
        for i, head in enumerate(heads):
            entries = {}
            for mname, module in head.named_modules(prefix=f"{EXIT_PREFIX}.{i}"):
                kind = "norm" if isinstance(module, nn.BatchNorm2d) else "weight"
                for name, v in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                    entries[f"{mname}.{name}"] = SliceEntry(f"{mname}.{name}", (), tuple(v.shape), kind, True)
            out.append(entries)
        return out

    def _held(self, tier: str) -> dict[str, SliceEntry]:
        depth = self.depth[tier]
        stages = [f"{info['module']}." for info in self.compiled.feature_info]
        dropped = (*stages[depth:], f"{self.compiled.classifier}.")
        out = {k: e for k, e in self.compiled[tier].slice_map.items() if not k.startswith(dropped)}
        for entries in self._exit_entries[:depth]:
            out.update(entries)
        return out

    def assign(self, levels: list[str], rng: random.Random) -> Assignment | None:
        level = self.largest(levels)
        budget = self.level_size[level] / max(self.level_size.values()) * max(self.size.values())
        fitting = [t for t in self.tier_names if self.size[t] <= budget]
        tier = fitting[-1] if fitting else self.tier_names[0]
        return Assignment(tier, (tier,))

    def init_global_state(self) -> dict[str, torch.Tensor]:
        state = self.compiled.init_global_state()
        state.update({f"{EXIT_PREFIX}.{k}": v for k, v in self._exits(len(self._widths)).state_dict().items()})
        return state

    def entries(self, assignment: Assignment) -> Mapping[str, SliceEntry]:
        return self.held[assignment.tier]

    def _model(self, tier: str, arrays: Mapping[str, torch.Tensor]) -> _ExitsNet:
        net = self.compiled[tier].build()
        held = self.held[tier]
        unused = [k for k in self.compiled[tier].slice_map if k not in held]
        prefix = f"{EXIT_PREFIX}."
        load_entries(net, {k: v for k, v in arrays.items() if not k.startswith(prefix)}, unused)
        exits = self._exits(self.depth[tier])
        exits.load_state_dict({k.removeprefix(prefix): v for k, v in arrays.items() if k.startswith(prefix)})
        return _ExitsNet(net, exits, set(held))

    def local_model(self, assignment, arrays):
        return self._model(assignment.tier, arrays)

    def eval_model(self, global_state, tier, data):
        return self._model(tier, SliceMap(dict(self.held[tier])).extract(global_state)).eval()

"""DepthFL: depth-prefix submodels with a bottleneck classifier at every exit and mutual
self-distillation between exits.

A submodel of depth d keeps the stem and the first d stages (groups of blocks) of a zoo ResNet.
Each stage's output feeds its own exit classifier, stored in the global state under the extra
keys ``exits.{i}.*`` (consistent, so every exit is averaged over the clients holding it). The
model's own ``fc`` and the blocks of stages a client does not hold are neither sent nor trained.
A submodel's prediction is its deepest exit.
"""

from __future__ import annotations

import random
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ...models.resnet import ResNet
from ...slim import SliceEntry
from ...spec import SubmodelSpec, TierSpec, stage_depths
from .base import Assignment, LocalModel, Method, load_entries

EXIT_PREFIX = "exits"


def exit_head(channels: int, num_classes: int) -> nn.Sequential:
    """A bottleneck classifier: 3x3 conv, BN, ReLU, global pooling, linear."""
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes),
    )


class _ExitsNet(LocalModel):
    """The first ``depth`` stages of a slim ResNet with an exit classifier after each."""

    def __init__(self, net: ResNet, exits: nn.ModuleList, held: set[str]):
        super().__init__()
        self.net, self.exits, self.held = net, exits, held

    def all_logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        net = self.net
        x = net.maxpool(net.relu(net.bn1(net.conv1(x))))
        out = []
        for name, head in zip(net.stage_names, self.exits):
            x = getattr(net, name)(x)
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


class DepthFL(Method):
    """DepthFL (Kim et al.): one tier per stage prefix (``d1`` .. ``dS``); a client trains the
    deepest prefix whose parameters (exits included) fit its largest allowed resource level."""

    name = "depthfl"

    def __init__(self, spec: SubmodelSpec, config):
        super().__init__(spec, config)
        full = self.compiled.create_global_model()
        if not isinstance(full, ResNet):
            raise ValueError(f"depthfl needs a zoo ResNet, got {spec.model}")
        self._widths = [self._stage_channels(full, name) for name in full.stage_names]
        self.num_classes = full.fc.out_features
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

    @staticmethod
    def _stage_channels(full: ResNet, name: str) -> int:
        """Output channels of a stage of the full model (the last conv of its last block)."""
        return [m for m in getattr(full, name).modules() if isinstance(m, nn.Conv2d)][-1].out_channels

    def _exits(self, depth: int) -> nn.ModuleList:
        return nn.ModuleList(exit_head(c, self.num_classes) for c in self._widths[:depth])

    def _exit_slices(self) -> dict[str, SliceEntry]:
        with torch.device("meta"):
            heads = self._exits(len(self._widths))
        out = {}
        for mname, module in heads.named_modules():
            kind = "norm" if isinstance(module, nn.BatchNorm2d) else "weight"
            for name, v in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                key = f"{EXIT_PREFIX}.{mname}.{name}"
                out[key] = SliceEntry(key, (), tuple(v.shape), kind, True)
        return out

    def _held(self, tier: str) -> dict[str, SliceEntry]:
        depth = self.depth[tier]
        stages = self.compiled.stage_names
        kept = tuple(f"{s}." for s in stages[:depth])
        out = {
            k: e for k, e in self.compiled[tier].slice_map.items()
            if k.startswith(kept) or not k.startswith((*(f"{s}." for s in stages), "fc."))
        }
        out.update({k: e for k, e in self._exit_entries.items() if int(k.split(".")[1]) < depth})
        return out

    def map_tier(self, level: str) -> str | None:
        budget = self.level_size[level] / max(self.level_size.values()) * max(self.size.values())
        fitting = [t for t in self.tier_names if self.size[t] <= budget]
        return fitting[-1] if fitting else self.tier_names[0]

    def assign(self, allowed: list[str], rng: random.Random) -> Assignment | None:
        tier = self.map_tier(self.largest(allowed))
        return Assignment(tier, (tier,))

    def init_global_state(self) -> dict[str, torch.Tensor]:
        state = self.compiled.init_global_state()
        state.update({f"{EXIT_PREFIX}.{k}": v for k, v in self._exits(len(self._widths)).state_dict().items()})
        return state

    def entries(self, assignment: Assignment) -> Mapping[str, SliceEntry]:
        return self.held[assignment.tier]

    def _model(self, tier: str, state: Mapping[str, torch.Tensor]) -> _ExitsNet:
        net = self.compiled[tier].build()
        held = self.held[tier]
        unused = [k for k in self.compiled[tier].slice_map if k not in held]
        load_entries(net, {k: v for k, v in state.items() if not k.startswith(f"{EXIT_PREFIX}.")}, unused)
        exits = self._exits(self.depth[tier])
        prefix = f"{EXIT_PREFIX}."
        exits.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
        return _ExitsNet(net, exits, set(held))

    def local_model(self, assignment, state):
        return self._model(assignment.tier, state)

    def eval_model(self, global_state, tier, bn_batches=None):
        entries = self.held[tier]
        return self._model(tier, {k: e.gather(global_state[e.global_key]).clone() for k, e in entries.items()}).eval()

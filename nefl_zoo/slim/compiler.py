"""Compile a :class:`~nefl_zoo.spec.SubmodelSpec` into slim modules and slice maps.

``compile_spec(spec)`` is the one representation of a nested model: for every tier a recipe
for a physically slimmed ``nn.Module`` (narrower layers, removed blocks absent) and the
:class:`SliceMap` that places each of its tensors in the global state. Extraction, aggregation,
Flower payloads and export all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from ..models import create_model
from ..spec import SubmodelSpec, TierSpec
from .slicemap import SliceEntry, SliceMap, tier_key

GlobalState = dict[str, torch.Tensor]


@dataclass(frozen=True)
class CompiledTier:
    """One tier: how to build its slim module and where its tensors live globally."""

    spec: SubmodelSpec
    tier: TierSpec
    slice_map: SliceMap

    @property
    def name(self) -> str:
        return self.tier.name

    def build(self) -> nn.Module:
        """A freshly initialised slim module (step sizes frozen if not learnable)."""
        model = create_model(self.spec.model, **self.spec.model_args, **self.spec.tier_args(self.tier))
        if not self.tier.learnable_steps:
            for name, p in model.named_parameters():
                if self.slice_map[name].kind == "steps":
                    p.requires_grad_(False)
        return model

    def extract(self, global_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This tier's state dict, gathered from the global state."""
        return self.slice_map.extract(global_state)

    def scatter_(self, global_state: Mapping[str, torch.Tensor], sub_state: Mapping[str, torch.Tensor]) -> None:
        """Write this tier's state dict back into the global state (in place)."""
        self.slice_map.scatter_(global_state, sub_state)

    def load(self, global_state: Mapping[str, torch.Tensor]) -> nn.Module:
        """The slim module carrying this tier's weights from the global state."""
        model = self.build()
        model.load_state_dict(self.extract(global_state), strict=True)
        return model


class CompiledSpec:
    """A spec compiled against its model: global tensor layout and one :class:`CompiledTier` per tier.

    Also what the full model declares: ``input_size``, ``stage_names``, ``num_classes``,
    ``num_features``, ``feature_info``, ``classifier`` (module name) and ``step_keys``.
    """

    def __init__(self, spec: SubmodelSpec):
        self.spec = spec
        with torch.device("meta"):
            full = create_model(spec.model, **spec.model_args)
        self.input_size: tuple[int, int, int] = tuple(full.default_cfg["input_size"])
        self.stage_names: tuple[str, ...] = full.stage_names
        self.num_classes: int = full.num_classes
        self.num_features: int = full.num_features
        self.feature_info: list[dict] = [dict(info) for info in full.feature_info]
        self.classifier: str = full.default_cfg["classifier"]
        self.step_keys: dict[str, tuple[int, int]] = full.step_keys()
        self.kinds: dict[str, str] = full.param_kinds()
        full_state = full.state_dict()
        self.full_shapes = {k: v.shape for k, v in full_state.items()}
        self.full_dtypes = {k: v.dtype for k, v in full_state.items()}
        self.tiers: dict[str, CompiledTier] = {}
        #: per tier, where each per-tier tensor's initial value sits in the full model's tensor
        self.sources: dict[str, dict[str, SliceEntry]] = {}
        for tier in spec.tiers:
            with torch.device("meta"):
                slim = create_model(spec.model, **spec.model_args, **spec.tier_args(tier))
            entries, sources = {}, {}
            for key, value in slim.state_dict().items():
                kind = self.kinds[key]
                index = full.slice_index(key, value.shape, self.full_shapes[key])
                if self.is_consistent(kind):
                    entries[key] = SliceEntry(key, index, tuple(value.shape), kind, True)
                else:
                    entries[key] = SliceEntry(tier_key(key, tier.name), (), tuple(value.shape), kind, False)
                    sources[key] = SliceEntry(key, index, tuple(value.shape), kind, True)
            self.tiers[tier.name] = CompiledTier(spec, tier, SliceMap(entries))
            self.sources[tier.name] = sources

    def is_consistent(self, kind: str) -> bool:
        """Whether tensors of ``kind`` are shared by all tiers."""
        return kind not in self.spec.inconsistent

    def __getitem__(self, tier: str) -> CompiledTier:
        if tier not in self.tiers:
            raise KeyError(f"no tier {tier!r}; tiers: {', '.join(self.tiers)}")
        return self.tiers[tier]

    def global_shapes(self) -> dict[str, torch.Size]:
        """Shape of every tensor of the global state."""
        shapes = {k: s for k, s in self.full_shapes.items() if self.is_consistent(self.kinds[k])}
        for ct in self.tiers.values():
            for e in ct.slice_map.values():
                if not e.consistent:
                    shapes[e.global_key] = torch.Size(e.shape)
        return shapes

    def create_global_model(self, pretrained: str | None = None) -> nn.Module:
        """The full-size model (``gamma_w = 1``, every block, every step 1)."""
        return create_model(self.spec.model, pretrained=pretrained, **self.spec.model_args)

    def init_global_state(self, model: nn.Module | None = None) -> GlobalState:
        """Global state from a full-size model (a fresh one if ``None``).

        Shared tensors are the model's; each tier's norms are the model's cut to the tier's
        channels (its slice region; so pretrained statistics are kept) and its step sizes are
        the spec's values.
        """
        full = (model or self.create_global_model()).state_dict()
        state = {k: v.detach().clone() for k, v in full.items() if self.is_consistent(self.kinds[k])}
        for ct in self.tiers.values():
            for key, e in ct.slice_map.items():
                if e.consistent:
                    continue
                if e.kind == "steps":
                    stage, block = self.step_keys[key]
                    value = ct.tier.steps[stage][block] if ct.tier.steps else 1.0
                    state[e.global_key] = torch.tensor(float(value), dtype=self.full_dtypes[key])
                else:
                    state[e.global_key] = self.sources[ct.name][key].gather(full[key]).clone()
        return state


def compile_spec(spec: SubmodelSpec) -> CompiledSpec:
    """Compile ``spec`` (see :class:`CompiledSpec`)."""
    return CompiledSpec(spec)


def build_submodel(spec: SubmodelSpec, tier: str | TierSpec) -> nn.Module:
    """A physically slimmed, freshly initialised module for one tier of ``spec``."""
    name = tier if isinstance(tier, str) else tier.name
    return compile_spec(spec)[name].build()


def extract(global_state: Mapping[str, torch.Tensor], spec: SubmodelSpec | CompiledSpec, tier: str) -> dict[str, torch.Tensor]:
    """Gather one tier's state dict from the global state."""
    compiled = spec if isinstance(spec, CompiledSpec) else compile_spec(spec)
    return compiled[tier].extract(global_state)


def scatter_(global_state: Mapping[str, torch.Tensor], spec: SubmodelSpec | CompiledSpec, tier: str, sub_state: Mapping[str, torch.Tensor]) -> None:
    """Write one tier's state dict back into the global state (inverse of :func:`extract`)."""
    compiled = spec if isinstance(spec, CompiledSpec) else compile_spec(spec)
    compiled[tier].scatter_(global_state, sub_state)

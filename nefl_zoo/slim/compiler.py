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
    """One tier: how to build its slim module and where its tensors live globally.

    Made by :func:`compile_spec`; ``compiled[name]`` gives one.

    Attributes:
        spec: the spec the tier belongs to.
        tier: the tier's own spec.
        slice_map: where each tensor of the tier's slim module lives in the global state.
    """

    spec: SubmodelSpec
    tier: TierSpec
    slice_map: SliceMap

    @property
    def name(self) -> str:
        return self.tier.name

    def build(self) -> nn.Module:
        """A freshly initialised slim module (step sizes frozen if not learnable).

        Returns:
            The tier's slim module, with random weights.
        """
        model = create_model(self.spec.model, **self.spec.model_args, **self.spec.tier_args(self.tier))
        if not self.tier.learnable_steps:
            for name, p in model.named_parameters():
                if self.slice_map[name].kind == "steps":
                    p.requires_grad_(False)
        return model

    def extract(self, global_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This tier's state dict, gathered from the global state.

        Args:
            global_state: the global state (:meth:`CompiledSpec.init_global_state`).

        Returns:
            The slim module's state dict, in fresh tensors.
        """
        return self.slice_map.extract(global_state)

    def scatter_(self, global_state: Mapping[str, torch.Tensor], sub_state: Mapping[str, torch.Tensor]) -> None:
        """Write this tier's state dict back into the global state (in place).

        Args:
            global_state: the global state, changed in place.
            sub_state: a state dict of this tier's slim module.
        """
        self.slice_map.scatter_(global_state, sub_state)

    def load(self, global_state: Mapping[str, torch.Tensor]) -> nn.Module:
        """The slim module carrying this tier's weights from the global state.

        Args:
            global_state: the global state.

        Returns:
            The tier's slim module, with its weights copied out of ``global_state``.

        Examples:
            >>> import nefl_zoo as nz
            >>> compiled = nz.compile_spec(nz.load_spec("specs/resnet20/nefl-w.yaml"))
            >>> small = compiled["g0.2"].load(compiled.init_global_state())
            >>> small.conv1
            Conv2d(1, 7, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False)
        """
        model = self.build()
        model.load_state_dict(self.extract(global_state), strict=True)
        return model


class CompiledSpec:
    """A spec compiled against its model: global tensor layout and one :class:`CompiledTier` per tier.

    Also what the full model declares: ``input_size``, ``stage_names``, ``num_classes``,
    ``num_features``, ``feature_info``, ``classifier`` (module name) and ``step_keys``.
    ``compiled[name]`` is the :class:`CompiledTier` of a tier (``KeyError`` for another name).

    Args:
        spec: the validated spec to compile.

    Attributes:
        tiers: the compiled tiers, by name, in the spec's order.
        full_shapes: the shape of every tensor of the full model.

    Examples:
        >>> import nefl_zoo as nz
        >>> compiled = nz.compile_spec(nz.load_spec("specs/resnet20/nefl-w.yaml"))
        >>> list(compiled.tiers), compiled.input_size
        (['g0.2', 'g0.4', 'g0.6', 'g0.8', 'g1'], (1, 16, 16))
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
        """Whether tensors of ``kind`` are shared by all tiers.

        Args:
            kind: a parameter kind: ``weight``, ``norm`` or ``steps``.

        Returns:
            ``False`` for the kinds the spec lists as ``inconsistent``.
        """
        return kind not in self.spec.inconsistent

    def __getitem__(self, tier: str) -> CompiledTier:
        if tier not in self.tiers:
            raise KeyError(f"no tier {tier!r}; tiers: {', '.join(self.tiers)}")
        return self.tiers[tier]

    def global_shapes(self) -> dict[str, torch.Size]:
        """Shape of every tensor of the global state.

        Returns:
            Global key to shape: shared tensors at full size, each tier's ``KEY@TIER`` tensors
            at the tier's size.
        """
        shapes = {k: s for k, s in self.full_shapes.items() if self.is_consistent(self.kinds[k])}
        for ct in self.tiers.values():
            for e in ct.slice_map.values():
                if not e.consistent:
                    shapes[e.global_key] = torch.Size(e.shape)
        return shapes

    def create_global_model(self, pretrained: str | None = None) -> nn.Module:
        """The full-size model (``gamma_w = 1``, every block, every step 1).

        Args:
            pretrained: weights to load, as :func:`~nefl_zoo.models.load_pretrained` takes
                them (a file, or ``torchvision:NAME`` / ``timm:NAME``); ``None``: random.

        Returns:
            The full model.
        """
        return create_model(self.spec.model, pretrained=pretrained, **self.spec.model_args)

    def init_global_state(self, model: nn.Module | None = None) -> GlobalState:
        """Global state from a full-size model (a fresh one if ``None``).

        Shared tensors are the model's; each tier's norms are the model's cut to the tier's
        channels (its slice region; so pretrained statistics are kept) and its step sizes are
        the spec's values.

        Args:
            model: a full-size model whose weights to start from.

        Returns:
            The global state: a flat ``dict[str, Tensor]``.

        Examples:
            >>> import nefl_zoo as nz
            >>> compiled = nz.compile_spec(nz.load_spec("specs/resnet20/nefl-w.yaml"))
            >>> state = compiled.init_global_state()
            >>> [key for key in state if key.startswith("bn1.weight")][:2]
            ['bn1.weight@g0.2', 'bn1.weight@g0.4']
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
    """Compile ``spec``: a slim-module recipe and a slice map for each of its tiers.

    Args:
        spec: the validated spec.

    Returns:
        The compiled spec (see :class:`CompiledSpec`).

    Examples:
        >>> import nefl_zoo as nz
        >>> compiled = nz.compile_spec(nz.load_spec("specs/resnet20/nefl-w.yaml"))
        >>> compiled["g0.2"].slice_map["conv1.weight"].shape
        (7, 1, 3, 3)
    """
    return CompiledSpec(spec)


def build_submodel(spec: SubmodelSpec, tier: str | TierSpec) -> nn.Module:
    """A physically slimmed, freshly initialised module for one tier of ``spec``.

    Args:
        spec: the validated spec.
        tier: the tier, by name or as its spec.

    Returns:
        The tier's slim module, with random weights.

    Raises:
        KeyError: no tier of that name.

    Examples:
        >>> import torch
        >>> import nefl_zoo as nz
        >>> model = nz.build_submodel(nz.load_spec("specs/resnet20/nefl-w.yaml"), "g0.2")
        >>> model(torch.zeros(1, 1, 16, 16)).shape
        torch.Size([1, 10])
    """
    name = tier if isinstance(tier, str) else tier.name
    return compile_spec(spec)[name].build()


def extract(global_state: Mapping[str, torch.Tensor], spec: SubmodelSpec | CompiledSpec, tier: str) -> dict[str, torch.Tensor]:
    """Gather one tier's state dict from the global state.

    Args:
        global_state: the global state.
        spec: the spec, compiled or not.
        tier: the tier's name.

    Returns:
        The tier's state dict.

    Examples:
        >>> import nefl_zoo as nz
        >>> compiled = nz.compile_spec(nz.load_spec("specs/resnet20/nefl-w.yaml"))
        >>> sub = nz.extract(compiled.init_global_state(), compiled, "g0.2")
        >>> sub["conv1.weight"].shape
        torch.Size([7, 1, 3, 3])
    """
    compiled = spec if isinstance(spec, CompiledSpec) else compile_spec(spec)
    return compiled[tier].extract(global_state)


def scatter_(global_state: Mapping[str, torch.Tensor], spec: SubmodelSpec | CompiledSpec, tier: str, sub_state: Mapping[str, torch.Tensor]) -> None:
    """Write one tier's state dict back into the global state (inverse of :func:`extract`).

    Args:
        global_state: the global state, changed in place.
        spec: the spec, compiled or not.
        tier: the tier's name.
        sub_state: a state dict of the tier's slim module.
    """
    compiled = spec if isinstance(spec, CompiledSpec) else compile_spec(spec)
    compiled[tier].scatter_(global_state, sub_state)

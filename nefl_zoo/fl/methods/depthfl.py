"""DepthFL in two variants (``method_args.variant``).

``original`` (Kim et al., ICLR 2023): submodel ``t`` keeps the contiguous depth prefix of the
full model (block granularity, in stage order) whose parameter ratio is nearest the tier's
``gamma``; every submodel has an exit: a bottleneck of depthwise-separable convolutions (one per
stage the prefix does not reach, to the last stage's channels and resolution) and a linear
classifier, stored in the global state as ``exits.{i}.*`` (``i``: the submodel's position). A
client trains every exit up to its submodel with cross-entropy plus mutual self-distillation whose
weight ramps up as ``exp(-5 (1 - t/R)^2)``, and with FedDyn's regulariser (:mod:`.feddyn`); BN
and every tensor are shared (averaged over the clients holding them, 1 each).

``nefl`` (the NeFL paper's baseline, its footnote on depthwise scaling and the authors' code):
the blocks each tier of a NeFL-D spec keeps (non-contiguous), step sizes fixed at 1, one shared
classifier and BN, plain cross-entropy, no exits and no distillation. ``nested``: the appendix's
reading (contiguous skipping blocks, each submodel a subset of the larger): every tier keeps the
first k blocks in stage order (``resnet20/depthfl-nested``); ``bn: per_tier``: its BN decoupling.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Literal, Mapping

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from ...slim import CompiledSpec, SliceEntry, SliceMap, compile_spec
from ...spec import SubmodelSpec, TierSpec, stage_depths
from ..strategy.base import Aggregate, ClientInfo, Instruction, MethodSettings, Reply, Run, State
from ..strategy.local_model import LocalModel, load_entries
from ..strategy.registry import register_method
from .common import Nested, fit_reply, level_sizes, module_macs, require_parts
from .feddyn import FedDynLocal, client_update, server_update

EXIT_PREFIX = "exits"
ENSEMBLE = "ensemble"


def prefix_steps(depths: list[int], blocks: int) -> list[list[float]]:
    """Step sizes keeping the first ``blocks`` residual blocks (stage order), skipping the rest."""
    out, start = [], 0
    for n in depths:
        out.append([1.0 if start + j < blocks else 0.0 for j in range(n)])
        start += n
    return out


def nested_prefixes(spec: SubmodelSpec) -> dict[str, int]:
    """Per tier of ``spec``, the k of its depth prefix (the first k blocks in stage order), each
    holding the previous tier's; one-line ``ValueError`` naming the first tier that is not."""
    depths = list(stage_depths(spec.model, tuple(sorted(spec.model_args.items()))))
    total, out, previous = sum(depths), {}, None
    for t in spec.tiers:
        kept = [bool(v) for stage in t.steps for v in stage] if t.steps is not None else [True] * total
        blocks = sum(kept)
        if kept != [True] * blocks + [False] * (total - blocks):
            per_stage = [sum(1 for v in stage if v) for stage in t.steps]
            steps = [[int(v) for v in stage] for stage in prefix_steps(depths, blocks)]
            raise ValueError(f"depthfl nested: tier {t.name} keeps blocks per stage {per_stage}, not a contiguous depth "
                             f"prefix of {spec.model} (its first {blocks} of {total} blocks in stage order would be steps "
                             f"{steps}); use a spec whose tiers keep the first k blocks, e.g. resnet20/depthfl-nested, "
                             "or drop method_args.nested")
        if previous is not None and blocks < out[previous]:
            raise ValueError(f"depthfl nested: tier {t.name} keeps the first {blocks} blocks, fewer than tier {previous} before "
                             f"it ({out[previous]}), so it is not a superset of it; list the tiers smallest first")
        out[t.name], previous = blocks, t.name
    return out


def prefix_ratios(spec: SubmodelSpec) -> dict[int, float]:
    """Parameter ratio of every depth prefix (1 .. all blocks) of ``spec``'s full model that skips
    only blocks the model can skip (``fixed_blocks``): a skipped block loses its branch (step
    included); a skipped first block keeps its projection. One-line ``ValueError`` when only the
    full model is left."""
    with torch.device("meta"):
        full = compile_spec(spec).create_global_model()
    total = sum(p.numel() for p in full.parameters())
    blocks = list(full.residual_blocks())
    branches = [sum(p.numel() for _, p in block.branch_parameters()) for _, _, block in blocks]
    fixed = [b for b, (s, j, _) in enumerate(blocks) if (s, j) in full.fixed_blocks()]
    if fixed and fixed[-1] == len(blocks) - 1:
        s, j, _ = blocks[-1]
        raise ValueError(f"depthfl needs a model whose trailing blocks can be skipped: {spec.model}'s last block "
                         f"(stage {s + 1} block {j}) cannot be, so its only depth prefix is the full model; "
                         "use nefl, heterofl or fjord (width nesting)")
    first = fixed[-1] + 1 if fixed else 1
    return {b: (total - sum(branches[b:])) / total for b in range(first, len(branches) + 1)}


def mutual_distillation(logits: list[torch.Tensor]) -> torch.Tensor:
    """DepthFL's mutual self-distillation: every exit's KL divergence from each other exit's
    (detached) softmax, averaged over the others, summed over exits."""
    if len(logits) < 2:
        return logits[0].new_zeros(())
    probs = [F.softmax(z.detach(), 1) for z in logits]
    total = logits[0].new_zeros(())
    for i, z in enumerate(logits):
        log_p = F.log_softmax(z, 1)
        total = total + sum(F.kl_div(log_p, probs[j], reduction="batchmean") for j in range(len(logits)) if j != i) / (len(logits) - 1)
    return total


def kd_weight(server_round: int, rounds: int, rampup: float) -> float:
    """DepthFL's distillation weight in round ``server_round`` (1-based) of ``rounds``:
    ``exp(-5 (1 - t/R)^2)`` with ``t = min(round - 1, R)`` and ``R = max(1, round(rampup * rounds))``
    (the authors' code ramps over 300 of its 1000 rounds: ``rampup`` 0.3)."""
    span = max(1, round(rampup * rounds))
    return math.exp(-5.0 * (1.0 - min(server_round - 1, span) / span) ** 2)


class SepConv(nn.Sequential):
    """DepthFL's bottleneck unit: depthwise 3x3 (``stride``), pointwise, BN, ReLU, depthwise 3x3,
    pointwise to ``c_out``, BN, ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__(nn.Conv2d(c_in, c_in, 3, stride, 1, groups=c_in, bias=False), nn.Conv2d(c_in, c_in, 1, bias=False),
                         nn.BatchNorm2d(c_in), nn.ReLU(), nn.Conv2d(c_in, c_in, 3, 1, 1, groups=c_in, bias=False),
                         nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class Exit(nn.Module):
    """One exit: ``bottleneck`` (a :class:`SepConv` per ``(c_in, c_out, stride)`` of the stages its
    prefix does not reach; none for a prefix ending in the last stage), then the model's pooling
    and the linear classifier ``fc``."""

    def __init__(self, stages: list[tuple[int, int, int]], num_features: int, num_classes: int):
        super().__init__()
        self.bottleneck = nn.Sequential(*(SepConv(*s) for s in stages))
        self.fc = nn.Linear(num_features, num_classes)


class _ExitsNet(LocalModel):
    """One submodel's slim network with the exits of every submodel whose prefix it contains.

    ``bounds[i]`` is exit ``i``'s prefix (blocks of the full architecture); exit ``i`` reads the
    features after those blocks through its bottleneck. The loss is cross-entropy at every exit
    plus ``kd_weight`` times :func:`mutual_distillation`.
    """

    def __init__(self, net: nn.Module, exits: nn.ModuleDict, bounds: list[int], depths: list[int], held: set[str], kd_weight: float):
        super().__init__()
        self.net, self.exits, self.bounds, self.held, self.kd_weight = net, exits, bounds, held, kd_weight
        starts = [sum(depths[:s]) for s in range(len(depths))]
        self.trunk = [(starts[s] + j, block) for s, j, block in net.residual_blocks() if starts[s] + j < bounds[-1]]

    def all_logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The logits of every exit, shallowest first."""
        x = self.net.forward_stem(x)
        out, t = [], 0
        for head, bound in zip(self.exits.values(), self.bounds):
            while t < len(self.trunk) and self.trunk[t][0] < bound:
                x = self.trunk[t][1](x)
                t += 1
            out.append(head.fc(self.net.forward_head(self.net.forward_norm(head.bottleneck(x)), pre_logits=True)))
        return out

    def forward(self, x):
        return self.all_logits(x)[-1]

    def loss(self, x, y):
        logits = self.all_logits(x)
        loss = sum(F.cross_entropy(z, y) for z in logits)
        if self.kd_weight:
            loss = loss + self.kd_weight * mutual_distillation(logits)
        return loss, logits[-1]

    def state_parameters(self) -> dict[str, nn.Parameter]:
        """The trainable parameters by their key in :meth:`state`."""
        out = {k: p for k, p in self.net.named_parameters() if k in self.held}
        out.update({f"{EXIT_PREFIX}.{k}": p for k, p in self.exits.named_parameters()})
        return out

    def state(self):
        out = {k: v.detach().clone() for k, v in self.net.state_dict().items() if k in self.held}
        out.update({f"{EXIT_PREFIX}.{k}": v.detach().clone() for k, v in self.exits.state_dict().items()})
        return out


class _Ensemble(nn.Module):
    """The mean softmax of every exit of one :class:`_ExitsNet`."""

    def __init__(self, exits_net: _ExitsNet):
        super().__init__()
        self.exits_net = exits_net

    def forward(self, x):
        return torch.stack([F.softmax(z, 1) for z in self.exits_net.all_logits(x)]).mean(0)


class DepthFLSettings(MethodSettings):
    """``method_args`` of ``depthfl``."""

    variant: Literal["original", "nefl"] = Field(
        "original", description="original: DepthFL's paper (exits with bottlenecks, mutual distillation, FedDyn); "
        "nefl: the NeFL paper's baseline (a NeFL-D spec's blocks, one shared classifier and BN, cross-entropy)")
    kd: bool | None = Field(None, description="mutual self-distillation among a client's exits (none: on for "
                            "variant original; nefl has no exits)")
    kd_rampup: float = Field(0.3, gt=0, le=1, description="share of the rounds over which the distillation weight ramps "
                             "up as exp(-5 (1 - t/R)^2) (the authors' code: 300 of 1000 rounds)")
    feddyn: bool | None = Field(None, description="FedDyn's regulariser and server update (none: on for variant "
                                "original, DepthFL's default; off for nefl)")
    feddyn_alpha: float = Field(0.1, gt=0, description="FedDyn's alpha (the authors' 0.1)")
    nested: bool = Field(False, description="variant nefl, the NeFL appendix's reading: every tier keeps the first k "
                         "blocks in stage order, each within the next (e.g. resnet20/depthfl-nested); other specs refused")
    bn: Literal["shared", "per_tier"] = Field("shared", description="variant nefl: BN shared (the NeFL authors' code) or "
                                              "per_tier (the appendix's BN decoupling, averaged per submodel)")

    @model_validator(mode="after")
    def _variant(self) -> "DepthFLSettings":
        for name in ("kd", "feddyn"):
            if self.variant == "nefl" and getattr(self, name):
                raise ValueError(f"{name}: variant nefl (the NeFL paper's DepthFL) has neither exits nor FedDyn")
        for name, off in (("nested", False), ("bn", "shared")):
            if self.variant == "original" and getattr(self, name) != off:
                raise ValueError(f"{name}: variant original builds its own nested prefixes with shared BN; {name} is for variant nefl")
        return self

    @property
    def distil(self) -> bool:
        """Whether clients distil between exits (``kd``, or the variant's default)."""
        return self.kd if self.kd is not None else self.variant == "original"

    @property
    def dynamic(self) -> bool:
        """Whether FedDyn is on (``feddyn``, or the variant's default)."""
        return self.feddyn if self.feddyn is not None else self.variant == "original"


def nefl_depth_spec(spec: SubmodelSpec, per_tier_bn: bool = False) -> SubmodelSpec:
    """The NeFL paper's DepthFL on ``spec``'s tiers: the blocks each tier keeps (non-contiguous, as a
    NeFL-D spec skips them) with step sizes fixed at 1, and nothing per tier (one shared classifier
    and BN, as the NeFL authors' code; ``per_tier_bn``: BN per tier). One-line ``ValueError`` for a tier that narrows widths."""
    for t in spec.tiers:
        if t.gamma_w != 1:
            raise ValueError(f"depthfl variant nefl takes the blocks of a depth-only (NeFL-D) spec; tier {t.name} has "
                             f"gamma_w {t.gamma_w} (use a NeFL-D spec, e.g. resnet20/nefl-d)")
    tiers = [t.model_copy(update={"learnable_steps": False,
                                  "steps": None if t.steps is None else [[1.0 if v else 0.0 for v in stage] for stage in t.steps]})
             for t in spec.tiers]
    return spec.model_copy(update={"tiers": tiers, "inconsistent": ["norm"] if per_tier_bn else []})


class Prefixes:
    """DepthFL's submodels: per tier of the run's spec, the contiguous depth prefix whose
    parameter ratio is nearest the tier's ``gamma`` (its measured ratio without one; ties: the
    shallower), as a compiled spec with nothing per tier, and the exits every prefix holds."""

    def __init__(self, spec: SubmodelSpec):
        self.depths = list(stage_depths(spec.model, tuple(sorted(spec.model_args.items()))))
        sizes = level_sizes(compile_spec(spec))
        ratios = prefix_ratios(spec)
        full = max(sizes.values())
        #: per submodel, the residual blocks it keeps (its exit's position)
        self.bounds = {
            t.name: min(ratios, key=lambda b: (abs(ratios[b] - (t.gamma if t.gamma is not None else sizes[t.name] / full)), b))
            for t in spec.tiers
        }
        tiers = [TierSpec(name=t.name, gamma=t.gamma, steps=prefix_steps(self.depths, self.bounds[t.name]), learnable_steps=False)
                 for t in spec.tiers]
        self.compiled: CompiledSpec = compile_spec(SubmodelSpec(model=spec.model, model_args=spec.model_args, tiers=tiers, inconsistent=[]))
        with torch.device("meta"):
            net = self.compiled.create_global_model()
            require_parts(net, "depthfl", spec.model)
            features = net.forward_intermediates(torch.empty(2, *self.compiled.input_size), intermediates_only=True)
        if any(f.ndim != 4 for f in features):
            raise ValueError(f"depthfl needs a model whose stages output feature maps (a ResNet), got {spec.model}")
        info = net.feature_info
        #: per stage (c_in, c_out, stride) of the bottleneck unit that stands in for it
        self.stage_units = [(info[s - 1]["num_chs"], info[s]["num_chs"], info[s]["reduction"] // info[s - 1]["reduction"]) if s else None
                            for s in range(len(info))]
        self.names = list(self.compiled.tiers)
        self.exit_index = {t: i for i, t in enumerate(self.names)}
        self.held = {t: self._held(t) for t in self.names}

    def _exit(self, tier: str) -> Exit:
        """A fresh exit of ``tier``: a bottleneck unit per stage after the one its prefix ends in."""
        bound, start, last = self.bounds[tier], 0, 0
        for s, n in enumerate(self.depths):
            if start < bound:
                last = s
            start += n
        return Exit(self.stage_units[last + 1:], self.compiled.num_features, self.compiled.num_classes)

    def _exits(self, tiers: list[str]) -> nn.ModuleDict:
        """Fresh exits of ``tiers``, keyed by their global index."""
        return nn.ModuleDict({str(self.exit_index[t]): self._exit(t) for t in tiers})

    def exits_of(self, tier: str) -> list[str]:
        """The submodels whose exits a client of ``tier`` trains (every one whose prefix ``tier``
        contains), shallowest first."""
        rank = {t: (self.bounds[t], i) for i, t in enumerate(self.names)}
        return sorted((t for t in self.names if rank[t] <= rank[tier]), key=rank.__getitem__)

    def _held(self, tier: str) -> dict[str, SliceEntry]:
        """The tier's tensors but its classifier and the projections of blocks past its prefix,
        and its exits."""
        with torch.device("meta"):
            net = self.compiled[tier].build()
            exits = self._exits(self.exits_of(tier))
        names = {id(m): n for n, m in net.named_modules()}
        starts = [sum(self.depths[:s]) for s in range(len(self.depths))]
        unused = [f"{names[id(block)]}." for s, j, block in net.residual_blocks() if starts[s] + j >= self.bounds[tier]]
        unused.append(f"{self.compiled.classifier}.")
        out = {k: e for k, e in self.compiled[tier].slice_map.items() if not k.startswith(tuple(unused))}
        for k, v in exits.state_dict().items():
            key = f"{EXIT_PREFIX}.{k}"
            out[key] = SliceEntry(key, (), tuple(v.shape), "weight", True)
        return out

    def init_global_state(self) -> dict[str, torch.Tensor]:
        """The compiled spec's state and every exit (global RNG)."""
        state = self.compiled.init_global_state()
        state.update({f"{EXIT_PREFIX}.{k}": v for k, v in self._exits(self.names).state_dict().items()})
        return state

    def model(self, tier: str, arrays: Mapping[str, torch.Tensor] | None, weight: float = 0.0) -> _ExitsNet:
        """``tier``'s slim network with its exits, carrying ``arrays`` (its held tensors; none: as
        initialised), distilling with ``weight``."""
        net = self.compiled[tier].build()
        names = self.exits_of(tier)
        exits = self._exits(names)
        if arrays is not None:
            prefix = f"{EXIT_PREFIX}."
            unused = [k for k in self.compiled[tier].slice_map if k not in self.held[tier]]
            load_entries(net, {k: v for k, v in arrays.items() if not k.startswith(prefix)}, unused)
            exits.load_state_dict({k.removeprefix(prefix): v for k, v in arrays.items() if k.startswith(prefix)})
        return _ExitsNet(net, exits, [self.bounds[t] for t in names], self.depths, set(self.held[tier]), weight)

    def eval_model(self, global_state, name: str, data) -> nn.Module:
        """A submodel at its own exit; ``ensemble``: the deepest submodel's exits' mean softmax."""
        tier = max(self.names, key=lambda t: (self.bounds[t], self.exit_index[t])) if name == ENSEMBLE else name
        model = self.model(tier, SliceMap(dict(self.held[tier])).extract(global_state))
        return _Ensemble(model) if name == ENSEMBLE else model


@register_method("depthfl", label="DepthFL", settings=DepthFLSettings)
class DepthFL(Nested):
    """DepthFL (Kim et al.), variant ``original``: submodel ``t`` of the run's spec is the
    contiguous depth prefix whose parameter ratio is nearest ``t``'s ``gamma`` (its measured ratio
    without one; ties: the shallower), with an exit (bottleneck and classifier) per submodel. A
    client picks its submodel like NeFL's and trains the exits of every submodel up to it with
    cross-entropy plus ramped-up mutual distillation and FedDyn. Evaluated: every submodel at its
    own exit, and ``ensemble`` (the full submodel's exits' mean softmax). Variant ``nefl``: the
    NeFL paper's DepthFL on a NeFL-D spec (one classifier, cross-entropy, shared BN); with
    ``nested``, the appendix's reading on a spec of contiguous nested prefixes (checked)."""

    def __init__(self, run: Run, settings: DepthFLSettings | None = None):
        settings = settings if settings is not None else DepthFLSettings()
        self.h: State = {}
        self.num_clients = 0
        if settings.variant == "nefl":
            spec = nefl_depth_spec(run.spec, per_tier_bn=settings.bn == "per_tier")
            self.prefix_blocks = nested_prefixes(spec) if settings.nested else None  # per tier: its prefix's blocks
            super().__init__(run, settings, compiled=compile_spec(spec), send_steps=False)
            return
        #: the prefixes, their exits and what each holds
        self.prefixes = prefixes = Prefixes(run.spec)
        super().__init__(run, settings, compiled=prefixes.compiled, entries=prefixes.held.__getitem__, client_model=prefixes.model,
                         eval_model=prefixes.eval_model, init=prefixes.init_global_state, extra_eval=[ENSEMBLE],
                         train_macs=lambda tier: module_macs(prefixes.model(tier, None), prefixes.compiled.input_size))

    def configure_train(self, server_round: int, global_state, clients: list[ClientInfo]) -> dict[int, Instruction]:
        self.num_clients = len(clients)  # FedDyn's M
        return super().configure_train(server_round, global_state, clients)

    def aggregate_train(self, server_round: int, global_state, replies: Mapping[int, Reply]) -> Aggregate:
        """The average (1 per client); with FedDyn, moved by the server's ``h`` (:func:`~.feddyn.server_update`)."""
        result = super().aggregate_train(server_round, global_state, replies)
        if self.settings.variant == "nefl" or not self.settings.dynamic:
            return result
        bad = {cid for cid, _ in result.rejected}
        holders = Counter(e.global_key for cid, r in replies.items() if cid not in bad for e in self.entries(r.level).values())
        state = server_update(self.h, global_state, result.state, holders, max(self.num_clients, 1), self.settings.feddyn_alpha)
        return Aggregate(state, result.accepted, result.rejected, result.metrics)

    def local_model(self, instruction: Instruction) -> LocalModel | None:
        """The nefl variant's plain submodel; none for the original, whose step also takes the
        round's distillation weight and FedDyn's client state (:meth:`train`)."""
        return super().local_model(instruction) if self.settings.variant == "nefl" else None

    def train(self, instruction: Instruction, data, client_state: State) -> Reply:
        if self.settings.variant == "nefl":
            return super().train(instruction, data, client_state)
        weight = kd_weight(int(instruction.config["round"]), self.run.rounds, self.settings.kd_rampup) if self.settings.distil else 0.0
        model = self.prefixes.model(instruction.level, instruction.arrays, weight)
        if not self.settings.dynamic:
            return fit_reply(model, data, instruction)
        alpha = self.settings.feddyn_alpha
        reply = fit_reply(FedDynLocal(model, model.state_parameters(), client_state, alpha), data, instruction)
        client_update(client_state, instruction.arrays, reply.arrays, alpha)  # the client's linear term, kept between rounds
        return reply

    def server_state(self) -> State:
        return dict(self.h)

    def load_server_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.h = dict(state)

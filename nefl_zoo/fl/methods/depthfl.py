"""DepthFL as the NeFL paper's baseline (appendix "Baselines"): contiguous depth prefixes at the
run's parameter ratios, an exit classifier per prefix, BN decoupled per submodel and mutual
self-distillation among the exits a client trains.

Submodel ``t`` keeps the first ``prefix[t]`` residual blocks of the full architecture (block
granularity, in stage order: NeFL-D with the trailing blocks skipped, step sizes fixed at 1);
the projection shortcuts of the skipped stages' first blocks stay as the downsampling layers
that bring its features to the classifier's input size. Each submodel has its own exit
classifier, stored in the global state as ``exits.{i}.weight/bias`` (``i``: the submodel's
position; consistent, so averaged over the clients holding it), and its own BatchNorm
(``inconsistent: [norm]``). The model's own classifier is not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from ...slim import CompiledSpec, SliceEntry, SliceMap, compile_spec
from ...spec import SubmodelSpec, TierSpec, stage_depths
from ..local import LocalModel, load_entries
from ..registry import register_method
from ..strategy import MethodSettings, Run
from ..strategy_utils import Nested, level_sizes

EXIT_PREFIX = "exits"
ENSEMBLE = "ensemble"


def prefix_steps(depths: list[int], blocks: int) -> list[list[float]]:
    """Step sizes keeping the first ``blocks`` residual blocks (stage order), skipping the rest."""
    out, start = [], 0
    for n in depths:
        out.append([1.0 if start + j < blocks else 0.0 for j in range(n)])
        start += n
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


class _ExitsNet(LocalModel):
    """One submodel's slim network with the exits of every submodel whose prefix it contains.

    ``bounds[i]`` is exit ``i``'s prefix (blocks of the full architecture); exit ``i`` reads the
    features after those blocks, brings them to the classifier's input through the next stages'
    projection shortcuts (ReLU after each, as in a skipped block), pools and classifies.
    """

    def __init__(self, net: nn.Module, exits: nn.ModuleDict, bounds: list[int], depths: list[int], held: set[str], kd: bool):
        super().__init__()
        self.net, self.exits, self.bounds, self.held, self.kd = net, exits, bounds, held, kd
        starts = [sum(depths[:s]) for s in range(len(depths))]
        self.trunk = [(starts[s] + j, block) for s, j, block in net.residual_blocks() if starts[s] + j < bounds[-1]]
        self.firsts = {s: block for s, j, block in net.residual_blocks() if j == 0}
        self.starts = starts

    def _downsample(self, x: torch.Tensor, blocks: int) -> torch.Tensor:
        for s, start in enumerate(self.starts):
            if start >= blocks and getattr(self.firsts.get(s), "downsample", None) is not None:
                x = F.relu(self.firsts[s].downsample(x))
        return x

    def all_logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The logits of every exit, shallowest first."""
        x = self.net.forward_stem(x)
        out, t = [], 0
        for head, bound in zip(self.exits.values(), self.bounds):
            while t < len(self.trunk) and self.trunk[t][0] < bound:
                x = self.trunk[t][1](x)
                t += 1
            out.append(head(self.net.forward_head(self.net.forward_norm(self._downsample(x, bound)), pre_logits=True)))
        return out

    def forward(self, x):
        return self.all_logits(x)[-1]

    def loss(self, x, y):
        logits = self.all_logits(x)
        loss = sum(F.cross_entropy(z, y) for z in logits)
        if self.kd:
            loss = loss + mutual_distillation(logits)
        return loss, logits[-1]

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

    kd: bool = Field(True, description="mutual self-distillation among a client's exits")


class Prefixes:
    """DepthFL's submodels: per tier of the run's spec, the contiguous depth prefix whose
    parameter ratio is nearest the tier's ``gamma`` (its measured ratio without one; ties: the
    shallower), as a compiled spec with BN per tier, and the exits every prefix holds."""

    def __init__(self, spec: SubmodelSpec, kd: bool):
        self.kd = kd
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
        self.compiled: CompiledSpec = compile_spec(SubmodelSpec(model=spec.model, model_args=spec.model_args, tiers=tiers, inconsistent=["norm"]))
        with torch.device("meta"):
            net = self.compiled.create_global_model()
            features = net.forward_intermediates(torch.empty(2, *self.compiled.input_size), intermediates_only=True)
        if any(f.ndim != 4 for f in features):
            raise ValueError(f"depthfl needs a model whose stages output feature maps (a ResNet), got {spec.model}")
        self.names = list(self.compiled.tiers)
        self.exit_index = {t: i for i, t in enumerate(self.names)}
        self.held = {t: self._held(t) for t in self.names}

    def _exits(self, tiers: list[str]) -> nn.ModuleDict:
        """Fresh exit classifiers of ``tiers``, keyed by their global index."""
        return nn.ModuleDict({str(self.exit_index[t]): nn.Linear(self.compiled.num_features, self.compiled.num_classes) for t in tiers})

    def exits_of(self, tier: str) -> list[str]:
        """The submodels whose exits a client of ``tier`` trains (every one whose prefix ``tier``
        contains), shallowest first."""
        rank = {t: (self.bounds[t], i) for i, t in enumerate(self.names)}
        return sorted((t for t in self.names if rank[t] <= rank[tier]), key=rank.__getitem__)

    def _held(self, tier: str) -> dict[str, SliceEntry]:
        classifier = f"{self.compiled.classifier}."
        out = {k: e for k, e in self.compiled[tier].slice_map.items() if not k.startswith(classifier)}
        for i in (self.exit_index[t] for t in self.exits_of(tier)):
            for name, shape in (("weight", (self.compiled.num_classes, self.compiled.num_features)), ("bias", (self.compiled.num_classes,))):
                key = f"{EXIT_PREFIX}.{i}.{name}"
                out[key] = SliceEntry(key, (), shape, "weight", True)
        return out

    def init_global_state(self) -> dict[str, torch.Tensor]:
        """The compiled spec's state and every exit (global RNG)."""
        state = self.compiled.init_global_state()
        state.update({f"{EXIT_PREFIX}.{k}": v for k, v in self._exits(self.names).state_dict().items()})
        return state

    def model(self, tier: str, arrays) -> _ExitsNet:
        """``tier``'s slim network with its exits, carrying ``arrays`` (its held tensors)."""
        net = self.compiled[tier].build()
        prefix = f"{EXIT_PREFIX}."
        unused = [k for k in self.compiled[tier].slice_map if k not in self.held[tier]]
        load_entries(net, {k: v for k, v in arrays.items() if not k.startswith(prefix)}, unused)
        names = self.exits_of(tier)
        exits = self._exits(names)
        exits.load_state_dict({k.removeprefix(prefix): v for k, v in arrays.items() if k.startswith(prefix)})
        bounds = [self.bounds[t] for t in names]
        return _ExitsNet(net, exits, bounds, self.depths, set(self.held[tier]), self.kd)

    def eval_model(self, global_state, name: str, data) -> nn.Module:
        """A submodel at its own exit; ``ensemble``: the deepest submodel's exits' mean softmax."""
        tier = max(self.names, key=lambda t: (self.bounds[t], self.exit_index[t])) if name == ENSEMBLE else name
        model = self.model(tier, SliceMap(dict(self.held[tier])).extract(global_state))
        return _Ensemble(model) if name == ENSEMBLE else model


@register_method("depthfl", label="DepthFL", settings=DepthFLSettings)
class DepthFL(Nested):
    """DepthFL (Kim et al.) as the NeFL paper's baseline: submodel ``t`` of the run's spec is the
    contiguous depth prefix whose parameter ratio is nearest ``t``'s ``gamma`` (its measured ratio
    without one; ties: the shallower), with its own exit classifier and BN. A client picks its
    submodel like NeFL's and trains the exits of every submodel up to it, with cross-entropy at
    every exit plus mutual distillation. Evaluated: every submodel at its own exit, and
    ``ensemble`` (the full submodel's exits' mean softmax)."""

    def __init__(self, run: Run, settings: DepthFLSettings | None = None):
        settings = settings if settings is not None else DepthFLSettings()
        #: the prefixes, their exits and what each holds
        self.prefixes = prefixes = Prefixes(run.spec, settings.kd)
        super().__init__(run, settings, compiled=prefixes.compiled, entries=prefixes.held.__getitem__, client_model=prefixes.model,
                         eval_model=prefixes.eval_model, init=prefixes.init_global_state, extra_eval=[ENSEMBLE])

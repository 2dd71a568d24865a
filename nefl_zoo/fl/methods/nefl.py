"""NeFL: any spec (W, D, D_O, WD), per-tier step sizes and norms, dynamic submodel choice, and
NeFedAvg. The other nested methods are small subclasses that adjust one or two of its steps."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from ...slim import CompiledSpec, SliceEntry, SliceMap, compile_spec
from ...spec import SubmodelSpec, TierSpec
from ..aggregate import Update, nefedavg
from ..client import evaluate, fit
from ..local import LocalModel, SubmodelLocal, load_entries
from ..strategy import Aggregate, ClientInfo, CompiledStrategy, Instruction, Reply, State, register_method

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    """What one client trains this round: its submodel and every tier whose tensors it updates."""

    tier: str
    tiers: tuple[str, ...]

    def to_config(self) -> dict:
        """As flat config entries (``tier``, ``tiers``)."""
        return {"tier": self.tier, "tiers": list(self.tiers)}

    @classmethod
    def from_config(cls, config: Mapping) -> "Assignment":
        """Read back :meth:`to_config`'s entries (``KeyError`` if absent)."""
        return cls(str(config["tier"]), tuple(str(t) for t in config["tiers"]))


@register_method("nefl", label="NeFL")
class NeFL(CompiledStrategy):
    """NeFL as in the paper.

    A client picks a random submodel among the resource levels its environment allows; it
    receives that submodel's tensors (its slice map), trains it with cross-entropy and returns
    it; :func:`~nefl_zoo.fl.aggregate.nefedavg` averages every element over the clients holding
    it (consistent tensors: NeFedAvg; ``KEY@TIER`` tensors: FedAvg per tier). Learnable step
    sizes follow each tier's ``learnable_steps``; ``inconsistent`` in the spec decides which
    tensors are kept per tier.

    Subclasses adjust :meth:`method_spec` (what is trained), :meth:`assign` (who trains what),
    :meth:`entries` (which tensors travel), :meth:`local_model` (the client's loss) and
    :meth:`eval_model` (what is evaluated).
    """

    def __init__(self, spec: SubmodelSpec, train, settings=None, **run):
        super().__init__(spec, train, settings, **run)
        levels = compile_spec(spec)
        #: elements of each resource level (the run spec's tiers), in spec order
        self.level_size = {name: ct.slice_map.numel() for name, ct in levels.tiers.items()}
        method_spec = self.method_spec(spec)
        self.compiled: CompiledSpec = levels if method_spec is spec else compile_spec(method_spec)

    def largest(self, levels: list[str]) -> str:
        """The largest resource level among ``levels`` (by parameter count)."""
        return max(levels, key=self.level_size.__getitem__)

    # -- what each method adjusts ---------------------------------------------------------
    def method_spec(self, spec: SubmodelSpec) -> SubmodelSpec:
        """The spec this method trains (NeFL: the run's spec as written)."""
        return spec

    def assign(self, levels: list[str], rng: random.Random) -> Assignment | None:
        """NeFL's dynamic environment: a random allowed submodel each round (None: sits out)."""
        tier = rng.choice(levels)
        return Assignment(tier, (tier,))

    def entries(self, assignment: Assignment) -> Mapping[str, SliceEntry]:
        """The tensors a client with ``assignment`` receives and returns."""
        return self.compiled[assignment.tier].slice_map

    def local_model(self, assignment: Assignment, arrays: Mapping[str, torch.Tensor]) -> LocalModel:
        """The client's trainable model, loaded from the received tensors."""
        net = self.compiled[assignment.tier].build()
        load_entries(net, arrays)
        return SubmodelLocal(net)

    def eval_model(self, global_state: Mapping[str, torch.Tensor], tier: str, data) -> nn.Module:
        """The model evaluated as ``tier`` (one of :attr:`eval_names`; ``data``: the run's datasets)."""
        return self.compiled[tier].load(global_state)

    @property
    def eval_names(self) -> list[str]:
        """The models evaluated: every submodel (a method may add others, e.g. an ensemble)."""
        return self.tier_names

    # -- hooks ------------------------------------------------------------------------------
    def init_global_state(self) -> State:
        return self.compiled.init_global_state()

    def configure_train(self, server_round: int, global_state, clients: list[ClientInfo]) -> dict[int, Instruction]:
        rng = random.Random(f"{self.seed}:assign:{server_round - 1}")
        out = {}
        for client in self.sample(server_round, clients):
            assignment = self.assign(list(client.levels), rng)
            if assignment is None:
                continue
            arrays = SliceMap(dict(self.entries(assignment))).extract(global_state)
            out[client.cid] = Instruction(arrays, {**self.train_config_for(server_round, client.cid), **assignment.to_config()})
        return out

    def train(self, instruction: Instruction, data, client_state: State) -> Reply:
        assignment = Assignment.from_config(instruction.config)
        local = self.local_model(assignment, instruction.arrays)
        result = fit(local, data, instruction.config)
        return Reply(result.state, {"num_samples": result.num_samples, **result.metrics, **assignment.to_config()})

    def aggregate_train(self, server_round: int, global_state, replies: Mapping[int, Reply]) -> Aggregate:
        updates, rejected = [], []
        for cid, reply in replies.items():
            reason = reply.error
            if reason is None:
                try:
                    entries = self.entries(Assignment.from_config(reply.metrics))
                    updates.append(Update(entries, reply.arrays, self.reply_weight(reply), cid))
                except (KeyError, TypeError, ValueError) as exc:
                    reason = f"reply metrics do not name a submodel of {self.name} ({exc})"
            if reason is not None:
                log.warning("client %s: reply rejected: %s", cid, reason)
                rejected.append((cid, reason))
        state, invalid = nefedavg(global_state, updates)
        return Aggregate(state, len(updates) - len(invalid), rejected + invalid)

    def evaluate(self, server_round: int, global_state, data) -> dict[str, float]:
        """Accuracy of every model of :attr:`eval_names` under every BN treatment of
        ``eval_bn``, as ``TREATMENT/NAME``; the submodels' under the first treatment also by name."""
        if self.eval_per_client:
            return {}
        out = {}
        for treatment in self.eval_bn:
            for name in self.eval_names:
                model = self.with_bn(self.eval_model(global_state, name, data), treatment, data)
                out[f"{treatment}/{name}"] = evaluate(model, data.test, self.eval_batch_size)
                if treatment == self.eval_bn[0] and name in self.tier_names:
                    out[name] = out[f"{treatment}/{name}"]
        return out

    def configure_evaluate(self, server_round: int, global_state, clients: list[ClientInfo]) -> dict[int, Instruction]:
        """With ``eval.per_client``: every client receives the submodel of its largest allowed
        resource level (the one it would deploy), to score it on its own test split."""
        if not self.eval_per_client:
            return {}
        out = {}
        for client in clients:
            assignment = self.assign([self.largest(list(client.levels))], random.Random(0))
            if assignment is not None:
                arrays = SliceMap(dict(self.entries(assignment))).extract(global_state)
                out[client.cid] = Instruction(arrays, {"client": client.cid, **assignment.to_config()})
        return out

    def evaluate_client(self, instruction: Instruction, data, client_state: State) -> Reply:
        assignment = Assignment.from_config(instruction.config)
        accuracy = evaluate(self.local_model(assignment, instruction.arrays), data, self.eval_batch_size)
        return Reply({}, {"accuracy": accuracy, "num_samples": len(data), "tier": assignment.tier})

    def aggregate_evaluate(self, server_round: int, replies: Mapping[int, Reply]) -> dict[str, float]:
        return mean_accuracy_per_tier(replies, self.tier_names)

    def submodel_numel(self, tier: str) -> int:
        return sum(e.numel for e in self.entries(Assignment(tier, (tier,))).values())


def single_tier_spec(spec: SubmodelSpec, tier: TierSpec) -> SubmodelSpec:
    """``spec`` reduced to one of its tiers."""
    return spec.model_copy(update={"tiers": [tier]})


def mean_accuracy_per_tier(replies: Mapping[int, Reply], order: list[str]) -> dict[str, float]:
    """The mean of the replies' ``accuracy`` over the clients of each ``tier``, in ``order``."""
    by_tier: dict[str, list[float]] = {}
    for reply in replies.values():
        by_tier.setdefault(str(reply.metrics["tier"]), []).append(float(reply.metrics["accuracy"]))
    return {t: sum(by_tier[t]) / len(by_tier[t]) for t in order if t in by_tier}

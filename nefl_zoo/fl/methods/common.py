"""The pieces methods share, as plain functions and one composable strategy (the way Flower's
strategies call ``strategy_utils``): client sampling and seeds, the instruction config of local
training, reply weights, resource levels, width-only and single-tier specs, evaluation under
every BN treatment of ``eval.bn``, per-level means of client evaluations, and :class:`Nested`,
a nested method assembled from parts (NeFL is :class:`Nested` with every default).

Methods import from here and from the packages below them (the interface and registry,
:mod:`nefl_zoo.fl.strategy`; local training, :mod:`nefl_zoo.fl.training`; aggregation,
:mod:`nefl_zoo.fl.aggregation`), never from another method's file. Also here:
:func:`weight_scale`, the method's client weights scaled for secure aggregation.
"""

from __future__ import annotations

import logging
import random
from typing import Callable, Collection, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ...slim import CompiledSpec, SliceEntry, SliceMap, compile_spec
from ...spec import SubmodelSpec, TierSpec
from ..aggregation.nefedavg import Update
from ..aggregation.rules import aggregate_updates
from ..aggregation.secagg import SecureAggregation, sum_error
from ..strategy.base import (
    Aggregate,
    ClientInfo,
    ConfigValue,
    Instruction,
    MethodInfo,
    MethodSettings,
    Reply,
    Run,
    State,
    Strategy,
)
from ..strategy.local_model import LocalModel, SubmodelLocal, load_entries
from ..training.bn import BN_TREATMENTS, recompute_batches, recompute_bn
from ..training.client import evaluate, fit, learning_rate

log = logging.getLogger(__name__)


# -- clients and their instructions ------------------------------------------------------------
def sample_clients(run: Run, server_round: int, clients: Sequence[ClientInfo]) -> list[ClientInfo]:
    """This round's clients: ``round(fraction * n)`` (at least one), seeded by run seed and
    round, in the order of ``clients``."""
    rng = random.Random(f"{run.seed}:sample:{server_round - 1}")
    picked = sorted(rng.sample(range(len(clients)), max(1, round(run.fraction * len(clients)))))
    return [clients[i] for i in picked]


def client_seed(run: Run, server_round: int, cid: int) -> int:
    """The seed of one client's local training in one round."""
    return int(np.random.SeedSequence([run.seed, server_round - 1, cid]).generate_state(1)[0])


def train_config(run: Run, server_round: int, cid: int) -> dict[str, ConfigValue]:
    """The instruction config of local training (what :func:`~nefl_zoo.fl.training.client.fit` reads):
    round, client, seed, lr and the :class:`~nefl_zoo.fl.strategy.sections.TrainConfig` fields a client needs."""
    cfg = run.train
    out: dict[str, ConfigValue] = {
        "round": server_round, "client": cid, "seed": client_seed(run, server_round, cid),
        "lr": learning_rate(cfg, server_round - 1, run.rounds), "local_epochs": cfg.local_epochs,
        "batch_size": cfg.batch_size, "min_batch": cfg.min_batch, "last_batch": cfg.last_batch,
        "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
    }
    if cfg.grad_clip is not None:
        out["grad_clip"] = cfg.grad_clip
    return out


def fit_reply(local: LocalModel, data, instruction: Instruction) -> Reply:
    """Train ``local`` on ``data`` as ``instruction`` says; the reply carries its state, sample
    count, mean loss, training accuracy and level."""
    return fit(local, data, instruction.config).reply(instruction.level)


def reply_weight(run: Run, reply: Reply, default: str = "clients") -> float:
    """A reply's aggregation weight under ``train.weighting`` (``None``: the method's ``default``):
    1 per client (``clients``) or the client's sample count (``samples``)."""
    return 1.0 if (run.train.weighting or default) == "clients" else float(reply.num_samples)


# -- resource levels and specs -----------------------------------------------------------------
def require_parts(net: nn.Module, method: str, model: str) -> None:
    """A one-line ``ValueError`` unless ``net`` runs its stem, stages and head apart (what
    FedGH's extractor, DepthFL's exits and FedLPS's encoder/predictors split)."""
    if not getattr(net, "runs_in_parts", True):
        raise ValueError(f"{method}: {model} runs only whole (nested automatically), but {method} needs its stages and head "
                         "apart; use a zoo model (`nefl-zoo models`)")


def level_sizes(compiled: CompiledSpec) -> dict[str, int]:
    """Elements of each tier of ``compiled`` (a resource level when it is the run spec), in spec order."""
    return {name: ct.slice_map.numel() for name, ct in compiled.tiers.items()}


def largest(levels: Collection[str], sizes: Mapping[str, int]) -> str:
    """The largest of ``levels`` by ``sizes`` (ties: the first)."""
    return max(levels, key=sizes.__getitem__)


def single_tier_spec(spec: SubmodelSpec, tier: TierSpec) -> SubmodelSpec:
    """``spec`` reduced to one of its tiers."""
    return spec.model_copy(update={"tiers": [tier]})


def single_model(run: Run, tier: TierSpec, only_allowed: bool = False) -> dict:
    """The :class:`Nested` parts of FedAvg on one ``tier`` of the run's spec, step sizes fixed
    and not sent: every sampled client trains it, or with ``only_allowed`` only the clients
    whose environment allows it; averaged by sample counts (FedAvg's n_k / n)."""
    one = tier.model_copy(update={"learnable_steps": False})
    compiled = compile_spec(single_tier_spec(run.spec, one))

    def assign(levels: Sequence[str], rng: random.Random) -> str | None:
        return one.name if not only_allowed or one.name in levels else None

    return {"compiled": compiled, "assign": assign, "send_steps": False, "weighting": "samples"}


def width_spec(spec: SubmodelSpec, inconsistent: list[str]) -> SubmodelSpec:
    """Width-only tiers with the parameter ratios of ``spec``'s tiers and fixed step sizes: a
    width-only tier keeps its ``gamma_w`` (the same widths as NeFL-W), a tier that skips blocks
    takes its nominal ``gamma`` as width ratio."""
    def skips(t: TierSpec) -> bool:
        return t.steps is not None and any(v == 0 for stage in t.steps for v in stage)

    tiers = [
        TierSpec(name=t.name, gamma_w=t.gamma if skips(t) and t.gamma is not None else t.gamma_w, learnable_steps=False,
                 gamma=t.gamma, channel_multiple=t.channel_multiple)
        for t in spec.tiers
    ]
    return SubmodelSpec(model=spec.model, model_args=spec.model_args, channel_multiple=spec.channel_multiple, tiers=tiers,
                        inconsistent=inconsistent)


# -- evaluation --------------------------------------------------------------------------------
def bn_treatments(run: Run) -> tuple[str, ...]:
    """The BN treatments evaluated (:mod:`nefl_zoo.fl.training.bn`): ``eval.bn`` first, then the other with ``eval.bn_both``."""
    first = run.eval.bn
    return (first, *(t for t in BN_TREATMENTS if t != first and run.eval.bn_both))


def with_bn(model: nn.Module, treatment: str, run: Run, data) -> nn.Module:
    """``model`` in eval mode with the BN statistics of ``treatment`` (``recompute``: on
    ``eval.bn_batches`` batches of ``data.train_eval`` shuffled with the run seed,
    :func:`~nefl_zoo.fl.training.bn.recompute_bn`, so every method and submodel sees the same batches)."""
    if treatment == "recompute":
        recompute_bn(model, recompute_batches(data.train_eval, run.train.batch_size, run.seed, run.eval.bn_batches))
    return model.eval()


def evaluate_treatments(run: Run, score: Callable[[str], Mapping[str, float]], plain: Collection[str]) -> dict[str, float]:
    """``score(treatment)`` (accuracy by name) for every BN treatment, as ``TREATMENT/NAME``;
    the names in ``plain`` under the first treatment also by name."""
    out: dict[str, float] = {}
    for i, treatment in enumerate(bn_treatments(run)):
        for name, acc in score(treatment).items():
            out[f"{treatment}/{name}"] = acc
            if i == 0 and name in plain:
                out[name] = acc
    return out


def mean_accuracy_per_level(replies: Mapping[int, Reply], order: Sequence[str], metric: str = "accuracy") -> dict[str, float]:
    """The mean of the replies' ``metric`` over the clients of each level, in ``order``
    (replies with an error or no level are left out)."""
    by_level: dict[str, list[float]] = {}
    for reply in replies.values():
        if reply.error is None and reply.level is not None:
            by_level.setdefault(reply.level, []).append(float(reply.metrics[metric]))
    return {t: sum(by_level[t]) / len(by_level[t]) for t in order if t in by_level}


def module_macs(module: nn.Module, input_size: tuple[int, ...]) -> int:
    """Forward MACs of ``module`` per image of ``input_size`` (fvcore, :func:`~nefl_zoo.profile.count_macs`)."""
    from ...profile import count_macs  # fvcore: imported only when counted

    return count_macs(module, input_size)


def random_level(levels: Sequence[str], rng: random.Random) -> str | None:
    """NeFL's dynamic environment: a random allowed level each round."""
    return rng.choice(levels)


# -- the composable nested strategy -------------------------------------------------------------
class Nested(Strategy):
    """A nested method assembled from parts: a client trains one tier (its level) of a compiled
    spec, receives and returns that tier's slice of the global state, and
    :func:`~nefl_zoo.fl.aggregation.nefedavg.nefedavg` averages every element over the clients holding it
    (consistent tensors: NeFedAvg; ``KEY@TIER`` tensors: FedAvg per tier), or as ``run.aggregation``
    says (:func:`~nefl_zoo.fl.aggregation.aggregate_updates`: clipping, median, trimmed mean, DP,
    whose denominators are the clients :meth:`configure_train` assigned). Every tier is
    evaluated on the server under each BN treatment, or, with ``eval.per_client``, every
    client's largest allowed level on its own test split.

    Args:
        run, settings: as for every :class:`~nefl_zoo.fl.strategy.Strategy`.
        compiled: the spec the method trains (default: the run's spec). Its tier names are
            the resource levels clients are assigned.
        assign: ``(allowed levels, rng) -> level`` a sampled client trains this round, or
            ``None`` to sit out (default :func:`random_level`).
        entries: ``level -> slice entries`` of the tensors a client of that level receives and
            returns (default: the tier's slice map).
        client_model: ``(level, tensors) -> LocalModel`` a client trains (default: the slim
            tier with cross-entropy, :meth:`submodel`).
        eval_model: ``(global state, name, data) -> module`` evaluated as ``name`` (default:
            the tier carrying its entries).
        init: ``() -> State``, the initial global state (default: the compiled spec's).
        extra_eval: names evaluated besides the tiers, reported only as ``TREATMENT/NAME``.
        static_bn: BN statistics are not trained, so they are always recomputed at evaluation.
        send_steps: whether step sizes travel; without, they stay the spec's constants.
        weighting: the method's own aggregation weights (``clients`` or ``samples``, its paper's),
            used unless ``train.weighting`` says otherwise (:func:`reply_weight`).
        train_macs: ``level -> MACs`` a client of that level spends per training image in the
            forward passes of its local step (default: the tier's forward MACs, :meth:`client_macs`).

    The parts are plain callables given to the constructor (as Flower's strategies take
    ``evaluate_fn``); the class calls none of its own methods while it is set up.
    """

    robust_aggregation = True

    def __init__(self, run: Run, settings: MethodSettings | None = None, *, compiled: CompiledSpec | None = None,
                 assign: Callable[[Sequence[str], random.Random], str | None] = random_level,
                 entries: Callable[[str], Mapping[str, SliceEntry]] | None = None,
                 client_model: Callable[[str, Mapping[str, torch.Tensor]], LocalModel] | None = None,
                 eval_model: Callable[[Mapping[str, torch.Tensor], str, object], nn.Module] | None = None,
                 init: Callable[[], State] | None = None, extra_eval: Sequence[str] = (),
                 static_bn: bool = False, send_steps: bool = True, weighting: str = "clients",
                 train_macs: Callable[[str], float] | None = None):
        super().__init__(run, settings)
        levels = compile_spec(run.spec) if compiled is None or compiled.spec is not run.spec else compiled
        #: elements of each resource level (the run spec's tiers), in spec order
        self.level_size = level_sizes(levels)
        self.compiled: CompiledSpec = compiled or levels
        self.send_steps, self.static_bn, self.extra_eval = send_steps, static_bn, tuple(extra_eval)
        #: the method's own aggregation weights (``train.weighting`` overrides them)
        self.weighting = weighting
        self._train_macs = train_macs
        self.assign = assign
        self.entries = entries or self._tier_entries
        self.client_model = client_model or (lambda tier, arrays: SubmodelLocal(self.submodel(tier, arrays), exclude=self._steps(tier)))
        self.eval_model = eval_model or (lambda state, tier, data: self.submodel(tier, SliceMap(dict(self._tier_entries(tier))).extract(state)))
        self._init = init
        #: (round, client -> level) of the last :meth:`configure_train`: DP's fixed denominators
        self.assigned: tuple[int, dict[int, str]] = (0, {})
        tiers = tuple(self.compiled.tiers)
        numel = {t: sum(e.numel for e in self.entries(t).values()) for t in tiers}
        sizes = level_sizes(self.compiled)
        self.info = MethodInfo(self.compiled.spec, self.compiled.input_size, self.compiled.num_classes, tiers, tiers, numel,
                               worst_case=min(tiers, key=sizes.__getitem__))

    # -- the default parts ------------------------------------------------------------------
    def _tier_entries(self, tier: str) -> Mapping[str, SliceEntry]:
        slice_map = self.compiled[tier].slice_map
        return slice_map if self.send_steps else {k: e for k, e in slice_map.items() if e.kind != "steps"}

    def _steps(self, tier: str) -> set[str]:
        """The step sizes of ``tier`` that do not travel (none with ``send_steps``)."""
        return set() if self.send_steps else {k for k, e in self.compiled[tier].slice_map.items() if e.kind == "steps"}

    def submodel(self, tier: str, arrays: Mapping[str, torch.Tensor]) -> nn.Module:
        """The slim module of ``tier`` carrying ``arrays`` (without ``send_steps``, its step
        sizes stay the spec's constants)."""
        net = self.compiled[tier].build()
        load_entries(net, arrays, unused=self._steps(tier))
        return net

    def client_macs(self, level: str) -> float:
        """Forward MACs a client of ``level`` spends per training image (fvcore counts; one
        multiply-add = 1): the method's ``train_macs``, by default the tier's slim module's."""
        if self._train_macs is not None:
            return self._train_macs(level)
        from ...profile import macs_signature, tier_macs  # fvcore: imported only when counted

        tier = self.compiled[level]
        return tier_macs(macs_signature(self.compiled.spec, tier.tier, self.compiled.input_size), tier.build)  # cached per signature

    # -- server hooks -----------------------------------------------------------------------
    def init_global_state(self) -> State:
        if self._init is not None:
            return self._init()
        state = self.compiled.init_global_state()
        if self.send_steps:
            return state
        keys = {e.global_key for tier in self.compiled.tiers for e in self.entries(tier).values()}
        return {k: v for k, v in state.items() if k in keys}

    def configure_train(self, server_round: int, global_state, clients: list[ClientInfo]) -> dict[int, Instruction]:
        rng = random.Random(f"{self.run.seed}:assign:{server_round - 1}")
        out = {}
        for client in sample_clients(self.run, server_round, clients):
            tier = self.assign(list(client.levels), rng)
            if tier is not None:
                arrays = SliceMap(dict(self.entries(tier))).extract(global_state)
                out[client.cid] = Instruction(arrays, train_config(self.run, server_round, client.cid), tier)
        self.assigned = (server_round, {cid: i.level for cid, i in out.items()})
        return out

    def aggregate_train(self, server_round: int, global_state, replies: Mapping[int, Reply]) -> Aggregate:
        config, (assigned_round, assigned) = self.run.aggregation, self.assigned
        if config.dp is not None and assigned_round != server_round:
            raise RuntimeError(f"{self.name}: aggregation.dp needs configure_train of round {server_round} first (its denominators)")
        updates, rejected = [], []
        for cid, reply in replies.items():
            reason = reply.error
            if reason is None and reply.level not in self.compiled.tiers:
                reason = f"reply level {reply.level!r} is not a submodel of {self.name}"
            if reason is None and config.dp is not None and reply.level != assigned.get(cid):
                reason = f"reply level {reply.level!r} is not the assigned {assigned.get(cid)!r}"
            if reason is not None:
                log.warning("client %s: reply rejected: %s", cid, reason)
                rejected.append((cid, reason))
                continue
            updates.append(Update(self.entries(reply.level), reply.arrays, reply_weight(self.run, reply, self.weighting), cid))
        state, invalid, metrics = aggregate_updates(global_state, updates, config, assigned=[self.entries(t) for t in assigned.values()] if config.dp else None,
                                                    seed=self.run.seed, server_round=server_round, rate=self.run.fraction)
        return Aggregate(state, len(updates) - len(invalid), rejected + invalid, metrics)

    def evaluate(self, server_round: int, global_state, data) -> dict[str, float]:
        """Every tier (and ``extra_eval``) on the test set under each BN treatment; nothing with
        ``eval.per_client`` (the clients evaluate)."""
        if self.run.eval.per_client:
            return {}

        def score(treatment: str) -> dict[str, float]:
            return {name: evaluate(self.evaluated_model(global_state, name, data, treatment), data.test, self.run.eval.batch_size)
                    for name in (*self.compiled.tiers, *self.extra_eval)}

        return evaluate_treatments(self.run, score, self.compiled.tiers)

    def evaluated_model(self, global_state, name: str, data, treatment: str) -> nn.Module:
        """The model :meth:`evaluate` scores as ``name`` under the BN ``treatment`` (with static BN
        always recomputed), in eval mode."""
        bn = "recompute" if self.static_bn else treatment
        return with_bn(self.eval_model(global_state, name, data), bn, self.run, data)

    def configure_evaluate(self, server_round: int, global_state, clients: list[ClientInfo]) -> dict[int, Instruction]:
        """With ``eval.per_client``: every client receives the submodel of its largest allowed
        resource level (the one it would deploy), to score it on its own test split."""
        if not self.run.eval.per_client:
            return {}
        out = {}
        for client in clients:
            tier = self.assign([largest(client.levels, self.level_size)], random.Random(0))
            if tier is not None:
                out[client.cid] = Instruction(SliceMap(dict(self.entries(tier))).extract(global_state), {"client": client.cid}, tier)
        return out

    def aggregate_evaluate(self, server_round: int, replies: Mapping[int, Reply]) -> dict[str, float]:
        return mean_accuracy_per_level(replies, list(self.compiled.tiers))

    # -- client hooks -----------------------------------------------------------------------
    def local_model(self, instruction: Instruction) -> LocalModel:
        return self.client_model(instruction.level, instruction.arrays)

    def train(self, instruction: Instruction, data, client_state: State) -> Reply:
        return fit_reply(self.client_model(instruction.level, instruction.arrays), data, instruction)

    def evaluate_client(self, instruction: Instruction, data, client_state: State) -> Reply:
        accuracy = evaluate(self.client_model(instruction.level, instruction.arrays), data, self.run.eval.batch_size)
        return Reply({}, {"accuracy": accuracy}, num_samples=len(data), level=instruction.level)


def weight_scale(strategy: Strategy, partition_sizes: list[int], settings: SecureAggregation, clients: int) -> float:
    """What clients multiply their weights by under secure aggregation so that every weight is
    in ``(0, 1]``: 1 per client (``train.weighting: clients``), else ``1 / largest partition``;
    ``ValueError`` when the smallest scaled weight is not clear of
    :func:`~nefl_zoo.fl.aggregation.secagg.sum_error` (it would read as unheld)."""
    weights = [w for n in partition_sizes if (w := reply_weight(strategy.run, Reply({}, num_samples=n), strategy.weighting)) > 0]
    scale = 1 / max(weights)
    if min(weights) * scale <= 2 * sum_error(settings, clients):
        raise ValueError(f"secure_aggregation: the smallest client weight ({min(weights) * scale:.2g} scaled) is within "
                         "SecAgg+'s quantisation error; raise quantization_range")
    return scale

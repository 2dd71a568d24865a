"""The FedLPS strategy: its settings, the backbone (pre-trained on the held-out split when first
needed, by default), the server's hooks (backbone fill-in and per-task weighted averaging) and the
client's (masks chosen after its first local training, kept as client state)."""

from __future__ import annotations

import copy
import logging
import math
from typing import Annotated, Any, Literal, Mapping

import torch
from pydantic import Field, field_validator
from torch import nn

from ....models import create_model
from ....models.base import NestedNet
from ....slim import SliceMap, compile_spec
from ...aggregation.nefedavg import Update, check_update
from ...strategy.base import Aggregate, ClientInfo, Instruction, MethodInfo, MethodSettings, Reply, Run, State, Strategy
from ...strategy.registry import register_method
from ...training.bn import recompute_batches
from ..common import evaluate_treatments, fit_reply, largest, level_sizes, require_parts, sample_clients, train_config
from .networks import Encoder, MultiTask, Predictor, evaluate_tasks, load_backbone, norm_modules, with_task_bn
from .pretrain import NO_PUBLIC, fingerprint, pretrain_for_run
from .pruning import Masks, Pruning
from .tasks import DIGIT_GROUPS, TaskSet, TaskSpec, check_tasks, dataset_labels

log = logging.getLogger(__name__)
PUBLIC, NONE = "public", "none"  # method_args.pretrained: pre-train on the held-out split; the random initialisation
BACKBONE_SHA256 = "backbone_sha256"  # a reply's metric and the server state's key: the backbone's fingerprint


class FedLPSSettings(MethodSettings):
    """``method_args`` of ``fedlps``."""

    encoder_fraction: float = Field(0.25, gt=0, lt=1, description="n: the encoder is the stem and the first ceil(n * N) of the N residual blocks")
    levels: list[Annotated[float, Field(ge=0, lt=1)]] = Field(
        [0.0, 0.2, 0.4, 0.6, 0.8], min_length=1,
        description="pruning ratio rho per resource level, from the largest tier of the run spec to the smallest",
    )
    tasks: list[TaskSpec] = Field(DIGIT_GROUPS, min_length=1, description="disjoint groups of the dataset's labels, "
                                  "each a task with its own images: {name, labels}")
    backbone: str | None = Field(None, description="zoo model of the backbone (e.g. resnet18, shufflenet_v2_x1_0) with the "
                                 "spec's model_args; none: the spec's model")
    backbone_args: dict[str, Any] = Field({}, description="model arguments of the backbone over the spec's (e.g. planes)")
    fill: Literal["backbone", "global"] = Field("backbone", description="what the server writes into a reply's pruned entries: "
                                                "the backbone predictor's (the paper's Algorithm 2) or the global predictor's "
                                                "(what the authors' code does: torch.prune keeps pruned weights at the received values)")
    pretrained: str = Field(PUBLIC, description="the backbone's weights: public (the default): pre-trained from the run "
                            "seed's initialisation on the held-out data.public_fraction that no client holds (pretrain_epochs, "
                            "pretrain_lr; deterministic from the seed), when the run first needs them; a weights file "
                            "(.safetensors/.pth, e.g. from pretrain_backbone); none (or null): the run seed's random "
                            "initialisation, a random frozen encoder")
    pretrain_epochs: int = Field(30, ge=1, description="pretrained: public: epochs over the held-out split")
    pretrain_lr: float | None = Field(None, gt=0, description="pretrained: public: SGD learning rate (constant; batch size, "
                                      "momentum and weight decay: train's); none: train.lr")
    mask_from: Literal["trained", "received"] = Field("trained", description="what a client's masks are chosen from in its "
                                                      "first round: its predictors after training them unpruned that round "
                                                      "(the authors' code), or the received predictors before training "
                                                      "(the paper's Algorithm 1)")

    @field_validator("tasks", mode="before")
    @classmethod
    def _disjoint(cls, tasks):
        return check_tasks(tasks) if isinstance(tasks, list) else tasks

    @field_validator("pretrained", mode="before")
    @classmethod
    def _weights(cls, value):
        if value is None:  # null: what it always meant, the random initialisation
            return NONE
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"expected {PUBLIC}, {NONE} or a weights file, got an empty string")
        return value


def weighted_average(states: list[tuple[Mapping[str, torch.Tensor], float]]) -> dict[str, torch.Tensor]:
    """Per key, the average of ``states`` weighted by their weights (in float64; integer
    tensors such as BN's ``num_batches_tracked`` are rounded)."""
    total = sum(w for _, w in states)
    out = {}
    for key, ref in states[0][0].items():
        mean = sum(s[key].to(torch.float64) * w for s, w in states) / total
        out[key] = (mean if ref.is_floating_point() else mean.round()).to(ref.dtype)
    return out


@register_method("fedlps", label="FedLPS", settings=FedLPSSettings)
class FedLPS(Strategy):
    """FedLPS: shared frozen encoder, per-task predictors pruned by L1 norm per client level, pruned entries filled from the backbone."""

    def __init__(self, run: Run, settings: FedLPSSettings | None = None):
        super().__init__(run, settings)
        s, spec = self.settings, run.spec
        if run.eval.per_client:
            raise ValueError("fedlps: evaluates its global task predictors on the test set; unset eval.per_client")
        compiled = compile_spec(spec)
        self.level_size = level_sizes(compiled)
        if len(s.levels) != len(self.level_size):
            raise ValueError(f"fedlps: method_args.levels has {len(s.levels)} pruning ratios but the spec has "
                             f"{len(self.level_size)} tiers (resource levels)")
        by_size = sorted(self.level_size, key=lambda t: -self.level_size[t])  # largest first, ties in spec order
        self.rho = dict(zip(by_size, s.levels))
        self.taskset = TaskSet(list(s.tasks), compiled.num_classes)
        self.tasks, self.task_classes = self.taskset.names, self.taskset.classes

        weights = None if s.pretrained in (PUBLIC, NONE) else s.pretrained
        #: the backbone (frozen): the seed's initialisation until :meth:`prepare_backbone` pre-trains it (``pretrained: public``)
        self.backbone = load_backbone(spec, run.seed, weights, s.backbone, s.backbone_args)
        require_parts(self.backbone, "fedlps", s.backbone or spec.model)
        blocks = list(self.backbone.residual_blocks())
        n = math.ceil(s.encoder_fraction * len(blocks) - 1e-9)
        if n >= len(blocks):
            raise ValueError(f"fedlps: encoder_fraction {s.encoder_fraction} leaves no block of {len(blocks)} for the predictors")
        self.encoder = Encoder(self.backbone, [b for _, _, b in blocks[:n]])
        self.num_encoder_blocks = n
        with torch.device("meta"):  # the blocks' structure, copied for every (pruned) predictor
            template = create_model(s.backbone or spec.model, **{**spec.model_args, **s.backbone_args})
        self.block_keys = [(self.backbone.stage_names[st], str(j)) for st, j, _ in blocks[n:]]  # (stage module, index in it)
        self.templates = [b for _, _, b in list(template.residual_blocks())[n:]]
        self.norms = norm_modules(self.backbone)
        self.norm_templates = [(name, template.get_submodule(name)) for name in self.norms]
        norms = [(name, self.backbone.get_submodule(name)) for name in self.norms]
        self.pruning = Pruning([(f"{st}.{j}", b) for (st, j), (_, _, b) in zip(self.block_keys, blocks[n:])], norms, self.backbone.param_kinds())
        self._predictor_blocks = [(*key, b) for key, (_, _, b) in zip(self.block_keys, blocks[n:])]
        levels = tuple(self.level_size)
        numel = {**{t: sum(e.numel for e in self.predictor(t)[1].values()) for t in self.tasks},
                 **{lv: sum(e.numel for task in self.tasks for e in self.predictor(task, self.level_masks(lv))[1].values()) for lv in levels}}
        self.info = MethodInfo(spec, compiled.input_size, compiled.num_classes, levels, tuple(self.tasks), numel, worst_case=None)  # tasks, not submodels
        self._pending = s.pretrained == PUBLIC  # pre-trained when its weights are first needed (building for shapes costs nothing)
        if self._pending and getattr(run, "data", None) is not None and not run.data.public_fraction:
            raise ValueError(NO_PUBLIC)
        self._backbone_predictor: dict[str, torch.Tensor] | None = None
        self._sha256: str | None = None

    # -- the backbone ---------------------------------------------------------------------
    def prepare_backbone(self) -> NestedNet:
        """The backbone with its weights: with ``pretrained: public``, pre-trained on the run's
        held-out split the first time (:func:`.pretrain.pretrain_for_run`, deterministic from
        the run seed); every hook calls this before using the encoder or the backbone predictor."""
        if self._pending:
            self.backbone.load_state_dict(pretrain_for_run(self.run, self.settings, self.info.input_size), strict=True)
            self._pending = False
        return self.backbone

    @property
    def backbone_predictor(self) -> dict[str, torch.Tensor]:
        """The backbone predictor (its blocks after the encoder; fixed): what fills pruned entries
        on the server, and every task predictor's initial value."""
        if self._backbone_predictor is None:
            self.prepare_backbone()
            norms = [(name, self.backbone.get_submodule(name)) for name in self.norms]
            predictor = Predictor(self.backbone, self._predictor_blocks, nn.Identity(), norms)
            self._backbone_predictor = {k: v.detach().cpu().clone() for k, v in predictor.state_dict().items()}
        return self._backbone_predictor

    @property
    def backbone_sha256(self) -> str:
        """The backbone's fingerprint (:func:`.pretrain.fingerprint`): checked on resume (server
        state) and in every reply (the client's encoder must be the server's)."""
        if self._sha256 is None:
            self._sha256 = fingerprint(self.prepare_backbone().state_dict())
        return self._sha256

    # -- models -------------------------------------------------------------------------
    def predictor(self, task: str, masks: Masks | None = None):
        """An uninitialised (meta) predictor of ``task``, pruned to ``masks`` (None: full), and
        the slice entry of each of its tensors in the global state (key ``TASK.KEY``)."""
        with torch.device("meta"):
            head = nn.Linear(self.backbone.num_features, self.task_classes[task])
        module = Predictor(self.backbone, [(*key, copy.deepcopy(b)) for key, b in zip(self.block_keys, self.templates)], head,
                           [(name, copy.deepcopy(m)) for name, m in self.norm_templates])
        return module, self.pruning.prune(task, module, masks)

    def load_predictor(self, task: str, arrays: Mapping[str, torch.Tensor], masks: Masks | None = None) -> Predictor:
        """``task``'s predictor (pruned to ``masks``) carrying its tensors from the full
        predictors in ``arrays`` (global keys)."""
        module, entries = self.predictor(task, masks)
        module.load_state_dict(SliceMap(entries).extract(arrays), strict=True, assign=True)
        return module

    def choose_masks(self, arrays: Mapping[str, torch.Tensor], rho: float) -> dict[str, torch.Tensor]:
        """Every task's mask at ratio ``rho``, by L1 norm of the filters in ``arrays`` (global keys)."""
        return self.pruning.choose(self.tasks, arrays, rho)

    def level_masks(self, level: str) -> dict[str, torch.Tensor]:
        """Masks of ``level``'s sizes keeping the first channels (costs do not depend on which)."""
        return self.pruning.prefix(self.tasks, self.rho[level])

    def model(self, predictors: Mapping[str, Predictor]) -> MultiTask:
        """The encoder with these task predictors (the backbone's weights as they are: the hooks
        call :meth:`prepare_backbone` first)."""
        return MultiTask(self.encoder, predictors, self.taskset)

    def cut(self, arrays: Mapping[str, torch.Tensor], masks: Masks) -> dict[str, torch.Tensor]:
        """The pruned predictors' tensors (global keys, pruned shapes) cut out of the full
        predictors in ``arrays`` (global keys) by ``masks``."""
        out = {}
        for task in self.tasks:
            _, entries = self.predictor(task, masks)
            out.update({entries[k].global_key: v for k, v in SliceMap(entries).extract(arrays).items()})
        return out

    def level_costs(self):
        """Per resource level: trained parameters and MACs (:func:`.costs.level_costs`)."""
        from .costs import level_costs

        return level_costs(self)

    # -- server hooks ---------------------------------------------------------------------
    def init_global_state(self) -> State:
        """Every task's predictor: the backbone's blocks (pre-trained first, ``pretrained:
        public``) and a fresh head (global RNG)."""
        state, backbone = {}, self.backbone_predictor  # pre-trained (if pending) before any head draws from the RNG
        for task in self.tasks:
            head = nn.Linear(self.backbone.num_features, self.task_classes[task])
            state.update({f"{task}.{k}": v.clone() for k, v in backbone.items()})
            state.update({f"{task}.head.{k}": v.detach().clone() for k, v in head.state_dict().items()})
        return state

    def configure_train(self, server_round: int, global_state, clients: list[ClientInfo]) -> dict[int, Instruction]:
        out = {}
        for client in sample_clients(self.run, server_round, clients):
            level = largest(client.levels, self.level_size)  # a client's resource level: its largest allowed tier
            config = {**train_config(self.run, server_round, client.cid), "rho": self.rho[level]}
            out[client.cid] = Instruction({k: v.clone() for k, v in global_state.items()}, config, level)
        return out

    def recover(self, reply: Reply, global_state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Per task, the reply's full predictor (global keys): the backbone predictor (``fill:
        global``: the global one) with the reply's tensors written over the entries its masks
        kept. ``ValueError`` says why a reply cannot be used."""
        if reply.error is not None:
            raise ValueError(reply.error)
        if reply.level not in self.rho:
            raise ValueError(f"reply level {reply.level!r} is not a resource level")
        theirs = reply.metrics.get(BACKBONE_SHA256)
        if theirs != self.backbone_sha256:  # a Flower node pre-trains its own encoder: another device or thread count differs
            raise ValueError(f"the client's backbone (sha256 {str(theirs)[:12]}) is not the server's ({self.backbone_sha256[:12]}): "
                             "pre-trained on another device or thread count, or other weights")
        masks = self.pruning.read(self.tasks, reply.arrays)
        per_task = {task: self.predictor(task, masks)[1] for task in self.tasks}
        entries = {e.global_key: e for task_entries in per_task.values() for e in task_entries.values()}
        reason = check_update(Update(entries, {k: v for k, v in reply.arrays.items() if k not in masks}))
        if reason is not None:
            raise ValueError(reason)
        recovered = {}
        for task, task_entries in per_task.items():
            fill = self.backbone_predictor if self.settings.fill == "backbone" else {}
            full = {e.global_key: fill.get(k, global_state[e.global_key]).clone() for k, e in task_entries.items()}
            SliceMap(task_entries).scatter_(full, {k: reply.arrays[e.global_key] for k, e in task_entries.items()})
            recovered[task] = full
        return recovered

    def aggregate_train(self, server_round: int, global_state, replies: Mapping[int, Reply]) -> Aggregate:
        self.prepare_backbone()
        accepted, rejected = [], []
        for cid, reply in replies.items():
            try:
                weights = {task: float(reply.metrics[f"num_samples.{task}"]) for task in self.tasks}
                if not all(math.isfinite(w) and w >= 0 for w in weights.values()) or not sum(weights.values()):
                    raise ValueError(f"task sample counts {weights} must be >= 0, one of them positive")
                if self.run.train.weighting == "clients":  # 1 per client that trained the task; default: its images (the paper)
                    weights = {task: float(w > 0) for task, w in weights.items()}
                accepted.append((self.recover(reply, global_state), weights))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("client %s: reply rejected: %s", cid, exc)
                rejected.append((cid, str(exc)))
        state = dict(global_state)
        if accepted:
            for task in self.tasks:  # a client without images of a task did not train its predictor
                trained = [(recovered[task], weights[task]) for recovered, weights in accepted if weights[task] > 0]
                if trained:
                    state.update(weighted_average(trained))
        return Aggregate(state, len(accepted), rejected)

    def server_state(self) -> State:
        """The backbone's fingerprint, so a resume verifies that it rebuilt (pre-trained, or
        read from its file) the backbone the run was trained with."""
        return {BACKBONE_SHA256: torch.tensor(list(bytes.fromhex(self.backbone_sha256)), dtype=torch.uint8)}

    def load_server_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Check the checkpoint's backbone fingerprint against this backbone's; ``ValueError``
        on a difference (a checkpoint without one, from before fingerprints, is not checked)."""
        extra = sorted(set(state) - {BACKBONE_SHA256})
        if extra:
            raise ValueError(f"fedlps: unexpected server state {extra[:3]}")
        if BACKBONE_SHA256 not in state:
            log.warning("fedlps: the checkpoint holds no backbone fingerprint (an older run): the backbone is not verified")
            return
        saved = bytes(state[BACKBONE_SHA256].to(torch.uint8).tolist()).hex()
        if saved != self.backbone_sha256:
            raise ValueError(f"fedlps: this backbone (sha256 {self.backbone_sha256[:12]}) is not the one the checkpoint was "
                             f"trained with ({saved[:12]}): pre-trained on another device or thread count, or its weights "
                             "file changed")

    def evaluate(self, server_round: int, global_state, data) -> dict[str, float]:
        """The encoder with every task's global predictor, each task's accuracy on its own test
        images, under each BN treatment of ``eval.bn`` (``recompute``: each predictor's statistics
        on its task's images among the same training batches every method sees; averaged
        statistics of pruned predictors do not fit the full ones)."""
        self.prepare_backbone()

        def score(treatment: str) -> dict[str, float]:
            model = self.model({task: self.load_predictor(task, global_state) for task in self.tasks})
            batches = recompute_batches(data.train_eval, self.run.train.batch_size, self.run.seed, self.run.eval.bn_batches)
            return evaluate_tasks(with_task_bn(model, treatment, batches), data.test, self.run.eval.batch_size)

        return evaluate_treatments(self.run, score, self.tasks)

    # -- client hook ----------------------------------------------------------------------
    def train(self, instruction: Instruction, data, client_state: State) -> Reply:
        """Train the client's pruned predictors. In its first round (no masks in ``client_state``)
        the masks are chosen by L1 norm at the instruction's ``rho``: with ``mask_from: trained``
        (the authors' code) the client trains its full predictors that round and chooses the
        masks from the trained weights, then replies with their kept entries; with ``received``
        (the paper's Algorithm 1) it chooses them from the received predictors, then trains the
        pruned ones. Later rounds train the pruned predictors under the kept masks."""
        self.prepare_backbone()
        rho = float(instruction.config["rho"])
        if not client_state and self.settings.mask_from == "received":
            client_state.update(self.choose_masks(instruction.arrays, rho))
        masks = dict(client_state) or None  # None: the first round of mask_from: trained, the full predictors
        model = self.model({task: self.load_predictor(task, instruction.arrays, masks) for task in self.tasks})
        reply = fit_reply(model, data, instruction)
        if masks is None:  # pruned after training: the masks from the trained weights, the reply their kept entries
            masks = self.choose_masks(reply.arrays, rho)
            client_state.update(masks)
            reply.arrays = self.cut(reply.arrays, masks)
        reply.arrays.update({k: v.clone() for k, v in masks.items()})
        reply.metrics.update({f"num_samples.{task}": n for task, n in self.taskset.counts(dataset_labels(data)).items()})
        reply.metrics[BACKBONE_SHA256] = self.backbone_sha256
        return reply

"""The FedLPS strategy: its settings, the server's hooks (backbone fill-in and per-task
weighted averaging) and the client's (masks kept as client state)."""

from __future__ import annotations

import copy
import logging
import math
from typing import Annotated, Any, Literal, Mapping

import torch
from pydantic import Field, field_validator
from torch import nn

from ....models import create_model
from ....slim import SliceMap, compile_spec
from ...aggregate import Update, check_update
from ...bn import recompute_batches
from ...registry import register_method
from ...strategy import Aggregate, ClientInfo, Instruction, MethodInfo, MethodSettings, Reply, Run, State, Strategy
from ...strategy_utils import evaluate_treatments, fit_reply, largest, level_sizes, require_parts, sample_clients, train_config
from .networks import Encoder, MultiTask, Predictor, evaluate_tasks, load_backbone, norm_modules, with_task_bn
from .pruning import Masks, Pruning
from .tasks import DIGIT_GROUPS, TaskSet, TaskSpec, check_tasks, dataset_labels

log = logging.getLogger(__name__)


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
    pretrained: str | None = Field(None, description="backbone weights (.safetensors/.pth; pretrain_backbone trains them on "
                                   "the held-out data.public_fraction); none: the run seed's random initialisation")

    @field_validator("tasks", mode="before")
    @classmethod
    def _disjoint(cls, tasks):
        return check_tasks(tasks) if isinstance(tasks, list) else tasks


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

        self.backbone = load_backbone(spec, run.seed, s.pretrained, s.backbone, s.backbone_args)
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
        predictor = Predictor(self.backbone, [(*key, b) for key, (_, _, b) in zip(self.block_keys, blocks[n:])], nn.Identity(), norms)
        #: the backbone predictor (its blocks; fixed): what fills pruned entries on the server
        self.backbone_predictor = {k: v.detach().clone() for k, v in predictor.state_dict().items()}
        levels = tuple(self.level_size)
        numel = {**{t: sum(e.numel for e in self.predictor(t)[1].values()) for t in self.tasks},
                 **{lv: sum(e.numel for task in self.tasks for e in self.predictor(task, self.level_masks(lv))[1].values()) for lv in levels}}
        self.info = MethodInfo(spec, compiled.input_size, compiled.num_classes, levels, tuple(self.tasks), numel, worst_case=None)  # tasks, not submodels

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
        """The encoder with these task predictors."""
        return MultiTask(self.encoder, predictors, self.taskset)

    def level_costs(self):
        """Per resource level: trained parameters and MACs (:func:`.costs.level_costs`)."""
        from .costs import level_costs

        return level_costs(self)

    # -- server hooks ---------------------------------------------------------------------
    def init_global_state(self) -> State:
        """Every task's predictor: the backbone's blocks and a fresh head (global RNG)."""
        state = {}
        for task in self.tasks:
            head = nn.Linear(self.backbone.num_features, self.task_classes[task])
            state.update({f"{task}.{k}": v.clone() for k, v in self.backbone_predictor.items()})
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

    def evaluate(self, server_round: int, global_state, data) -> dict[str, float]:
        """The encoder with every task's global predictor, each task's accuracy on its own test
        images, under each BN treatment of ``eval.bn`` (``recompute``: each predictor's statistics
        on its task's images among the same training batches every method sees; averaged
        statistics of pruned predictors do not fit the full ones)."""
        def score(treatment: str) -> dict[str, float]:
            model = self.model({task: self.load_predictor(task, global_state) for task in self.tasks})
            batches = recompute_batches(data.train_eval, self.run.train.batch_size, self.run.seed, self.run.eval.bn_batches)
            return evaluate_tasks(with_task_bn(model, treatment, batches), data.test, self.run.eval.batch_size)

        return evaluate_treatments(self.run, score, self.tasks)

    # -- client hook ----------------------------------------------------------------------
    def train(self, instruction: Instruction, data, client_state: State) -> Reply:
        if not client_state:  # the first round: choose the masks from the current predictors
            client_state.update(self.choose_masks(instruction.arrays, float(instruction.config["rho"])))
        masks = dict(client_state)
        model = self.model({task: self.load_predictor(task, instruction.arrays, masks) for task in self.tasks})
        reply = fit_reply(model, data, instruction)
        reply.arrays.update({k: v.clone() for k, v in masks.items()})
        reply.metrics.update({f"num_samples.{task}": n for task, n in self.taskset.counts(dataset_labels(data)).items()})
        return reply

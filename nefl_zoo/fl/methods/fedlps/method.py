"""The FedLPS strategy: its settings, the server's hooks (backbone fill-in and per-task
weighted averaging) and the client's (masks kept as client state)."""

from __future__ import annotations

import logging
import math
from typing import Annotated, Mapping

import torch
from pydantic import Field, field_validator
from torch import nn

from ....models import create_model
from ....slim import SliceMap, compile_spec
from ...aggregate import Update, check_update
from ...registry import register_method
from ...strategy import Aggregate, ClientInfo, Instruction, MethodInfo, MethodSettings, Reply, Run, State, Strategy
from ...strategy_utils import evaluate_treatments, fit_reply, largest, level_sizes, sample_clients, train_config, with_bn
from .networks import Encoder, MultiTask, Predictor, evaluate_tasks, load_backbone
from .pruning import Masks, Pruning
from .tasks import TASKS, TaskName

log = logging.getLogger(__name__)


class FedLPSSettings(MethodSettings):
    """``method_args`` of ``fedlps``."""

    encoder_fraction: float = Field(0.25, gt=0, lt=1, description="n: the encoder is the stem and the first ceil(n * N) of the N residual blocks")
    levels: list[Annotated[float, Field(ge=0, lt=1)]] = Field(
        [0.0, 0.2, 0.4, 0.6, 0.8], min_length=1,
        description="pruning ratio rho per resource level, from the largest tier of the run spec to the smallest",
    )
    tasks: list[TaskName] = Field(["class", "parity"], min_length=1, description="the tasks every client trains (label maps)")
    pretrained: str | None = Field(None, description="backbone weights (.safetensors/.pth); none: the run seed's random initialisation")

    @field_validator("tasks")
    @classmethod
    def _distinct(cls, tasks: list[str]) -> list[str]:
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"tasks must be distinct, got {tasks}")
        return tasks


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
        self.tasks = list(s.tasks)
        self.task_classes = {t: TASKS[t].classes(compiled.num_classes) for t in self.tasks}

        self.backbone = load_backbone(spec, run.seed, s.pretrained)
        blocks = list(self.backbone.residual_blocks())
        n = math.ceil(s.encoder_fraction * len(blocks) - 1e-9)
        if n >= len(blocks):
            raise ValueError(f"fedlps: encoder_fraction {s.encoder_fraction} leaves no block of {len(blocks)} for the predictors")
        self.encoder = Encoder(self.backbone, [b for _, _, b in blocks[:n]])
        self.num_encoder_blocks = n
        with torch.device("meta"):  # the blocks' structure, copied for every (pruned) predictor
            template = create_model(spec.model, **spec.model_args)
        self.pruning = Pruning(self.backbone, template, n)
        self.prunable = self.pruning.blocks
        predictor = Predictor(self.backbone, [(*key, b) for key, (_, _, b) in zip(self.pruning.keys, blocks[n:])], nn.Identity())
        #: the backbone predictor (its blocks; fixed): what fills pruned entries on the server
        self.backbone_predictor = {k: v.detach().clone() for k, v in predictor.state_dict().items()}
        levels = tuple(self.level_size)
        numel = {**{t: sum(e.numel for e in self.predictor(t)[1].values()) for t in self.tasks},
                 **{lv: sum(e.numel for task in self.tasks for e in self.predictor(task, self.level_masks(lv))[1].values()) for lv in levels}}
        self.info = MethodInfo(spec, compiled.input_size, compiled.num_classes, levels, tuple(self.tasks), numel)

    # -- models -------------------------------------------------------------------------
    def predictor(self, task: str, masks: Masks | None = None):
        """An uninitialised (meta) predictor of ``task``, pruned to ``masks`` (None: full), and
        the slice entry of each of its tensors in the global state (key ``TASK.KEY``)."""
        with torch.device("meta"):
            head = nn.Linear(self.backbone.num_features, self.task_classes[task])
        return self.pruning.predictor(task, head, masks)

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
        return MultiTask(self.encoder, predictors)

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
        """Per task, the reply's full predictor (global keys): the backbone predictor with the
        reply's tensors written over the entries its mask kept. ``ValueError`` says why a reply
        cannot be used."""
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
            full = {e.global_key: self.backbone_predictor.get(k, global_state[e.global_key]).clone() for k, e in task_entries.items()}
            SliceMap(task_entries).scatter_(full, {k: reply.arrays[e.global_key] for k, e in task_entries.items()})
            recovered[task] = full
        return recovered

    def aggregate_train(self, server_round: int, global_state, replies: Mapping[int, Reply]) -> Aggregate:
        accepted, rejected = [], []
        for cid, reply in replies.items():
            try:
                weights = {task: float(reply.metrics[f"num_samples.{task}"]) for task in self.tasks}
                if not all(math.isfinite(w) and w > 0 for w in weights.values()):
                    raise ValueError(f"task sample counts {weights} must be positive")
                accepted.append((self.recover(reply, global_state), weights))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("client %s: reply rejected: %s", cid, exc)
                rejected.append((cid, str(exc)))
        state = dict(global_state)
        if accepted:
            for task in self.tasks:
                state.update(weighted_average([(recovered[task], weights[task]) for recovered, weights in accepted]))
        return Aggregate(state, len(accepted), rejected)

    def evaluate(self, server_round: int, global_state, data) -> dict[str, float]:
        """The encoder with every task's global predictor, one accuracy per task, under each BN
        treatment of ``eval.bn`` (``recompute``: the predictors' statistics, on the encoder's
        features; averaged statistics of pruned predictors do not fit the full ones)."""
        def score(treatment: str) -> dict[str, float]:
            model = self.model({task: self.load_predictor(task, global_state) for task in self.tasks})
            return evaluate_tasks(with_bn(model, treatment, self.run, data), data.test, self.run.eval.batch_size)

        return evaluate_treatments(self.run, score, self.tasks)

    # -- client hook ----------------------------------------------------------------------
    def train(self, instruction: Instruction, data, client_state: State) -> Reply:
        if not client_state:  # the first round: choose the masks from the current predictors
            client_state.update(self.choose_masks(instruction.arrays, float(instruction.config["rho"])))
        masks = dict(client_state)
        model = self.model({task: self.load_predictor(task, instruction.arrays, masks) for task in self.tasks})
        reply = fit_reply(model, data, instruction)
        reply.arrays.update({k: v.clone() for k, v in masks.items()})
        reply.metrics.update({f"num_samples.{task}": reply.num_samples for task in self.tasks})
        return reply

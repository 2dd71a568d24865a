"""FedLPS (Jia et al., AAAI 2024): multi-task FL with a shared frozen encoder and task
predictors pruned channel-wise per client, aggregated with the backbone's help.

The backbone is the run spec's full zoo model (``method_args.pretrained`` weights, else the
run seed's random initialisation, the same tensors NeFL starts from). The model contract cuts
it; what counts as a layer is a residual block (``residual_blocks()``):

* the **encoder** is ``forward_stem`` plus the first ``ceil(encoder_fraction * N)`` of the N
  blocks. It is frozen (eval mode, no gradients), never sent, and computed once per batch for
  all tasks;
* a **predictor** per task is the remaining blocks (named as in the backbone, e.g.
  ``layer2.0.conv1.weight``), the backbone's parameter-free ``forward_norm`` /
  ``forward_head(pre_logits=True)`` and a task head ``Linear(num_features, task classes)``.

Tasks are label maps of the dataset's labels (:data:`TASKS`: ``class``, ``parity``, ``mod3``,
``ge5``); every client trains every task on all its images (loss: the sum of the tasks'
cross-entropies, so each predictor gets its own task's gradient).

**Pruning.** A client's resource level is its largest allowed tier of the run spec; the level
gives its pruning ratio rho. In its first round the client ranks, in every predictor block,
the output filters of each branch convolution but the last (a basic block's ``conv1``) by L1
norm and keeps the ``C - round(rho * C)`` largest (the following norm and the next
convolution's input follow). These are the block's **inner** channels: the residual stream
(block outputs, shortcuts, the head's input) keeps all its channels, so pruned blocks still
add up. The kept indices (the mask) are per-client state and are reused every round. Kept
channels are not a prefix, so the client's physically smaller predictor maps into the global
one through :class:`~nefl_zoo.slim.SliceEntry` index tensors.

**A round.** The server sends every task's full predictor; the client cuts its pruned
predictors out with its mask, trains them and returns them with the mask. The server rebuilds
each full predictor by filling the pruned entries from the backbone predictor (the backbone's
blocks, fixed), then averages per task weighted by the client's sample count for that task.
Evaluation: encoder + each task's global (unpruned) predictor on the test set, one accuracy per
task. BN running statistics are averaged like every other tensor, but statistics gathered in
pruned predictors do not fit the full one (digits, pre-trained backbone: class accuracy 95%
with recomputed statistics, 40% with the averaged ones), so by default the predictors'
statistics are recomputed on a few training batches before evaluation
(``bn_recompute_batches``, HeteroFL's static BN; ``null``: as averaged).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Annotated, Callable, Literal, Mapping

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import nn
from torch.utils.data import DataLoader

from ...models import create_model, load_pretrained
from ...models.base import NestedNet
from ...slim import SliceEntry, SliceMap, compile_spec
from ...spec import SubmodelSpec
from ..aggregate import Update, check_update
from ..client import fit
from ..local import LocalModel
from ..strategy import Aggregate, ClientInfo, Instruction, MethodSettings, Reply, State, Strategy, register_method
from ..bn import recompute_bn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """A labelling of the dataset's images: its class count (given the dataset's) and label map."""

    description: str
    classes: Callable[[int], int]
    labels: Callable[[torch.Tensor], torch.Tensor]


TASKS: dict[str, Task] = {
    "class": Task("the dataset's label", lambda n: n, lambda y: y),
    "parity": Task("label even/odd", lambda n: 2, lambda y: y % 2),
    "mod3": Task("label modulo 3", lambda n: 3, lambda y: y % 3),
    "ge5": Task("label >= 5", lambda n: 2, lambda y: (y >= 5).long()),
}
TaskName = Literal["class", "parity", "mod3", "ge5"]


class FedLPSSettings(MethodSettings):
    """``method_args`` of ``fedlps``."""

    encoder_fraction: float = Field(0.25, gt=0, lt=1, description="n: the encoder is the stem and the first ceil(n * N) of the N residual blocks")
    levels: list[Annotated[float, Field(ge=0, lt=1)]] = Field(
        [0.0, 0.2, 0.4, 0.6, 0.8], min_length=1,
        description="pruning ratio rho per resource level, from the largest tier of the run spec to the smallest",
    )
    tasks: list[TaskName] = Field(["class", "parity"], min_length=1, description="the tasks every client trains (label maps)")
    pretrained: str | None = Field(None, description="backbone weights (.safetensors/.pth); none: the run seed's random initialisation")
    bn_recompute_batches: int | None = Field(
        20, ge=1, description="before evaluation, recompute the global predictors' BN statistics on N training batches "
        "(HeteroFL's static BN); null: evaluate with the averaged statistics",
    )

    @field_validator("tasks")
    @classmethod
    def _distinct(cls, tasks: list[str]) -> list[str]:
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"tasks must be distinct, got {tasks}")
        return tasks


def l1_channels(weight: torch.Tensor, rho: float) -> torch.Tensor:
    """Output channels of a convolution kept at pruning ratio ``rho``: the ``C - round(rho * C)``
    (at least one) with the largest L1 norm of their filter, ties to the lower index; ascending."""
    scores = weight.detach().abs().flatten(1).sum(1)
    channels = len(scores)
    keep = max(1, channels - round(rho * channels))
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:keep].sort().values


def weighted_average(states: list[tuple[Mapping[str, torch.Tensor], float]]) -> dict[str, torch.Tensor]:
    """Per key, the average of ``states`` weighted by their weights (in float64; integer
    tensors such as BN's ``num_batches_tracked`` are rounded)."""
    total = sum(w for _, w in states)
    out = {}
    for key, ref in states[0][0].items():
        mean = sum(s[key].to(torch.float64) * w for s, w in states) / total
        out[key] = (mean if ref.is_floating_point() else mean.round()).to(ref.dtype)
    return out


@dataclass(frozen=True)
class PrunableBlock:
    """A predictor block: its module path (the same in the backbone and every predictor), its
    branch's convolutions and their norms (child names, in order) and its inner widths (the
    outputs of every convolution but the last)."""

    path: str
    convs: tuple[str, ...]
    norms: tuple[str, ...]
    widths: tuple[int, ...]


def prunable_block(path: str, block: nn.Module) -> PrunableBlock:
    """Describe ``block``'s branch (its ``branch_parameters()``) as a chain of convolutions, each
    followed by a batch norm; ``ValueError`` for any other block."""
    branch = {id(p) for _, p in block.branch_parameters()}
    children = [(n, m) for n, m in block.named_children() if any(id(p) in branch for p in m.parameters())]
    convs = [(n, m) for n, m in children if isinstance(m, nn.Conv2d)]
    norms = [(n, m) for n, m in children if isinstance(m, nn.BatchNorm2d)]
    if (len(convs) < 2 or len(convs) != len(norms) or len(children) != 2 * len(convs)
            or any(c.groups != 1 or c.out_channels != b.num_features for (_, c), (_, b) in zip(convs, norms))):
        raise ValueError(f"fedlps: block {path} is not a chain of convolutions with batch norms (FedLPS prunes ResNet blocks)")
    return PrunableBlock(path, tuple(n for n, _ in convs), tuple(n for n, _ in norms), tuple(c.out_channels for _, c in convs[:-1]))


def mask_key(task: str, block: PrunableBlock, conv: int) -> str:
    """Key of a mask (kept channel indices) in client state and replies."""
    return f"mask.{task}.{block.path}.{conv}"


class Encoder(nn.Module):
    """The backbone's stem and first blocks; always in eval mode, its weights frozen."""

    def __init__(self, net: NestedNet, blocks: list[nn.Module]):
        super().__init__()
        self.net = net
        self.blocks = blocks  # modules of ``net`` (a plain list: registered there)

    def train(self, mode: bool = True) -> "Encoder":
        return super().train(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.net.forward_stem(x)
        for block in self.blocks:
            x = block(x)
        return x


class Predictor(nn.Module):
    """Blocks after the encoder, keyed as in the backbone (``layer2.0...``), the backbone's
    parameter-free neck (``forward_norm``, ``forward_head(pre_logits=True)``) and a task head."""

    def __init__(self, neck: NestedNet, blocks: list[tuple[str, str, nn.Module]], head: nn.Linear):
        super().__init__()
        self.stages: list[str] = []
        for stage, index, block in blocks:
            if stage not in self.stages:
                self.add_module(stage, nn.Sequential())
                self.stages.append(stage)
            self.get_submodule(stage).add_module(index, block)
        self.head = head
        self._neck = (neck,)  # a tuple: not a submodule of the predictor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = self.get_submodule(stage)(x)
        neck = self._neck[0]
        return self.head(neck.forward_head(neck.forward_norm(x), pre_logits=True))


class MultiTask(LocalModel):
    """The frozen encoder (run once per batch) feeding one predictor per task."""

    def __init__(self, encoder: Encoder, predictors: Mapping[str, Predictor]):
        super().__init__()
        self.encoder = encoder
        self.predictors = nn.ModuleDict(predictors)

    def logits(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            embedding = self.encoder(x)
        return {task: predictor(embedding) for task, predictor in self.predictors.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(list(self.logits(x).values()), 1)

    def loss(self, x, y):
        logits = self.logits(x)
        loss = sum(F.cross_entropy(out, TASKS[task].labels(y)) for task, out in logits.items())
        return loss, next(iter(logits.values()))

    def state(self):
        return {f"{task}.{k}": v.detach().clone() for task, p in self.predictors.items() for k, v in p.state_dict().items()}


@torch.no_grad()
def evaluate_tasks(model: MultiTask, dataset, batch_size: int = 256) -> dict[str, float]:
    """Top-1 accuracy of every task of ``model`` (eval mode) on ``dataset``'s mapped labels."""
    model.eval()
    correct = dict.fromkeys(model.predictors, 0)
    total = 0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        for task, out in model.logits(x).items():
            correct[task] += int((out.argmax(1) == TASKS[task].labels(y)).sum())
        total += len(y)
    return {task: c / max(total, 1) for task, c in correct.items()}


def load_backbone(spec: SubmodelSpec, seed: int, pretrained: str | Path | None) -> NestedNet:
    """The run spec's full model: ``pretrained`` weights, or the random initialisation of
    ``seed`` (what the engine's ``torch.manual_seed(seed)`` gives NeFL); frozen, eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = create_model(spec.model, **spec.model_args)
    if pretrained is not None:
        load_pretrained(net, pretrained)
    return net.requires_grad_(False).eval()


@register_method("fedlps", label="FedLPS", settings=FedLPSSettings)
class FedLPS(Strategy):
    """FedLPS: shared frozen encoder, per-task predictors pruned by L1 norm per client level, pruned entries filled from the backbone."""

    def __init__(self, spec: SubmodelSpec, train, settings=None, **run):
        super().__init__(spec, train, settings, **run)
        s = self.settings
        if getattr(self, "eval_per_client", False):
            raise ValueError("fedlps: evaluates its global task predictors on the test set; unset eval.per_client")
        compiled = compile_spec(spec)
        self.level_size = {name: ct.slice_map.numel() for name, ct in compiled.tiers.items()}
        if len(s.levels) != len(self.level_size):
            raise ValueError(f"fedlps: method_args.levels has {len(s.levels)} pruning ratios but the spec has "
                             f"{len(self.level_size)} tiers (resource levels)")
        clash = set(s.tasks) & set(self.level_size)
        if clash:
            raise ValueError(f"fedlps: tier {sorted(clash)[0]!r} has the name of a task")
        by_size = sorted(self.level_size, key=lambda t: -self.level_size[t])  # largest first, ties in spec order
        self.rho = dict(zip(by_size, s.levels))
        self._input_size, self._num_classes = compiled.input_size, compiled.num_classes
        self.tasks = list(s.tasks)
        self.task_classes = {t: TASKS[t].classes(self._num_classes) for t in self.tasks}

        self.backbone = load_backbone(spec, self.seed, s.pretrained)
        blocks = list(self.backbone.residual_blocks())
        n = math.ceil(s.encoder_fraction * len(blocks) - 1e-9)
        if n >= len(blocks):
            raise ValueError(f"fedlps: encoder_fraction {s.encoder_fraction} leaves no block of {len(blocks)} for the predictors")
        self.encoder = Encoder(self.backbone, [b for _, _, b in blocks[:n]])
        self.num_encoder_blocks = n
        # predictor blocks keyed (stage module, index in the stage) as in the backbone
        keys = [(self.backbone.stage_names[st], str(j)) for st, j, _ in blocks[n:]]
        self.prunable = [prunable_block(f"{stage}.{j}", b) for (stage, j), (_, _, b) in zip(keys, blocks[n:])]
        with torch.device("meta"):  # the blocks' structure, copied for every (pruned) predictor
            template = create_model(spec.model, **spec.model_args)
        self._template = [(*key, b) for key, (_, _, b) in zip(keys, list(template.residual_blocks())[n:])]
        self.kinds = self.backbone.param_kinds()
        predictor = Predictor(self.backbone, [(*key, b) for key, (_, _, b) in zip(keys, blocks[n:])], nn.Identity())
        #: the backbone predictor (its blocks; fixed): what fills pruned entries on the server
        self.backbone_predictor = {k: v.detach().clone() for k, v in predictor.state_dict().items()}

    @property
    def tier_names(self) -> list[str]:
        """The resource levels clients train at (the run spec's tiers), then the tasks evaluated."""
        return [*self.level_size, *self.tasks]

    @property
    def global_spec(self) -> SubmodelSpec:
        return self.run_spec

    @property
    def input_size(self) -> tuple[int, int, int]:
        return self._input_size

    @property
    def num_classes(self) -> int:
        return self._num_classes

    # -- models -------------------------------------------------------------------------
    def level(self, client: ClientInfo) -> str:
        """A client's resource level: its largest allowed tier."""
        return max(client.levels, key=self.level_size.__getitem__)

    def predictor(self, task: str, masks: Mapping[str, torch.Tensor] | None = None) -> tuple[Predictor, dict[str, SliceEntry]]:
        """An uninitialised (meta) predictor of ``task``, pruned to ``masks`` (None: full), and
        the slice entry of each of its tensors in the global state (key ``TASK.KEY``)."""
        blocks, regions = [], {}
        for (stage, index, template), info in zip(self._template, self.prunable):
            block = copy.deepcopy(template)
            kept = [None if masks is None else masks[mask_key(task, info, c)] for c in range(len(info.widths))] + [None]
            for c, (conv_name, norm_name) in enumerate(zip(info.convs, info.norms)):
                out_idx, in_idx = kept[c], kept[c - 1] if c > 0 else None
                if out_idx is None and in_idx is None:
                    continue
                conv, norm = block.get_submodule(conv_name), block.get_submodule(norm_name)
                with torch.device("meta"):
                    new = nn.Conv2d(conv.in_channels if in_idx is None else len(in_idx), conv.out_channels if out_idx is None else len(out_idx),
                                    conv.kernel_size, conv.stride, conv.padding, conv.dilation, bias=conv.bias is not None)
                    block.add_module(conv_name, new)
                    regions[new] = (out_idx, in_idx)
                    if out_idx is not None:
                        new = nn.BatchNorm2d(len(out_idx), norm.eps, norm.momentum, norm.affine, norm.track_running_stats)
                        block.add_module(norm_name, new)
                        regions[new] = (out_idx,)
            blocks.append((stage, index, block))
        with torch.device("meta"):
            head = nn.Linear(self.backbone.num_features, self.task_classes[task])
        module = Predictor(self.backbone, blocks, head)
        entries = {}
        for mname, sub in module.named_modules():
            region = regions.get(sub, ())
            for pname, t in chain(sub.named_parameters(recurse=False), sub.named_buffers(recurse=False)):
                key = f"{mname}.{pname}" if mname else pname
                index = ()
                if t.ndim and any(r is not None for r in region):
                    index = tuple(region[d] if d < len(region) and region[d] is not None else slice(0, size) for d, size in enumerate(t.shape))
                entries[key] = SliceEntry(f"{task}.{key}", index, tuple(t.shape), self.kinds.get(key, "weight"), True)
        return module, entries

    def load_predictor(self, task: str, arrays: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor] | None = None) -> Predictor:
        """``task``'s predictor (pruned to ``masks``) carrying its tensors from the full
        predictors in ``arrays`` (global keys)."""
        module, entries = self.predictor(task, masks)
        module.load_state_dict(SliceMap(entries).extract(arrays), strict=True, assign=True)
        return module

    def choose_masks(self, arrays: Mapping[str, torch.Tensor], rho: float) -> dict[str, torch.Tensor]:
        """Every task's mask at ratio ``rho``, by L1 norm of the filters in ``arrays`` (global keys)."""
        return {
            mask_key(task, info, c): l1_channels(arrays[f"{task}.{info.path}.{conv}.weight"], rho)
            for task in self.tasks for info in self.prunable for c, conv in enumerate(info.convs[:-1])
        }

    def level_masks(self, level: str) -> dict[str, torch.Tensor]:
        """Masks of ``level``'s sizes keeping the first channels (costs do not depend on which)."""
        rho = self.rho[level]
        return {
            mask_key(task, info, c): torch.arange(max(1, width - round(rho * width)))
            for task in self.tasks for info in self.prunable for c, width in enumerate(info.widths)
        }

    def model(self, predictors: Mapping[str, Predictor]) -> MultiTask:
        """The encoder with these task predictors."""
        return MultiTask(self.encoder, predictors)

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
        for client in self.sample(server_round, clients):
            level = self.level(client)
            config = {**self.train_config_for(server_round, client.cid), "tier": level, "tiers": [level], "rho": self.rho[level]}
            out[client.cid] = Instruction({k: v.clone() for k, v in global_state.items()}, config)
        return out

    def recover(self, reply: Reply, global_state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """Per task, the reply's full predictor (global keys): the backbone predictor with the
        reply's tensors written over the entries its mask kept. ``ValueError`` says why a reply
        cannot be used."""
        if reply.error is not None:
            raise ValueError(reply.error)
        if reply.metrics.get("tier") not in self.rho:
            raise ValueError(f"reply tier {reply.metrics.get('tier')!r} is not a resource level")
        masks = {}
        for task in self.tasks:
            for info in self.prunable:
                for c, width in enumerate(info.widths):
                    key = mask_key(task, info, c)
                    kept = reply.arrays.get(key)
                    if (kept is None or kept.dtype != torch.int64 or kept.ndim != 1 or not len(kept)
                            or int(kept[0]) < 0 or int(kept[-1]) >= width or not bool((kept[1:] > kept[:-1]).all())):
                        raise ValueError(f"{key}: expected ascending distinct channel indices below {width}")
                    masks[key] = kept
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

    def eval_model(self, global_state: Mapping[str, torch.Tensor], data) -> MultiTask:
        """The encoder with every task's global predictor; with ``bn_recompute_batches``, the
        predictors' BN statistics recomputed on that many training batches (seeded by the run
        seed), as the averaged statistics of pruned predictors do not fit the full ones."""
        predictors = {task: self.load_predictor(task, global_state) for task in self.tasks}
        batches = self.settings.bn_recompute_batches
        if batches:
            generator = torch.Generator().manual_seed(self.seed)
            loader = DataLoader(data.train_eval, batch_size=self.train_config.batch_size, shuffle=True, generator=generator)
            with torch.no_grad():
                embeddings = [(self.encoder(x), y) for x, y in itertools.islice(loader, batches)]
            for predictor in predictors.values():
                recompute_bn(predictor, embeddings)
        return self.model(predictors)

    def evaluate(self, server_round: int, global_state, data) -> dict[str, float]:
        return evaluate_tasks(self.eval_model(global_state, data), data.test, self.eval_batch_size)

    def submodel_numel(self, tier: str) -> int:
        """A task: elements of its full predictor; a level: of all its pruned predictors."""
        if tier in self.tasks:
            return sum(e.numel for e in self.predictor(tier)[1].values())
        masks = self.level_masks(tier)
        return sum(e.numel for task in self.tasks for e in self.predictor(task, masks)[1].values())

    # -- client hook ----------------------------------------------------------------------
    def train(self, instruction: Instruction, data, client_state: State) -> Reply:
        level = str(instruction.config["tier"])
        if not client_state:  # the first round: choose the masks from the current predictors
            client_state.update(self.choose_masks(instruction.arrays, float(instruction.config["rho"])))
        masks = dict(client_state)
        model = self.model({task: self.load_predictor(task, instruction.arrays, masks) for task in self.tasks})
        result = fit(model, data, instruction.config)
        metrics = {"num_samples": result.num_samples, "loss": result.metrics["loss"], "tier": level, "tiers": [level],
                   **{f"num_samples.{task}": result.num_samples for task in self.tasks}}
        return Reply({**result.state, **{k: v.clone() for k, v in masks.items()}}, metrics)

    # -- costs ----------------------------------------------------------------------------
    def level_costs(self) -> list["LevelCost"]:
        """Per resource level (spec order): trained predictor parameters and forward MACs of the
        encoder plus every task's pruned predictor, against one full model per task (fvcore)."""
        from ...profile import count_macs

        full_macs = 0
        for task in self.tasks:
            with torch.device("meta"):
                full = create_model(self.run_spec.model, **{**self.run_spec.model_args, "num_classes": self.task_classes[task]})
            full_macs += count_macs(full.to_empty(device="cpu"), self.input_size)
        out = []
        for level in self.level_size:
            masks = self.level_masks(level)
            predictors = {task: self.predictor(task, masks)[0].to_empty(device="cpu") for task in self.tasks}
            params = sum(p.numel() for p in chain.from_iterable(p.parameters() for p in predictors.values()))
            macs = count_macs(self.model(predictors), self.input_size)
            out.append(LevelCost(level, self.rho[level], params, macs, full_macs))
        return out


@dataclass(frozen=True)
class LevelCost:
    """What a client of one resource level trains: predictor parameters (all tasks) and the
    forward MACs of one image through the encoder and its pruned predictors, against one full
    model per task."""

    level: str
    rho: float
    predictor_params: int
    macs: int
    full_macs: int

    @property
    def macs_ratio(self) -> float:
        return self.macs / self.full_macs


def pretrain_backbone(config, epochs: int, out_path: str | Path, lr: float | None = None) -> float:
    """Centralised pre-training of a backbone for FedLPS's ``method_args.pretrained``.

    Trains the run spec's full model (the run seed's initialisation) for ``epochs`` epochs on
    the pooled training images of ``config.data`` (the config's augmentation) with the
    dataset's labels: SGD with ``lr`` (default ``train.lr``, constant) and the config's batch
    size, momentum and weight decay, the last incomplete batch of each epoch dropped (a batch of
    a few images through BatchNorm can wreck the weights). Saves the plain state dict as
    safetensors at ``out_path`` and returns the accuracy on the test split (not trained on).
    """
    from safetensors.torch import save_file

    from ..client import evaluate
    from ..data import load_data

    spec, t = config.submodel_spec(), config.train
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        net = create_model(spec.model, **spec.model_args)
        data = load_data(config.data, config.data_root(), tuple(net.default_cfg["input_size"]), 1, config.seed)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr or t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        loader = DataLoader(data.train, batch_size=t.batch_size, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(config.seed))
        net.train()
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(net(x), y).backward()
                optimizer.step()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, str(out_path))
    return evaluate(net, data.test, config.eval.batch_size)

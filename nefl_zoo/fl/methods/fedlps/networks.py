"""FedLPS's networks: the frozen encoder, the task predictors, the multi-task model a client
trains, and the backbone they are cut from."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ....models import create_model, load_pretrained
from ....models.base import NestedNet
from ....spec import SubmodelSpec
from ...strategy.local_model import LocalModel
from ...training.batches import ordered_batches
from ...training.bn import recompute_bn
from ...training.device import placement
from .tasks import TaskSet


class Encoder(nn.Module):
    """The backbone's stem and first blocks, frozen. The backbone is held outside the module
    tree (a tuple), so the encoder has no parameters or norms of its own to train or reset and
    the backbone stays in eval mode."""

    def __init__(self, net: NestedNet, blocks: list[nn.Module]):
        super().__init__()
        self._net = (net,)
        self.blocks = blocks  # modules of ``net`` (a plain list: not registered here)

    def _apply(self, fn, recurse: bool = True):
        """``.to(device)``, ``.double()``, ... reach the held backbone too (it runs the forward)."""
        self._net[0]._apply(fn, recurse)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._net[0].forward_stem(x)
        for block in self.blocks:
            x = block(x)
        return x


class Predictor(nn.Module):
    """Blocks after the encoder, keyed as in the backbone (``layer2.0...``), the modules of the
    backbone's ``forward_norm`` (ShuffleNetV2's ``conv5``; ResNets: none), the backbone's
    parameter-free pooling (``forward_head(pre_logits=True)``) and a task head."""

    def __init__(self, neck: NestedNet, blocks: list[tuple[str, str, nn.Module]], head: nn.Module,
                 norms: list[tuple[str, nn.Module]] = ()):
        super().__init__()
        self.stages: list[str] = []
        for stage, index, block in blocks:
            if stage not in self.stages:
                self.add_module(stage, nn.Sequential())
                self.stages.append(stage)
            self.get_submodule(stage).add_module(index, block)
        self.norms = [name for name, _ in norms]
        for name, module in norms:
            self.add_module(name, module)
        self.head = head
        self._neck = (neck,)  # a tuple: not a submodule of the predictor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = self.get_submodule(stage)(x)
        for name in self.norms:
            x = self.get_submodule(name)(x)
        return self.head(self._neck[0].forward_head(x, pre_logits=True))


def norm_modules(net: NestedNet) -> list[str]:
    """The top-level modules ``net.forward_norm`` runs, in order; ``ValueError`` unless running
    them one after another is what ``forward_norm`` computes."""
    called: list[str] = []
    hooks = [m.register_forward_hook(lambda *_, name=name: called.append(name)) for name, m in net.named_children()]
    x = torch.randn(2, net.feature_info[-1]["num_chs"], 2, 2, generator=torch.Generator().manual_seed(0))  # not the global RNG
    try:
        with torch.no_grad():
            expected = net.forward_norm(x)
    except RuntimeError:
        raise ValueError(f"fedlps: {type(net).__name__} is not a convolutional backbone (FedLPS prunes ResNet and ShuffleNetV2 blocks)") from None
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for name in called:
            x = net.get_submodule(name)(x)
    if not torch.equal(x, expected):
        raise ValueError(f"fedlps: {type(net).__name__}.forward_norm is not a chain of its modules {called}")
    return called


class MultiTask(LocalModel):
    """The frozen encoder (run once per batch) feeding one predictor per task; each image goes
    to its own task's predictor (:class:`~.tasks.TaskSet` routes by label)."""

    def __init__(self, encoder: Encoder, predictors: Mapping[str, Predictor], tasks: TaskSet):
        super().__init__()
        self.encoder = encoder
        self.predictors = nn.ModuleDict(predictors)
        self.tasks = tasks

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.encoder(x)

    def routed(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per task with images in the batch: (rows, task-local labels, its predictor's logits).
        In training mode a task with a single image in the batch is left out (BatchNorm)."""
        embedding, out = self.embed(x), {}
        for task, (rows, local) in self.tasks.route(y).items():
            if not (self.training and len(rows) < 2):
                out[task] = (rows, local, self.predictors[task](embedding[rows]))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every task's logits for every image, concatenated (what MAC counts see)."""
        embedding = self.embed(x)
        return torch.cat([p(embedding) for p in self.predictors.values()], 1)

    def loss(self, x, y):
        """The sum over the batch's tasks of each task's mean cross-entropy on its own images;
        the logits: per image, its task's logits at its task's labels (-inf elsewhere)."""
        full = torch.full((len(y), len(self.tasks.task_of)), float("-inf"), device=x.device)
        loss = torch.zeros((), device=x.device, requires_grad=True)  # a batch whose tasks all have one image trains nothing
        for task, (rows, local, logits) in self.routed(x, y).items():
            loss = loss + F.cross_entropy(logits, local)
            full[rows.unsqueeze(1), self.tasks.labels[task].to(x.device)] = logits.detach().to(full.dtype)
        return loss, full

    def state(self):
        return {f"{task}.{k}": v.detach().clone() for task, p in self.predictors.items() for k, v in p.state_dict().items()}


def with_task_bn(model: MultiTask, treatment: str, batches) -> MultiTask:
    """``model`` in eval mode; ``recompute``: every predictor's BN statistics recomputed on its
    own task's images in ``batches`` (:func:`~nefl_zoo.fl.training.bn.recompute_bn`)."""
    if treatment == "recompute":
        batches = list(batches)
        for task, predictor in model.predictors.items():
            own = [(x[rows], local) for x, y in batches for t, (rows, local) in model.tasks.route(y).items() if t == task]
            recompute_bn(nn.Sequential(model.encoder, predictor), own)
    return model.eval()


@torch.no_grad()
def evaluate_tasks(model: MultiTask, dataset, batch_size: int = 256) -> dict[str, float]:
    """Top-1 accuracy of every task of ``model`` (eval mode) on its own images in ``dataset``."""
    device = placement().device
    model.to(device).eval()
    correct = dict.fromkeys(model.predictors, 0)
    total = dict.fromkeys(model.predictors, 0)
    for x, y in ordered_batches(dataset, batch_size, device):
        for task, (_, local, logits) in model.routed(x, y).items():
            correct[task] += int((logits.argmax(1) == local).sum())
            total[task] += len(local)
    return {task: correct[task] / max(total[task], 1) for task in correct}


def load_backbone(spec: SubmodelSpec, seed: int, pretrained: str | Path | None, model: str | None = None,
                  model_args: Mapping | None = None) -> NestedNet:
    """The backbone: ``model`` (default: the run spec's model) with the spec's model arguments
    updated by ``model_args``, ``pretrained`` weights or the random initialisation of ``seed``
    (what the engine's ``torch.manual_seed(seed)`` gives NeFL; where FedLPS's default
    ``pretrained: public`` starts pre-training from, :mod:`.pretrain`); frozen, eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = create_model(model or spec.model, **{**spec.model_args, **(model_args or {})})
    if pretrained is not None:
        load_pretrained(net, pretrained)
    return net.requires_grad_(False).eval()

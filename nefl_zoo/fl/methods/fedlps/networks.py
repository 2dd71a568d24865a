"""FedLPS's networks: the frozen encoder, the task predictors, the multi-task model a client
trains, and the backbone they are cut from."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from ....models import create_model, load_pretrained
from ....models.base import NestedNet
from ....spec import SubmodelSpec
from ...local import LocalModel
from .tasks import TASKS


class Encoder(nn.Module):
    """The backbone's stem and first blocks, frozen. The backbone is held outside the module
    tree (a tuple), so the encoder has no parameters or norms of its own to train or reset and
    the backbone stays in eval mode."""

    def __init__(self, net: NestedNet, blocks: list[nn.Module]):
        super().__init__()
        self._net = (net,)
        self.blocks = blocks  # modules of ``net`` (a plain list: not registered here)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._net[0].forward_stem(x)
        for block in self.blocks:
            x = block(x)
        return x


class Predictor(nn.Module):
    """Blocks after the encoder, keyed as in the backbone (``layer2.0...``), the backbone's
    parameter-free neck (``forward_norm``, ``forward_head(pre_logits=True)``) and a task head."""

    def __init__(self, neck: NestedNet, blocks: list[tuple[str, str, nn.Module]], head: nn.Module):
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

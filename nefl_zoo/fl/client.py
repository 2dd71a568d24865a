"""Local training and evaluation as plain functions, driven by an instruction's flat config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch.utils.data import DataLoader, Dataset

from .local import LocalModel
from .settings import TrainConfig


@dataclass
class ClientResult:
    """What local training produced: the trained tensors, the sample count and metrics."""

    state: dict[str, torch.Tensor]
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)


def learning_rate(cfg: TrainConfig, round_index: int, rounds: int) -> float:
    """Learning rate of round ``round_index`` (0-based) of ``rounds``.

    ``step``: x0.1 from T/2 and again from 3T/4 (the paper's); ``cosine``: linear warm-up over
    ``warmup_rounds`` then cosine decay to 0; ``constant``.
    """
    if cfg.schedule == "step":
        return cfg.lr * 0.1 ** ((round_index >= rounds / 2) + (round_index >= 3 * rounds / 4))
    if cfg.schedule == "cosine":
        if round_index < cfg.warmup_rounds:
            return cfg.lr * (round_index + 1) / cfg.warmup_rounds
        span = max(1, rounds - cfg.warmup_rounds)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * (round_index - cfg.warmup_rounds) / span))
    return cfg.lr


def fit(local: LocalModel, dataset: Dataset, config: Mapping) -> ClientResult:
    """SGD on ``dataset`` as an instruction's ``config`` says (``lr``, ``local_epochs``,
    ``batch_size``, ``momentum``, ``weight_decay``, optional ``grad_clip``, ``seed``).

    All randomness (shuffling, augmentation, sampled widths) comes from ``seed``; the caller's
    global RNG state is left untouched, so results do not depend on what ran before.
    """
    seed, grad_clip = int(config["seed"]), config.get("grad_clip")
    params = [p for p in local.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=config["lr"], momentum=config["momentum"], weight_decay=config["weight_decay"])
    total_loss, correct, seen = 0.0, 0, 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        loader = DataLoader(dataset, batch_size=int(config["batch_size"]), shuffle=True, generator=generator)
        local.train()
        for _ in range(int(config["local_epochs"])):
            for x, y in loader:
                if len(y) < 2:  # BatchNorm cannot train on a single sample
                    continue
                optimizer.zero_grad(set_to_none=True)
                loss, logits = local.loss(x, y)
                loss.backward()
                if grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, grad_clip)
                optimizer.step()
                total_loss += float(loss.detach()) * len(y)
                correct += int((logits.argmax(1) == y).sum())
                seen += len(y)
    metrics = {"loss": total_loss / max(seen, 1), "accuracy": correct / max(seen, 1)}
    return ClientResult(local.state(), len(dataset), metrics)


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Dataset, batch_size: int = 256) -> float:
    """Top-1 accuracy of ``model`` (in eval mode) on ``dataset``."""
    model.eval()
    correct = total = 0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        correct += int((model(x).argmax(1) == y).sum())
        total += len(y)
    return correct / max(total, 1)

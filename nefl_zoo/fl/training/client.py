"""Local training and evaluation as plain functions, driven by an instruction's flat config."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch
from torch.utils.data import Dataset

from ..strategy.base import Reply
from ..strategy.local_model import LocalModel
from ..strategy.sections import TrainConfig
from .batches import ordered_batches, shuffled_batches
from .device import placement, to_cpu
from .step import MEMORY_FORMATS, LocalForward


@dataclass
class ClientResult:
    """What local training produced: the trained tensors, the sample count and metrics.

    Attributes:
        state: the trained tensors, on the CPU.
        num_samples: the client's training samples.
        metrics: the mean loss, the training accuracy and, compiled, ``compile_s``.
    """

    state: dict[str, torch.Tensor]
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)

    def reply(self, level: str | None) -> Reply:
        """The reply of a client of ``level`` that trained: its state, sample count, mean loss,
        training accuracy and, compiled, ``compile_s``.

        Args:
            level: the tier the client trained.

        Returns:
            The reply to send the server.
        """
        metrics = {k: self.metrics[k] for k in ("accuracy", "compile_s") if k in self.metrics}
        return Reply(self.state, metrics, num_samples=self.num_samples,
                     loss=self.metrics["loss"], level=level)


def learning_rate(cfg: TrainConfig, round_index: int, rounds: int) -> float:
    """Learning rate of round ``round_index`` (0-based) of ``rounds``.

    ``step``: x0.1 from T/2 and again from 3T/4 (the paper's); ``cosine``: linear warm-up over
    ``warmup_rounds`` then cosine decay to 0; ``constant``.

    Args:
        cfg: the local training settings (``lr``, ``schedule``, ``warmup_rounds``).
        round_index: the round, from 0.
        rounds: the run's rounds, T.

    Returns:
        The learning rate.

    Examples:
        >>> from nefl_zoo.fl import learning_rate
        >>> from nefl_zoo.fl.strategy import TrainConfig
        >>> step = TrainConfig(lr=0.1, schedule="step")
        >>> [round(learning_rate(step, r, 8), 4) for r in range(8)]
        [0.1, 0.1, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001]
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
    ``batch_size``, ``min_batch``, ``last_batch``, ``momentum``, ``weight_decay``, optional
    ``grad_clip``, ``seed``), on the device, in the precision and the way (compiled or not, in a
    memory format: :mod:`.step`) of the current :func:`~nefl_zoo.fl.training.device.placement`.

    All randomness (shuffling, augmentation, sampled widths) comes from ``seed``; the caller's
    global RNG state is left untouched, so results do not depend on what ran before. ``local``
    is moved to the device; the returned state is on the CPU. Compiled, the metrics hold
    ``compile_s``: the seconds of this client's steps that compiled a structure.

    Args:
        local: the client's model, as its method builds it.
        dataset: the client's training data.
        config: the instruction's training settings.

    Returns:
        The trained tensors, the sample count and the metrics.
    """
    where = placement()
    seed, grad_clip = int(config["seed"]), config.get("grad_clip")
    local.to(where.device, memory_format=MEMORY_FORMATS[where.memory_format])
    params = [p for p in local.parameters() if p.requires_grad]
    scaler = where.scaler()
    optimizer = torch.optim.SGD(params, lr=config["lr"], momentum=config["momentum"], weight_decay=config["weight_decay"])
    forward = LocalForward(local, where, int(config["batch_size"]))
    total_loss, correct, seen, compile_s = 0.0, 0, 0, 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        local.train()
        for x, y in training_batches(dataset, config, where.device):
            x = forward.prepare(x)
            started = time.perf_counter() if forward.compiles(x) else None
            optimizer.zero_grad(set_to_none=True)
            with where.autocast():
                loss, logits = forward(x, y)
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            total_loss += float(loss.detach()) * len(y)
            correct += int((logits.argmax(1) == y).sum())
            seen += len(y)
            if started is not None:
                compile_s += time.perf_counter() - started
    if forward.channels_last:
        local.to(memory_format=torch.contiguous_format)
    metrics = {"loss": total_loss / max(seen, 1), "accuracy": correct / max(seen, 1)}
    if forward.compiled:
        metrics["compile_s"] = compile_s
    return ClientResult(to_cpu(local.state()), len(dataset), metrics)


def training_batches(dataset: Dataset, config: Mapping, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of local training as an instruction's ``config`` says: ``local_epochs`` of
    ``batch_size``, each epoch's last batch below ``min_batch`` dropped, or merged into the one
    before when ``last_batch`` is ``merge`` (:class:`~nefl_zoo.fl.strategy.sections.TrainConfig`; an
    instruction without them, from an older server, gets its defaults)."""
    defaults = TrainConfig.model_fields
    min_batch = int(config.get("min_batch", defaults["min_batch"].default))
    merge = config.get("last_batch", defaults["last_batch"].default) == "merge"
    return shuffled_batches(dataset, int(config["batch_size"]), int(config["seed"]), int(config["local_epochs"]), device,
                            min_batch=min_batch, merge=merge)


@torch.no_grad()
def correct(model: torch.nn.Module, dataset: Dataset, batch_size: int = 256) -> torch.Tensor:
    """Whether the top-1 prediction of ``model`` (in eval mode, moved to the current placement's
    device) is right, for every sample of ``dataset`` in order.

    Args:
        model: the model.
        dataset: ``(image, label)`` pairs.
        batch_size: images per batch.

    Returns:
        A bool tensor on the CPU, one flag per image of ``dataset``.
    """
    where = placement()
    model.to(where.device).eval()
    flags = []
    for x, y in ordered_batches(dataset, batch_size, where.device):
        with where.autocast():
            flags.append((model(x).argmax(1) == y).cpu())
    return torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool)


def evaluate(model: torch.nn.Module, dataset: Dataset, batch_size: int = 256) -> float:
    """Top-1 accuracy of ``model`` (in eval mode, moved to the current placement's device) on
    ``dataset``.

    Args:
        model: the model.
        dataset: ``(image, label)`` pairs.
        batch_size: images per batch.

    Returns:
        The share of images whose top class is the label (0 for an empty dataset).
    """
    flags = correct(model, dataset, batch_size)
    return int(flags.sum()) / max(len(flags), 1)

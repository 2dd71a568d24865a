"""Batched clients (``train.parallel_clients``): the clients of one submodel in a round trained
together, ``torch.func.functional_call`` + ``vmap`` over their stacked tensors.

Each client keeps what sequential training gives it (:func:`~nefl_zoo.fl.training.client.fit`): its own
batches (the same shuffling and augmentation from its seed, :mod:`.batches`), its own SGD state
(momentum, weight decay, gradient clipping, written here on the stacked tensors with
``torch.optim.SGD``'s update rule) and its own BatchNorm statistics (the stacked buffers are
passed to ``functional_call`` and updated in place per client). Clients whose datasets differ
in size have different batch counts and last-batch sizes: every step groups the clients that
still train by their batch size and runs each group on its rows of the stacks, so no sample is
padded. The result equals sequential training up to float rounding (tested: max relative
difference <= 1e-5 per tensor on digits, fp32).

Only a :class:`~nefl_zoo.fl.strategy.local_model.LocalModel` declaring ``batchable`` (its loss a pure function
of its tensors and batch: NeFL, FedAvg, HeteroFL, ...) from a method's
:meth:`~nefl_zoo.fl.strategy.Strategy.local_model` is batched; others (FedProx's anchored loss,
FjORD's sampled widths, distillation, FedGH, FedLPS) and ``precision: fp16`` (its gradient
scaler is per optimizer) train one at a time, said once in a log line.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import Dataset

from ..strategy.base import Instruction, Reply, Strategy
from ..strategy.local_model import LocalModel, impure_reason
from .client import ClientResult, fit, training_batches
from .device import placement, to_cpu

log = logging.getLogger(__name__)
_said: set[tuple[str, str]] = set()
Tensors = dict[str, torch.Tensor]


class _LossOf(nn.Module):
    """``forward(x, y)`` is the local model's ``loss`` (what ``functional_call`` can call)."""

    def __init__(self, local: LocalModel):
        super().__init__()
        self.local = local

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return self.local.loss(x, y)


def _why_not(local: LocalModel | None) -> str | None:
    """Why ``local`` cannot train batched, or ``None`` when it can."""
    if local is None:
        return "its client step is not plain local training"
    reason = impure_reason(local)
    if reason is None and placement().precision == "fp16":
        return "precision fp16 needs a gradient scaler per client"
    return reason


def _group_key(local: LocalModel, instruction: Instruction) -> tuple:
    config = instruction.config
    shapes = tuple((k, tuple(v.shape)) for k, v in local.state_dict().items())
    hyper = tuple(config.get(k) for k in ("lr", "momentum", "weight_decay", "grad_clip", "local_epochs", "batch_size", "min_batch", "last_batch"))
    return instruction.level, type(local), hyper, shapes


def _sgd(params: Tensors, grads: Tensors, momenta: Tensors | None, config: Mapping) -> None:
    """One step of ``torch.optim.SGD`` (and ``clip_grad_norm_``) for every client, in place."""
    clip = config.get("grad_clip")
    if clip is not None:
        norms = torch.stack([g.reshape(len(g), -1).norm(2, 1) for g in grads.values()], 1).norm(2, 1)
        coef = (clip / (norms + 1e-6)).clamp(max=1.0)
        grads = {k: g * coef.view(-1, *(1,) * (g.ndim - 1)) for k, g in grads.items()}
    lr, momentum, decay = float(config["lr"]), float(config["momentum"]), float(config["weight_decay"])
    for k, p in params.items():
        d = grads[k]
        if decay:
            d = d.add(p, alpha=decay)
        if momenta is not None:  # zero-initialised: the first step gives momentum * 0 + d = d, as torch's clone
            d = momenta[k].mul_(momentum).add_(d)
        p.add_(d, alpha=-lr)


def fit_together(locals_: Sequence[LocalModel], datasets: Sequence[Dataset], configs: Sequence[Mapping]) -> list[ClientResult]:
    """Train every ``locals_[i]`` on ``datasets[i]`` as :func:`~nefl_zoo.fl.training.client.fit` with
    ``configs[i]`` would (the same architecture and hyper-parameters, seeds of their own), on the
    current placement; returns their results in order, states on the CPU."""
    where, config = placement(), configs[0]
    template = _LossOf(locals_[0]).train()
    wrapped = [_LossOf(local) for local in locals_]
    trainable = {k for k, p in template.named_parameters() if p.requires_grad}
    tensors = [dict(w.named_parameters()) | dict(w.named_buffers()) for w in wrapped]
    stacked = {k: torch.stack([t[k].detach() for t in tensors]).to(where.device) for k in tensors[0]}
    params = {k: v for k, v in stacked.items() if k in trainable}
    others = {k: v for k, v in stacked.items() if k not in trainable}
    momenta = {k: torch.zeros_like(v) for k, v in params.items()} if float(config["momentum"]) else None
    streams = []
    for dataset, cfg in zip(datasets, configs):
        seed = int(cfg["seed"])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            streams.append(list(training_batches(dataset, cfg, where.device)))

    def loss_of(p: Tensors, rest: Tensors, x: torch.Tensor, y: torch.Tensor):
        loss, logits = functional_call(template, (p, rest), (x, y))
        return loss, (loss, logits)

    step = vmap(grad(loss_of, has_aux=True))
    n = len(locals_)
    loss_sum = torch.zeros(n, dtype=torch.float64, device=where.device)
    correct = torch.zeros(n, dtype=torch.int64, device=where.device)
    seen = [0] * n
    for s in range(max(len(stream) for stream in streams)):
        by_size: dict[int, list[int]] = {}
        for c, stream in enumerate(streams):
            if s < len(stream):
                by_size.setdefault(len(stream[s][1]), []).append(c)
        for size, members in by_size.items():
            rows = None if len(members) == n else torch.tensor(members, device=where.device)
            p, rest = ({k: v[rows] for k, v in t.items()} if rows is not None else t for t in (params, others))
            m = None if momenta is None else ({k: v[rows] for k, v in momenta.items()} if rows is not None else momenta)
            x = torch.stack([streams[c][s][0] for c in members])
            y = torch.stack([streams[c][s][1] for c in members])
            with where.autocast():
                grads, (loss, logits) = step(p, rest, x, y)
            _sgd(p, grads, m, config)
            if rows is not None:  # write the group's rows back (its BN buffers were updated in its copy)
                for full, part in ((params, p), (others, rest), *(((momenta, m),) if m is not None else ())):
                    for k, v in part.items():
                        full[k][rows] = v
            index = rows if rows is not None else slice(None)
            loss_sum[index] += loss.detach().double() * size
            correct[index] += (logits.argmax(-1) == y).sum(1)
            for c in members:
                seen[c] += size
    results = []
    losses, rights = loss_sum.tolist(), correct.tolist()
    for c, (w, dataset) in enumerate(zip(wrapped, datasets)):
        with torch.no_grad():
            for k, v in (*params.items(), *others.items()):
                tensors[c][k].copy_(v[c])
        metrics = {"loss": losses[c] / max(seen[c], 1), "accuracy": rights[c] / max(seen[c], 1)}
        results.append(ClientResult(to_cpu(w.local.state()), len(dataset), metrics))
    return results


def train_clients(strategy: Strategy, instructions: Mapping[int, Instruction], data_of: Callable[[int], Dataset],
                  train_one: Callable[[int], Reply], parallel: int) -> dict[int, Reply]:
    """Every client's reply to its train ``instruction``, in instruction order: clients of one
    level whose models can be batched, ``parallel`` at a time (:func:`fit_together`), the rest
    one at a time (``train_one(cid)``: the method's own ``train``)."""
    groups: dict[tuple, list[tuple[int, LocalModel]]] = {}
    replies: dict[int, Reply] = {}
    for cid, instruction in instructions.items():
        local = strategy.local_model(instruction)
        reason = _why_not(local)
        if reason is None:
            groups.setdefault(_group_key(local, instruction), []).append((cid, local))
            continue
        if (strategy.name, reason) not in _said:
            _said.add((strategy.name, reason))
            log.warning("%s: clients train one at a time, not batched: %s", strategy.name, reason)
        replies[cid] = train_one(cid) if local is None else fit(local, data_of(cid), instruction.config).reply(instruction.level)
    for members in groups.values():
        for start in range(0, len(members), parallel):
            chunk = members[start:start + parallel]
            cids = [cid for cid, _ in chunk]
            if len(chunk) == 1:
                replies[cids[0]] = fit(chunk[0][1], data_of(cids[0]), instructions[cids[0]].config).reply(instructions[cids[0]].level)
                continue
            results = fit_together([local for _, local in chunk], [data_of(c) for c in cids], [instructions[c].config for c in cids])
            replies.update({cid: r.reply(instructions[cid].level) for cid, r in zip(cids, results)})
    return {cid: replies[cid] for cid in instructions}

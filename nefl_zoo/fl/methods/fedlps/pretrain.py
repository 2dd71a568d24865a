"""Centralised pre-training of a FedLPS backbone on the held-out public split
(``data.public_fraction``), which no client holds.

``method_args.pretrained: public`` (the default) runs :func:`pretrain` when the strategy first
needs its backbone's weights (:meth:`~.method.FedLPS.prepare_backbone`); :func:`pretrain_backbone`
trains the same weights from a run configuration and saves them to a file (for
``method_args.pretrained: FILE``). Both are deterministic from the run seed: the backbone starts
from the seed's initialisation (:func:`~.networks.load_backbone`'s) and every random draw
(shuffling, augmentation) comes from the seed, the caller's RNG left untouched; so at a fixed
device and thread count a run, its resume and a Flower node pre-train bit-identical weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset

from ....models import create_model
from ....models.base import NestedNet

log = logging.getLogger(__name__)

NO_PUBLIC = ("fedlps: method_args.pretrained: public pre-trains the encoder on the held-out split data.public_fraction, "
             "and this run holds none out: set data.public_fraction (e.g. 0.2), or method_args.pretrained to a weights "
             "file or to none (a random encoder)")


def held_out(data_cfg, root: str | Path, input_size: tuple[int, int, int], num_clients: int, seed: int):
    """The run's data (:func:`~nefl_zoo.data.loading.load_data`) and its public split as a dataset
    (training augmentation); ``ValueError`` without a public split. The split is taken before
    partitioning, so it does not depend on ``num_clients`` or the partition."""
    from ....data.loading import load_data

    if not data_cfg.public_fraction:
        raise ValueError(NO_PUBLIC)
    data = load_data(data_cfg, Path(root), input_size, num_clients, seed)
    return data, Subset(data.train, data.public.tolist())


def public_data(config):
    """The run's data (partitioned as the engine does), its public split as a dataset (training
    augmentation) and the backbone's (model, arguments); ``ValueError`` without a public split."""
    from ...strategy.registry import parse_settings

    spec = config.submodel_spec()
    settings = parse_settings(config.method, config.method_args)
    backbone = (settings.backbone or spec.model, {**spec.model_args, **settings.backbone_args})
    with torch.device("meta"):
        input_size = tuple(create_model(backbone[0], **backbone[1]).default_cfg["input_size"])
    data, public = held_out(config.data, config.data_root(), input_size, config.clients.num_clients, config.seed)
    return data, public, backbone


def pretrain(model: str, model_args: Mapping, public: Dataset, train, seed: int, epochs: int, where,
             lr: float | None = None) -> NestedNet:
    """The backbone ``model`` (``model_args``) initialised from ``seed`` and trained ``epochs``
    epochs on ``public`` with the dataset's labels: SGD with ``lr`` (default ``train.lr``,
    constant) and ``train``'s batch size, momentum and weight decay, on ``where`` (a
    :class:`~nefl_zoo.fl.training.device.Placement`), the last incomplete batch of each epoch dropped (a
    batch of a few images through BatchNorm can wreck the weights). Every random draw comes from
    ``seed``; the caller's RNG state is left untouched. On CUDA, cuDNN runs its deterministic
    algorithms meanwhile (a resume re-runs this; its fingerprint check refuses other weights)."""
    with torch.random.fork_rng(devices=[]), _deterministic_cudnn(where.device.type == "cuda"):
        torch.manual_seed(seed)
        net = create_model(model, **model_args).to(where.device)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr or train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
        loader = DataLoader(public, batch_size=train.batch_size, shuffle=True, drop_last=len(public) > train.batch_size,
                            generator=torch.Generator().manual_seed(seed))
        net.train()
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                with where.autocast():
                    loss = F.cross_entropy(net(x.to(where.device)), y.to(where.device))
                loss.backward()
                optimizer.step()
    return net.eval()


@contextlib.contextmanager
def _deterministic_cudnn(on: bool):
    """cuDNN's deterministic algorithms, no autotuning, while the block runs (``on``)."""
    cudnn = torch.backends.cudnn
    saved = cudnn.deterministic, cudnn.benchmark
    if on:
        cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = saved


def cpu_state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``net``'s state dict, detached, contiguous, on the CPU."""
    return {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}


def pretrain_for_run(run, settings, input_size: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """What ``method_args.pretrained: public`` loads: the backbone pre-trained on the held-out
    split of ``run.data`` (its root resolved) with ``settings.pretrain_epochs`` and
    ``pretrain_lr`` (:func:`pretrain`; the weights :func:`pretrain_backbone` saves for the same
    configuration), as a CPU state dict. Logs the time and the test accuracy."""
    from ...training.client import evaluate
    from ...training.device import Placement, placed

    data_cfg = getattr(run, "data", None)  # Run.data: the run's data section, its root resolved
    if data_cfg is None:
        raise ValueError("fedlps: method_args.pretrained: public pre-trains on the run's held-out data, which this Run does "
                         "not carry (Run.data); build the strategy with RunConfig.build_strategy")
    start = time.perf_counter()
    where = Placement.of(run.train)
    # one client: the held-out split is taken before partitioning, whatever the partition
    data, public = held_out(data_cfg.model_copy(update={"partition": "iid", "local_split": None}), data_cfg.root,
                            input_size, 1, run.seed)
    net = pretrain(settings.backbone or run.spec.model, {**run.spec.model_args, **settings.backbone_args}, public, run.train,
                   run.seed, settings.pretrain_epochs, where, settings.pretrain_lr)
    with placed(where):
        accuracy = evaluate(net, data.test, run.eval.batch_size)
    log.info("fedlps: backbone pre-trained on the %d held-out images, %d epochs, in %.1f s (test accuracy %.4f)",
             len(public), settings.pretrain_epochs, time.perf_counter() - start, accuracy)
    return cpu_state(net)


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a state dict: every key with its dtype, shape and bytes, in key order."""
    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key].detach().cpu().contiguous()
        digest.update(f"{key}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.view(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def pretrain_backbone(config, epochs: int, out_path: str | Path, lr: float | None = None) -> float:
    """Centralised pre-training of a backbone for FedLPS's ``method_args.pretrained``.

    Trains the backbone (``method_args.backbone``, default the spec's model; the run seed's
    initialisation) for ``epochs`` epochs on the public split (:func:`public_data`) as
    :func:`pretrain` does, with ``lr`` (default ``train.lr``) and the config's batch size,
    momentum and weight decay: the weights ``pretrained: public`` with ``pretrain_epochs:
    epochs`` and ``pretrain_lr: lr`` loads. Saves the plain state dict as safetensors at
    ``out_path`` and returns the accuracy on the test split.
    """
    from safetensors.torch import save_file

    from ...training.client import evaluate
    from ...training.device import placed

    where = config.placement()
    data, public, backbone = public_data(config)
    net = pretrain(backbone[0], backbone[1], public, config.train, config.seed, epochs, where, lr)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    save_file(cpu_state(net), str(out_path))
    with placed(where):
        return evaluate(net, data.test, config.eval.batch_size)

"""Centralised pre-training of a FedLPS backbone (``method_args.pretrained``)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ....models import create_model


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

    from ...client import evaluate
    from ...data import load_data

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

"""Centralised pre-training of a FedLPS backbone (``method_args.pretrained``) on the held-out
public split (``data.public_fraction``), which no client holds."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from ....models import create_model


def public_data(config):
    """The run's data (:func:`~nefl_zoo.fl.data.load_data`, partitioned as the engine does), its
    public split as a dataset (training augmentation) and the backbone's (model, arguments);
    ``ValueError`` without a public split."""
    from ...data import load_data
    from ...registry import parse_settings

    if not config.data.public_fraction:
        raise ValueError("fedlps: pre-training needs a held-out public split that no client holds: set data.public_fraction")
    spec = config.submodel_spec()
    settings = parse_settings(config.method, config.method_args)
    backbone = (settings.backbone or spec.model, {**spec.model_args, **settings.backbone_args})
    with torch.device("meta"):
        input_size = tuple(create_model(backbone[0], **backbone[1]).default_cfg["input_size"])
    data = load_data(config.data, config.data_root(), input_size, config.clients.num_clients, config.seed)
    return data, Subset(data.train, data.public.tolist()), backbone


def pretrain_backbone(config, epochs: int, out_path: str | Path, lr: float | None = None) -> float:
    """Centralised pre-training of a backbone for FedLPS's ``method_args.pretrained``.

    Trains the backbone (``method_args.backbone``, default the spec's model; the run seed's
    initialisation) for ``epochs`` epochs on the public split (:func:`public_data`) with the
    dataset's labels: SGD with ``lr`` (default ``train.lr``, constant) and the config's batch
    size, momentum and weight decay, the last incomplete batch of each epoch dropped (a batch of
    a few images through BatchNorm can wreck the weights). Saves the plain state dict as
    safetensors at ``out_path`` and returns the accuracy on the test split.
    """
    from safetensors.torch import save_file

    from ...client import evaluate
    from ...device import placed

    t, where = config.train, config.placement()
    data, public, backbone = public_data(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        net = create_model(backbone[0], **backbone[1]).to(where.device)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr or t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        loader = DataLoader(public, batch_size=t.batch_size, shuffle=True, drop_last=len(public) > t.batch_size,
                            generator=torch.Generator().manual_seed(config.seed))
        net.train()
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                with where.autocast():
                    loss = F.cross_entropy(net(x.to(where.device)), y.to(where.device))
                loss.backward()
                optimizer.step()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, str(out_path))
    with placed(where):
        return evaluate(net, data.test, config.eval.batch_size)

"""FedDyn (Acar et al., ICLR 2021), the dynamic regulariser DepthFL aggregates with, as plain
pieces: a client loss, the client's update of its linear term and the server's update.

A client k keeps a linear term ``g_k`` (per parameter, zero at first) and minimises
``L_k(w) - <w, g_k> + alpha/2 ||w - w_received||^2``; after training, ``g_k <- g_k - alpha (w_k -
w_received)``. The server keeps ``h`` (zero at first): with ``w_avg`` the average of the replies,
``h <- h - alpha * n/M * (w_avg - w_old)`` (``n`` replies holding the tensor, ``M`` clients in
all) and the new global tensor is ``w_avg - h / alpha``. Only parameters (weights and biases) take
part; BN running statistics are averaged as they are.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ..strategy.local_model import LocalModel


def is_parameter(key: str) -> bool:
    """Whether a state key names a trainable parameter (a weight or a bias, not a statistic)."""
    return key.rsplit("@", 1)[0].endswith(("weight", "bias"))


class FedDynLocal(LocalModel):
    """``base``'s loss plus FedDyn's terms over ``params`` (state key -> parameter), with the
    client's linear terms ``grads`` (state key -> tensor; a missing key is zero)."""

    def __init__(self, base: LocalModel, params: Mapping[str, nn.Parameter], grads: Mapping[str, torch.Tensor], alpha: float):
        super().__init__()
        self.base, self.alpha = base, alpha
        self.terms = [(p, p.detach().clone(), grads.get(k)) for k, p in params.items() if p.requires_grad]

    def forward(self, x):
        return self.base(x)

    def loss(self, x, y):
        loss, logits = self.base.loss(x, y)
        for p, p0, g in self.terms:
            if g is not None:
                loss = loss - (p * g).sum()
            loss = loss + self.alpha / 2 * ((p - p0) ** 2).sum()
        return loss, logits

    def state(self):
        return self.base.state()


def client_update(grads: dict[str, torch.Tensor], received: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor], alpha: float) -> None:
    """``g_k <- g_k - alpha (w_k - w_received)`` for every parameter in ``trained`` (in place)."""
    for key, w in trained.items():
        if is_parameter(key):
            g = grads.get(key, torch.zeros_like(w))
            grads[key] = g - alpha * (w - received[key])


def server_update(h: dict[str, torch.Tensor], old: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor],
                  holders: Mapping[str, int], num_clients: int, alpha: float) -> dict[str, torch.Tensor]:
    """Update ``h`` in place for the parameters ``holders`` names (key -> replies holding it) and
    return the new global state: ``averaged`` with those parameters moved to ``w_avg - h / alpha``."""
    out = dict(averaged)
    for key, n in holders.items():
        if not is_parameter(key) or n == 0:
            continue
        h[key] = h.get(key, torch.zeros_like(old[key])) - alpha * n / num_clients * (averaged[key] - old[key])
        out[key] = averaged[key] - h[key] / alpha
    return out

"""Client-side models: what a client trains (``loss``) and what it sends back (``state``)."""

from __future__ import annotations

import abc
from typing import ClassVar, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn


class LocalModel(nn.Module, abc.ABC):
    """A client's trainable model: ``loss(x, y)`` for local training, ``state()`` to upload.

    ``batchable``: ``loss`` is a pure function of the module's parameters, buffers and batch
    (no RNG, no tensors held outside the module), so several clients' copies may be trained
    together with ``torch.func`` (:mod:`nefl_zoo.fl.training.parallel`).
    """

    batchable: ClassVar[bool] = False

    @abc.abstractmethod
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, logits)`` of one batch."""

    @abc.abstractmethod
    def state(self) -> dict[str, torch.Tensor]:
        """The tensors to return to the server, keyed like the method's slice entries."""


class SubmodelLocal(LocalModel):
    """One slim submodel trained with cross-entropy (NeFL, FedAvg); its state leaves out the
    ``exclude`` keys (e.g. step sizes kept constant)."""

    batchable = True

    def __init__(self, net: nn.Module, exclude: Iterable[str] = ()):
        super().__init__()
        self.net, self.exclude = net, frozenset(exclude)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, x, y):
        logits = self(x)
        return F.cross_entropy(logits, y), logits

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.net.state_dict().items() if k not in self.exclude}


def impure_reason(local: LocalModel) -> str | None:
    """Why ``local``'s loss is not a pure function of its tensors and batch (it cannot be
    batched or compiled with the same results as eager training), or ``None`` when it is."""
    if not local.batchable:
        return f"its client model ({type(local).__name__}) has a loss that is not a pure function of its tensors"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in local.modules()):
        return "its client model uses dropout (random per batch)"
    return None


def load_entries(module: nn.Module, state: Mapping[str, torch.Tensor], unused: Iterable[str] = ()) -> None:
    """Load ``state`` into ``module``; only buffers and the ``unused`` keys may be missing."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = set(missing) - {k for k, _ in module.named_buffers()} - set(unused)
    if unexpected or missing:
        raise KeyError(f"state does not fit the module: missing {sorted(missing)[:3]}, unexpected {unexpected[:3]}")

"""FedProx (Li et al., 2020): NeFL's nested training with a proximal term on each client's
submodel, ``mu / 2 * ||w - w_received||^2``, which keeps local updates near the global model."""

from __future__ import annotations

from pydantic import Field

from ..local import LocalModel
from ..strategy import MethodSettings, register_method
from .nefl import NeFL


class FedProxSettings(MethodSettings):
    """``method_args`` of ``fedprox``."""

    mu: float = Field(0.01, ge=0, description="weight of the proximal term (0: no term)")


class ProximalLocal(LocalModel):
    """A client model whose loss adds ``mu / 2`` times the squared distance of its trainable
    parameters from their received values."""

    def __init__(self, base: LocalModel, mu: float):
        super().__init__()
        self.base, self.mu = base, mu
        self.anchor = [(p, p.detach().clone()) for p in base.parameters() if p.requires_grad]

    def forward(self, x):
        return self.base(x)

    def loss(self, x, y):
        loss, logits = self.base.loss(x, y)
        proximal = sum(((p - p0) ** 2).sum() for p, p0 in self.anchor)
        return loss + self.mu / 2 * proximal, logits

    def state(self):
        return self.base.state()


@register_method("fedprox", label="FedProx", settings=FedProxSettings)
class FedProx(NeFL):
    """NeFL whose clients minimise their loss plus the proximal term (``method_args.mu``)."""

    def local_model(self, assignment, arrays) -> LocalModel:
        return ProximalLocal(super().local_model(assignment, arrays), self.settings.mu)

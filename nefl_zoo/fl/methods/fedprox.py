"""FedProx (Li et al., 2020): NeFL's nested training with a proximal term on each client's
submodel, ``mu / 2 * ||w - w_received||^2``, which keeps local updates near the global model."""

from __future__ import annotations

from pydantic import Field

from ..strategy.base import MethodSettings, Run
from ..strategy.local_model import LocalModel, SubmodelLocal
from ..strategy.registry import register_method
from .common import Nested


class FedProxSettings(MethodSettings):
    """``method_args`` of ``fedprox``."""

    mu: float = Field(0.01, ge=0, description="weight of the proximal term (0: no term)")


class ProximalLocal(LocalModel):
    """A client model whose loss adds ``mu / 2`` times the squared distance of its trainable
    parameters from their received values."""

    def __init__(self, base: LocalModel, mu: float):
        super().__init__()
        self.base, self.mu = base, mu
        self.trained = [p for p in base.parameters() if p.requires_grad]
        for i, p in enumerate(self.trained):  # buffers, so they move with the model to the training device
            self.register_buffer(f"anchor{i}", p.detach().clone(), persistent=False)

    def forward(self, x):
        return self.base(x)

    def loss(self, x, y):
        loss, logits = self.base.loss(x, y)
        proximal = sum(((p - getattr(self, f"anchor{i}")) ** 2).sum() for i, p in enumerate(self.trained))
        return loss + self.mu / 2 * proximal, logits

    def state(self):
        return self.base.state()


@register_method("fedprox", label="FedProx", settings=FedProxSettings)
class FedProx(Nested):
    """NeFL whose clients minimise their loss plus the proximal term (``method_args.mu``);
    replies are averaged by sample counts, as in FedProx (``train.weighting`` overrides)."""

    def __init__(self, run: Run, settings: FedProxSettings | None = None):
        def client_model(tier: str, arrays) -> ProximalLocal:
            return ProximalLocal(SubmodelLocal(self.submodel(tier, arrays)), self.settings.mu)

        super().__init__(run, settings, client_model=client_model, weighting="samples")

"""A client's side of a round: local training and evaluation (:mod:`.client`), the batches it
draws (:mod:`.batches`), where it trains (:mod:`.device`), its compiled step (:mod:`.step`),
clients of one submodel trained together (:mod:`.parallel`) and BatchNorm statistics at
evaluation (:mod:`.bn`)."""

from .client import ClientResult, evaluate, fit, learning_rate

__all__ = ["ClientResult", "evaluate", "fit", "learning_rate"]

"""Server aggregation: NeFedAvg as pure functions over state dicts and slice maps
(:mod:`.nefedavg`), the ``aggregation:`` section and the rule it selects (:mod:`.rules`): norm
clipping and robust rules (:mod:`.robust`), differential privacy (:mod:`.privacy`); the
``secure_aggregation:`` section and the flat vectors SecAgg+ sums (:mod:`.secagg`)."""

from .nefedavg import Sums, Update, accumulate, check_update, nefedavg, weighted_mean
from .rules import AggregationConfig, PrivacyConfig, aggregate_updates
from .secagg import SecureAggregation

__all__ = ["AggregationConfig", "PrivacyConfig", "SecureAggregation", "Sums", "Update", "accumulate", "aggregate_updates",
           "check_update", "nefedavg", "weighted_mean"]

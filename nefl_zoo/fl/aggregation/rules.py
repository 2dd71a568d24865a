"""The ``aggregation:`` section of a run config and the aggregation it selects.

Nothing set: NeFedAvg (:func:`~.nefedavg.nefedavg`), as every method averages today. Options,
for every method that averages nested updates (those built on
:class:`~nefl_zoo.fl.methods.common.Nested`: NeFL, FedAvg and its variants, FedAvgM, FedProx, HeteroFL,
FjORD, DepthFL; FedGH trains its header on the server and FedLPS fills pruned entries before its
own average, so both refuse the section):

* ``clip``: norm bounding, each client's update clipped to this L2 norm in global
  coordinates (:mod:`.robust`), before any rule;
* ``rule``: ``mean`` (weighted NeFedAvg), ``median`` or ``trimmed_mean`` (``trim``: share cut
  from each end), element-wise over the clients holding each element (:mod:`.robust`);
* ``dp``: client-level differential privacy, DP-FedAvg with fixed denominators (:mod:`.privacy`):
  needs ``clip`` (the sensitivity) and the ``mean`` rule; each round's cumulative epsilon at
  ``dp.delta`` is the round record's ``epsilon``.

Every option is stateless or seeded per round, so a resumed run is bit-identical.
"""

from __future__ import annotations

import logging
from typing import Literal, Mapping

import torch
from pydantic import Field, model_validator

from ...slim import SliceEntry
from ...userfiles import Strict, field_error
from .nefedavg import Update, check_update, nefedavg
from .privacy import epsilon, noise_generator, private_mean
from .robust import clip_update, coordinate_rule

log = logging.getLogger(__name__)


class PrivacyConfig(Strict):
    """``aggregation.dp``: DP-FedAvg's noise and the delta epsilon is reported at."""

    noise_multiplier: float = Field(..., gt=0, description="z: the noise std on each summed element is z * clip")
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta of the reported (epsilon, delta)")


class AggregationConfig(Strict):
    """``aggregation:``: the server's rule, norm bounding and differential privacy (default:
    plain NeFedAvg, bit-identical to a config without the section)."""

    rule: Literal["mean", "median", "trimmed_mean"] = Field("mean", description="element-wise over the clients holding each element")
    trim: float | None = Field(None, gt=0, lt=0.5, description="trimmed_mean: share of an element's holders cut from each end")
    clip: float | None = Field(None, gt=0, description="max L2 norm of a client's update (trained minus global tensors, in global coordinates)")
    dp: PrivacyConfig | None = Field(None, description="client-level differential privacy (DP-FedAvg); needs clip and rule mean")

    @model_validator(mode="after")
    def _check(self) -> "AggregationConfig":
        if (self.rule == "trimmed_mean") != (self.trim is not None):
            raise field_error("trim", "required with rule trimmed_mean" if self.trim is None else f"only with rule trimmed_mean, not {self.rule}")
        if self.dp is not None and self.clip is None:
            raise field_error("clip", "dp needs a clip norm (the sensitivity the noise is calibrated to)")
        if self.dp is not None and self.rule != "mean":
            raise field_error("rule", f"dp adds noise to the sums of the mean; {self.rule} cannot apply")
        return self

    @property
    def plain(self) -> bool:
        """Whether this is plain NeFedAvg (nothing set)."""
        return self.rule == "mean" and self.clip is None and self.dp is None


def aggregate_updates(global_state: Mapping[str, torch.Tensor], updates: list[Update], config: AggregationConfig, *,
                      assigned: list[Mapping[str, SliceEntry]] | None = None, seed: int | None = None,
                      server_round: int | None = None, rate: float | None = None) -> tuple[dict[str, torch.Tensor], list[tuple[int | str, str]], dict[str, float]]:
    """``updates`` aggregated as ``config`` says: ``(new state, rejected, metrics)``.

    Invalid updates (:func:`~.nefedavg.check_update`) are logged and rejected, as by
    :func:`~.nefedavg.nefedavg`. ``metrics``: ``clipped`` (updates scaled down) with ``clip``;
    ``epsilon`` (cumulative, after ``server_round`` rounds at sampling ``rate``) with ``dp``,
    which also needs ``assigned`` (the slice entries of every client assigned this round),
    ``rate``, the run ``seed`` and ``server_round`` (none of them has a default).
    """
    if config.plain:
        return (*nefedavg(global_state, updates), {})
    valid, rejected = [], []
    for update in updates:
        reason = check_update(update)
        if reason is None:
            valid.append(update)
        else:
            log.warning("client %s: update rejected: %s", update.client, reason)
            rejected.append((update.client, reason))
    metrics: dict[str, float] = {}
    if config.clip is not None:
        clipped = [clip_update(global_state, u, config.clip) for u in valid]
        valid = [u for u, _ in clipped]
        metrics["clipped"] = sum(c for _, c in clipped)
    if config.dp is not None:
        if assigned is None or rate is None or seed is None or server_round is None:
            raise ValueError("aggregation.dp: needs the round's assigned clients (the denominators), the sampling rate, "
                             "the run seed and the round")
        dp = config.dp
        state = private_mean(global_state, valid, assigned, config.clip, dp.noise_multiplier, noise_generator(seed, server_round))
        metrics["epsilon"] = epsilon(rate, dp.noise_multiplier, server_round, dp.delta)
    elif config.rule == "mean":
        state, _ = nefedavg(global_state, valid)
    else:
        state = coordinate_rule(global_state, valid, config.rule, config.trim or 0.0)
    return state, rejected, metrics

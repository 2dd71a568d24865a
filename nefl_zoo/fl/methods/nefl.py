"""NeFL: any spec (W, D, D_O, WD), per-tier step sizes and norms, dynamic submodel choice, and
NeFedAvg."""

from __future__ import annotations

from ..strategy.registry import register_method
from .common import Nested


@register_method("nefl", label="NeFL")
class NeFL(Nested):
    """NeFL as in the paper: a client picks a random submodel among the resource levels its
    environment allows; it receives that submodel's tensors (its slice map), trains it with
    cross-entropy and returns it; NeFedAvg averages every element over the clients holding it
    (consistent tensors), FedAvg per tier the ``KEY@TIER`` tensors. Learnable step sizes follow
    each tier's ``learnable_steps``; ``inconsistent`` in the spec decides which tensors are kept
    per tier."""

"""NeFL: any spec (W, D, D_O, WD), per-tier step sizes and norms, dynamic submodel choice."""

from __future__ import annotations

from .base import Method


class NeFL(Method):
    """NeFL as in the paper: :class:`Method`'s defaults are NeFL's behaviour.

    Learnable step sizes follow each tier's ``learnable_steps`` (false: the paper's N/L
    ablation); ``inconsistent`` in the spec decides which tensors are kept per tier.
    """

    name = "nefl"

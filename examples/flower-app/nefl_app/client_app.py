"""The ClientApp: runs the method's client hooks on the node's partition (its node config)."""

from nefl_zoo.fl.flower.client import app

__all__ = ["app"]

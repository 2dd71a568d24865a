"""Nested federated learning on Flower (``pip install 'nefl-zoo[flower]'``): every registered
method on Flower's Message API, in Flower's simulation engine or a real deployment.

- :class:`NestedStrategy`: Flower's ``Strategy`` for a nefl-zoo method (one message per node
  with only its submodel; replies turned back into :class:`~nefl_zoo.fl.strategy.Reply`\\ s).
- :class:`FlowerEngine`: the embedded :class:`~nefl_zoo.fl.engine.Engine` with Flower as its
  transport (same run directory, metrics, checkpoints and resume).
- ``client.app``: the ``ClientApp``; :func:`server_app`: the deployment ``ServerApp``;
  :func:`simulate`: a run on Flower's simulation engine (``nefl-zoo train --engine flower``).
"""

from .engine import FlowerEngine
from .server import SimulatedRun, server_app, simulate, simulate_runs
from .strategy import NestedStrategy, NodeRegistry

__all__ = ["FlowerEngine", "NestedStrategy", "NodeRegistry", "SimulatedRun", "server_app", "simulate", "simulate_runs"]

"""Nested federated learning on Flower (``pip install 'nefl-zoo[flower]'``): every registered
method on Flower's Message API, in Flower's simulation engine or a real deployment.

One path: :class:`FlowerEngine` is the embedded :class:`~nefl_zoo.fl.engine.Engine` with Flower
as its transport (one message per node with only its submodel; the same run directory,
metrics, checkpoints, per-client state and resume). ``client.app`` is the ``ClientApp``;
:func:`server_app` the deployment ``ServerApp``; :func:`simulate` / :func:`simulate_runs` run
on Flower's simulation engine (``nefl-zoo train --engine flower``).
"""

from .flower_engine import FlowerEngine
from .nodes import NodeRegistry
from .server import SimulatedRun, server_app, simulate, simulate_runs

__all__ = ["FlowerEngine", "NodeRegistry", "SimulatedRun", "server_app", "simulate", "simulate_runs"]

"""The embedded engine with Flower as its transport.

:class:`FlowerEngine` is :class:`~nefl_zoo.fl.engine.Engine` itself (the round loop, metrics
records, evaluation, checkpoints, resume and the run directory are literally the same code)
with two methods replaced: :meth:`available_clients` returns the clients of the Flower nodes
that are connected and set up, and :meth:`exchange` sends each client's instruction to its node
as a ``Message`` through a Flower ``Grid`` and returns the replies. It runs inside a Flower
``ServerApp`` (the simulation engine's or a SuperLink's).

Per-client state (FedGH's extractors) lives on the nodes, in their ``context.state``; it is not
in the server's checkpoints, so resuming such a method under Flower starts it afresh.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

from flwr.serverapp import Grid

from ..config import RunConfig
from ..engine import Engine
from ..strategy import ClientInfo, Instruction, Reply
from .strategy import NestedStrategy, NodeRegistry


class FlowerEngine(Engine):
    """Runs one configuration on the Flower nodes reachable through ``grid``.

    Args:
        config: the run configuration (sent to every node in its setup message).
        out_dir: the run directory (the same layout as the embedded engine's).
        grid: the ``ServerApp``'s grid.
        timeout: seconds to wait for a round's replies; later replies count as rejected.
        min_nodes: nodes to wait for before the first round (default: ``clients.num_clients``,
            so every partition takes part as in the embedded engine).
        stop: set it to end the run while it waits for nodes or replies
            (:class:`~nefl_zoo.fl.flower.strategy.Stopped`).
    """

    def __init__(self, config: RunConfig, out_dir: str | Path, grid: Grid, *, timeout: float = 3600.0,
                 min_nodes: int | None = None, stop: threading.Event | None = None):
        super().__init__(config, out_dir)
        self.grid = grid
        self.min_nodes = config.clients.num_clients if min_nodes is None else min_nodes
        levels = [t.name for t in config.submodel_spec().tiers]
        nodes = NodeRegistry(uuid.uuid4().hex, json.dumps(config.to_dict()), self.clients, levels,
                             timeout=timeout, stop=stop)
        self.flower = NestedStrategy(self.strategy, nodes, timeout=timeout)
        self._started = False

    def available_clients(self) -> list[ClientInfo]:
        clients = self.flower.nodes.refresh(self.grid, 1 if self._started else self.min_nodes)
        self._started = True
        return clients

    def exchange(self, kind: str, instructions: dict[int, Instruction]) -> dict[int, Reply]:
        return self.flower.exchange(self.grid, kind, instructions)

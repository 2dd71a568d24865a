"""The embedded engine with Flower as its transport: the one way a method runs on Flower.

:class:`FlowerEngine` is :class:`~nefl_zoo.fl.engine.Engine` itself (the round loop, metrics
records, evaluation, checkpoints, resume and the run directory are literally the same code)
with two methods replaced: :meth:`~FlowerEngine.available_clients` returns the clients of the
Flower nodes that are connected and set up, and :meth:`~FlowerEngine.exchange` sends each
client's instruction to its node as one ``Message`` (only that client's submodel) through a
Flower ``Grid`` and turns the replies back into :class:`~nefl_zoo.fl.strategy.Reply`\\ s. It
runs inside a Flower ``ServerApp`` (the simulation engine's or a SuperLink's).

Per-client state (FedGH's extractors, FedLPS's masks) is kept by the engine, as in process:
each message carries its client's state and each ``train`` reply returns it updated, so the
engine's checkpoints hold it and a resumed run continues bit-identically.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from pathlib import Path

from flwr.app import Message
from flwr.serverapp import Grid

from ..config import RunConfig
from ..engine import Engine
from ..strategy import ClientInfo, Instruction, Reply
from .nodes import NodeRegistry, collect
from .records import error_reply, instruction_content, read_reply

log = logging.getLogger(__name__)


class FlowerEngine(Engine):
    """Runs one configuration on the Flower nodes reachable through ``grid``.

    Args:
        config: the run configuration (sent to every node in its setup message).
        out_dir: the run directory (the same layout as the embedded engine's).
        grid: the ``ServerApp``'s grid.
        timeout: seconds to wait for a round's replies; a node without a reply by then counts as
            a rejected reply (the round completes with the others).
        min_nodes: nodes to wait for before the first round (default: ``clients.num_clients``,
            so every partition takes part as in the embedded engine).
        stop: set it to end the run while it waits for nodes or replies
            (:class:`~nefl_zoo.fl.flower.nodes.Stopped`).
    """

    def __init__(self, config: RunConfig, out_dir: str | Path, grid: Grid, *, timeout: float = 3600.0,
                 min_nodes: int | None = None, stop: threading.Event | None = None, poll: float = 0.1):
        super().__init__(config, out_dir)
        self.grid, self.timeout, self.poll = grid, timeout, poll
        self.min_nodes = config.clients.num_clients if min_nodes is None else min_nodes
        levels = [t.name for t in config.submodel_spec().tiers]
        self.nodes = NodeRegistry(uuid.uuid4().hex, json.dumps(config.to_dict()), self.clients, levels,
                                  timeout=timeout, stop=stop)
        self._started = False

    def available_clients(self) -> list[ClientInfo]:
        clients = self.nodes.refresh(self.grid, 1 if self._started else self.min_nodes)
        self._started = True
        return clients

    def exchange(self, kind: str, instructions: dict[int, Instruction]) -> dict[int, Reply]:
        """Send each client its instruction and state through the grid; return the replies in
        instruction order (a missing, error or undecodable one with ``error`` set) and keep the
        client states that ``train`` replies return."""
        sent = {cid: Message(instruction_content(instruction, self.nodes.run, self.client_states.get(cid, {})),
                             self.nodes.node_of(cid), kind)
                for cid, instruction in instructions.items()}
        received = collect(self.grid, list(sent.values()), self.timeout, self.poll, self.nodes.stop)
        by_id = {m.metadata.message_id: cid for cid, m in sent.items()}  # ids given when pushed
        answers: dict[int, Message] = {}
        for message in received:
            cid = by_id.get(message.metadata.reply_to_message_id)
            if cid is None:
                log.warning("a %s reply from node %s answers no message of this round; ignored", kind, message.metadata.src_node_id)
                continue
            answers[cid] = message
        replies: dict[int, Reply] = {}
        for cid in sent:
            if cid not in answers:
                replies[cid] = error_reply(f"no reply within {self.timeout:g} s")
                continue
            replies[cid], client_state = read_reply(answers[cid])
            if kind == "train" and client_state is not None:
                self.client_states[cid] = client_state
        return replies

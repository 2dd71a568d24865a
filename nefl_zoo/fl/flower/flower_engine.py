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

With ``secure_aggregation`` in the config, train rounds run Flower's SecAgg+
(:class:`~nefl_zoo.fl.flower.secure.SecureMethod`): the server gets only the sum of the clients'
scattered updates and weights, and each round's record adds ``secagg_bytes`` (every protocol
message's bytes, down and up).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from pathlib import Path

from flwr.app import Message
from flwr.serverapp import Grid

from ...bounds import number
from ..config import ConfigError, RunConfig
from ..engine import Engine
from ..methods.common import weight_scale
from ..strategy.base import ClientInfo, Instruction, Reply
from .nodes import NodeRegistry, check_waits, collect
from .records import error_reply, instruction_content, read_reply
from .secure import SecureMethod, check_secure

log = logging.getLogger(__name__)


def check_flower_config(config: RunConfig) -> None:
    """A one-line :class:`~nefl_zoo.fl.config.ConfigError` for what a Flower run cannot give:
    ``devices`` (the virtual clock is the in-process engine's) or a ``secure_aggregation`` that
    cannot apply (:func:`~.secure.check_secure`)."""
    if config.devices is not None:
        raise ConfigError(config._source, "devices", "the virtual clock runs on the in-process engine; remove devices: or --engine flower")
    check_secure(config)


class FlowerEngine(Engine):
    """Runs one configuration on the Flower nodes reachable through ``grid``.

    Args:
        config: the run configuration (sent to every node in its setup message).
        out_dir: the run directory (the same layout as the embedded engine's).
        grid: the ``ServerApp``'s grid.
        timeout: seconds to wait for a round's replies; a node without a reply by then counts as
            a rejected reply (the round completes with the others).
        min_nodes: nodes to wait for before the first round, 1 to ``clients.num_clients``
            (default: all, so every partition takes part as in the embedded engine).
        poll: seconds between two pulls for replies (:func:`~.nodes.check_waits`, as ``timeout``).
        stop: set it to end the run while it waits for nodes or replies
            (:class:`~nefl_zoo.fl.flower.nodes.Stopped`).
    """

    secure_transport = True

    def __init__(self, config: RunConfig, out_dir: str | Path, grid: Grid, *, timeout: float = 3600.0,
                 min_nodes: int | None = None, stop: threading.Event | None = None, poll: float = 0.1):
        check_flower_config(config)
        check_waits(timeout, poll)
        if min_nodes is not None:
            number("min_nodes", min_nodes, 1, config.clients.num_clients, integer=True)
        super().__init__(config, out_dir)
        self.grid, self.timeout, self.poll = grid, timeout, poll
        self.min_nodes = config.clients.num_clients if min_nodes is None else min_nodes
        levels = [t.name for t in config.submodel_spec().tiers]
        self.nodes = NodeRegistry(uuid.uuid4().hex, json.dumps(config.to_dict()), self.clients, levels,
                                  timeout=timeout, poll=poll, stop=stop)
        self._started = False
        self.secure: SecureMethod | None = None
        if config.secure_aggregation is not None:
            sizes = [len(self.data.client_dataset(c.cid)) for c in self.clients]
            scale = weight_scale(self.strategy, sizes, config.secure_aggregation, max(1, round(config.clients.fraction * len(sizes))))
            self.strategy = self.secure = SecureMethod(self.strategy, config.secure_aggregation, scale, timeout=timeout, poll=poll,
                                                       stop=self.nodes.stop)

    def available_clients(self) -> list[ClientInfo]:
        clients = self.nodes.refresh(self.grid, 1 if self._started else self.min_nodes)
        self._started = True
        return clients

    def run_round(self, round_index: int) -> dict:
        record = super().run_round(round_index)
        if self.secure is not None:
            record["secagg_bytes"] = dict(self.secure.bytes)
        return record

    def exchange(self, kind: str, instructions: dict[int, Instruction]) -> dict[int, Reply]:
        """Send each client its instruction and state through the grid; return the replies in
        instruction order (a missing, error or undecodable one with ``error`` set) and keep the
        client states that ``train`` replies return. Secure train rounds go through SecAgg+."""
        if kind == "train" and self.secure is not None:
            contents = {self.nodes.node_of(cid): (cid, instruction_content(i, self.nodes.run, self.client_states.get(cid, {})), int(i.config["seed"]))
                        for cid, i in instructions.items()}
            return self.secure.exchange(self.grid, self.round + 1, contents)
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

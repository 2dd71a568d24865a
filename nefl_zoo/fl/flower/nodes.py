"""Which Flower node is which client: setting up nodes for a run, and collecting replies.

Flower knows nodes by random ids; a method knows clients by partition and resource levels.
:class:`NodeRegistry` learns, once per node and run, which client a node is: it sends a setup
(``query``) message carrying the run's configuration, and the node answers with its
``node_config`` (``partition-id``, ``num-partitions`` and optionally ``max-tier`` or ``levels``).
:func:`collect` pushes messages through a ``Grid`` and pulls their replies.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Mapping, Sequence

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from ...bounds import MAX_POLL_S, MAX_TIMEOUT_S, number
from ..strategy.base import ClientInfo

log = logging.getLogger(__name__)

SETUP, NODE = "nefl.setup", "nefl.node"  # record names of the setup message and its reply
NODE_KEYS = ("partition-id", "num-partitions", "max-tier", "levels")  # what a node reports


class Stopped(RuntimeError):
    """The run was stopped while it waited for nodes or replies."""


def check_waits(timeout: float, poll: float) -> None:
    """``ValueError`` naming ``timeout`` (seconds to wait for replies: more than 0, at most a
    week) or ``poll`` (seconds between two pulls: more than 0, at most an hour) when out of
    bounds, so that no wait is endless or a busy loop."""
    number("timeout", timeout, 0, MAX_TIMEOUT_S, open_low=True)
    number("poll", poll, 0, MAX_POLL_S, open_low=True)


def collect(grid: Grid, messages: Sequence[Message], timeout: float, poll: float = 0.1,
            stop: threading.Event | None = None) -> list[Message]:
    """Push ``messages`` and pull their replies until all are in or ``timeout`` seconds passed
    (``Grid.send_and_receive`` polls a SuperLink only every 3 s); :class:`Stopped` if ``stop``
    is set meanwhile. ``ValueError`` (:func:`check_waits`) before anything is pushed."""
    check_waits(timeout, poll)
    pending = {i for i in grid.push_messages(messages) if i}
    replies: list[Message] = []
    deadline = time.monotonic() + timeout
    while pending:
        if stop is not None and stop.is_set():
            raise Stopped("the run was stopped while waiting for replies")
        for reply in grid.pull_messages(list(pending)):
            replies.append(reply)
            pending.discard(reply.metadata.reply_to_message_id)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll)
    return replies


def node_levels(node: Mapping, default: tuple[str, ...], tiers: Sequence[str]) -> tuple[str, ...]:
    """A node's resource levels: ``levels`` (comma-separated tier names), else every tier up to
    ``max-tier`` (in spec order), else ``default`` (the run config's group of its partition)."""
    if "levels" in node:
        names = tuple(t.strip() for t in str(node["levels"]).split(",") if t.strip())
    elif "max-tier" in node:
        top = str(node["max-tier"])
        if top not in tiers:
            raise ValueError(f"max-tier {top!r} is not a tier of the run's spec ({', '.join(tiers)})")
        names = tuple(tiers[: list(tiers).index(top) + 1])
    else:
        return default
    unknown = [t for t in names if t not in tiers]
    if unknown or not names:
        raise ValueError(f"levels {names!r}: not tiers of the run's spec ({', '.join(tiers)})")
    return names


class NodeRegistry:
    """Which connected Flower node is which client, for one run.

    Args:
        run: the run's id (names its configuration on the nodes).
        config_json: the resolved run configuration, sent to every node in its setup message.
        defaults: the configured clients (partition ids ``0..M-1`` and their default levels).
        tiers: the run spec's tier names (resource levels), in spec order.
        timeout: seconds to wait for setup replies; poll: seconds between two pulls for them
            (:func:`check_waits`).
        stop: when set, waiting for nodes or replies ends with :class:`Stopped`.
    """

    def __init__(self, run: str, config_json: str, defaults: Sequence[ClientInfo], tiers: Sequence[str],
                 timeout: float = 60.0, poll: float = 0.1, stop: threading.Event | None = None):
        check_waits(timeout, poll)
        self.run, self.config_json, self.timeout, self.poll = run, config_json, timeout, poll
        self.stop = stop or threading.Event()
        self.defaults = {c.cid: c for c in defaults}
        self.tiers = list(tiers)
        self.clients: dict[int, ClientInfo] = {}  # node id -> client
        self.refused: dict[int, str] = {}  # node id -> why it takes no part

    def node_of(self, cid: int) -> int:
        """The id of the node that is client ``cid``."""
        return next(n for n, c in self.clients.items() if c.cid == cid)

    def refresh(self, grid: Grid, min_nodes: int = 1) -> list[ClientInfo]:
        """Set up newly connected nodes, forget departed ones, and return the clients of the
        connected nodes (by partition id); wait until at least ``min_nodes`` are there (1 to
        the number of clients: no more nodes than clients are ever set up)."""
        number("min_nodes", min_nodes, 1, len(self.defaults), integer=True)
        waited = 0.0
        while True:
            connected = set(grid.get_node_ids())
            for node_id in set(self.clients) - connected:
                log.warning("node %s (client %s) left", node_id, self.clients.pop(node_id).cid)
            new = connected - set(self.clients) - set(self.refused)
            if new:
                self._set_up(grid, sorted(new))
            if len(self.clients) >= min_nodes:
                return sorted(self.clients.values(), key=lambda c: c.cid)
            if self.stop.is_set():
                raise Stopped("the run was stopped while waiting for nodes")
            if waited % 30 == 0:
                log.info("waiting for nodes: %d of %d set up", len(self.clients), min_nodes)
            time.sleep(1.0)
            waited += 1.0

    def _set_up(self, grid: Grid, node_ids: list[int]) -> None:
        """Send each node the run (its own message), register or refuse it by its reply; a node
        without a reply yet, or whose partition another node holds, is asked again next time."""
        messages = {node_id: Message(RecordDict({SETUP: ConfigRecord({"run": self.run, "config": self.config_json})}),
                                     node_id, MessageType.QUERY) for node_id in node_ids}
        replies = {m.metadata.reply_to_message_id: m for m in collect(grid, list(messages.values()), self.timeout, self.poll, self.stop)}
        for node_id, message in messages.items():
            reply = replies.get(message.metadata.message_id)
            if reply is None:
                log.warning("node %s: no setup reply within %g s", node_id, self.timeout)
                continue
            try:
                client = self._client(reply)
            except (KeyError, TypeError, ValueError) as exc:
                self.refused[node_id] = str(exc)
                log.warning("node %s takes no part in this run: %s", node_id, exc)
                continue
            if client.cid in (c.cid for c in self.clients.values()):
                log.warning("node %s: partition-id %s is node %s's (until that one leaves)", node_id, client.cid, self.node_of(client.cid))
                continue
            self.clients[node_id] = client

    def _client(self, reply: Message) -> ClientInfo:
        if reply.has_error():
            raise ValueError(f"setup failed: {reply.error.reason}")
        node = dict(reply.content.config_records[NODE])
        cid, parts = int(node["partition-id"]), int(node.get("num-partitions", len(self.defaults)))
        if parts != len(self.defaults) or cid not in self.defaults:
            raise ValueError(f"partition-id {cid} of num-partitions {parts}; the run has clients.num_clients = {len(self.defaults)}")
        return ClientInfo(cid, node_levels(node, self.defaults[cid].levels, self.tiers))

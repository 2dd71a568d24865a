"""Which Flower node is which client (``nefl_zoo.fl.flower.nodes``) against a scripted Grid: nodes
that answer their setup message, nodes that stay silent, two nodes claiming one partition, a node
that leaves, and a run that waits for nodes (said every 30 s, not every second)."""

import logging
import time
import uuid
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402

from nefl_zoo.fl.flower import nodes  # noqa: E402
from nefl_zoo.fl.flower.nodes import NODE, NodeRegistry, Stopped, check_waits  # noqa: E402
from nefl_zoo.fl.strategy.base import ClientInfo  # noqa: E402

CLIENTS = [ClientInfo(0, ("g1",)), ClientInfo(1, ("g1",))]


class SetupGrid:
    """Nodes answering their setup message with their ``node_config`` (``None``: no answer)."""

    def __init__(self, node_configs: dict):
        self.node_configs = dict(node_configs)
        self.replies: dict[str, Message] = {}
        self.asked: list[int] = []

    def get_node_ids(self):
        return list(self.node_configs)

    def push_messages(self, messages):
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            node = message.metadata.dst_node_id
            self.asked.append(node)
            if self.node_configs[node] is not None:
                reply = Message(RecordDict({NODE: ConfigRecord(self.node_configs[node])}), reply_to=message)
                self.replies[message.metadata.message_id] = reply
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


def test_silent_nodes_are_asked_again_and_a_partition_goes_to_one_node_until_it_leaves(caplog, server_identity):
    caplog.set_level(logging.INFO, logger=nodes.__name__)
    grid = SetupGrid({5: {"partition-id": 0, "num-partitions": 2}, 6: None, 7: {"partition-id": 0, "num-partitions": 2}})
    registry = NodeRegistry("r", "{}", CLIENTS, ["g1"], timeout=0.05, poll=0.01)
    assert registry.refresh(grid) == [ClientInfo(0, ("g1",))] and registry.node_of(0) == 5
    assert [r.getMessage() for r in caplog.records] == ["node 6: no setup reply within 0.05 s",
                                                        "node 7: partition-id 0 is node 5's (until that one leaves)"]
    caplog.clear()
    del grid.node_configs[5]
    grid.node_configs[6] = {"partition-id": 1, "num-partitions": 2}
    assert registry.refresh(grid, min_nodes=2) == [ClientInfo(0, ("g1",)), ClientInfo(1, ("g1",))]
    assert registry.node_of(0) == 7 and registry.node_of(1) == 6 and grid.asked == [5, 6, 7, 6, 7]
    assert [r.getMessage() for r in caplog.records] == ["node 5 (client 0) left"]


def test_waiting_for_nodes_is_said_every_30_seconds_until_the_run_is_stopped(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=nodes.__name__)
    slept = []
    monkeypatch.setattr(nodes, "time", SimpleNamespace(sleep=slept.append, monotonic=time.monotonic))
    registry = NodeRegistry("r", "{}", CLIENTS, ["g1"])

    class NoNodes:
        def get_node_ids(self):
            if len(slept) == 61:
                registry.stop.set()
            return []

    with pytest.raises(Stopped, match="^the run was stopped while waiting for nodes$"):
        registry.refresh(NoNodes())
    assert slept == [1.0] * 61
    assert [r.getMessage() for r in caplog.records] == ["waiting for nodes: 0 of 1 set up"] * 3  # at 0, 30 and 60 s


def test_waits_and_node_counts_are_checked_before_anything_is_sent():
    with pytest.raises(ValueError, match=r"^poll: must be a number in \(0, 3600\], got 0$"):
        check_waits(1, 0)
    with pytest.raises(ValueError, match=r"^min_nodes: must be an integer in 1\.\.2, got 1\.5$"):
        NodeRegistry("r", "{}", CLIENTS, ["g1"]).refresh(SetupGrid({}), 1.5)

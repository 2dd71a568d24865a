"""Nested FL on Flower: the FlowerEngine's transport on an in-process grid (no Ray, no
processes) and ``nefl-zoo train --engine flower`` through ``simulate``.

Every method's simulation against the embedded engine, and resume with per-client state, are in
``test_method_contract_flower.py`` (the same simulation, ``tests/support/flower.py``)."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402

from nefl_zoo.fl.flower import FlowerEngine  # noqa: E402
from nefl_zoo.fl.flower.client import app as client_app  # noqa: E402
from nefl_zoo.fl.flower.nodes import node_levels  # noqa: E402
from nefl_zoo.fl.flower.records import read_reply, reply_content, tensor_bytes, to_state  # noqa: E402

from .conftest import assert_equal_tensors, records, same_tensors, tiny  # noqa: E402
from .support.flower import InProcessGrid, nbytes  # noqa: E402

torch.set_num_threads(1)
TIERS = ["g0.25", "g0.5", "g1"]


def test_node_levels_from_node_config():
    assert node_levels({}, ("g0.5",), TIERS) == ("g0.5",)
    assert node_levels({"max-tier": "g0.5"}, ("g1",), TIERS) == ("g0.25", "g0.5")
    assert node_levels({"levels": "g1, g0.25"}, (), TIERS) == ("g1", "g0.25")
    for bad in ({"max-tier": "g2"}, {"levels": "g0.25,huge"}, {"levels": ""}):
        with pytest.raises(ValueError):
            node_levels(bad, (), TIERS)


def test_a_node_builds_the_method_and_its_data_at_setup_not_in_its_first_round(server_identity, caplog):
    import json
    import logging

    from flwr.app import ConfigRecord, MessageType

    from nefl_zoo.fl.flower import client as flower_client
    from nefl_zoo.fl.flower.nodes import NODE, SETUP

    def setup(run: str, config_json: str):
        context = Context(run_id=1, node_id=7, node_config={"partition-id": 1, "num-partitions": 4}, state=RecordDict(),
                          run_config={})
        message = Message(RecordDict({SETUP: ConfigRecord({"run": run, "config": config_json})}), 7, MessageType.QUERY)
        return client_app(message, context)

    flower_client._method.cache_clear()
    reply = setup("run-1", json.dumps(tiny().to_dict()))
    assert dict(reply.content.config_records[NODE]) == {"partition-id": 1, "num-partitions": 4}
    assert flower_client._method.cache_info().currsize == 1  # built while the setup was answered
    # a configuration the node cannot build: the setup is still answered (its first message will
    # fail and report why), and the node's log says so
    with caplog.at_level(logging.WARNING, logger="nefl_zoo.fl.flower.client"):
        reply = setup("run-2", json.dumps({**tiny().to_dict(), "method": "bogus"}))
    assert not reply.has_error() and dict(reply.content.config_records[NODE])["partition-id"] == 1
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["run run-2 could not be set up on this node (its first message will fail)"]
    assert flower_client._method.cache_info().currsize == 1


def error(answer, sent):
    return Message(Error(code=2, reason="out of memory"), reply_to=sent)


def nan(answer, sent):
    reply, state = read_reply(answer)
    arrays = {k: torch.full_like(v, math.nan) if v.is_floating_point() else v for k, v in reply.arrays.items()}
    return Message(reply_content(dataclasses.replace(reply, arrays=arrays), state), reply_to=sent)


@pytest.mark.parametrize("method", ["nefl", "fedgh"])
def test_engine_sends_each_node_its_submodel_and_rejects_error_nan_and_missing_replies(method, server_identity, tmp_path):
    # Prepare: 4 nodes, client c always trains tier c (client 3 the full model); node 1 answers
    # with an error, node 2 with NaN tensors, node 3 never (the round's timeout is 0.5 s)
    config = tiny(method=method, rounds=1, train__local_epochs=1, data__local_split=[0.8, 0.1, 0.1], clients__num_clients=4,
                  clients__environment="fixed", clients__groups=[["g0.25"], ["g0.5"], ["g1"], ["g1"]])
    grid = InProcessGrid(4, {1001: error, 1002: nan, 1003: lambda answer, sent: None})
    engine = FlowerEngine(config, tmp_path, grid, timeout=0.5)
    torch.manual_seed(0)
    engine.state = state = engine.strategy.init_global_state()

    # Execute: one round
    record = engine.run_round(0)

    # Assert: one message per node, with only its client's submodel: the method's instruction
    expected = engine.strategy.configure_train(1, state, engine.clients)
    train = [m for m in grid.pushed if m.metadata.message_type == "train"]
    assert sorted(m.metadata.dst_node_id for m in train) == [1000, 1001, 1002, 1003]
    for message in train:
        cid = message.metadata.dst_node_id - 1000
        arrays = message.content.array_records["arrays"]
        assert_equal_tensors(to_state(arrays), expected[cid].arrays)
        assert tensor_bytes(arrays) == record["per_client"][str(cid)]["bytes_down"]
    if method == "nefl":  # a nested method sends a submodel, never the global model (it holds every tier's norms)
        assert max(nbytes(i.arrays) for i in expected.values()) < nbytes(state)
    # only node 0's update is merged, exactly as the method merges it on its own; the round completes
    good, client_state = read_reply(grid.answers[next(m for m in train if m.metadata.dst_node_id == 1000).metadata.message_id])
    assert record["clients"] == 1 and record["rejected"] == 3
    assert_equal_tensors(engine.state, engine.strategy.aggregate_train(1, state, {0: good}).state)
    assert not all(torch.equal(engine.state[k], state[k]) for k in state)
    # per-client state is the engine's (sent with instructions, returned by train replies), not the nodes'
    assert_equal_tensors(engine.client_states[0], client_state)
    assert 1 not in engine.client_states and 3 not in engine.client_states
    assert all(not context.state.array_records for context in grid.contexts.values())


def test_cli_train_engine_flower_runs_simulate_and_gives_the_embedded_run_and_its_table(tmp_path, monkeypatch, server_identity):
    """``--engine flower`` goes through :func:`~nefl_zoo.fl.flower.simulate`; Ray's part (run on
    the shared simulation, ``test_method_contract_flower.py``) is replaced by the in-process grid, so no second Ray start."""
    from typer.testing import CliRunner

    from nefl_zoo.fl.flower import server
    from nefl_zoo_cli.app import app

    from .test_cli_train import QUICK, TINY

    calls = []

    def simulate_in_process(runs, **options):
        calls.append(options)
        return [FlowerEngine(r.config, r.out, InProcessGrid(r.config.clients.num_clients)).run(resume=r.resume, overwrite=r.overwrite, observer=r.observer)
                for r in runs]

    monkeypatch.setattr(server, "simulate_runs", simulate_in_process)
    args = ["train", QUICK, *TINY, "--set", "rounds=1", "--threads", "1"]
    runner = CliRunner()
    embedded = runner.invoke(app, [*args, "--out", str(tmp_path / "embedded")])
    assert embedded.exit_code == 0, embedded.output
    flower = runner.invoke(app, [*[a for a in args if a != "--quiet"], "--engine", "flower", "--out", str(tmp_path / "flower")])
    assert flower.exit_code == 0, flower.output
    assert [c["threads"] for c in calls] == [1]
    assert "worst (g0.2) / avg / min" in flower.output and f"run dir {tmp_path / 'flower'}" in flower.output.replace("\n", "")
    assert same_tensors(tmp_path / "flower", tmp_path / "embedded")
    assert records(tmp_path / "flower") == records(tmp_path / "embedded")
    bad = runner.invoke(app, [*args, "--engine", "ray", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "ray" in bad.output and not (tmp_path / "bad").exists()


class ScriptedStrategy:
    """The client hooks of a method, scripted: each records what it was given and returns ``reply``."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def train(self, instruction, data, client_state):
        self.calls.append(("train", instruction.level, data, dict(client_state)))
        return self.reply

    def evaluate_client(self, instruction, data, client_state):
        self.calls.append(("evaluate", instruction.level, data, dict(client_state)))
        return self.reply


def serve(kind, reply, node_config=None, secure=None):
    """One ``kind`` message for run ``r`` to a node set up for it, its method scripted."""
    from flwr.app import ConfigRecord

    from nefl_zoo.fl.training.device import Placement
    from nefl_zoo.fl.flower import client as flower_client
    from nefl_zoo.fl.flower.records import instruction_content
    from nefl_zoo.fl.strategy.base import Instruction

    strategy = ScriptedStrategy(reply)
    data = SimpleNamespace(client_dataset=lambda p: f"train split {p}", client_test=lambda p: f"test split {p}")
    context = Context(run_id=1, node_id=7, node_config=node_config or {"partition-id": 2, "num-partitions": 4},
                      state=RecordDict({flower_client.RUNS: ConfigRecord({"r": "{}"})}), run_config={})
    content = instruction_content(Instruction({}, {"seed": 1}, "g0.5"), "r", {"extractor": torch.ones(2)})
    if secure is not None:
        content[flower_client.SECURE] = secure
    message = Message(content, 7, kind)
    built = (strategy, data, Placement())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flower_client, "_built", lambda config_json, ctx: built)
        return flower_client._serve(kind, message, context), strategy


def test_an_evaluate_message_runs_the_clients_evaluation_on_its_own_test_split(server_identity):
    from nefl_zoo.fl.strategy.base import Reply

    answer, strategy = serve("evaluate", Reply({}, {"accuracy": 0.5}, num_samples=3))
    assert [(kind, level, data) for kind, level, data, _ in strategy.calls] == [("evaluate", "g0.5", "test split 2")]
    assert torch.equal(strategy.calls[0][3]["extractor"], torch.ones(2))  # the client's state, read
    reply, state = read_reply(answer)
    assert (reply.metrics, reply.num_samples, state) == ({"accuracy": 0.5}, 3, None)  # no state comes back from an evaluation
    answer, strategy = serve("train", Reply({}, {"loss": 1.0}, num_samples=3))
    assert strategy.calls[0][:3] == ("train", "g0.5", "train split 2") and set(read_reply(answer)[1]) == {"extractor"}


def test_a_client_hook_that_reports_an_error_is_an_error_reply_and_a_node_without_a_partition_is_refused(server_identity):
    from flwr.common.constant import ErrorCode

    from nefl_zoo.fl.strategy.base import Reply

    answer, _ = serve("train", Reply({}, error="out of memory"))
    assert answer.has_error() and (answer.error.code, answer.error.reason) == (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "out of memory")
    with pytest.raises(ValueError, match=r"^this node's node_config has no partition-id \(flower-supernode --node-config "
                                         r"'partition-id=0 num-partitions=N'\)$"):
        serve("train", Reply({}), node_config={"num-partitions": 4})


def test_a_nodes_own_data_root_device_and_threads_apply_to_its_runs(monkeypatch):
    from nefl_zoo.fl.flower import client as flower_client

    asked = []
    monkeypatch.setattr(flower_client, "_method", lambda *args: asked.append(args))
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "data-root": "/data/node7", "device": "cpu", "threads": 2},
                      state=RecordDict(), run_config={})
    try:
        flower_client._built("{}", context)
        assert asked == [("{}", "/data/node7", "cpu")] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    flower_client._built("{}", Context(run_id=1, node_id=8, node_config={"partition-id": 1}, state=RecordDict(), run_config={}))
    assert asked[1] == ("{}", "", "")  # the run configuration's own data root and device


def test_min_nodes_lets_a_run_start_with_fewer_nodes_and_later_rounds_go_on_with_those_left(server_identity, tmp_path):
    """``min_nodes`` nodes start round 1 (all clients by default: with fewer, the run waits for
    nodes until it is stopped); after that a round takes whichever nodes are left, however few."""
    import threading

    from nefl_zoo.fl.flower.nodes import NodeRegistry, Stopped

    def stopped_after(seconds: float) -> threading.Event:
        stop = threading.Event()
        timer = threading.Timer(seconds, stop.set)
        timer.daemon = True
        timer.start()
        return stop

    def grid_of(nodes: int) -> InProcessGrid:  # the first nodes of the config's 4 clients
        grid = InProcessGrid(4)
        for node in range(1000 + nodes, 1004):
            del grid.contexts[node]
        return grid

    config = tiny(rounds=2, train__local_epochs=1, data__max_test_samples=32)  # min_nodes out of 1..4: test_bounds.py
    waits = []
    refresh = NodeRegistry.refresh
    grid = grid_of(2)
    engine = FlowerEngine(config, tmp_path / "two", grid, timeout=5, min_nodes=2, stop=stopped_after(60))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NodeRegistry, "refresh", lambda self, grid, wait: waits.append(wait) or refresh(self, grid, wait))
        torch.manual_seed(0)
        engine.state = engine.strategy.init_global_state()
        first = engine.run_round(0)
        del grid.contexts[1001]  # a node leaves
        second = engine.run_round(1)
    assert waits == [2, 1] and (first["clients"], second["clients"]) == (2, 1)
    one = FlowerEngine(config, tmp_path / "one", grid_of(1), timeout=5, min_nodes=1, stop=stopped_after(60))
    torch.manual_seed(0)
    one.state = one.strategy.init_global_state()
    assert one.run_round(0)["clients"] == 1
    every = FlowerEngine(config, tmp_path / "all", grid_of(3), timeout=5, stop=stopped_after(0.5))  # waits for all 4
    every.state = every.strategy.init_global_state()
    with pytest.raises(Stopped, match="while waiting for nodes"):
        every.run_round(0)


def test_a_reply_to_no_message_of_the_round_is_ignored_and_logged(server_identity, tmp_path, caplog):
    import logging

    class Stray(InProcessGrid):
        def pull_messages(self, message_ids):
            replies = super().pull_messages(message_ids)
            if replies:
                stale = Message(RecordDict(), dst_node_id=1001, message_type="train")
                stale.metadata.__dict__["_message_id"] = "old"
                replies.append(Message(RecordDict(), reply_to=stale))
            return replies

    engine = FlowerEngine(tiny(rounds=1, train__local_epochs=1, data__max_test_samples=32), tmp_path, Stray(4), timeout=5)
    torch.manual_seed(0)
    engine.state = engine.strategy.init_global_state()
    with caplog.at_level(logging.WARNING, logger="nefl_zoo.fl.flower.flower_engine"):
        record = engine.run_round(0)
    assert record["clients"] == 4 and record["rejected"] == 0
    assert [r.getMessage() for r in caplog.records if r.name == "nefl_zoo.fl.flower.flower_engine"][0] == \
        "a train reply from node 1001 answers no message of this round; ignored"


def test_secure_weights_are_scaled_for_the_clients_of_a_round(monkeypatch, tmp_path):
    """The check that the smallest scaled weight stays clear of SecAgg+'s error is made for the
    clients one round samples (``fraction`` of them), as the error grows with them."""
    from nefl_zoo.fl.flower import flower_engine

    calls = []
    monkeypatch.setattr(flower_engine, "weight_scale", lambda strategy, sizes, settings, clients: calls.append((sizes, clients)) or 0.5)
    engine = FlowerEngine(tiny(clients__fraction=0.75, secure_aggregation={}), tmp_path, InProcessGrid(4))
    sizes = [len(engine.data.client_dataset(c)) for c in range(4)]
    assert calls == [(sizes, 3)] and engine.secure.scale == 0.5

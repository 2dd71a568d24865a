"""Nested FL on Flower: the Strategy driven by hand-made messages (no Ray, no processes), and
the simulation engine against the embedded engine (one shared simulation for the module)."""

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Error, Message  # noqa: E402

from nefl_zoo.fl.engine import Engine, client_groups  # noqa: E402
from nefl_zoo.fl.flower import FlowerEngine, NestedStrategy, NodeRegistry, SimulatedRun, simulate_runs  # noqa: E402
from nefl_zoo.fl.flower.records import reply_content, tensor_bytes, to_array_record, to_state  # noqa: E402
from nefl_zoo.fl.flower.strategy import node_levels  # noqa: E402
from nefl_zoo.fl.methods import Assignment  # noqa: E402
from nefl_zoo.fl.strategy import ClientInfo, Reply, registered_methods  # noqa: E402
from nefl_zoo.slim import SliceMap  # noqa: E402

from .test_fl_engine import tiny  # noqa: E402

torch.set_num_threads(1)
TIERS = ["g0.25", "g0.5", "g1"]


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@pytest.fixture
def server_identity(monkeypatch):
    """What a ServerApp process has set when it builds messages (Flower's TaskIdentity)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def submodel(method, state, tier):
    """The tensors a nested method sends a client training ``tier`` (through its slice map)."""
    return SliceMap(dict(method.entries(Assignment(tier, (tier,))))).extract(state)


class FakeGrid:
    """The part of a Flower Grid that configure_train uses: the connected node ids."""

    def __init__(self, node_ids):
        self.node_ids = node_ids

    def get_node_ids(self):
        return list(self.node_ids)


def nested_strategy(config, first_node=100):
    """A NestedStrategy whose registry already knows node ``first_node + c`` as client ``c``."""
    method = config.build_strategy()
    groups = client_groups(config, TIERS)
    m = config.clients.num_clients
    clients = [ClientInfo(c, tuple(groups[c * len(groups) // m])) for c in range(m)]
    nodes = NodeRegistry("run-1", json.dumps(config.to_dict()), clients, TIERS)
    for client in clients:
        nodes.add(first_node + client.cid, client)
    return NestedStrategy(method, nodes, timeout=5)


def test_node_levels_from_node_config():
    assert node_levels({}, ("g0.5",), TIERS) == ("g0.5",)
    assert node_levels({"max-tier": "g0.5"}, ("g1",), TIERS) == ("g0.25", "g0.5")
    assert node_levels({"levels": "g1, g0.25"}, (), TIERS) == ("g1", "g0.25")
    for bad in ({"max-tier": "g2"}, {"levels": "g0.25,huge"}, {"levels": ""}):
        with pytest.raises(ValueError):
            node_levels(bad, (), TIERS)


@pytest.mark.parametrize("method", ["nefl", "heterofl"])
def test_strategy_sends_submodels_and_skips_error_nan_and_missing_replies(method, server_identity):
    # Prepare: 4 nodes, fixed environment (client c always trains tier c; client 3 the full model)
    config = tiny(method=method, clients__num_clients=4, clients__environment="fixed",
                  clients__groups=[["g0.25"], ["g0.5"], ["g1"], ["g1"]])
    strategy = nested_strategy(config)
    torch.manual_seed(0)
    state = strategy.method.init_global_state()

    # Execute: configure
    messages = list(strategy.configure_train(1, to_array_record(state), ConfigRecord(), FakeGrid([100, 101, 102, 103])))

    # Assert: one message per node, carrying only its client's submodel
    assert sorted(m.metadata.dst_node_id for m in messages) == [100, 101, 102, 103]
    for message in messages:
        cid = message.metadata.dst_node_id - 100
        tier = ["g0.25", "g0.5", "g1", "g1"][cid]
        assert message.content.config_records["config"]["tier"] == tier
        arrays = to_state(message.content.array_records["arrays"])
        expected = submodel(strategy.method, state, tier)
        assert arrays.keys() == expected.keys() and all(torch.equal(arrays[k], expected[k]) for k in arrays)
        assert tensor_bytes(message.content.array_records["arrays"]) == nbytes(expected)
        assert nbytes(expected) < nbytes(state)  # never the global model (it holds every tier's norms)

    # Execute: replies from client 0 (trained: +1 everywhere), 1 (an error), 2 (NaN); 3 never answers
    by_cid = {m.metadata.dst_node_id - 100: m for m in messages}
    sent = {cid: to_state(m.content.array_records["arrays"]) for cid, m in by_cid.items()}
    good = Reply({k: v + 1 for k, v in sent[0].items()},
                 {"num_samples": 10, "loss": 0.5, "tier": "g0.25", "tiers": ["g0.25"]})
    nan = Reply({k: torch.full_like(v, math.nan) if v.is_floating_point() else v for k, v in sent[2].items()},
                {"num_samples": 10, "loss": 0.5, "tier": "g1", "tiers": ["g1"]})
    replies = [
        Message(reply_content(good), reply_to=by_cid[0]),
        Message(Error(code=2, reason="out of memory"), reply_to=by_cid[1]),
        Message(reply_content(nan), reply_to=by_cid[2]),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)

    # Assert: only client 0's update is merged, exactly as the method merges it on its own
    assert metrics["accepted"] == 1 and metrics["rejected"] == 3
    expected = strategy.method.aggregate_train(1, state, {0: good}).state
    merged = to_state(arrays)
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], expected[k]) for k in merged)
    assert not torch.equal(merged["conv1.weight"], state["conv1.weight"])


class InProcessGrid:
    """A Flower Grid whose nodes are this process: each pushed message runs the ClientApp
    right away with its node's Context (no Ray, no processes)."""

    def __init__(self, num_nodes: int):
        from flwr.app import Context, RecordDict

        self.contexts = {1000 + i: Context(run_id=1, node_id=1000 + i, node_config={"partition-id": i, "num-partitions": num_nodes},
                                           state=RecordDict(), run_config={}) for i in range(num_nodes)}
        self.replies: dict[str, Message] = {}

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        import uuid

        from nefl_zoo.fl.flower.client import app

        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.replies[message.metadata.message_id] = app(message, self.contexts[message.metadata.dst_node_id])
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


METHOD_ARGS = {"fedlps": {"levels": [0.0, 0.4, 0.8]}}  # one pruning ratio per tier of tiny()


# nefl, heterofl and fedgh run in the simulation below; fedavg_min/_full only assign other tiers than fedavg
@pytest.mark.parametrize("method", sorted(set(registered_methods()) - {"nefl", "heterofl", "fedgh", "fedavg_min", "fedavg_full"}))
def test_every_method_runs_through_flower_messages(method, server_identity, tmp_path):
    """Each method's instructions and replies through Flower records and the ClientApp's
    handlers (in this process) give the embedded engine's run exactly."""
    config = tiny(method=method, rounds=1, clients__num_clients=3, train__local_epochs=1, eval__every=1,
                  data__max_test_samples=50, method_args=METHOD_ARGS.get(method, {}))
    Engine(config, tmp_path / "embedded").run()
    FlowerEngine(config, tmp_path / "flower", InProcessGrid(3)).run()
    a, b = (load_file(str(tmp_path / run / "global.safetensors")) for run in ("embedded", "flower"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda r: {k: v for k, v in r.items() if k != "time_s"}  # noqa: E731
    assert [strip(r) for r in records(tmp_path / "embedded")] == [strip(r) for r in records(tmp_path / "flower")]


def submodel_bytes(config) -> tuple[dict[str, int], int]:
    """Bytes of the tensors a client training each tier exchanges, and of the global state."""
    method = config.build_strategy()
    torch.manual_seed(0)
    state = method.init_global_state()
    return {tier: nbytes(submodel(method, state, tier)) for tier in method.tier_names}, nbytes(state)


# -- the simulation engine against the embedded engine -----------------------------------------
def configs():
    small = {"rounds": 2, "clients__num_clients": 3, "train__local_epochs": 1}
    return {
        "nefl": tiny(**small),
        "heterofl": tiny(method="heterofl", **small),
        "fedgh": tiny(method="fedgh", method_args={"rep_dim": 16}, data__local_split=[0.8, 0.1, 0.1],
                      eval__per_client=True, **small),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each config on the embedded engine and, in one Flower simulation, on Flower; plus the nefl
    config stopped after round 1 and resumed on Flower."""
    out = tmp_path_factory.mktemp("flower")
    for name, config in configs().items():
        Engine(config, out / f"embedded-{name}").run()
    nefl = configs()["nefl"]
    simulated = [SimulatedRun(config, out / f"flower-{name}") for name, config in configs().items()]
    simulated += [SimulatedRun(nefl.model_copy(update={"rounds": 1}), out / "flower-resumed"),
                  SimulatedRun(nefl, out / "flower-resumed", resume=True)]
    simulate_runs(simulated, threads=1)
    return out


def layout(run_dir):
    """The run directory's file names, content hashes masked."""
    return {re.sub(r"ckpt-\w+-\w+", "#", p.name) for p in run_dir.iterdir()}


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["nefl", "heterofl", "fedgh", "resumed"])
def test_simulation_gives_the_embedded_engines_run(runs, name):
    embedded, flower = runs / f"embedded-{'nefl' if name == 'resumed' else name}", runs / f"flower-{name}"
    a, b = load_file(str(embedded / "global.safetensors")), load_file(str(flower / "global.safetensors"))
    assert a.keys() == b.keys()
    assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) <= 1e-6
    assert layout(flower) == layout(embedded) - {"#.clients.safetensors", "clients.safetensors"}  # on the nodes
    strip = lambda r: {k: v for k, v in r.items() if k != "time_s"}  # noqa: E731
    # the resumed run's round 1 was its last round then, so it was evaluated; compare the end
    first = -1 if name == "resumed" else 0
    assert [strip(r) for r in records(embedded)[first:]] == [strip(r) for r in records(flower)[first:]]


def test_simulation_reports_each_nodes_submodel_bytes(runs):
    sizes, full = submodel_bytes(configs()["nefl"])
    seen = set()
    for record in records(runs / "flower-nefl"):
        assert record["per_client"].keys() == {"0", "1", "2"}
        for client in record["per_client"].values():
            assert client["bytes_down"] == client["bytes_up"] == sizes[client["tier"]] < full
            seen.add(client["tier"])
        assert record["bytes_down"] == sum(c["bytes_down"] for c in record["per_client"].values())
    assert len(seen) >= 2


def test_cli_train_engine_flower_gives_the_embedded_run_and_its_table(tmp_path):
    from typer.testing import CliRunner

    from nefl_zoo_cli.app import app

    from .test_cli_train import QUICK, TINY

    args = ["train", QUICK, *TINY, "--set", "rounds=1", "--threads", "1"]
    runner = CliRunner()
    embedded = runner.invoke(app, [*args, "--out", str(tmp_path / "embedded")])
    assert embedded.exit_code == 0, embedded.output
    flower = runner.invoke(app, [*[a for a in args if a != "--quiet"], "--engine", "flower", "--out", str(tmp_path / "flower")])
    assert flower.exit_code == 0, flower.output
    assert "worst / avg" in flower.output and f"run dir {tmp_path / 'flower'}" in flower.output.replace("\n", "")
    a, b = (load_file(str(tmp_path / run / "global.safetensors")) for run in ("embedded", "flower"))
    assert a.keys() == b.keys() and max(float((a[k].double() - b[k].double()).abs().max()) for k in a) <= 1e-6
    bad = runner.invoke(app, [*args, "--engine", "ray", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and bad.output.strip() == "error: --engine: expected embedded or flower, got 'ray'"

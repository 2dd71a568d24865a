"""Numbers and addresses checked before they are used (``nefl_zoo.bounds``): the one check of
each kind, and the Flower settings that rely on it (the deployment ServerApp's run config, the
engine's waits, a simulation's timeout). The policy's settings are in ``test_adaptive.py``, the
latency table's in ``test_device_bench.py``, ``serve``'s in ``test_serve.py`` and ``clientapp``'s
in ``test_flower_worker.py``."""

import math
import threading
from pathlib import Path

import pytest

from nefl_zoo.bounds import address, host, number

APP = Path(__file__).resolve().parents[1] / "examples" / "flower-app"


@pytest.mark.parametrize("value, low, high, kind, want", [
    (0, 0, 1, {"open_low": True}, "a number in (0, 1]"),
    (1, 0, 1, {"open_high": True}, "a number in [0, 1)"),
    (math.nan, 0, 1, {}, "a number in [0, 1]"),
    (math.inf, 0, math.inf, {}, "a finite number >= 0"),
    (-math.inf, 0, math.inf, {"open_low": True}, "a finite number > 0"),
    (True, 0, 1, {}, "a number in [0, 1]"),
    ("1", 0, 1, {}, "a number in [0, 1]"),
    (None, 0, 1, {}, "a number in [0, 1]"),
    (1.0, 1, 10, {"integer": True}, "an integer in 1..10"),
    (11, 1, 10, {"integer": True}, "an integer in 1..10"),
    (10**400, 1, 10, {"integer": True}, "an integer in 1..10"),
    (-1, 0, math.inf, {"integer": True}, "an integer >= 0"),
    (0.0005, 0.001, 86_400_000, {}, "a number in [0.001, 86400000]"),
])
def test_a_number_out_of_bounds_is_one_line_naming_it_the_rule_and_the_value(value, low, high, kind, want):
    with pytest.raises(ValueError) as err:
        number("--opt", value, low, high, **kind)
    assert str(err.value) == f"--opt: must be {want}, got {value!r}"


def test_numbers_at_their_bounds_come_back_as_given():
    assert number("x", 1, 0, 1) == 1 and number("x", 0.0, 0, 1) == 0.0 and number("x", 10**18, 0, integer=True) == 10**18
    assert number("x", 1e-300, 0, 1, open_low=True) == 1e-300 and number("x", 5, 1, 10, integer=True) == 5


@pytest.mark.parametrize("text, why", [
    ("host:", "no port"), (":80", "no host"), ("host", "no port"), ("host:99999", "the port must be in 1..65535"),
    ("host:0", "the port must be in 1..65535"), ("host:-1", "the port must be in 1..65535"),
    ("host:80a", "the port must be in 1..65535"), ("host:" + "9" * 5000, "the port must be in 1..65535"),
    ("host:８０", "the port must be in 1..65535"), ("a b:1", "'a b' is not a host name or an IP address"),
    ("-x:1", "'-x' is not a host name or an IP address"), ("::1:80", "an IPv6 address goes in brackets: [::1]:80"),
    ("[host]:80", "brackets hold an IPv6 address"), ("[::g]:80", "'::g' is not a host name or an IP address"),
    ("http://host:80", "an address, not a URL: leave out the scheme"), ("h\n:1", "'h\\n' is not a host name or an IP address"),
])
def test_a_malformed_address_is_one_line_saying_what_is_wrong(text, why):
    with pytest.raises(ValueError) as err:
        address("--runtime-api-address", text)
    assert str(err.value) == f"--runtime-api-address: must be HOST:PORT, got {text!r} ({why})"


def test_addresses_and_hosts_that_are_fine():
    assert address("a", "127.0.0.1:9094") == ("127.0.0.1", 9094)
    assert address("a", "[::1]:1") == ("::1", 1) and address("a", "node-3.cluster_x.example:65535") == ("node-3.cluster_x.example", 65535)
    assert host("h", "::1") == "::1" and host("h", "0.0.0.0") == "0.0.0.0" and host("h", "localhost") == "localhost"
    for bad in ("", "a b", "host:", "x" * 254, None):
        with pytest.raises(ValueError, match="must be a host name or an IP address"):
            host("--host", bad)


# -- the Flower settings -----------------------------------------------------------------------
@pytest.mark.parametrize("run_config, message", [
    ({"round-timeout": math.nan}, "run config round-timeout: must be a number in (0, 604800], got nan"),
    ({"round-timeout": 0}, "run config round-timeout: must be a number in (0, 604800], got 0"),
    ({"round-timeout": 10**9}, "run config round-timeout: must be a number in (0, 604800], got 1000000000"),
    ({"round-timeout": "600"}, "run config round-timeout: must be a number in (0, 604800], got '600'"),
    ({"resume": "false"}, "run config resume: must be true or false, got 'false'"),
    ({"overwrite": 1}, "run config overwrite: must be true or false, got 1"),
    ({"min-nodes": 4}, "run config min-nodes: must be an integer in 0..3, got 4"),  # digits.yaml has 3 clients
    ({"min-nodes": -1}, "run config min-nodes: must be an integer in 0..3, got -1"),
])
def test_the_deployment_serverapp_refuses_a_bad_run_config_before_any_round(run_config, message, monkeypatch):
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from nefl_zoo.fl.flower import server

    def never(*args, **kwargs):
        raise AssertionError("a bad run config reached the engine")

    monkeypatch.setattr(server, "FlowerEngine", never)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"config": "digits.yaml", **run_config})
    with pytest.raises(ValueError) as err:
        server.server_app(APP)(None, context)
    assert str(err.value) == message


def test_the_engines_waits_are_checked_before_anything_is_loaded_or_sent(tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    from nefl_zoo.fl import engine
    from nefl_zoo.fl.flower import FlowerEngine, NodeRegistry, server
    from nefl_zoo.fl.flower.nodes import collect
    from nefl_zoo.fl.strategy.base import ClientInfo

    from .conftest import tiny

    def never(*args, **kwargs):
        raise AssertionError("reached past the checks")

    monkeypatch.setattr(engine.Engine, "__init__", never)  # nothing loaded
    config = tiny()
    for kwargs, message in [
        ({"timeout": math.inf}, "timeout: must be a number in (0, 604800], got inf"),
        ({"timeout": -1.0}, "timeout: must be a number in (0, 604800], got -1.0"),
        ({"poll": 0.0}, "poll: must be a number in (0, 3600], got 0.0"),
        ({"poll": math.nan}, "poll: must be a number in (0, 3600], got nan"),
        ({"min_nodes": 5}, "min_nodes: must be an integer in 1..4, got 5"),  # 4 clients: a 5th node is never set up
        ({"min_nodes": 0}, "min_nodes: must be an integer in 1..4, got 0"),
    ]:
        with pytest.raises(ValueError) as err:
            FlowerEngine(config, tmp_path, None, **kwargs)
        assert str(err.value) == message

    class Grid:
        def push_messages(self, messages):
            raise AssertionError("pushed")

        def get_node_ids(self):
            return [1, 2]

    with pytest.raises(ValueError, match=r"^timeout: must be a number in \(0, 604800\], got nan$"):
        collect(Grid(), [], math.nan)
    with pytest.raises(ValueError, match=r"^poll: must be a number in \(0, 3600\], got 1e\+300$"):
        collect(Grid(), [], 1.0, poll=1e300)
    with pytest.raises(ValueError, match=r"^timeout: must be a number in \(0, 604800\], got 0$"):
        NodeRegistry("r", "{}", [ClientInfo(0, ("g1",))], ["g1"], timeout=0)
    stopped = threading.Event()
    stopped.set()
    registry = NodeRegistry("r", "{}", [ClientInfo(0, ("g1",)), ClientInfo(1, ("g1",))], ["g1"], stop=stopped)
    with pytest.raises(ValueError, match=r"^min_nodes: must be an integer in 1\.\.2, got 3$"):
        registry.refresh(Grid(), 3)  # would wait for ever: 2 clients are at most 2 nodes

    monkeypatch.setattr("flwr.simulation.run_simulation", never)  # no Ray
    run = server.SimulatedRun(config, tmp_path)
    for kwargs, message in [
        ({"timeout": math.inf}, "timeout: must be a number in (0, 604800], got inf"),
        ({"threads": 0}, "threads: must be an integer in 1..1024, got 0"),
        ({"cpus": 10**6}, "cpus: must be an integer in 1..1024, got 1000000"),
    ]:
        with pytest.raises(ValueError) as err:
            server.simulate_runs([run], **kwargs)
        assert str(err.value) == message

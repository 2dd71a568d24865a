"""The method contract on Flower: every registered method's 2-round run through Flower's
ServerApp and ClientApp equals its run on the embedded engine, and a method that keeps per-client
state resumes on Flower bit-identically, on an in-process grid whose messages cross Flower's
protobuf; NeFL under SecAgg+ runs in Flower's simulation too (Ray's worker processes;
``tests/support/flower.py``), so a new method adds no Ray run. The simulation's
per-node bytes and observer calls are checked here too, so the suite's one Ray start stays on
one worker (``--dist loadfile``)."""

import pytest

pytest.importorskip("flwr")

from nefl_zoo.fl.strategy.registry import registered_methods  # noqa: E402

from .conftest import contract_config, records, same_tensors  # noqa: E402
from .support.flower import (CLIENT_STATES, OBSERVED, InProcessGrid, layout, secure_contract_config, simulation,  # noqa: E402
                             submodel_bytes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return simulation(tmp_path_factory)


@pytest.mark.parametrize("method", list(registered_methods()))
def test_flower_equals_the_embedded_engine(runs, method):
    embedded, flower = runs / f"embedded-{method}", runs / f"wire-{method}"
    assert layout(flower) == layout(embedded)
    assert same_tensors(flower, embedded)
    if (embedded / CLIENT_STATES).exists():
        assert same_tensors(flower, embedded, CLIENT_STATES)
    assert records(flower) == records(embedded)


def test_secure_simulation_on_ray_gives_the_in_process_secure_run_bit_for_bit(runs, tmp_path, server_identity):
    """SecAgg+ in Flower's simulation (Ray, its ClientApp processes) and on an in-process grid
    (protobuf both ways): the same global tensors and records, stochastic rounding being seeded
    per client and the masks cancelling in the sum (tests/test_secagg.py: the bound, the masks)."""
    from nefl_zoo.fl.flower import FlowerEngine

    config = secure_contract_config()
    FlowerEngine(config, tmp_path / "wire", InProcessGrid(config.clients.num_clients, wire=True), timeout=30).run()
    assert same_tensors(runs / "flower-nefl-secure", tmp_path / "wire")
    assert records(runs / "flower-nefl-secure") == records(tmp_path / "wire")
    assert [r["clients"] for r in records(tmp_path / "wire")] == [2, 2]


def test_methods_with_client_state_resume_on_flower_bit_identically(runs):
    """Stopped after round 1 and resumed on Flower: the uninterrupted Flower run's and the
    embedded run's global and per-client tensors (the client state is in Flower's checkpoints)."""
    stateful = sorted(m for m in registered_methods() if (runs / f"embedded-{m}" / CLIENT_STATES).exists())
    assert "fedgh" in stateful  # FedGH's extractors are per-client state: the check below is not empty
    for method in stateful:
        resumed = runs / f"wire-{method}-resumed"
        for name in ("global.safetensors", CLIENT_STATES):
            assert same_tensors(resumed, runs / f"wire-{method}", name), (method, name)
            assert same_tensors(resumed, runs / f"embedded-{method}", name), (method, name)
        # round 1 was the last round of the stopped run, so it was evaluated: compare the end
        assert records(resumed)[-1] == records(runs / f"embedded-{method}")[-1], method


def test_flower_sends_each_node_only_its_submodels_bytes(tmp_path_factory):
    runs = simulation(tmp_path_factory)
    sizes, full = submodel_bytes(contract_config("nefl"))
    seen = set()
    for record in records(runs / "wire-nefl"):
        assert len(record["per_client"]) == record["clients"] >= 1
        for client in record["per_client"].values():
            assert client["bytes_down"] == client["bytes_up"] == sizes[client["tier"]] < full
            seen.add(client["tier"])
        assert record["bytes_down"] == sum(c["bytes_down"] for c in record["per_client"].values())
    assert len(seen) >= 2


def test_simulation_calls_the_observer_from_the_serverapp(tmp_path_factory):
    simulation(tmp_path_factory)
    assert OBSERVED.seen == ["start", 1, 2, "end"]

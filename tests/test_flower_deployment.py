"""Nested FL on a real Flower deployment: a SuperLink and 3 SuperNodes as processes on free
localhost ports (``tests/support/deployment.py``), two with a long-running ``nefl-zoo clientapp``
(process isolation) and one with Flower's ClientApp process per message, the example Flower App
submitted with ``flwr run``.

One deployment serves two runs: NeFL for 1 round (the embedded engine's global tensors and
records; each node trains only submodels its declared level allows and exchanges only their
bytes), then resumed to 3 rounds with one SuperNode killed after round 2: round 2 is the
embedded engine's, and round 3 completes with the other two nodes. Every method's parity on
Flower's transport is the simulation's (``test_method_contract_flower.py``); this test proves the
deployment: processes, gRPC, node configs, resume and a departing node. Every process started
here is ended (process groups). Deselect with ``-m 'not deployment'`` where localhost ports
cannot be opened.
"""

import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("flwr")

from nefl_zoo.fl.config import parse_config  # noqa: E402
from nefl_zoo.fl.engine import Engine  # noqa: E402

from .conftest import records, same_tensors, tiny  # noqa: E402
from .support.deployment import LocalDeployment, group_alive  # noqa: E402
from .support.flower import layout, submodel_bytes  # noqa: E402

pytestmark = pytest.mark.deployment
torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
APP = ROOT / "examples" / "flower-app"
# what each node declares: node 0 only the smallest tier, node 1 up to g0.5, node 2 nothing
# (it gets the config's group for partition 2); the embedded runs use the same groups. One torch
# thread, as here: the same arithmetic, so the same tensors
NODE_CONFIGS = [{"threads": 1, "max_tier": "g0.25"}, {"threads": 1, "max_tier": "g0.5"}, {"threads": 1}]
# nodes 0 and 1 run a long-running `nefl-zoo clientapp` (process isolation; node 1 is killed with
# it), node 2 a ClientApp process per message as Flower does by default: both give the same tensors
ISOLATION = ["process", "process", "subprocess"]
GROUPS = [["g0.25"], ["g0.25", "g0.5"], ["g0.25", "g0.5", "g1"]]


def wait_for(condition, timeout: float, what: str, deployment: LocalDeployment, run: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or deployment.processes[run].poll() is not None:
            pytest.fail(f"{what} did not happen: {deployment.log(run)}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    if shutil.which("flower-superlink", path=str(BIN)) is None:
        pytest.skip("flower-superlink is not installed next to this Python")
    try:
        dep = LocalDeployment(tmp_path_factory.mktemp("deployment"))
    except OSError as exc:
        pytest.skip(f"no free localhost port: {exc}")
    try:
        dep.start_superlink()
        for i, (node_config, isolation) in enumerate(zip(NODE_CONFIGS, ISOLATION)):
            dep.start_supernode(i, 3, isolation=isolation, **node_config)
        yield dep
    finally:
        assert dep.close() == [], "processes left behind"


def config(rounds: int):
    return tiny(rounds=rounds, clients__num_clients=3, clients__groups=GROUPS, train__local_epochs=1)


def test_deployment_equals_embedded_and_survives_a_killed_supernode(deployment, tmp_path):
    # Prepare: the config as a file the ServerApp reads, and the embedded engine's runs
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config(1).to_dict()))
    for rounds in (1, 2):
        Engine(parse_config(config(rounds).to_dict()), tmp_path / f"embedded-{rounds}").run()

    # Execute: NeFL for 1 round on the 3 SuperNodes
    out = tmp_path / "nefl"
    run = deployment.flwr_run("run", APP, {"config": str(path), "out": str(out)})
    assert run.wait(timeout=900) == 0, deployment.log("run")

    # Assert: the embedded engine's global tensors, the same run directory and records
    assert same_tensors(out, tmp_path / "embedded-1")
    assert layout(out) == layout(tmp_path / "embedded-1")
    assert records(out) == records(tmp_path / "embedded-1")
    # each node trained a submodel its declared level allows, and moved only its bytes
    sizes, full = submodel_bytes(config(1))
    (record,) = records(out)
    assert record["clients"] == 3 and record["rejected"] == 0
    for cid, client in record["per_client"].items():
        assert client["tier"] in GROUPS[int(cid)]
        assert client["bytes_down"] == client["bytes_up"] == sizes[client["tier"]] < full

    # Execute: resume to 3 rounds; kill SuperNode 1 (its process group) once round 2 is recorded.
    # SIGTERM: the SuperLink learns at once; after SIGKILL it takes a missed heartbeat (60 s in
    # flwr 1.42), then the same error reply
    run = deployment.flwr_run("run-resumed", APP, {"out": str(out), "resume": True, "overrides": "rounds=3"})
    wait_for(lambda: len(records(out)) >= 2, 900, "round 2", deployment, "run-resumed")
    deployment.end("supernode1", signal.SIGTERM)
    assert run.wait(timeout=900) == 0, deployment.log("run-resumed")

    # Assert: round 2 is the embedded engine's; round 3 completed with the two remaining nodes
    assert [r["round"] for r in records(out)] == [1, 2, 3] and (out / "summary.json").exists()
    assert records(out)[1] == records(tmp_path / "embedded-2")[1]
    last = records(out)[-1]
    assert last["clients"] == 2, last
    assert "1" not in last["per_client"] or last["rejected"] == 1
    assert not group_alive(deployment.processes["supernode1"].pid)
    assert not group_alive(deployment.processes["supernode1-clientapp"].pid)

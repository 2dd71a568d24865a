"""Nested FL on a real Flower deployment: a SuperLink and 3 SuperNodes as processes on free
localhost ports, the example Flower App submitted with ``flwr run``.

One deployment serves three runs: NeFL and HeteroFL for 2 rounds (the same global tensors as the
embedded engine; each node trains only submodels its declared level allows and exchanges only
their bytes), then the NeFL run resumed to 4 rounds with one SuperNode killed after round 3:
round 4 completes with the other two. Every process started here is ended (process groups).
Deselect with ``-m 'not deployment'`` where localhost ports cannot be opened.
"""

import json
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytest.importorskip("flwr")

from nefl_zoo.fl.config import parse_config  # noqa: E402
from nefl_zoo.fl.engine import Engine  # noqa: E402
from nefl_zoo.fl.flower.local import LocalDeployment, group_alive  # noqa: E402

from .test_fl_engine import tiny  # noqa: E402
from .test_flower import submodel_bytes  # noqa: E402

pytestmark = pytest.mark.deployment
torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
APP = ROOT / "examples" / "flower-app"
# what each node declares: node 0 only the smallest tier, node 1 up to g0.5, node 2 nothing
# (it gets the config's group for partition 2); the embedded runs use the same groups. One torch
# thread, as here: the same arithmetic, so the same tensors
NODE_CONFIGS = [{"threads": 1, "max_tier": "g0.25"}, {"threads": 1, "max_tier": "g0.5"}, {"threads": 1}]
GROUPS = [["g0.25"], ["g0.25", "g0.5"], ["g0.25", "g0.5", "g1"]]


def wait_for(condition, timeout: float, what: str, deployment: LocalDeployment, run: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or deployment.processes[run].poll() is not None:
            pytest.fail(f"{what} did not happen: {deployment.log(run)}")
        time.sleep(0.2)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


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
        for i, node_config in enumerate(NODE_CONFIGS):
            dep.start_supernode(i, 3, **node_config)
        yield dep
    finally:
        assert dep.close() == [], "processes left behind"


def config(method: str):
    return tiny(method=method, rounds=2, clients__num_clients=3, clients__groups=GROUPS, train__local_epochs=1)


def test_deployment_equals_embedded_and_survives_a_killed_supernode(deployment, tmp_path):
    # Prepare: the configs as files the ServerApp reads, and the embedded engine's runs
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config("nefl").to_dict()))
    for method in ("nefl", "heterofl"):
        Engine(parse_config(config(method).to_dict()), tmp_path / f"embedded-{method}").run()

    # Execute: NeFL and HeteroFL for 2 rounds on the 3 SuperNodes
    for method in ("nefl", "heterofl"):
        run = deployment.flwr_run(f"run-{method}", APP, {"config": str(path), "out": str(tmp_path / method), "overrides": f"method={method}"})
        assert run.wait(timeout=900) == 0, deployment.log(f"run-{method}")

        # Assert: the embedded engine's global tensors, the same run directory and records
        a = load_file(str(tmp_path / f"embedded-{method}" / "global.safetensors"))
        b = load_file(str(tmp_path / method / "global.safetensors"))
        assert a.keys() == b.keys(), deployment.log(f"run-{method}")
        assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) <= 1e-6
        assert (tmp_path / method / "summary.json").exists()
        strip = lambda r: {k: v for k, v in r.items() if k != "time_s"}  # noqa: E731
        assert [strip(r) for r in records(tmp_path / method)] == [strip(r) for r in records(tmp_path / f"embedded-{method}")]
        # each node trained a submodel its declared level allows, and moved only its bytes
        sizes, full = submodel_bytes(config(method))
        for record in records(tmp_path / method):
            assert record["clients"] == 3 and record["rejected"] == 0
            for cid, client in record["per_client"].items():
                assert client["tier"] in GROUPS[int(cid)]
                assert client["bytes_down"] == client["bytes_up"] == sizes[client["tier"]] < full

    # Execute: resume the NeFL run to 4 rounds; kill SuperNode 1 (its process group) once round 3
    # is recorded. SIGTERM: the SuperLink learns at once; after SIGKILL it takes a missed
    # heartbeat (60 s in flwr 1.42), then the same error reply
    out = tmp_path / "nefl"
    run = deployment.flwr_run("run-resumed", APP, {"out": str(out), "resume": True, "overrides": "rounds=4"})
    wait_for(lambda: len(records(out)) >= 3, 900, "round 3", deployment, "run-resumed")
    deployment.end("supernode1", signal.SIGTERM)
    assert run.wait(timeout=900) == 0, deployment.log("run-resumed")

    # Assert: round 4 completed with the two remaining nodes
    last = records(out)[-1]
    assert [r["round"] for r in records(out)] == [1, 2, 3, 4] and (out / "summary.json").exists()
    assert last["clients"] == 2, last
    assert "1" not in last["per_client"] or last["rejected"] == 1
    assert not group_alive(deployment.processes["supernode1"].pid)

"""The ServerApps without Ray or processes: :func:`simulate_runs` with Flower's
``run_simulation`` replaced by one that runs the ServerApp on an in-process grid (what it asks
Ray for, in which order its runs go, what it restores), and the deployment ServerApp of
``examples/flower-app`` on an in-process grid (its run config, its log lines). The real Ray
simulation and deployment are ``test_method_contract_flower.py`` and ``test_flower_deployment.py``."""

import json
import logging
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

from nefl_zoo.fl.flower import server  # noqa: E402

from .conftest import records, same_tensors, tiny  # noqa: E402
from .support.flower import InProcessGrid  # noqa: E402

APP = Path(__file__).resolve().parents[1] / "examples" / "flower-app"
torch.set_num_threads(1)


def quick(**overrides):
    return tiny(**{"rounds": 1, "train__local_epochs": 1, "data__max_test_samples": 32, **overrides})


@pytest.fixture
def in_process_simulation(monkeypatch, server_identity):
    """``run_simulation`` runs the ServerApp on an :class:`InProcessGrid` of its SuperNodes and
    notes what it was asked for, the Ray variables and the flwr log level meanwhile."""
    calls = []

    def run_simulation(server_app, client_app, num_supernodes, backend_config):
        calls.append({"nodes": num_supernodes, "backend": backend_config, "client_app": client_app,
                      "env": {k: server.os.environ.get(k) for k in ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "RAY_worker_niceness")},
                      "flwr_level": logging.getLogger("flwr").level})
        context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
        server_app._main(InProcessGrid(num_supernodes), context)

    for name in ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "RAY_worker_niceness"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("flwr.simulation.run_simulation", run_simulation)
    monkeypatch.setattr(logging.getLogger("flwr"), "level", logging.WARNING)
    return calls


def test_runs_go_in_order_through_one_simulation_that_asks_ray_for_what_was_given(in_process_simulation, tmp_path):
    first, second = quick(), quick(seed=1)
    seen = []

    class Observer:
        def start(self, engine):
            seen.append(("start", str(engine.out)))

        def round(self, record, last_eval):
            seen.append(("round", record["round"]))

        def end(self, engine, result):
            seen.append(("end", str(engine.out)))

    results = server.simulate_runs([server.SimulatedRun(first, tmp_path / "a"),
                                    server.SimulatedRun(second, tmp_path / "b", observer=Observer())], threads=1, cpus=2)
    (call,) = in_process_simulation
    assert call["nodes"] == 4 and call["client_app"] is server.client_app
    assert call["backend"] == {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                               "init_args": {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False,
                                             "logging_level": logging.ERROR}}
    assert call["env"] == {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_worker_niceness": "0"}
    assert call["flwr_level"] == logging.ERROR and logging.getLogger("flwr").level == logging.WARNING  # restored
    assert [r.acc for r in results] == [json.loads((tmp_path / d / "summary.json").read_text())["acc"] for d in "ab"]
    assert seen == [("start", str(tmp_path / "b")), ("round", 1), ("end", str(tmp_path / "b"))]
    assert not same_tensors(tmp_path / "a", tmp_path / "b")  # two seeds, two runs
    assert [r["round"] for r in records(tmp_path / "a")] == [1]


def test_a_verbose_simulation_keeps_flowers_logs_and_a_resume_continues_the_run(in_process_simulation, tmp_path):
    config = quick(rounds=2, checkpoint_every=1)
    server.simulate(config.model_copy(update={"rounds": 1}), tmp_path / "run", threads=2, cpus=3, verbose=True)
    result = server.simulate(config, tmp_path / "run", resume=True, threads=2, cpus=3)
    verbose, resumed = in_process_simulation
    assert verbose["backend"]["client_resources"]["num_cpus"] == 2 and verbose["backend"]["init_args"]["num_cpus"] == 3
    assert verbose["backend"]["init_args"]["log_to_driver"] is True and verbose["backend"]["init_args"]["logging_level"] == logging.INFO
    assert verbose["flwr_level"] == logging.WARNING and resumed["flwr_level"] == logging.ERROR
    assert result.acc == json.loads((tmp_path / "run" / "summary.json").read_text())["acc"] and [r["round"] for r in records(tmp_path / "run")] == [1, 2]


def test_runs_of_different_sizes_and_a_simulation_that_ends_early_are_errors(in_process_simulation, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"^the runs of one simulation need the same clients.num_clients, got \[3, 4\]$"):
        server.simulate_runs([server.SimulatedRun(quick(), tmp_path / "a"), server.SimulatedRun(quick(clients__num_clients=3), tmp_path / "b")])
    run = server.SimulatedRun(quick(), tmp_path / "d")
    for kwargs, message in [({"timeout": 0}, r"^timeout: must be a number in \(0, 604800\], got 0$"),
                            ({"cpus": 0}, r"^cpus: must be an integer in 1\.\.1024, got 0$")]:
        with pytest.raises(ValueError, match=message):
            server.simulate_runs([run], **kwargs)
    assert in_process_simulation == []  # refused before Ray
    monkeypatch.setattr("flwr.simulation.run_simulation", lambda *args, **kwargs: None)  # Ray gave up without a word
    with pytest.raises(RuntimeError, match=r"^the Flower simulation ended before its runs did$"):
        server.simulate(quick(), tmp_path / "c", threads=1)
    assert logging.getLogger("flwr").level == logging.WARNING


def test_the_deployment_serverapp_runs_its_config_with_overrides_and_logs_each_round(server_identity, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    logger = logging.getLogger("nefl_zoo")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "level", logging.WARNING)
    run_config = {"config": "digits.yaml", "overrides": "rounds=2; train.local_epochs=1 ;data.max_test_samples=32;eval.every=2",
                  "round-timeout": 60.0, "resume": False}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    handler_output = []
    monkeypatch.setattr(logging.StreamHandler, "emit", lambda self, record: handler_output.append(self.format(record)))
    server.server_app(APP)(InProcessGrid(3), context)
    out = tmp_path / "runs" / "digits-flower-nefl-s0"  # the default run directory, under the working directory
    assert [r["round"] for r in records(out)] == [1, 2]
    assert logger.level == logging.INFO and logger.propagate is False
    assert len(handler_output) == 4, handler_output
    start, first, second, done = handler_output
    assert start == f"INFO nefl_zoo.fl.flower.server: nefl digits-flower: round 0 of 2, run directory {out}"
    assert re.fullmatch(r"INFO nefl_zoo\.fl\.flower\.server: round 1: 3 clients, 0 rejected, loss \d+\.\d{4}", first)  # not evaluated
    assert re.fullmatch(r"INFO nefl_zoo\.fl\.flower\.server: round 2: 3 clients, 0 rejected, loss \d+\.\d{4}, worst \d\.\d{3} avg \d\.\d{3}", second)
    assert re.fullmatch(r"INFO nefl_zoo\.fl\.flower\.server: done: g0\.2 \d\.\d{4}, g0\.6 \d\.\d{4}, g1 \d\.\d{4}", done)

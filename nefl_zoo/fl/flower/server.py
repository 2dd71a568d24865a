"""Flower ``ServerApp``\\ s: the simulation behind ``nefl-zoo train --engine flower`` and the
deployment app that ``flwr run`` submits to a SuperLink.

Both run a :class:`~nefl_zoo.fl.flower.flower_engine.FlowerEngine`, so a Flower run writes the same
run directory as the embedded engine and resumes the same way.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ...bounds import MAX_THREADS, MAX_TIMEOUT_S, number
from ..config import RunConfig, apply_overrides, load_config, parse_config
from ..engine import RunObserver, RunResult, resume_config
from ..training.device import gpu_share
from .client import app as client_app
from .flower_engine import FlowerEngine, check_flower_config

log = logging.getLogger(__name__)


@dataclass
class SimulatedRun:
    """One run of a simulation: what :meth:`~nefl_zoo.fl.engine.Engine.run` takes."""

    config: RunConfig
    out: str | Path
    resume: bool = False
    overwrite: bool = False
    observer: RunObserver | None = None


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def simulate_runs(runs: Sequence[SimulatedRun], *, threads: int | None = None, cpus: int | None = None,
                  timeout: float = 3600.0, verbose: bool = False) -> list[RunResult]:
    """Run ``runs`` one after another in one Flower simulation (``flwr.simulation.run_simulation``,
    Ray): one virtual SuperNode per client, ``partition-id`` = client id.

    Each client gets ``threads`` CPUs (default: torch's thread count here) of ``cpus`` (default:
    every core of this process), so ``cpus // threads`` clients train in parallel; where
    ``train.device`` is CUDA they share the GPUs (:func:`~nefl_zoo.fl.training.device.gpu_share`; Ray then shows each client
    its share as ``cuda``, so give ``cuda`` or ``auto``, not ``cuda:N``). All runs must have the
    same ``clients.num_clients``. Flower's and Ray's logs are shown only when ``verbose``.
    """
    import torch
    from flwr.simulation import run_simulation

    number("timeout", timeout, 0, MAX_TIMEOUT_S, open_low=True)  # before Ray starts: one line, not a failed ServerApp
    for name, count in (("threads", threads), ("cpus", cpus)):
        if count is not None:
            number(name, count, 1, MAX_THREADS, integer=True)
    for run in runs:
        check_flower_config(run.config)
    sizes = {r.config.clients.num_clients for r in runs}
    if len(sizes) != 1:
        raise ValueError(f"the runs of one simulation need the same clients.num_clients, got {sorted(sizes)}")
    cpus = cpus or _cpus()
    per_client = max(1, min(threads or torch.get_num_threads(), cpus))
    device = max((r.config.placement().device for r in runs), key=lambda d: d.type == "cuda")
    gpus = gpu_share(device.type, torch.cuda.device_count() if device.type == "cuda" else 0, cpus // per_client)
    backend = {"client_resources": {"num_cpus": per_client, "num_gpus": gpus},
               "init_args": {"num_cpus": cpus, "include_dashboard": False, "log_to_driver": verbose,
                             "logging_level": logging.INFO if verbose else logging.ERROR}}
    results: list[RunResult] = []
    stop = threading.Event()
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        for run in runs:
            engine = FlowerEngine(run.config, run.out, grid, timeout=timeout, stop=stop)
            results.append(engine.run(resume=run.resume, overwrite=run.overwrite, observer=run.observer))

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a Ray FutureWarning
    os.environ.setdefault("RAY_worker_niceness", "0")  # Ray's default 15 starves clients on a busy machine
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    if not verbose:
        flwr_log.setLevel(logging.ERROR)
    try:
        run_simulation(server, client_app, num_supernodes=sizes.pop(), backend_config=backend)
    finally:
        stop.set()  # e.g. Ctrl-C: the ServerApp thread stops waiting for replies
        flwr_log.setLevel(level)
    if len(results) != len(runs):
        raise RuntimeError("the Flower simulation ended before its runs did")
    return results


def simulate(config: RunConfig, out: str | Path, *, resume: bool = False, overwrite: bool = False,
             observer: RunObserver | None = None, threads: int | None = None, cpus: int | None = None,
             verbose: bool = False) -> RunResult:
    """Run one configuration on Flower's simulation engine into ``out`` (see :func:`simulate_runs`)."""
    runs = [SimulatedRun(config, out, resume, overwrite, observer)]
    return simulate_runs(runs, threads=threads, cpus=cpus, verbose=verbose)[0]


class _LogProgress:
    """Observer of a deployed run: one log line per round (shown by ``flwr run --stream``)."""

    def start(self, engine) -> None:
        log.info("%s %s: round %d of %d, run directory %s", engine.config.method, engine.config.name,
                 engine.round, engine.config.rounds, engine.out.resolve())

    def round(self, record: dict, last_eval: dict) -> None:
        acc = f", worst {last_eval['worst']:.3f} avg {last_eval['avg']:.3f}" if "acc" in record else ""
        log.info("round %d: %d clients, %d rejected, loss %.4f%s", record["round"], record["clients"],
                 record["rejected"], record["train_loss"], acc)

    def end(self, engine, result: RunResult) -> None:
        log.info("done: %s", ", ".join(f"{t} {a:.4f}" for t, a in result.acc.items()))


def _log_to_stderr() -> None:
    """Show nefl-zoo's INFO logs (rounds, rejected replies) in the ServerApp's output, which
    ``flwr run --stream`` and ``flwr log`` show."""
    logger = logging.getLogger("nefl_zoo")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO)


def server_app(app_dir: str | Path) -> ServerApp:
    """The deployment ``ServerApp`` of a Flower App in ``app_dir``; its run config (the app's
    ``[tool.flwr.app.config]``, overridable with ``flwr run --run-config``):

    ``config``: the training config YAML, relative to ``app_dir`` or absolute;
    ``overrides``: ``;``-separated ``KEY=VALUE`` as ``nefl-zoo train --set``;
    ``out``: the run directory (relative: to the ServerApp's working directory, that of the
    SuperLink; empty: ``runs/NAME-METHOD-sSEED``); ``resume`` (continue ``out`` from its
    checkpoint, config from there), ``overwrite``; ``round-timeout``: seconds to wait for a
    round's replies (more than 0, at most a week); ``min-nodes``: nodes to wait for before
    round 1 (0: ``clients.num_clients``; at most that). A setting of the wrong type or out of
    bounds ends the run before any data is loaded, with one line naming it.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        _log_to_stderr()
        rc = context.run_config
        overrides = [s.strip() for s in str(rc.get("overrides", "")).split(";") if s.strip()]
        resume, overwrite = (_flag(rc, key) for key in ("resume", "overwrite"))
        timeout = number("run config round-timeout", rc.get("round-timeout", 3600.0), 0, MAX_TIMEOUT_S, open_low=True)
        out = str(rc.get("out", ""))
        if resume:
            cfg = parse_config(apply_overrides(resume_config(out).to_dict(), overrides, out), out)
        else:
            path = Path(str(rc["config"]))
            cfg = load_config(path if path.is_absolute() else Path(app_dir) / path, overrides)
        min_nodes = number("run config min-nodes", rc.get("min-nodes", 0), 0, cfg.clients.num_clients, integer=True)
        out = out or f"runs/{cfg.name}-{cfg.method}-s{cfg.seed}"
        engine = FlowerEngine(cfg, out, grid, timeout=float(timeout), min_nodes=min_nodes or None)
        engine.run(resume=resume, overwrite=overwrite, observer=_LogProgress())

    return app


def _flag(run_config, key: str) -> bool:
    """A true/false setting of the run config (absent: false); ``ValueError`` for anything else
    (the string ``"false"`` is not false)."""
    value = run_config.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"run config {key}: must be true or false, got {value!r}")
    return value

"""Flower benchmarks: wall time per round of the digits
run on the embedded engine, on Flower's simulation engine and on a local Flower deployment, with
start-up shown separately, and whether each gives the embedded engine's final tensors.

The run: ``specs/train/digits-quick.yaml`` (NeFL, ResNet20 at 16x16, 20 clients, 10 per round,
5 local epochs), ``--rounds`` rounds, evaluated once after the last. A round's time is its
``metrics.jsonl`` record's ``time_s`` (configure, deliver, train, reply, aggregate). Per round:
the median of rounds 2..R. Start-up: wall time from the start (the call, or starting the
SuperLink) to the end of round 1, minus one median round; it holds Ray's start, the nodes' set-up
and the first messages' imports and data loading.

Engines: ``embedded-1`` / ``embedded-2`` (in process, 1 or 2 torch threads); ``simulation-1`` /
``simulation-2`` (Ray, 1 or 2 actors with one thread each; ``--engine flower`` uses every core);
``deployment-subprocess`` / ``deployment-process`` (a SuperLink and 20 SuperNodes on 127.0.0.1, the
example Flower App with ``flwr run``, one thread per node: Flower starting a ClientApp process per
message, or one long-running ``nefl-zoo clientapp`` per node). Every engine runs ``--passes``
times, every other pass in reverse order (A B C C B A), so a change in the machine's load falls
on all of them alike; the table gives every pass, with the load average before and after it.

Run: ``python benchmarks/bench_flower.py [--rounds 8] [--passes 2] [--engines embedded-1,simulation-2]``;
prints markdown.

Results: every table printed goes to ``benchmarks/results/flower.json`` and the figure drawn from it
to ``docs/benchmarks/img/flower.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import publish  # results JSON and figure (benchmarks/publish.py)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "specs" / "train" / "digits-quick.yaml"
APP = ROOT / "examples" / "flower-app"


class Clock:
    """Observer: when each round ended, from the start of the measurement."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.ends: list[float] = []

    def start(self, engine) -> None:
        pass

    def round(self, record: dict, last_eval: dict) -> None:
        self.ends.append(time.perf_counter() - self.t0)

    def end(self, engine, result) -> None:
        pass


def overrides(rounds: int) -> list[str]:
    return [f"rounds={rounds}", f"eval.every={rounds}", f"checkpoint_every={rounds}"]


def embedded(rounds: int, out: Path, threads: int) -> dict:
    from nefl_zoo.fl.config import load_config
    from nefl_zoo.fl.engine import Engine

    before, clock = torch.get_num_threads(), Clock()
    torch.set_num_threads(threads)
    try:
        Engine(load_config(CONFIG, overrides(rounds)), out).run(observer=clock)
    finally:
        torch.set_num_threads(before)
    return {"first_round_end": clock.ends[0]}


def simulation(rounds: int, out: Path, actors: int) -> dict:
    """Flower's simulation engine, ``actors`` clients at a time, one torch thread each."""
    from nefl_zoo.fl.config import load_config
    from nefl_zoo.fl.flower import simulate

    clock = Clock()
    simulate(load_config(CONFIG, overrides(rounds)), out, observer=clock, threads=1, cpus=actors)
    return {"first_round_end": clock.ends[0]}


def deployment(rounds: int, out: Path, isolation: str) -> dict:
    """A SuperLink and one SuperNode per client on 127.0.0.1, one torch thread each."""
    from nefl_zoo.fl.config import load_config
    sys.path.insert(0, str(ROOT))  # tests/support: test-only process management, not in the package
    from tests.support.deployment import LocalDeployment

    clients = load_config(CONFIG).clients.num_clients
    t0 = time.perf_counter()
    with LocalDeployment(out.parent / f"{out.name}-processes") as dep:
        dep.start_superlink()
        for i in range(clients):
            dep.start_supernode(i, clients, isolation=isolation, threads=1)
        run = dep.flwr_run("run", APP, {"config": str(CONFIG), "out": str(out), "overrides": "; ".join(overrides(rounds))})
        first = None
        while run.poll() is None:
            if first is None and records(out):
                first = time.perf_counter() - t0
            time.sleep(0.1)
        if run.returncode != 0:
            raise RuntimeError(f"flwr run failed: {dep.log('run')}")
    return {"first_round_end": first}


ENGINES = {  # name -> (label, run(rounds, out))
    "embedded-1": ("embedded, 1 thread", lambda r, o: embedded(r, o, 1)),
    "embedded-2": ("embedded, 2 threads", lambda r, o: embedded(r, o, 2)),
    "simulation-1": ("simulation, 1 actor", lambda r, o: simulation(r, o, 1)),
    "simulation-2": ("simulation, 2 actors", lambda r, o: simulation(r, o, 2)),
    "deployment-subprocess": ("deployment, a ClientApp process per message (Flower's subprocess isolation)",
                              lambda r, o: deployment(r, o, "subprocess")),
    "deployment-process": ("deployment, long-running ClientApps (process isolation, nefl-zoo clientapp)",
                           lambda r, o: deployment(r, o, "process")),
}


def measure(name: str, rounds: int, out: Path) -> dict:
    """One pass of engine ``name``: per-round times, start-up, load averages, the final state's hash."""
    load = os.getloadavg()
    result = ENGINES[name][1](rounds, out)
    times = [r["time_s"] for r in records(out)]
    per_round = statistics.median(times[1:])
    return {"engine": name, "per_round": per_round, "rounds": times, "load": (load, os.getloadavg()),
            "startup": max(0.0, result["first_round_end"] - per_round),  # 0 when round 1 was no slower
            "state": hashlib.sha256((out / "global.safetensors").read_bytes()).hexdigest()}


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def serial_share(rounds: int, out: Path) -> dict:
    """Where an embedded round's time goes (1 thread): the clients' training, which Flower runs
    in parallel, and the server's own steps (configure, aggregate; evaluation once at the end),
    which stay serial whatever the engine. Medians over rounds 2..R, in seconds."""
    from nefl_zoo.fl.config import load_config
    from nefl_zoo.fl.engine import Engine

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(load_config(CONFIG, overrides(rounds)), out)
    spent: dict[str, list[float]] = {"configure": [], "train": [], "aggregate": [], "evaluate": []}

    def timed(name, call):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[name].append(time.perf_counter() - t0)
        return run

    engine.strategy.configure_train = timed("configure", engine.strategy.configure_train)
    engine.strategy.aggregate_train = timed("aggregate", engine.strategy.aggregate_train)
    engine.exchange = timed("train", engine.exchange)
    engine.evaluate = timed("evaluate", engine.evaluate)
    try:
        engine.run()
    finally:
        torch.set_num_threads(before)
    return {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in spent.items()}


def print_serial(share: dict, clients: int) -> None:
    serial = share["configure"] + share["aggregate"]
    total = serial + share["train"]
    print("\n### What stays serial per round (embedded engine, 1 thread, median of rounds 2..R)\n")
    print(f"Per round: clients' training {share['train']:.2f} s ({clients} clients), the server's configure "
          f"{share['configure']:.3f} s and aggregate {share['aggregate']:.3f} s (serial: {100 * serial / total:.1f}% of "
          f"the round); evaluation of every submodel, when scheduled, {share['evaluate']:.2f} s, also serial.")
    print("Ideal per-round time with N cores running clients in parallel (no transport cost): "
          + ", ".join(f"N={n}: {serial + share['train'] / min(n, clients):.2f} s ({total / (serial + share['train'] / min(n, clients)):.1f}x)"
                      for n in (1, 2, 4, 8, clients)) + f"; beyond {clients} cores a round has no more clients to spread.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"which to run (comma-separated of {', '.join(ENGINES)})")
    parser.add_argument("--passes", type=int, default=2, help="passes over the engines, every other one in reverse order")
    parser.add_argument("--serial", action="store_true", help="also time the server's serial steps of an embedded run")
    args = parser.parse_args()
    names = args.engines.split(",")
    unknown = sorted(set(names) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    work = Path(tempfile.mkdtemp(prefix="bench-flower-"))
    start_load = os.getloadavg()
    passes: dict[str, list[dict]] = {n: [] for n in names}
    for p in range(args.passes):  # A B C ... C B A: drift in the machine's load falls on every engine alike
        for name in (names if p % 2 == 0 else names[::-1]):
            passes[name].append(measure(name, args.rounds, work / f"{name}-{p}"))
            print(f"# {name} pass {p + 1}: {passes[name][-1]['per_round']:.2f} s per round", file=sys.stderr, flush=True)
    end_load = os.getloadavg()

    import flwr

    reference = next((passes[n][0]["state"] for n in ("embedded-1",) if n in passes), None)
    base = statistics.mean(r["per_round"] for r in passes.get("embedded-1", [])) if "embedded-1" in passes else None
    print(f"torch {torch.__version__}, flwr {flwr.__version__}, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}; {args.passes} passes (order reversed every other pass); "
          f"load average {' / '.join(f'{x:.2f}' for x in start_load)} at the start, "
          f"{' / '.join(f'{x:.2f}' for x in end_load)} at the end\n")
    print(f"### digits-quick, {args.rounds} rounds (per round: median of rounds 2..{args.rounds} in each pass)\n")
    print("| engine | per round (s), per pass | mean | ratio to embedded, 1 thread | start-up (s) | "
          "final state = embedded, 1 thread | load avg (1 min) before / after, per pass |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        runs = passes[name]
        mean = statistics.mean(r["per_round"] for r in runs)
        same = "n/a" if reference is None else ("yes" if all(r["state"] == reference for r in runs) else "**no**")
        ratio = f"{mean / base:.2f}x" if base else "n/a"
        per_pass = ", ".join(f"{r['per_round']:.2f}" for r in runs)
        startup = ", ".join(f"{r['startup']:.1f}" for r in runs)
        loads = ", ".join(f"{r['load'][0][0]:.2f} / {r['load'][1][0]:.2f}" for r in runs)
        print(f"| {ENGINES[name][0]} | {per_pass} | {mean:.2f} | {ratio} | {startup} | {same} | {loads} |")
    if args.serial:
        from nefl_zoo.fl.config import load_config

        config = load_config(CONFIG)
        print_serial(serial_share(args.rounds, work / "serial"), round(config.clients.num_clients * config.clients.fraction))


if __name__ == "__main__":
    publish.run("flower", main)

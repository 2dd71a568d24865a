"""Side by side with the NeFL authors' own code: the same rounds of NeFL-W and NeFL-WD, timed interleaved.

The authors' public repository (https://github.com/honggkang/nested-federated-learning, commit
7a96913 when this was written) is read from a checkout given by path; nothing of it is copied
here. Their ``NeFL-toy.py`` runs in a process of its own with these changes made at run time
(the files are not touched), printed with every run (:data:`PATCHES`): the line that picks
``cuda:N`` picks the CPU; ``getDataset`` returns this benchmark's tensors (no download); their
IID split returns this benchmark's five client partitions; ``wandb`` and ``torchsummary`` are
empty modules when absent (imported, unused with ``--wandb ''``); four functions are wrapped to
time the rounds and the clients (the round starts when told to and ends after ``NeFedAvg``).
Their own flags do the rest: ``--num_users 5 --frac 1 --min_flex_num 0 --max_flex_num 0``
(client i trains submodel i, every round), ``--local_ep 1 --local_bs 32 --lr 0.1``,
``--learnable_step True --pretrained '' --wandb ''`` (an empty string is their ``False``).

nefl-zoo runs the same work through its engine (``Engine.run_round``: instructions, local
training, NeFedAvg; no evaluation on either side) in the ways of :data:`OURS` (``--sides``: the
default, channels-last, compiled, bf16), each in its own process. Both sides build the same
data: MNIST at 3x32x32 for ResNet18 (5 clients x 600 images, read with ``--mnist``,
``benchmarks/mnist_offline.py`` writes it) and scikit-learn's digits at 3x16x16 for ResNet56
(the smallest CIFAR ResNet of the authors' code; 5 clients of 269-270), no augmentation on
either side. Each process reports a hash of its images and labels and its submodels' widths and
step sizes; the run stops unless all sides agree. Rounds are timed in turn (the order rotating
every round), with the 1-minute load average before each; the compiled side's first round
holds its compilation (``compile_s``, TorchInductor's cache emptied for every process).

``--part steps`` times one training step (batch 32) per submodel in this process instead: the
authors' module (NCHW, eager, skipped blocks computed and multiplied by 0) against nefl-zoo's
slim module eager and in the ways ``--ways`` names (:data:`WAYS`: channels-last, compiled, both,
bf16), with each module's MACs and GFLOP/s; then a matrix product's GFLOP/s in fp32 and bf16
(what the core can do), one step's loss and gradients in fp32 and bf16 against float64, and
SGD's for-loop, foreach and fused kernels.

Run: ``python benchmarks/bench_peer.py --authors PATH [--mnist DIR] [--models resnet18,resnet56]
[--methods W,WD] [--rounds 5] [--threads 2] [--sides nefl-zoo,channels-last,compiled,bf16]``;
``--part steps [--ways ...] [--steps 10]`` for the step tables. Results: ``benchmarks/results/peer.json`` and ``docs/benchmarks/img/peer.png``
(``--plot-only`` redraws it; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import publish  # results JSON and figure (benchmarks/publish.py)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHECKOUT_HELP = ("a checkout of the NeFL authors' repository: git clone https://github.com/honggkang/nested-federated-learning "
                 "PATH (commit 7a96913 was measured)")
CASES = {"resnet18": {"data": "mnist", "input": (3, 32, 32), "clients_total": 100},
         "resnet56": {"data": "digits", "input": (3, 16, 16), "clients_total": 5}}
TIERS = ("g0.2", "g0.4", "g0.6", "g0.8", "g1")
#: nefl-zoo's sides: the defaults (eager, contiguous, fp32), then train.memory_format, train.compile, train.precision
OURS = {"nefl-zoo": {"compile": False, "memory_format": "contiguous", "precision": "fp32"},
        "channels-last": {"compile": False, "memory_format": "channels_last", "precision": "fp32"},
        "compiled": {"compile": True, "memory_format": "channels_last", "precision": "fp32"},
        "bf16": {"compile": False, "memory_format": "channels_last", "precision": "bf16"}}
CPU_LINE = "args.device = 'cuda:' + args.device_id"
PATCHES = (
    f"NeFL-toy.py: `{CPU_LINE}` -> `args.device = 'cpu'` (in the source read into the process; the file is unchanged)",
    "utils.getData.getDataset -> the benchmark's tensors (train and test), no transform",
    "utils.getData.cifar_iid -> the benchmark's five client partitions",
    "wandb, torchsummary -> empty modules where not installed (imported, not used with --wandb '')",
    "utils.util.get_logger, utils.NeFedAvg.NeFedAvg, utils.util.extract_submodel_weight_from_globalM, "
    "utils.fed.LocalUpdateM.train -> wrapped to start and end rounds and time clients",
)


class _Stop(Exception):
    """Ends the authors' training loop after the last timed round."""


# -- the data both sides train on ----------------------------------------------------------------
def bench_data(model: str, mnist: str | None):
    """``(images, labels, partitions of 5 clients, sha256)`` of ``model``'s case."""
    import numpy as np
    import torch

    from nefl_zoo.data.loading import load_data
    from nefl_zoo.data.config import DataConfig

    case = CASES[model]
    root = Path(mnist or ".")
    data = load_data(DataConfig(dataset=case["data"], root=str(root), augment=False), root, case["input"], case["clients_total"], 0)
    images, labels = data.train.images, torch.as_tensor(data.train.labels)
    parts = [np.asarray(p) for p in data.partitions[:5]]
    digest = hashlib.sha256(images.numpy().tobytes() + labels.numpy().tobytes() + b"".join(p.tobytes() for p in parts))
    return images, labels, parts, digest.hexdigest()[:16]


def _emit(message: dict) -> None:
    print("@@" + json.dumps(message), flush=True)


def _wait() -> bool:
    """Block until the parent says ``go`` (True) or ``stop`` (False)."""
    return sys.stdin.readline().strip() == "go"


# -- the authors' side ---------------------------------------------------------------------------
def _their_structure(net) -> dict:
    import torch

    stages = [getattr(net, f"layer{i}") for i in range(1, 5) if hasattr(net, f"layer{i}")]
    return {"widths": [net.conv1.out_channels, *(stage[0].conv1.out_channels for stage in stages)],
            "steps": [[float(torch.as_tensor(block.step_size).flatten()[0]) for block in stage] for stage in stages]}


def authors_worker(case: dict) -> None:
    """Run the authors' NeFL-toy.py with :data:`PATCHES`, a round at a time as the parent says."""
    import random

    import numpy as np
    import torch

    torch.set_num_threads(case["threads"])
    checkout = Path(case["authors"]).resolve()
    images, labels, parts, digest = bench_data(case["model"], case["mnist"])
    os.chdir(tempfile.mkdtemp(prefix="nefl-authors-"))  # their ./output folder goes here
    sys.path.insert(0, str(checkout))
    import importlib.util

    for name in ("wandb", "torchsummary"):
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = types.ModuleType(name)
    import utils.fed as fed
    import utils.getData as get_data
    import utils.NeFedAvg as nefedavg
    import utils.util as util

    dataset = torch.utils.data.TensorDataset(images, labels)
    get_data.getDataset = lambda args: (dataset, dataset)
    get_data.cifar_iid = lambda data, num_users, seed: {i: set(p.tolist()) for i, p in enumerate(parts)}
    clock = {"tier": None, "start": 0.0, "clients": [], "round": 0}
    structure: list[dict] = []

    def get_logger(*args, **kwargs):  # called once, just before their round loop
        logger = original_logger(*args, **kwargs)
        _emit({"ready": True, "data": digest, "structure": structure})
        if not _wait():
            raise _Stop
        clock["start"] = time.perf_counter()
        return logger

    def extract(*args, **kwargs):
        clock["tier"] = kwargs["model_i"]
        return original_extract(*args, **kwargs)

    def train(self, *args, **kwargs):
        started = time.perf_counter()
        out = original_train(self, *args, **kwargs)
        clock["clients"].append([TIERS[clock["tier"]], time.perf_counter() - started])
        return out

    def aggregate(*args, **kwargs):
        out = original_nefedavg(*args, **kwargs)
        _emit({"round_s": time.perf_counter() - clock["start"], "clients": clock["clients"]})
        clock["clients"], clock["round"] = [], clock["round"] + 1
        if clock["round"] == case["rounds"] or not _wait():
            raise _Stop
        clock["start"] = time.perf_counter()
        return out

    original_logger, original_extract = util.get_logger, util.extract_submodel_weight_from_globalM
    original_train, original_nefedavg = fed.LocalUpdateM.train, nefedavg.NeFedAvg
    util.get_logger, util.extract_submodel_weight_from_globalM = get_logger, extract
    fed.LocalUpdateM.train, nefedavg.NeFedAvg = train, aggregate
    script = checkout / "NeFL-toy.py"
    source = script.read_text(encoding="utf-8")
    if source.count(CPU_LINE) != 1:
        raise SystemExit(f"{script}: the line `{CPU_LINE}` is not there once: not the measured version of the authors' code")
    sys.argv = [str(script), "--model_name", case["model"], "--method", case["method"], "--dataset", "cifar10",
                "--num_users", "5", "--frac", "1", "--min_flex_num", "0", "--max_flex_num", "0", "--local_ep", "1",
                "--local_bs", "32", "--lr", "0.1", "--epochs", str(case["rounds"]), "--num_experiment", "1",
                "--learnable_step", "True", "--pretrained", "", "--wandb", ""]
    namespace = {"__name__": "nefl_toy", "__file__": str(script)}
    exec(compile(source.replace(CPU_LINE, "args.device = 'cpu'"), str(script), "exec"), namespace)
    args = namespace["args"]
    ps, s2d = namespace["get_submodel_info"](args)
    build = namespace[f"{case['model']}wd"]
    structure.extend(_their_structure(build(s2d[i][0], ps[i], True, 10)) for i in range(len(ps)))
    torch.manual_seed(args.rs)  # as their __main__ seeds its first experiment
    np.random.seed(args.rs)
    random.seed(args.rs)
    try:
        namespace["main"]()
    except _Stop:
        pass


# -- nefl-zoo's side -----------------------------------------------------------------------------
def _spec(model: str, method: str) -> dict:
    from nefl_zoo.spec import load_spec

    spec = load_spec(f"{model}/nefl-{method.lower()}").model_dump(mode="json", exclude_none=True)
    spec["model_args"] = {**spec.get("model_args", {}), "img_size": CASES[model]["input"][-1]}
    return spec


def _our_structure(strategy) -> list[dict]:
    out = []
    for tier in TIERS:
        net = strategy.compiled[tier].build()
        steps = [[0.0] * depth for depth in net.stage_depths]
        for s, j, block in net.residual_blocks():
            steps[s][j] = float(block.step.detach()) if block.has_branch else 0.0
        stages = [net.get_submodule(name) for name in net.stage_names]
        out.append({"widths": [net.conv1.out_channels, *(stage[0].conv1.out_channels if hasattr(stage[0], "conv1")
                                                           else stage[0].downsample[0].out_channels for stage in stages)],
                    "steps": steps})
    return out


def ours_worker(case: dict) -> None:
    """nefl-zoo's engine on the same data, a round at a time as the parent says."""
    import torch

    torch.set_num_threads(case["threads"])
    from nefl_zoo.fl.methods import common
    from nefl_zoo.fl.config import parse_config
    from nefl_zoo.data.loading import FederatedData, TensorImages
    from nefl_zoo.fl.engine import Engine

    images, labels, parts, digest = bench_data(case["model"], case["mnist"])
    train = {"local_epochs": 1, "batch_size": 32, "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, "device": "cpu",
             "compile": case["compile"], "memory_format": case["memory_format"], "precision": case["precision"]}
    config = parse_config({"name": "peer", "method": "nefl", "seed": 0, "rounds": case["rounds"], "spec": _spec(case["model"], case["method"]),
                           "clients": {"num_clients": 5, "fraction": 1.0, "environment": "fixed"}, "train": train,
                           "eval": {"every": 10**6}}, "bench_peer")
    engine = Engine(config, Path(tempfile.mkdtemp(prefix="nefl-zoo-")) / "run")
    data = TensorImages(images, labels.numpy())
    engine.data = FederatedData(data, data, data, labels.numpy(), 10, parts)
    clients: list[list] = []
    fit_reply = common.fit_reply

    def timed(local, data, instruction):
        started = time.perf_counter()
        out = fit_reply(local, data, instruction)
        clients.append([instruction.level, time.perf_counter() - started])
        return out

    common.fit_reply = timed
    torch.manual_seed(0)
    engine.state = engine.strategy.init_global_state()
    _emit({"ready": True, "data": digest, "structure": _our_structure(engine.strategy)})
    for r in range(case["rounds"]):
        if not _wait():
            return
        started = time.perf_counter()
        record = engine.run_round(r)
        _emit({"round_s": time.perf_counter() - started, "clients": clients, "compile_s": record.get("compile_s")})
        clients.clear()


# -- the parent: rounds in turn ------------------------------------------------------------------
class Worker:
    """One side in a process of its own (TorchInductor's cache empty, the thread count set)."""

    def __init__(self, name: str, case: dict, logs: Path, cache: str | None = None):
        self.cache = cache or tempfile.mkdtemp(prefix="inductor-")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": self.cache, "OMP_NUM_THREADS": str(case["threads"])}
        self.name, self.log = name, logs / f"{case['model']}-{case['method']}-{name.replace(' ', '-')}.log"
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(case)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True, env=env, cwd=ROOT)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise SystemExit(f"the {self.name} process ended early: see {self.log}")

    def send(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("stop")
            self.proc.wait(timeout=120)


def race(model: str, method: str, args, sides: dict[str, dict], logs: Path) -> dict[str, list[dict]]:
    """Every side's rounds of one case, timed in turn; each result holds ``load`` (1-minute
    load average just before it). The compiled side then starts once more on the TorchInductor
    cache its run filled and trains one round: ``warm`` holds that round (its ``compile_s``)."""
    base = {"model": model, "method": method, "rounds": args.rounds, "threads": args.threads, "mnist": args.mnist,
            "authors": str(args.authors)}
    workers = {name: Worker(name, {**base, **side}, logs) for name, side in sides.items()}
    try:
        ready = {name: w.read() for name, w in workers.items()}
        for name, message in ready.items():
            for key in ("data", "structure"):
                if message[key] != ready["authors"][key]:
                    raise SystemExit(f"{model} {method}: {name}'s {key} differs from the authors' side: {message[key]} "
                                     f"against {ready['authors'][key]}")
        results: dict[str, list[dict]] = {name: [] for name in sides}
        names = list(sides)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                load = os.getloadavg()[0]
                workers[name].send("go")
                results[name].append({**workers[name].read(), "load": load})
            print(f"  {model} {method} round {r + 1}: " + ", ".join(f"{n} {results[n][-1]['round_s']:.1f} s" for n in names),
                  file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    if "compiled" in sides:
        again = Worker("compiled-warm", {**base, **sides["compiled"], "rounds": 1}, logs, cache=workers["compiled"].cache)
        try:
            again.read()
            load = os.getloadavg()[0]
            again.send("go")
            results["warm"] = [{**again.read(), "load": load}]
        finally:
            again.close()
    return results


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report_rounds(cases: dict[tuple[str, str], dict[str, list[dict]]], args) -> None:
    """The per-round, per-tier and summary tables of :func:`race`'s results."""
    ours = [n for n in next(iter(cases.values())) if n not in ("authors", "warm")]
    print(f"\nRounds, {args.threads} thread(s) per side, timed in turn (load: 1-minute load average just before the round; "
          "x: the authors' seconds / nefl-zoo's):\n")
    print(publish.render_row(["case", "round", "authors s", "load", *(c for n in ours for c in (f"{n} s", "load", "x"))]))
    print("|---" * (4 + 3 * len(ours)) + "|")
    for (model, method), results in cases.items():
        for r, theirs in enumerate(results["authors"]):
            cells = [f"{model} NeFL-{method}", str(r + 1), f"{theirs['round_s']:.2f}", f"{theirs['load']:.2f}"]
            for n in ours:
                mine = results[n][r]
                cells += [f"{mine['round_s']:.2f}" + (f" (compile {mine['compile_s']:.0f})" if mine.get("compile_s") else ""),
                          f"{mine['load']:.2f}", f"{theirs['round_s'] / mine['round_s']:.2f}"]
            print(publish.render_row(cells))
    print("\nPer submodel: median seconds of one client's local training (600 or 269-270 images, one epoch), rounds 2 on:\n")
    print(publish.render_row(["case", "submodel", "authors s", *(c for n in ours for c in (f"{n} s", "x"))]))
    print("|---" * (3 + 2 * len(ours)) + "|")
    for (model, method), results in cases.items():
        for tier in TIERS:
            per = {n: _median([s for rec in results[n][1:] for t, s in rec["clients"] if t == tier]) for n in ("authors", *ours)}
            cells = [f"{model} NeFL-{method}", tier, f"{per['authors']:.2f}"]
            for n in ours:
                cells += [f"{per[n]:.2f}", f"{per['authors'] / per[n]:.2f}"]
            print(publish.render_row(cells))
    compiled = next((n for n in ours if n == "compiled"), None)
    print(f"\nSummary: median round, rounds 2 to {args.rounds}" + ("; the compiled side's compilation (its first steps) amortised "
          "over N rounds, x = N x authors / (compile + N x compiled)" if compiled else "") + ":\n")
    header = ["case", "authors s", *(c for n in ours for c in (f"{n} s", "x"))]
    header += ["compile s", "x over 10 rounds", "x over 100 rounds", "x over 500 rounds", "compile s, cache warm"] if compiled else []
    print(publish.render_row([*header, "load range"]))
    print("|---" * (len(header) + 1) + "|")
    for (model, method), results in cases.items():
        med = {n: _median([rec["round_s"] for rec in results[n][1:]]) for n in ("authors", *ours)}
        cells = [f"{model} NeFL-{method}", f"{med['authors']:.2f}"]
        for n in ours:
            cells += [f"{med[n]:.2f}", f"{med['authors'] / med[n]:.2f}"]
        if compiled:
            compile_s = results[compiled][0].get("compile_s") or 0.0
            cells.append(f"{compile_s:.0f}")
            cells += [f"{n_rounds * med['authors'] / (compile_s + n_rounds * med[compiled]):.2f}" for n_rounds in (10, 100, 500)]
            cells.append(f"{results['warm'][0].get('compile_s') or 0.0:.0f}")
        loads = [rec["load"] for recs in results.values() for rec in recs]
        print(publish.render_row([*cells, f"{min(loads):.2f}-{max(loads):.2f}"]))


# -- one step per submodel, in this process ------------------------------------------------------
#: nefl-zoo's ways of taking a step in ``--part steps`` (``--ways`` picks some; eager always runs)
WAYS = {"eager": {}, "channels-last": {"memory_format": "channels_last"}, "compiled": {"compile": True},
        "compiled + channels-last": {"compile": True, "memory_format": "channels_last"},
        "bf16 + channels-last": {"precision": "bf16", "memory_format": "channels_last"}}


def steps(args) -> None:
    """The step table: the authors' module against nefl-zoo's slim module, per submodel, in the
    ways of ``--ways``; then what the core can do, bf16's error and SGD's kernels."""
    import torch

    from nefl_zoo.fl.training.device import Placement
    from nefl_zoo.profile import count_macs
    from nefl_zoo.slim import compile_spec
    from nefl_zoo.spec import parse_spec
    from nefl_zoo.timing import interleaved_median_ms

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(args.authors.resolve()))
    import models as their_models
    from utils.getData import get_submodel_info

    ways = {w: Placement(**WAYS[w]) for w in WAYS if w == "eager" or w in args.ways}
    compiles = any(where.compile for where in ways.values())
    print(f"\nOne training step (batch 32, SGD lr 0.1), median ms of {args.steps} interleaved steps, {args.threads} thread(s); "
          "MACs: one image's forward pass (the authors' module computes its skipped blocks and multiplies them by 0); "
          "GFLOP/s: 3 x 2 x MACs x 32 over the step; x: the authors' ms / the best of nefl-zoo's in fp32:\n")
    print(publish.render_row(["case", "submodel", "authors MMACs", "nefl-zoo MMACs", "authors ms", *(f"{w} ms" for w in ways),
                              *(["compile s"] if compiles else []), "x", "GFLOP/s authors", "GFLOP/s best fp32", "load"]))
    print("|---" * (9 + len(ways) + compiles) + "|")
    optimizer_rows, error_rows, seen = [], [], set()
    for model in args.models:
        x, y = torch.randn(32, *CASES[model]["input"]), torch.randint(0, 10, (32,))
        for method in args.methods:
            ps, s2d = get_submodel_info(argparse.Namespace(model_name=model, method=method, model_num=5))
            spec = compile_spec(parse_spec(_spec(model, method), "spec"))
            for i, tier in enumerate(TIERS):
                if (model, ps[i], json.dumps(s2d[i][0])) in seen:
                    continue  # the same submodel as an earlier method's
                seen.add((model, ps[i], json.dumps(s2d[i][0])))
                theirs = getattr(their_models, f"{model}wd")(s2d[i][0], ps[i], True, 10)
                macs = {"authors": count_macs(theirs, CASES[model]["input"]), "ours": count_macs(spec[tier].build(), CASES[model]["input"])}
                fns = {"authors": _their_step(theirs.train(), x, y)}
                compile_s = {}
                for way, where in ways.items():
                    fns[way] = step_of = _our_step(spec[tier].build(), where, x, y)
                    started = time.perf_counter()
                    step_of()  # compiles
                    compile_s[way] = time.perf_counter() - started
                load = os.getloadavg()[0]
                ms = interleaved_median_ms(fns, rounds=args.steps, warmup_rounds=1)
                best = min(ms[w] for w, where in ways.items() if where.precision == "fp32")
                gflop = {side: 3 * 2 * 32 * m / 1e9 for side, m in macs.items()}  # forward + two backward products
                print(publish.render_row([f"{model} NeFL-{method}", tier, f"{macs['authors'] / 1e6:.1f}", f"{macs['ours'] / 1e6:.1f}",
                                          f"{ms['authors']:.1f}", *(f"{ms[w]:.1f}" for w in ways),
                                          *([f"{max(compile_s.values()):.0f}"] if compiles else []), f"{ms['authors'] / best:.2f}",
                                          f"{gflop['authors'] / ms['authors'] * 1e3:.1f}", f"{gflop['ours'] / best * 1e3:.1f}",
                                          f"{load:.2f}"]), flush=True)
                if tier == "g1" and method == args.methods[0]:
                    optimizer_rows.append((model, _optimizer_ms(spec[tier].build(), x, y, args.steps)))
                    error_rows.append((model, _precision_error(spec[tier].build(), x, y)))
    _core_gflops(args.threads)
    print("\nbf16's error: one step's loss and gradients of the full submodel (batch 32, training mode, just built) against "
          "float64, relative (a gradient: the norm of the difference over the norm; all: every parameter's together), "
          "autocast as train.precision sets it:\n")
    kinds = [f"{p} {what}" for what in ("loss", "gradient, all", "gradient, first layer", "gradient, classifier") for p in ("fp32", "bf16")]
    print(publish.render_row(["model", *kinds]))
    print("|---" * (1 + len(kinds)) + "|")
    for model, err in error_rows:
        print(publish.render_row([model, *(f"{err[k]:.1e}" for k in kinds)]))
    print("\nSGD's kernels on the full submodel: median ms of `optimizer.step()` alone (momentum 0.9, weight decay 5e-4), "
          "interleaved:\n")
    print(publish.render_row(["model", "for-loop ms", "foreach ms", "fused ms"]))
    print("|---|---|---|---|")
    for model, ms in optimizer_rows:
        print(publish.render_row([model, f"{ms['for-loop']:.2f}", f"{ms['foreach']:.2f}", f"{ms['fused']:.2f}"]))


def _core_gflops(threads: int) -> None:
    """What the core can do: the GFLOP/s of a large matrix product in fp32 and bf16."""
    import torch

    from nefl_zoo.timing import interleaved_median_ms

    print(f"\nWhat the core can do: a 2048 x 2048 matrix product, {threads} thread(s), median of 5, "
          f"load {os.getloadavg()[0]:.2f}:\n")
    print("| dtype | GFLOP/s |\n|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        ms = interleaved_median_ms({"mm": lambda: a @ b}, rounds=5, warmup_rounds=1)["mm"]
        print(publish.render_row([str(dtype).removeprefix("torch."), f"{2 * 2048 ** 3 / ms / 1e6:.0f}"]))


def _precision_error(net, x, y) -> dict[str, float]:
    """Relative error of one step's loss and gradients (all, the first layer's, the classifier's)
    in fp32 and under bf16 autocast, against float64."""
    import copy

    import torch
    import torch.nn.functional as F

    def loss_and_grads(module, inputs, dtype=None):
        module = copy.deepcopy(module).train()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(module(inputs), y)
        loss.backward()
        grads = [p.grad.detach().double().flatten() for p in module.parameters()]
        weights = [g for g, p in zip(grads, module.parameters()) if p.dim() > 1]
        return {"loss": loss.detach().double().reshape(1), "gradient, all": torch.cat(grads),
                "gradient, first layer": weights[0], "gradient, classifier": weights[-1]}

    exact = loss_and_grads(copy.deepcopy(net).double(), x.double())
    out = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        for what, value in loss_and_grads(net, x, dtype).items():
            out[f"{name} {what}"] = float((value - exact[what]).norm() / exact[what].norm())
    return out


def _their_step(net, x, y):
    """One SGD step of the authors' module as their ``LocalUpdateM.train`` takes it."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

    def run():
        optimizer.zero_grad()
        F.cross_entropy(net(x)[0], y).backward()
        optimizer.step()

    return run


def _our_step(net, where, x, y):
    """One SGD step of nefl-zoo's slim module as :func:`~nefl_zoo.fl.training.client.fit` takes it on ``where``."""
    import torch

    from nefl_zoo.fl.strategy.local_model import SubmodelLocal
    from nefl_zoo.fl.training.step import MEMORY_FORMATS, LocalForward

    local = SubmodelLocal(net).train().to(memory_format=MEMORY_FORMATS[where.memory_format])
    forward = LocalForward(local, where, len(x))
    optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
    xs = forward.prepare(x)

    def run():
        optimizer.zero_grad()
        with where.autocast():
            loss = forward(xs, y)[0]
        loss.backward()
        optimizer.step()

    return run


def _optimizer_ms(net, x, y, rounds: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from nefl_zoo.timing import interleaved_median_ms

    F.cross_entropy(net(x), y).backward()
    kinds = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    optimizers = {k: torch.optim.SGD(net.parameters(), lr=1e-12, momentum=0.9, weight_decay=5e-4, **kw) for k, kw in kinds.items()}
    return interleaved_median_ms({k: o.step for k, o in optimizers.items()}, rounds=max(rounds, 10) * 3, warmup_rounds=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--authors", type=Path, required=True, help=CHECKOUT_HELP)
    parser.add_argument("--mnist", help="folder holding MNIST/raw (benchmarks/mnist_offline.py writes it); needed for resnet18")
    parser.add_argument("--part", choices=("rounds", "steps"), default="rounds")
    parser.add_argument("--models", default="resnet18,resnet56", help="resnet18 (MNIST), resnet56 (digits)")
    parser.add_argument("--methods", default="W,WD", help="NeFL-W and NeFL-WD (the authors' --method)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per side (rounds 2 on are compared)")
    parser.add_argument("--steps", type=int, default=10, help="--part steps: interleaved steps per way")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"--part steps: nefl-zoo's ways ({', '.join(WAYS)}); eager always")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of every side")
    parser.add_argument("--sides", default=",".join(OURS), help=f"nefl-zoo's sides raced against the authors': {', '.join(OURS)}")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "bench_peer", help="the processes' logs")
    args = parser.parse_args()
    args.models, args.methods, args.ways = args.models.split(","), args.methods.split(","), args.ways.split(",")
    if unknown := set(args.ways) - set(WAYS):
        raise SystemExit(f"--ways: unknown {', '.join(sorted(unknown))}; choose among {', '.join(WAYS)}")
    if not (args.authors / "NeFL-toy.py").is_file() or not (args.authors / "utils" / "NeFedAvg.py").is_file():
        raise SystemExit(f"--authors {args.authors}: no NeFL-toy.py and utils/NeFedAvg.py there; {CHECKOUT_HELP}")
    if args.part == "rounds" and "resnet18" in args.models and not args.mnist:
        raise SystemExit("--mnist DIR is needed for resnet18 (python benchmarks/mnist_offline.py DIR writes it)")
    commit = subprocess.run(["git", "-C", str(args.authors), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"the authors' code: {args.authors} at {commit or 'an unknown commit'}; changed at run time: "
          + "; ".join(PATCHES) + "\n", flush=True)
    if args.part == "steps":
        steps(args)
        return
    args.logs.mkdir(parents=True, exist_ok=True)
    sides = {"authors": {"worker": "authors"}, **{name: {"worker": "ours", **way} for name, way in OURS.items()}}
    sides = {name: sides[name] for name in ["authors", *(s for s in args.sides.split(",") if s != "authors")]}
    cases = {(model, method): race(model, method, args, sides, args.logs) for model in args.models for method in args.methods}
    report_rounds(cases, args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        case = json.loads(sys.argv[2])
        (authors_worker if case["worker"] == "authors" else ours_worker)(case)
    else:
        publish.run("peer", main)

"""The local training step (``nefl_zoo.fl.training.step``): ``train.compile`` (one compilation per
submodel structure, results equal to eager training, a compiled run resumed bit for bit),
``train.memory_format`` and the default step (the same results as before). The runs are
two-round digits runs of a ResNet20 cut to one residual block and two projection shortcuts at
8x8, two tiers. TorchInductor compiles one of them, made once for the file: its clients alone
train in the runs that compare compiled with eager training (each TorchInductor compilation
costs seconds with a warm cache and tens of seconds without); the one compilation per
structure is counted on both tiers through a backend that only counts. The tests that read the
TorchInductor runs are marked ``compile``: ``make test`` leaves them out (tens of seconds on a
fresh machine), ``make test-compile`` and CI run them."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nefl_zoo.fl.training import step
from nefl_zoo.fl.training.batches import shuffled_batches
from nefl_zoo.fl.training.client import fit
from nefl_zoo.fl.config import ConfigError, load_config, parse_config
from nefl_zoo.fl.training.device import Placement, placed
from nefl_zoo.fl.engine import Engine, resume_config
from nefl_zoo.fl.methods.fedprox import ProximalLocal
from nefl_zoo.fl.strategy.local_model import SubmodelLocal

QUICK = "specs/train/digits-quick.yaml"
ONE_BLOCK = [[1, 0, 0], [0, 0, 0], [0, 0, 0]]  # stages 2 and 3 keep only their projection shortcuts
SPEC = {"model": "resnet20", "model_args": {"num_classes": 10, "in_chans": 1, "img_size": 8}, "inconsistent": ["steps", "norm"],
        "tiers": [{"name": "narrow", "gamma_w": 0.25, "steps": ONE_BLOCK}, {"name": "wide", "gamma_w": 1.0, "steps": ONE_BLOCK}]}
# 4 clients of 336 or 337 digits, two per tier every round: 10 batches of 32 and a short one of 16 or 17
TINY = [f"spec={json.dumps(SPEC)}", "clients.num_clients=4", "clients.fraction=1.0", "clients.groups=[[narrow], [wide]]",
        "train.local_epochs=1", "train.momentum=0.9", "data.max_test_samples=50", "eval.bn_batches=1", "eval.every=2",
        "checkpoint_every=1", "rounds=2"]
WIDE = [*TINY, "clients.groups=[[wide]]"]  # every client trains the wide tier: one structure to compile


pytestmark = pytest.mark.usefixtures("one_thread")


def _float64_engine(config, out) -> Engine:
    """An engine whose images (training, BN recompute, test) are float64."""
    engine = Engine(config, out)
    for images in {id(d): d for d in (engine.data.train, engine.data.train_eval, engine.data.test)}.values():
        images = getattr(images, "dataset", images)
        images.images = images.images.double()
    return engine


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """In float64, every client on the wide tier: eager and compiled straight runs of two rounds,
    and a compiled run stopped after round 1 then resumed with the compiled steps forgotten (as
    a new process would)."""
    folder = tmp_path_factory.mktemp("compiled")
    default, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    try:
        step.clear_compiled()
        eager = _float64_engine(load_config(QUICK, WIDE), folder / "eager")
        eager.run()
        compiled = _float64_engine(load_config(QUICK, [*WIDE, "train.compile=true"]), folder / "compiled")
        compiled.run()
        _float64_engine(load_config(QUICK, [*WIDE, "train.compile=true", "rounds=1"]), folder / "resumed").run()
        step.clear_compiled()
        before = step.compile_stats.structures
        data = resume_config(folder / "resumed").to_dict()
        data["rounds"] = 2
        resumed = _float64_engine(parse_config(data, "resumed"), folder / "resumed")
        resumed.run(resume=True)
        recompiled = step.compile_stats.structures - before
    finally:
        torch.set_default_dtype(default)
        torch.set_num_threads(threads)
    records = {name: _records(folder / name) for name in ("eager", "compiled")}
    return SimpleNamespace(eager=eager, compiled=compiled, resumed=resumed, recompiled=recompiled, records=records)


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.compile
def test_compiled_training_equals_eager_training_to_float64_rounding(runs):
    """Two rounds of four clients, SGD with momentum, BN statistics and learnable step sizes."""
    eager, compiled = runs.eager.state, runs.compiled.state
    assert next(v for v in eager.values() if v.is_floating_point()).dtype == torch.float64
    assert eager.keys() == compiled.keys()
    assert any(not torch.equal(compiled[k], e) for k, e in eager.items())  # another program's arithmetic...
    for k, e in eager.items():  # ... the same result
        if e.is_floating_point():
            assert float((compiled[k] - e).abs().max()) <= 1e-10 * max(float(e.abs().max()), 1.0), k
        else:
            assert torch.equal(compiled[k], e), k
    losses = {name: [r["train_loss"] for r in records] for name, records in runs.records.items()}
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-12)
    assert [r["tiers"] for r in runs.records["compiled"]] == [{"wide": 4}] * 2


def test_each_tier_structure_compiles_once_for_every_client_and_round(tmp_path, monkeypatch):
    """Two tiers, two clients of each per round, two rounds, each client's short last batch
    eager: two graphs (TorchDynamo's, through a backend that counts them and runs them as they
    are); the compile time is in round 1's record and round 2 compiles nothing."""
    counted = []
    monkeypatch.setattr(step, "BACKEND", lambda graph, inputs: counted.append(1) or graph.forward)
    step.clear_compiled()
    before = step.compile_stats.structures
    engine = Engine(load_config(QUICK, [*TINY, "train.compile=true", "eval.every=10"]), tmp_path / "run")
    engine.run()
    step.clear_compiled()
    assert any(len(engine.data.client_dataset(c)) % engine.config.train.batch_size for c in range(4))
    records = _records(tmp_path / "run")
    assert [r["tiers"] for r in records] == [{"narrow": 2, "wide": 2}] * 2
    assert (len(counted), step.compile_stats.structures - before) == (2, 2)  # graphs compiled, structures
    assert records[0]["compile_s"] > 0 and records[1]["compile_s"] == 0.0


@pytest.mark.compile
def test_an_eager_run_records_no_compile_time(runs):
    assert all("compile_s" not in r for r in runs.records["eager"])


@pytest.mark.compile
def test_a_compiled_run_resumed_is_bit_identical(runs):
    assert runs.recompiled == 1  # the resumed run compiled its own step
    straight, resumed = runs.compiled.state, runs.resumed.state
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


# -- without compiling --------------------------------------------------------------------------
def _client(tmp_path, *overrides):
    engine = Engine(load_config(QUICK, [*TINY, *overrides]), tmp_path / "run")
    torch.manual_seed(0)
    cid, instruction = next(iter(engine.strategy.configure_train(1, engine.strategy.init_global_state(), engine.clients).items()))
    return engine, instruction, engine.data.client_dataset(cid)


def test_the_default_step_is_the_plain_sgd_loop_bit_for_bit(tmp_path):
    """``fit`` at the default settings (eager, contiguous layout) against the loop written out
    with SGD's per-tensor implementation, in float32: SGD's fused kernel would fail this (it
    rounds momentum's multiply-add once)."""
    engine, instruction, data = _client(tmp_path, "train.weight_decay=0.001")
    trained = fit(engine.strategy.local_model(instruction), data, instruction.config)
    local = engine.strategy.local_model(instruction)
    config = instruction.config
    optimizer = torch.optim.SGD(local.parameters(), lr=config["lr"], momentum=config["momentum"],
                                weight_decay=config["weight_decay"], foreach=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config["seed"])
        local.train()
        for x, y in shuffled_batches(data, config["batch_size"], config["seed"], config["local_epochs"], min_batch=config["min_batch"]):
            optimizer.zero_grad()
            F.cross_entropy(local(x), y).backward()
            optimizer.step()
    assert all(torch.equal(trained.state[k], v) for k, v in local.state().items())
    assert "compile_s" not in trained.metrics


def test_channels_last_training_equals_contiguous_to_float64_rounding(tmp_path):
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        engine, instruction, data = _client(tmp_path)
        engine.data.train.images = engine.data.train.images.double()
        results = {}
        for layout in ("contiguous", "channels_last"):
            with placed(Placement(memory_format=layout)):
                results[layout] = fit(engine.strategy.local_model(instruction), data, instruction.config)
    finally:
        torch.set_default_dtype(default)
    plain, nhwc = results["contiguous"].state, results["channels_last"].state
    assert all(v.is_contiguous() for v in nhwc.values())  # returned in the usual layout
    for k, v in plain.items():
        assert float((nhwc[k] - v).abs().max()) <= 1e-10 * max(float(v.abs().max()), 1.0), k


def test_a_client_whose_loss_is_not_pure_trains_eagerly_said_once(tmp_path, caplog):
    engine, instruction, data = _client(tmp_path)
    before = step.compile_stats.structures
    step._said.clear()
    with placed(Placement(compile=True)), caplog.at_level(logging.WARNING, logger="nefl_zoo.fl.training.step"):
        for _ in range(2):
            result = fit(ProximalLocal(engine.strategy.local_model(instruction), 0.1), data, {**instruction.config, "local_epochs": 1})
    assert step.compile_stats.structures == before and "compile_s" not in result.metrics
    assert [r.getMessage() for r in caplog.records] == [
        "train.compile: clients train eagerly, not compiled: its client model (ProximalLocal) has a loss that is not a pure "
        "function of its tensors"]


def test_every_structure_compiles_its_own_function_beyond_torchdynamos_recompilation_limit(monkeypatch):
    """Nine structures (linear models of nine widths), one more than TorchDynamo recompiles one
    function for, through a backend that only counts (TorchDynamo traces, nothing is compiled):
    one graph each, and the ninth still runs compiled, not eagerly."""
    counted = []
    monkeypatch.setattr(step, "BACKEND", lambda graph, inputs: counted.append(1) or graph.forward)
    step.clear_compiled()
    x, y = torch.randn(32, 1, 8, 8), torch.arange(32) % 10
    assert torch._dynamo.config.recompile_limit == 8
    for width in range(1, 10):
        local = SubmodelLocal(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, width), torch.nn.Linear(width, 10))).train()
        forward = step.LocalForward(local, Placement(compile=True), 32)
        for call in range(2):  # the second batch reuses the graph
            assert forward.compiles(x) == (call == 0)
            loss, _ = forward(x, y)
        assert float(loss.detach()) == pytest.approx(float(local.loss(x, y)[0].detach()), rel=1e-6)
    assert len(counted) == 9
    step.clear_compiled()


def test_compile_with_batched_clients_and_an_unknown_memory_format_are_one_line_errors():
    base = load_config(QUICK, TINY).model_dump()
    for train, field, words in (({"compile": True, "parallel_clients": 4}, "train", "set parallel_clients: 1 or compile: false"),
                                ({"memory_format": "nhwc"}, "train.memory_format", "'contiguous' or 'channels_last'")):
        with pytest.raises(ConfigError) as error:
            parse_config({**base, "train": {**base["train"], **train}}, "run.yaml")
        assert error.value.field == field and words in error.value.message and "\n" not in str(error.value)

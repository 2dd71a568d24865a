"""Accelerators and batched clients (issue 22): ``train.device``, ``train.precision``,
device-resident batches and ``train.parallel_clients``, all checked on the CPU."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from typer.testing import CliRunner

from cli.app import app
from nefl_zoo.fl.training import parallel as batched
from nefl_zoo.fl.training.batches import ordered_batches, shuffled_batches
from nefl_zoo.fl.training.bn import recompute_bn
from nefl_zoo.fl.training.client import fit, training_batches
from nefl_zoo.fl.config import load_config, parse_config
from nefl_zoo.fl.training.device import DeviceError, Placement, gpu_share, placed, resolve_device
from nefl_zoo.fl.engine import Engine, resume_config
from nefl_zoo.fl.methods.fedprox import ProximalLocal
from nefl_zoo.fl.strategy.local_model import SubmodelLocal

QUICK = "specs/train/digits-quick.yaml"
# 40 clients of 33 or 34 digits: batches of 32 then 1 (skipped) or 2, so clients of one tier
# have unequal last batches; lr 0.05 keeps one round's training well-conditioned (see below)
SMALL = ["clients.num_clients=40", "clients.fraction=0.1", "train.local_epochs=1", "spec.model_args.img_size=8",
         "train.lr=0.05", "train.momentum=0.5", "train.weight_decay=0.0005", "train.grad_clip=2.0",
         "clients.groups=[[g0.4], [g1]]", "data.max_test_samples=50", "eval.bn_batches=1"]
GPU = torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(tmp_path: Path, *overrides: str) -> Engine:
    return Engine(load_config(QUICK, [*SMALL, *overrides]), tmp_path / "run")


def _round(engine: Engine) -> dict[str, torch.Tensor]:
    """The global state after round 1 from the seeded initial state (no files written)."""
    torch.manual_seed(engine.config.seed)
    engine.state = engine.strategy.init_global_state()
    engine.run_round(0)
    return engine.state


# -- devices --------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpus, mps", [(2, False), (0, True), (0, False)])
def test_device_names_resolve_against_what_the_machine_has(monkeypatch, gpus, mps):
    """The machine faked: ``gpus`` CUDA GPUs, Apple's MPS or not (no device is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert resolve_device("auto") == torch.device("cuda" if gpus else "mps" if mps else "cpu")
    if gpus:
        assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cuda") == torch.device("cuda")
        with pytest.raises(DeviceError, match=r"^cuda:2 asked for, but this machine has 2 CUDA GPU\(s\), cuda:0 to cuda:1$"):
            resolve_device("cuda:2")
    else:
        with pytest.raises(DeviceError, match=r"^cuda asked for, but this machine has no CUDA GPU \(use auto or cpu\)$"):
            resolve_device("cuda")
    if mps:
        assert resolve_device("mps") == torch.device("mps")
    else:
        with pytest.raises(DeviceError, match=r"^mps asked for, but Apple's MPS is not available on this machine \(use auto or cpu\)$"):
            resolve_device("mps")


def test_device_names_resolve_and_an_absent_device_is_refused():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cuda", "mps", "cpu")
    with pytest.raises(DeviceError, match=r"^cuda:7 asked for, but this machine has (no CUDA GPU|\d+ CUDA GPU)"):
        resolve_device("cuda:7")
    with pytest.raises(ValueError, match=r"train\.device: expected auto, cpu, cuda, cuda:N or mps, got 'tpu'"):
        parse_config({**load_config(QUICK).to_dict(), "train": {"device": "tpu"}}, "x.yaml")


@pytest.mark.skipif(GPU, reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_a_one_line_cli_error(tmp_path):
    result = CliRunner().invoke(app, ["train", QUICK, "-o", str(tmp_path / "run"), "--set", "train.device=cuda", "--quiet"])
    assert result.exit_code == 2
    assert result.output == f"error: {QUICK}: train.device: cuda asked for, but this machine has no CUDA GPU (use auto or cpu)\n"
    assert not (tmp_path / "run").exists()


def test_gpu_share_splits_the_gpus_over_the_clients_training_at_once():
    assert gpu_share("cuda", 1, 4) == 0.25
    assert gpu_share("cuda", 2, 8) == 0.25
    assert gpu_share("cuda", 2, 1) == 1.0
    assert gpu_share("cpu", 0, 4) == 0.0 and gpu_share("mps", 1, 4) == 0.0


def test_batches_models_and_anchors_go_to_the_placement_device(tmp_path):
    """Plumbing on the meta device (shapes only): both batch paths deliver there, BN recompute
    moves the net there, and FedProx's anchors move with its model."""
    data = _engine(tmp_path).data
    for dataset in (data.client_dataset(0), data.test, data.train_eval):
        x, y = next(iter(shuffled_batches(dataset, 8, 0, 1, "meta")))
        assert x.device.type == y.device.type == "meta" and x.shape == (8, 1, 8, 8)
    x, _ = next(iter(ordered_batches(data.client_dataset(0), 8, "meta")))  # augmented: the DataLoader path
    assert x.device.type == "meta"
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU())  # BatchNorm reads a count back: not on meta
    with placed(Placement(torch.device("meta"))):
        recompute_bn(net, [(torch.zeros(4, 1, 8, 8), None)])
    assert {t.device.type for t in net.parameters()} == {"meta"}
    proximal = ProximalLocal(SubmodelLocal(torch.nn.Linear(3, 2)), 0.1).to("meta")
    assert {t.device.type for t in proximal.buffers()} == {"meta"}


# -- device-resident batches and precision ---------------------------------------------------------
def test_resident_batches_are_the_dataloaders_bit_for_bit(tmp_path):
    """Digits are cropped on the device tensors with the DataLoader's shuffling and crop offsets."""
    data = _engine(tmp_path).data
    for dataset in (data.client_dataset(3), data.train_eval):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            loader = DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(9))
            expected = [batch for _ in range(2) for batch in loader]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            got = list(shuffled_batches(dataset, 16, 9, 2))
        assert len(got) == len(expected) > 4
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, expected))
    plain = [x for x, _ in DataLoader(data.test, batch_size=16)]
    assert all(torch.equal(a, b) for a, (b, _) in zip(plain, ordered_batches(data.test, 16)))


def test_an_epochs_small_last_batch_is_dropped_or_merged_without_moving_the_other_batches(tmp_path):
    dataset = _engine(tmp_path).data.client_dataset(3)
    n, last = len(dataset), len(dataset) % 16
    assert last and n // 16 >= 2

    def draw(batch_size=16, **rule):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            return [y for _, y in shuffled_batches(dataset, batch_size, 9, 2, **rule)], torch.rand(1)

    def same(xs, ys):
        return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))

    every, after = draw()  # min_batch 1: the DataLoader's batches
    per_epoch = len(every) // 2
    assert [len(y) for y in every] == ([16] * (per_epoch - 1) + [last]) * 2
    assert same(draw(min_batch=last)[0], every)
    dropped, after_drop = draw(min_batch=last + 1)
    assert same(dropped, [y for i, y in enumerate(every) if i % per_epoch != per_epoch - 1])
    assert torch.equal(after_drop, after)  # the dropped batch was still drawn: the same RNG stream after it
    merged, after_merge = draw(min_batch=last + 1, merge=True)
    assert [len(y) for y in merged] == ([16] * (per_epoch - 2) + [16 + last]) * 2
    assert same(merged, [*every[:per_epoch - 2], torch.cat(every[per_epoch - 2:per_epoch]),
                         *every[per_epoch:-2], torch.cat(every[-2:])])
    assert torch.equal(after_merge, after)
    # an epoch that is one small batch is dropped, merged or not
    assert draw(n, min_batch=n + 1)[0] == [] and draw(n, min_batch=n + 1, merge=True)[0] == []
    assert [len(y) for y in draw(n, min_batch=n)[0]] == [n, n]


def test_an_instruction_without_the_last_batch_rule_gets_the_configs_defaults(tmp_path):
    """An instruction from a server that predates ``min_batch`` / ``last_batch`` trains as the
    defaults say: here the 1-image last batch of a 33-image client is still dropped."""
    engine = _engine(tmp_path)
    instruction = next(iter(engine.strategy.configure_train(1, engine.strategy.init_global_state(), engine.clients).values()))
    cid = next(c for c in range(engine.config.clients.num_clients) if len(engine.data.client_dataset(c)) % 32 == 1)
    dataset, config = engine.data.client_dataset(cid), instruction.config
    assert (config["min_batch"], config["last_batch"]) == (2, "drop")
    older = {k: v for k, v in config.items() if k not in ("min_batch", "last_batch")}

    def sizes(cfg):
        with torch.random.fork_rng(devices=[]):
            return [len(y) for _, y in training_batches(dataset, cfg, torch.device("cpu"))]

    assert sizes(older) == sizes(config) == [32] * int(config["local_epochs"])
    assert sizes({**config, "min_batch": 1}) == [32, 1] * int(config["local_epochs"])


def _reference_fit(local, dataset, config) -> dict[str, torch.Tensor]:
    """Local training as it was before devices and precisions (the DataLoader loop)."""
    seed = int(config["seed"])
    params = [p for p in local.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=config["lr"], momentum=config["momentum"], weight_decay=config["weight_decay"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loader = DataLoader(dataset, batch_size=int(config["batch_size"]), shuffle=True, generator=torch.Generator().manual_seed(seed))
        local.train()
        for _ in range(int(config["local_epochs"])):
            for x, y in loader:
                if len(y) < 2:
                    continue
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(local(x), y).backward()
                torch.nn.utils.clip_grad_norm_(params, config["grad_clip"])
                optimizer.step()
    return {k: v.detach() for k, v in local.net.state_dict().items()}


def test_fp32_is_unchanged_and_bf16_trains_on_the_cpu(tmp_path):
    engine = _engine(tmp_path)
    torch.manual_seed(0)
    instructions = engine.strategy.configure_train(1, engine.strategy.init_global_state(), engine.clients)
    cid, instruction = next(iter(instructions.items()))
    data = engine.data.client_dataset(cid)
    expected = _reference_fit(engine.strategy.local_model(instruction), data, instruction.config)
    fp32 = fit(engine.strategy.local_model(instruction), data, instruction.config)
    assert all(torch.equal(fp32.state[k], expected[k]) for k in expected)
    with placed(Placement(torch.device("cpu"), "bf16")):
        bf16 = fit(engine.strategy.local_model(instruction), data, instruction.config)
    assert bf16.state.keys() == fp32.state.keys() and bf16.state["conv1.weight"].dtype == torch.float32
    assert all(bool(torch.isfinite(v).all()) for v in bf16.state.values() if v.is_floating_point())
    assert not torch.equal(bf16.state["conv1.weight"], fp32.state["conv1.weight"])  # autocast did run
    assert abs(bf16.metrics["loss"] - fp32.metrics["loss"]) < 0.05


# -- batched clients ------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["nefl", "heterofl", "fedavg"])
def test_batched_clients_equal_sequential_ones(tmp_path, method, monkeypatch):
    """One round with its clients trained together equals the sequential round within 1e-5
    relative (per tensor, max |a - b| / max |b|); at least one group has 2 or more clients."""
    sizes = []
    real = batched.fit_together
    monkeypatch.setattr(batched, "fit_together", lambda locals_, *a: sizes.append(len(locals_)) or real(locals_, *a))
    sequential = _round(_engine(tmp_path, f"method={method}"))
    together = _round(_engine(tmp_path, f"method={method}", "train.parallel_clients=4"))
    assert sizes and max(sizes) >= 2
    assert sequential.keys() == together.keys()
    for k, b in sequential.items():
        a = together[k]
        if not b.is_floating_point():
            assert torch.equal(a, b), k
        else:
            assert float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1e-12), k


def test_a_method_that_cannot_batch_says_so_once_and_trains_sequentially(tmp_path, caplog):
    batched._said.clear()
    sequential = _round(_engine(tmp_path, "method=fedprox"))
    with caplog.at_level(logging.WARNING, logger="nefl_zoo.fl.training.parallel"):
        together = _round(_engine(tmp_path, "method=fedprox", "train.parallel_clients=4"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["fedprox: clients train one at a time, not batched: its client model (ProximalLocal) has a loss "
                     "that is not a pure function of its tensors"]
    assert all(torch.equal(together[k], sequential[k]) for k in sequential)


# -- resume ----------------------------------------------------------------------------------------
def test_resume_after_a_device_change_is_bit_identical(tmp_path):
    common = [*SMALL, "rounds=2", "checkpoint_every=1", "eval.every=2", "clients.fraction=0.05"]
    straight = Engine(load_config(QUICK, [*common, "train.device=cpu"]), tmp_path / "straight")
    straight.run()
    first = Engine(load_config(QUICK, [*common, "train.device=auto", "rounds=1"]), tmp_path / "resumed")
    first.run()
    data = resume_config(tmp_path / "resumed").to_dict()
    data["rounds"], data["train"]["device"] = 2, "cpu"
    resumed = Engine(parse_config(data, "resumed"), tmp_path / "resumed")
    resumed.run(resume=True)
    assert resumed.state.keys() == straight.state.keys()
    assert all(torch.equal(resumed.state[k], straight.state[k]) for k in straight.state)
    assert all(v.device.type == "cpu" for v in resumed.state.values())


# every shipped training config on digits whose method trains batched clients (digits-aligned is
# digits-aligned-quick for longer; digits-edge's MobileNetV2 uses dropout and trains one client at a
# time; the cifar10 configs need CIFAR-10), one round of one local epoch at its own learning rate,
# half the clients per round so that tiers have groups of two or more. Each config once, NeFL and
# HeteroFL both (FedAvg's batched round is test_batched_clients_equal_sequential_ones's), and
# digits-quick with merged last batches too
SHIPPED = [("digits-quick", "heterofl", []), ("digits-quick", "nefl", ["train.last_batch=merge", "train.min_batch=16"]),
           ("digits-aligned-quick", "nefl", []), ("digits-table1", "nefl", []),
           ("digits-compare", "nefl", []), ("digits-compare-noniid", "heterofl", [])]


def at_8x8(name: str) -> str:
    """The override that runs config ``name`` on 8x8 digits (their own size; the 16x16 configs do
    a quarter of the work): its spec, inline or the file it names, with ``img_size`` 8."""
    spec = load_config(f"specs/train/{name}.yaml").submodel_spec().model_dump(mode="json", exclude_unset=True)
    return "spec=" + json.dumps({**spec, "model_args": {**spec["model_args"], "img_size": 8}})


@pytest.mark.parametrize("name,method,extra", SHIPPED, ids=[f"{n}-{m}" + "".join(f"-{x.split('=')[1]}" for x in e) for n, m, e in SHIPPED])
def test_batched_clients_equal_sequential_ones_in_float64_on_every_shipped_config(tmp_path, name, method, extra, monkeypatch):
    """In float64 the batched round equals the sequential one to 1e-6 of the round's own update
    per tensor on every shipped digits config: the batched arithmetic is the sequential one,
    partial groups and short (or merged) last batches included. In float32 they differ further,
    as the sequential run at 1 and at 2 threads does (another summation order, amplified by
    training; docs/benchmarks/batched_order.md)."""
    sizes = []
    real = batched.fit_together
    monkeypatch.setattr(batched, "fit_together", lambda locals_, *a: sizes.append(len(locals_)) or real(locals_, *a))
    overrides = ["rounds=1", "clients.fraction=0.5", "train.local_epochs=1", f"method={method}", *extra, at_8x8(name)]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        states = {}
        for parallel in (1, 4):
            engine = Engine(load_config(f"specs/train/{name}.yaml", [*overrides, f"train.parallel_clients={parallel}"]), tmp_path / f"p{parallel}")
            engine.data.train.images = engine.data.train.images.double()
            torch.manual_seed(engine.config.seed)
            states["init"] = engine.state = engine.strategy.init_global_state()
            engine.run_round(0)
            states[parallel] = engine.state
    finally:
        torch.set_default_dtype(default)
    batch = engine.config.train.batch_size
    assert max(sizes) >= 2 and min(sizes) < 4, sizes  # groups trained together, one of them partial
    assert any(len(engine.data.client_dataset(c)) % batch for c in range(engine.config.clients.num_clients))
    assert next(v for v in states[1].values() if v.is_floating_point()).dtype == torch.float64
    for k, b in states[1].items():
        a, update = states[4][k], (b - states["init"][k]).abs().max() if b.is_floating_point() else None
        if update is None:
            assert torch.equal(a, b), k
        else:
            assert float((a - b).abs().max()) <= 1e-6 * max(float(update), 1e-12), k


# -- batched clients, unit by unit ----------------------------------------------------------------
def _float64_clients(tmp_path, *overrides):
    """An engine whose images are float64 (with the ``float64`` fixture's default dtype) and the
    round-1 train instructions of its largest tier."""
    engine = _engine(tmp_path, *overrides)
    engine.data.train.images = engine.data.train.images.double()
    torch.manual_seed(engine.config.seed)
    instructions = engine.strategy.configure_train(1, engine.strategy.init_global_state(), engine.clients)
    level = max(i.level for i in instructions.values())
    return engine, [i for i in instructions.values() if i.level == level]


@pytest.fixture
def float64():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


def test_fit_together_gives_each_client_what_fit_gives_it(tmp_path, float64):
    """Clients of 40, 35 and 1 samples (batches 32 + 8, 32 + 3 and 1): partial groups at every
    step, momentum carried over a partial group, clipping active; states, mean loss and
    accuracy (over the samples each client saw) equal sequential training in float64 to 1e-12."""
    engine, instructions = _float64_clients(tmp_path, "train.momentum=0.9", "train.grad_clip=0.05", "train.min_batch=1")
    instruction = instructions[0]
    train = engine.data.client_dataset(engine.clients[0].cid).dataset
    configs = [{**instruction.config, "seed": seed} for seed in (5, 6, 7)]
    # the one-sample client holds a sample its first step gets right: its accuracy is 1 / 1
    right = next(i for i in range(100) if fit(engine.strategy.local_model(instruction), torch.utils.data.Subset(train, [i]),
                                              configs[2]).metrics["accuracy"] == 1.0)
    datasets = [torch.utils.data.Subset(train, range(40)), torch.utils.data.Subset(train, range(40, 75)), torch.utils.data.Subset(train, [right])]
    together = batched.fit_together([engine.strategy.local_model(instruction) for _ in datasets], datasets, configs)
    for result, dataset, config in zip(together, datasets, configs):
        alone = fit(engine.strategy.local_model(instruction), dataset, config)
        assert result.num_samples == alone.num_samples == len(dataset)
        assert result.metrics["accuracy"] == alone.metrics["accuracy"]
        assert result.metrics["loss"] == pytest.approx(alone.metrics["loss"], rel=1e-12)
        for k, b in alone.state.items():  # equal to rounding (7e-16 here): a clipping off by 2e-6 / norm shows
            assert float((result.state[k] - b).abs().max()) <= 1e-12 * max(float(b.abs().max()), 1.0), k
    assert together[2].metrics["accuracy"] == 1.0 and 0.0 < together[0].metrics["accuracy"] < 1.0


def test_clients_train_together_only_with_equal_hyperparameters(tmp_path, float64, monkeypatch):
    engine, instructions = _float64_clients(tmp_path, "clients.fraction=0.5")
    a, b, c, *_ = instructions
    b.config, c.config = {**b.config, "lr": 0.01}, {**c.config, "local_epochs": 2}
    cids = {0: a, 1: b, 2: c}
    data_of = lambda cid: engine.data.client_dataset(cid)  # noqa: E731
    groups = []
    real = batched.fit_together
    monkeypatch.setattr(batched, "fit_together", lambda locals_, *rest: groups.append(len(locals_)) or real(locals_, *rest))
    replies = batched.train_clients(engine.strategy, cids, data_of, lambda cid: None, parallel=4)
    assert groups == []  # three groups of one: each trains alone with its own config
    for cid, instruction in cids.items():
        alone = fit(engine.strategy.local_model(instruction), data_of(cid), instruction.config).reply(instruction.level)
        assert all(torch.equal(replies[cid].arrays[k], v) for k, v in alone.arrays.items())


class _DoubledLoss(SubmodelLocal):
    """Batchable, the same tensors as :class:`SubmodelLocal`, another loss."""

    def loss(self, x, y):
        loss, logits = super().loss(x, y)
        return 2 * loss, logits


class _Stub:
    """A strategy whose clients are a model with dropout, a FedProx client, one without a local
    model, and two batchable ones whose tensors match but whose losses differ."""

    name = "stub"

    def __init__(self, dropout_local, prox_local, plain, doubled):
        self.locals = {0: dropout_local, 1: prox_local, 2: None, 3: plain, 4: doubled}

    def local_model(self, instruction):
        return self.locals[instruction.config["cid"]]


def test_clients_that_cannot_batch_train_alone_each_reason_said_once(tmp_path, float64, caplog):
    engine, instructions = _float64_clients(tmp_path)
    instruction = instructions[0]
    plain = engine.strategy.local_model(instruction)
    dropout = SubmodelLocal(torch.nn.Sequential(plain.net, torch.nn.Dropout(0.1)))
    prox = ProximalLocal(engine.strategy.local_model(instruction), 0.1)
    doubled = _DoubledLoss(engine.strategy.local_model(instruction).net)
    stub = lambda: _Stub(dropout, prox, engine.strategy.local_model(instruction), doubled)  # noqa: E731
    called = []
    batched._said.clear()
    cids = {cid: type(instruction)(instruction.arrays, {**instruction.config, "cid": cid}, instruction.level) for cid in range(5)}
    with caplog.at_level(logging.WARNING, logger="nefl_zoo.fl.training.parallel"):
        replies = batched.train_clients(stub(), cids, engine.data.client_dataset, lambda cid: called.append(cid) or "own", 4)
        batched.train_clients(stub(), cids, engine.data.client_dataset, lambda cid: "own", 4)
    assert called == [2] and replies[2] == "own"  # only the client without a local model: the method's own step
    assert replies[1].num_samples == len(engine.data.client_dataset(1))
    for cid, local in ((3, engine.strategy.local_model(instruction)), (4, _DoubledLoss(engine.strategy.local_model(instruction).net))):
        alone = fit(local, engine.data.client_dataset(cid), cids[cid].config).reply(instruction.level)
        assert all(torch.equal(replies[cid].arrays[k], v) for k, v in alone.arrays.items()), cid  # not trained as one group
    assert [r.getMessage() for r in caplog.records] == [
        "stub: clients train one at a time, not batched: its client model uses dropout (random per batch)",
        "stub: clients train one at a time, not batched: its client model (ProximalLocal) has a loss that is not a pure function of its tensors",
        "stub: clients train one at a time, not batched: its client step is not plain local training"]

"""The simulation engine: learning on digits, step sizes, bytes, and the nested baselines' parts
(resume and two rounds of every method: tests/test_method_contract.py)."""

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from nefl_zoo.fl.training.client import evaluate
from nefl_zoo.data.loading import load_data
from nefl_zoo.fl.engine import Engine, client_groups
from nefl_zoo.fl.methods.fjord import nested_entry
from nefl_zoo.fl.methods.common import with_bn
from nefl_zoo.slim import compile_spec, tier_key

from .conftest import records, tiny

torch.set_num_threads(1)


def test_nefl_beats_chance_on_every_submodel_and_writes_run_dir(tmp_path):
    result = Engine(tiny(rounds=3, eval__every=3), tmp_path).run()
    assert set(result.acc) == {"g0.25", "g0.5", "g1"}
    assert all(acc > 0.3 for acc in result.acc.values()), result.acc  # chance is 0.1
    assert result.worst_case == "g0.25" and result.worst == result.acc["g0.25"] and result.min == min(result.acc.values())
    for name in ("spec.yaml", "config.yaml", "global.safetensors", "metrics.jsonl", "metrics.csv", "checkpoint.json"):
        assert (tmp_path / name).exists(), name
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3]
    assert set(records[-1]["acc"]) == set(result.acc)
    csv = (tmp_path / "metrics.csv").read_text().splitlines()
    assert len(csv) == 4 and csv[0].endswith("worst,avg,min,acc_g0.25,acc_g0.5,acc_g1")


def test_worst_is_the_smallest_submodel_not_the_minimum(tmp_path, monkeypatch):
    """The NeFL paper's "Worst" is the worst-case (smallest) submodel; when a larger one is weaker,
    the minimum is its own column."""
    engine = Engine(tiny(rounds=1, eval__every=1, eval__bn_both=False), tmp_path)
    monkeypatch.setattr(engine.strategy, "evaluate", lambda *a: {"g0.25": 0.75, "g0.5": 0.25, "g1": 0.5, "recompute/g1": 0.125})
    result = engine.run()
    assert (result.worst, result.avg, result.min, result.worst_case) == (0.75, 0.5, 0.25, "g0.25")
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert (record["worst"], record["avg"], record["min"]) == (0.75, 0.5, 0.25)
    header, row = (line.split(",") for line in (tmp_path / "metrics.csv").read_text().splitlines())
    assert [row[header.index(c)] for c in ("worst", "avg", "min")] == ["0.75", "0.5", "0.25"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["worst"], summary["min"], summary["worst_case"]) == (0.75, 0.25, "g0.25")


def test_learned_step_sizes_reach_the_global_state(tmp_path):
    engine = Engine(tiny(rounds=1, eval__every=1), tmp_path)
    engine.run()
    state = load_file(str(tmp_path / "global.safetensors"))
    steps = {k: float(v) for k, v in state.items() if ".step@" in k}
    assert steps and any(abs(v - 1.0) > 1e-4 for v in steps.values()), steps


def test_frozen_step_sizes_stay_fixed(tmp_path):
    spec = tiny().spec | {"tiers": [{"name": "g0.5", "gamma_w": 0.5, "learnable_steps": False}, {"name": "g1", "gamma_w": 1.0, "learnable_steps": False}]}
    Engine(tiny(rounds=1, spec=spec), tmp_path).run()
    state = load_file(str(tmp_path / "global.safetensors"))
    assert all(float(v) == 1.0 for k, v in state.items() if ".step@" in k)


def test_communication_is_the_submodel_size(tmp_path):
    """Fixed environment, 3 clients: one per submodel; each moves its submodel, not the global model."""
    engine = Engine(tiny(rounds=1, clients__environment="fixed", clients__num_clients=3), tmp_path)
    engine.run()
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    compiled = engine.strategy.compiled
    itemsize = {k: torch.empty((), dtype=d).element_size() for k, d in compiled.full_dtypes.items()}
    sizes = [sum(e.numel * itemsize[k] for k, e in compiled[t].slice_map.items()) for t in ("g0.25", "g0.5", "g1")]
    assert record["tiers"] == {"g0.25": 1, "g0.5": 1, "g1": 1}
    assert record["bytes_down"] == record["bytes_up"] == sum(sizes)
    assert sizes[0] < sizes[1] < sizes[2]


def test_dynamic_environment_is_the_papers():
    levels = ["g0.2", "g0.4", "g0.6", "g0.8", "g1"]
    groups = client_groups(tiny(), levels)
    assert groups == [levels[:3], levels[:4], levels, levels[1:], levels[2:]]


def test_nested_entry_gives_views_of_the_wider_tensor():
    spec = tiny().submodel_spec()
    compiled = compile_spec(spec)
    key = "layer2.0.conv1.weight"
    narrow, wide = compiled["g0.25"].slice_map[key], compiled["g0.5"].slice_map[key]
    glob = compiled.init_global_state()
    rel = nested_entry(narrow, wide, key)
    assert torch.equal(rel.gather(wide.gather(glob[key])), narrow.gather(glob[key]))
    assert tier_key(key, "g1") == f"{key}@g1"


def test_heterofl_static_bn_and_scaler():
    method = tiny(method="heterofl", eval__bn_batches=2, eval__bn="running").build_strategy()
    entries = method.entries("g0.25")
    assert not any(k.endswith(("running_mean", "running_var")) for k in entries)
    assert "bn1.weight" in entries and entries["bn1.weight"].consistent  # shared BN affine
    torch.manual_seed(0)
    state = method.init_global_state()
    local = method.client_model("g0.25", {k: e.gather(state[e.global_key]).clone() for k, e in entries.items()})
    x = torch.randn(8, 1, 8, 8)
    local.train()
    conv_out = {}
    local.net.conv1.register_forward_hook(lambda m, i, o: conv_out.setdefault("o", o))
    local(x)
    expected = torch.nn.functional.conv2d(x, local.net.conv1.weight, padding=1) / 0.5  # rate sqrt(0.25)
    torch.testing.assert_close(conv_out["o"], expected)
    assert torch.equal(local.net.bn1.running_mean, torch.zeros_like(local.net.bn1.running_mean))
    assert set(local.state()) == set(entries)
    images = (torch.randn(1, 1, 8, 8) + 3).expand(48, 1, 8, 8).contiguous()  # one image, so every batch agrees
    data = SimpleNamespace(train_eval=TensorDataset(images, torch.zeros(48, dtype=torch.long)))
    net = with_bn(method.eval_model(state, "g0.25", data), "recompute", method.run, data)
    assert not net.training
    # recomputed from scratch as a cumulative average (default momentum would mix in the old 0)
    stem = torch.nn.functional.conv2d(images[:1], state["conv1.weight"][: net.conv1.out_channels], padding=1)
    torch.testing.assert_close(net.bn1.running_mean, stem.mean((0, 2, 3)))
    # static BN: evaluated with recomputed statistics although eval.bn is running
    data.test = TensorDataset(images[:8], torch.zeros(8, dtype=torch.long))
    acc = method.evaluate(1, state, data)
    assert acc["g0.25"] == evaluate(net, data.test) and set(acc) == {"g0.25", "g0.5", "g1", "running/g0.25", "running/g0.5", "running/g1"}


def test_fjord_narrow_width_trains_a_prefix_of_the_wide_tensors():
    method = tiny(method="fjord").build_strategy()
    assert method.assign(["g0.25", "g0.5", "g1"], random.Random(0)) == "g1"
    torch.manual_seed(0)
    state = method.init_global_state()
    entries = method.entries("g1")
    assert "layer1.0.bn1.weight@g0.25" in entries and "layer1.0.bn1.weight@g0.5" in entries and "layer1.0.bn1.weight" in entries
    local = method.client_model("g1", {k: e.gather(state[e.global_key]).clone() for k, e in entries.items()})
    assert local.widths == ["g0.25", "g0.5", "g1"]
    local.train()
    local.width_forward(0, torch.randn(4, 1, 8, 8)).sum().backward()
    grad = local.net.layer1[0].conv1.weight.grad
    k = method.compiled["g0.25"].slice_map["layer1.0.conv1.weight"].shape
    assert grad[: k[0], : k[1]].abs().sum() > 0
    assert grad[k[0]:].abs().sum() == 0 and grad[:, k[1]:].abs().sum() == 0
    assert local.net.layer1[0].bn1.weight.grad is None  # the narrow width used its own BN
    assert local.narrow[0].layer1[0].bn1.weight.grad is not None


def test_depthfl_holds_its_prefix_and_the_exits_up_to_it_and_evaluates_the_ensemble():
    method = tiny(method="depthfl", eval__bn_both=True).build_strategy()
    assert method.info.levels == method.info.eval_names == ("g0.25", "g0.5", "g1")
    assert method.prefixes.bounds == {"g0.25": 6, "g0.5": 7, "g1": 9}  # blocks; ratios 0.24, 0.46, 1 of 0.25, 0.5, 1
    held = method.entries(method.assign(["g0.25"], random.Random(0)))
    assert "exits.0.fc.weight" in held and "exits.0.bottleneck.0.0.weight" in held  # exit 0's bottleneck stands in for stage 3
    assert not any(k.startswith(("layer3.", "fc.", "exits.1.", "exits.2.")) for k in held)
    cfg = tiny(data__max_test_samples=16)
    data = load_data(cfg.data, cfg.data_root(), method.info.input_size, 4, 0)
    acc = method.evaluate(1, method.init_global_state(), data)
    assert {"running/ensemble", "recompute/ensemble", "g1", "recompute/g1"} <= set(acc) and "ensemble" not in acc


def test_bn_recompute_batches_are_the_first_of_one_shuffled_epoch_on_the_placement():
    from nefl_zoo.fl.training.batches import shuffled_batches
    from nefl_zoo.fl.training.bn import recompute_batches
    from nefl_zoo.fl.training.device import Placement, placed

    data = TensorDataset(torch.arange(10.0).view(10, 1), torch.arange(10))
    first = [y.tolist() for _, y in shuffled_batches(data, 4, seed=3)]  # one epoch: batches of 4, 4, 2
    assert [y.tolist() for _, y in recompute_batches(data, 4, 3, batches=2)] == first[:2]
    assert [y.tolist() for _, y in recompute_batches(data, 4, 3, batches=5)] == first  # never a second epoch
    with placed(Placement(torch.device("meta"))):
        assert {x.device.type for x, _ in recompute_batches(data, 4, 3, batches=2)} == {"meta"}


def test_only_a_zero_padded_square_crop_is_reproduced_on_resident_images():
    from torchvision.transforms import v2

    from nefl_zoo.fl.training.batches import _crop_padding

    assert _crop_padding(None) == 0 and _crop_padding(v2.RandomCrop(8, padding=2)) == 2
    assert _crop_padding(v2.RandomCrop(8, padding=[3, 3, 3, 3], fill=0)) == 3
    for other in (v2.RandomCrop(8, padding=2, padding_mode="reflect"), v2.RandomCrop(8, padding=2, fill=1),
                  v2.RandomCrop((8, 6), padding=2), v2.RandomCrop(8, padding=[1, 2]), v2.RandomCrop(8, pad_if_needed=True),
                  v2.RandomHorizontalFlip()):
        assert _crop_padding(other) is None, other


def test_in_memory_images_are_batched_without_a_dataloader_unless_their_transform_needs_one(monkeypatch):
    import nefl_zoo.fl.training.batches as batches
    from nefl_zoo.data.loading import TensorImages

    images = TensorImages(torch.arange(48.0).view(12, 1, 2, 2), torch.arange(12).numpy())
    shifted = TensorImages(images.images, images.labels.numpy(), transform=lambda x: x + 100)
    expected = [x for x, _ in batches.DataLoader(shifted, batch_size=5)]
    real_loader = batches.DataLoader

    def no_loader(*args, **kwargs):
        raise AssertionError("a DataLoader for images the module batches itself")

    monkeypatch.setattr(batches, "DataLoader", no_loader)
    subset = torch.utils.data.Subset(images, [7, 2, 9])
    assert [y.tolist() for _, y in batches.ordered_batches(subset, 2)] == [[7, 2], [9]]
    assert [y.tolist() for _, y in batches.ordered_batches(images, 5)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    monkeypatch.setattr(batches, "DataLoader", real_loader)
    got = [x for x, _ in batches.ordered_batches(shifted, 5)]  # a transform it cannot reproduce: the DataLoader's
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_dataloader_batches_move_to_the_device_too():
    from nefl_zoo.fl.training.batches import shuffled_batches

    data = TensorDataset(torch.zeros(6, 1, 2, 2), torch.arange(6))  # not in-memory images: the DataLoader path
    assert {(x.device.type, y.device.type) for x, y in shuffled_batches(data, 4, 0, 1, "meta")} == {("meta", "meta")}


def test_a_rounds_record_and_the_csv_columns_come_from_the_clients_replies(tmp_path, monkeypatch):
    """Each client trains on its own partition; the record's loss is the mean of the replies'
    losses, its per-client bytes are the instruction's and the reply's; the observer sees the
    last evaluation; the CSV has the documented columns; a run without extra metrics has none."""
    import csv
    import math

    config = tiny(rounds=1, train__local_epochs=1, data__max_test_samples=32)
    engine = Engine(config, tmp_path / "run")
    seen, replies = [], {}
    train = engine.strategy.train

    def recording(instruction, data, client_state):
        reply = train(instruction, data, client_state)
        cid = instruction.config["client"]
        seen.append((cid, list(data.indices)))
        replies[cid] = (instruction, reply)
        return reply

    monkeypatch.setattr(engine.strategy, "train", recording)
    evaluate_ = engine.strategy.evaluate
    monkeypatch.setattr(engine.strategy, "evaluate", lambda *args: {k: v for k, v in evaluate_(*args).items() if "/" not in k})
    observed = []

    class Observer:
        def start(self, engine):
            pass

        def round(self, record, last_eval):
            observed.append((record, last_eval))

        def end(self, engine, result):
            observed.append(result)

    result = engine.run(observer=Observer())
    assert sorted(seen) == [(c, list(engine.data.client_dataset(c).indices)) for c in range(4)]
    (record, last_eval), end = observed
    losses = [replies[c][1].loss for c in sorted(replies)]
    assert not math.isnan(record["train_loss"]) and record["train_loss"] == float(np.mean(losses))
    for cid, (instruction, reply) in replies.items():
        client = record["per_client"][str(cid)]
        assert client == {"tier": instruction.level, "bytes_down": sum(t.numel() * t.element_size() for t in instruction.arrays.values()),
                          "bytes_up": sum(t.numel() * t.element_size() for t in reply.arrays.values())}
    assert last_eval["acc"] == end.acc and end.extra == {}
    header = next(csv.reader((tmp_path / "run" / "metrics.csv").read_text().splitlines()))
    assert header[:9] == ["round", "lr", "clients", "rejected", "train_loss", "bytes_down", "bytes_up", "cum_bytes", "time_s"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["extra"] == {}


def test_the_in_process_engine_names_the_flower_engine_for_secure_aggregation(tmp_path):
    from nefl_zoo.fl.config import ConfigError

    with pytest.raises(ConfigError) as info:
        Engine(tiny(secure_aggregation={}), tmp_path)
    assert str(info.value).endswith("secure_aggregation: runs on Flower's SecAgg+: add --engine flower "
                                    "(the in-process engine sees every update), or remove the section")


def test_parallel_clients_train_each_on_its_own_partition_as_one_at_a_time(tmp_path):
    """``train.parallel_clients`` hands the strategy, each client's partition and its own train
    (FedGH's clients keep per-client state, so they train one at a time) to the batched trainer:
    the run is the sequential one, tensor for tensor."""
    from .conftest import same_tensors

    for parallel, name in ((1, "one"), (2, "two")):
        config = tiny(method="fedgh", rounds=1, train__local_epochs=1, data__max_test_samples=32, train__parallel_clients=parallel,
                      data__local_split=[0.8, 0.1, 0.1])
        Engine(config, tmp_path / name).run()
    assert same_tensors(tmp_path / "one", tmp_path / "two")
    assert same_tensors(tmp_path / "one", tmp_path / "two", "clients.safetensors")
    batched = Engine(tiny(rounds=1, train__local_epochs=1, data__max_test_samples=32, train__parallel_clients=2), tmp_path / "nefl")
    batched.run()  # NeFL's clients of one tier train together, each on its own partition
    assert [r["clients"] for r in records(tmp_path / "nefl")] == [4]

"""The simulation engine: learning on digits, bit-identical resume, baselines, step sizes, bytes."""

import json
import random

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from nefl_zoo.fl.config import parse_config
from nefl_zoo.fl.engine import Engine, client_groups
from nefl_zoo.fl.methods import Assignment
from nefl_zoo.fl.methods.fjord import nested_entry
from nefl_zoo.slim import compile_spec, tier_key

torch.set_num_threads(1)


def tiny(**overrides):
    data = {
        "name": "tiny", "method": "nefl", "rounds": 4,
        "spec": {
            "model": "resnet20", "model_args": {"in_chans": 1, "img_size": 8},
            "tiers": [{"name": "g0.25", "gamma_w": 0.25}, {"name": "g0.5", "gamma_w": 0.5}, {"name": "g1", "gamma_w": 1.0}],
        },
        "data": {"dataset": "digits", "augment": False},
        "clients": {"num_clients": 4, "fraction": 1.0},
        "train": {"local_epochs": 2, "batch_size": 32, "lr": 0.1, "schedule": "constant"},
        "eval": {"every": 2},
        "checkpoint_every": 2,
    }
    for key, value in overrides.items():
        node = data
        *parents, last = key.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return parse_config(data)


def test_nefl_beats_chance_on_every_submodel_and_writes_run_dir(tmp_path):
    result = Engine(tiny(), tmp_path).run()
    assert set(result.acc) == {"g0.25", "g0.5", "g1"}
    assert all(acc > 0.3 for acc in result.acc.values()), result.acc  # chance is 0.1
    assert result.worst == min(result.acc.values())
    for name in ("spec.yaml", "config.yaml", "global.safetensors", "metrics.jsonl", "metrics.csv", "checkpoint.json"):
        assert (tmp_path / name).exists(), name
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    assert set(records[-1]["acc"]) == set(result.acc)
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 5


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


def crash_in_round_3(config, out, monkeypatch) -> None:
    """Run ``config`` into ``out`` until a simulated crash at the start of round 3."""
    original = Engine.run_round

    def dies_in_round_3(self, round_index):
        if round_index == 2:
            raise KeyboardInterrupt("simulated crash")
        return original(self, round_index)

    monkeypatch.setattr(Engine, "run_round", dies_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        Engine(config, out).run()
    monkeypatch.setattr(Engine, "run_round", original)


def test_resume_is_bit_identical(tmp_path, monkeypatch):
    Engine(tiny(), tmp_path / "straight").run()
    crash_in_round_3(tiny(), tmp_path / "resumed", monkeypatch)
    assert json.loads((tmp_path / "resumed" / "checkpoint.json").read_text())["round"] == 2

    Engine(tiny(), tmp_path / "resumed").run(resume=True)
    a = load_file(str(tmp_path / "straight" / "global.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "global.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines_a = (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    lines_b = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    strip = lambda line: {k: v for k, v in json.loads(line).items() if k != "time_s"}  # noqa: E731
    assert [strip(x) for x in lines_a] == [strip(x) for x in lines_b]


@pytest.mark.parametrize("method", ["heterofl", "fjord", "depthfl", "fedavg", "fedavg_min", "fedavg_full"])
def test_each_baseline_runs_a_round(tmp_path, method):
    args = {"kd": True} if method == "fjord" else {}
    engine = Engine(tiny(method=method, rounds=1, train__local_epochs=1, method_args=args), tmp_path)
    torch.manual_seed(0)  # the engine seeds its initial state with the config seed (0)
    init = engine.strategy.init_global_state()
    result = engine.run()
    assert all(0 <= a <= 1 for a in result.acc.values())
    final = load_file(str(tmp_path / "global.safetensors"))
    assert final.keys() == init.keys()
    changed = [k for k in init if not torch.equal(init[k], final[k])]
    assert changed and all(torch.isfinite(v).all() for v in final.values() if v.is_floating_point())
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["rejected"] == 0 and record["clients"] >= 1
    if method == "depthfl":
        assert set(result.acc) == {"g0.25", "g0.5", "g1"} and "running/ensemble" in result.extra
        assert any(k.startswith("exits.") for k in changed)
    if method == "fjord":  # every width's own BN was trained by the clients that sampled it
        assert any(k.endswith("bn1.weight@g0.25") for k in changed)
    if method == "fedavg_min":
        assert set(result.acc) == {"g0.25"}


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
    method = tiny(method="heterofl", eval__bn_batches=2).build_strategy()
    a = Assignment("g0.25", ("g0.25",))
    entries = method.entries(a)
    assert not any(k.endswith(("running_mean", "running_var")) for k in entries)
    assert "bn1.weight" in entries and entries["bn1.weight"].consistent  # shared BN affine
    torch.manual_seed(0)
    state = method.init_global_state()
    local = method.local_model(a, {k: e.gather(state[e.global_key]).clone() for k, e in entries.items()})
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
    net = method.with_bn(method.eval_model(state, "g0.25", data), "running", data)  # static BN: recomputed anyway
    assert not net.training
    # recomputed from scratch as a cumulative average (default momentum would mix in the old 0)
    stem = torch.nn.functional.conv2d(images[:1], state["conv1.weight"][: net.conv1.out_channels], padding=1)
    torch.testing.assert_close(net.bn1.running_mean, stem.mean((0, 2, 3)))


def test_fjord_narrow_width_trains_a_prefix_of_the_wide_tensors():
    method = tiny(method="fjord").build_strategy()
    a = method.assign(["g0.25", "g0.5", "g1"], random.Random(0))
    assert a == Assignment("g1", ("g0.25", "g0.5", "g1"))
    torch.manual_seed(0)
    state = method.init_global_state()
    entries = method.entries(a)
    assert "layer1.0.bn1.weight@g0.25" in entries and "layer1.0.bn1.weight" in entries
    local = method.local_model(a, {k: e.gather(state[e.global_key]).clone() for k, e in entries.items()})
    local.train()
    local.width_forward(0, torch.randn(4, 1, 8, 8)).sum().backward()
    grad = local.net.layer1[0].conv1.weight.grad
    k = method.compiled["g0.25"].slice_map["layer1.0.conv1.weight"].shape
    assert grad[: k[0], : k[1]].abs().sum() > 0
    assert grad[k[0]:].abs().sum() == 0 and grad[:, k[1]:].abs().sum() == 0
    assert local.net.layer1[0].bn1.weight.grad is None  # the narrow width used its own BN
    assert local.narrow[0].layer1[0].bn1.weight.grad is not None


def test_depthfl_holds_its_prefix_and_the_exits_up_to_it():
    method = tiny(method="depthfl").build_strategy()
    assert method.tier_names == ["g0.25", "g0.5", "g1"]
    assert method.bounds == {"g0.25": 6, "g0.5": 7, "g1": 9}  # blocks; ratios 0.24, 0.46, 1 of 0.25, 0.5, 1
    held = method.entries(method.assign(["g0.25"], random.Random(0)))
    assert "layer3.0.downsample.0.weight" in held and "exits.0.weight" in held  # stage 3 only downsamples
    assert not any(k.startswith(("layer3.0.conv", "layer3.1.", "fc.", "exits.1.", "exits.2.")) for k in held)

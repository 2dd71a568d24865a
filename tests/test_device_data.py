"""Data shaped by the device class (``data.partition: devices``) and what each device class gets
(``eval.device_classes``): the documented label mix per class, quantity skew, bad values in one
line, per-class accuracy and updates against a hand computation, their resume, and their report."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nefl_zoo.fl.config import ConfigError, load_config
from nefl_zoo.data.device_partition import device_partition, largest_remainder
from nefl_zoo.fl.engine import Engine, RunResult
from nefl_zoo.fl.devices.population import DevicesConfig
from nefl_zoo.data.device_partition import device_kinds
from nefl_zoo.slim import SliceMap

from .conftest import crash_in_round, records, same_tensors, tiny

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]

NET = {"uplink_mbps": 20, "downlink_mbps": 20}
# four 0-4 digits for every 5-9 digit on phones, none of 0-4 on laptops; phones too slow for any tier
# within the deadline (so they run the smallest), laptops fast enough for the full model
PHONE = {"name": "phone", "share": 0.5, "macs_per_s": 1e5, "memory_mb": 64, **NET, "data": {"samples": 30, "labels": [4] * 5 + [1] * 5}}
LAPTOP = {"name": "laptop", "share": 0.5, "macs_per_s": 2e9, "memory_mb": 64, **NET, "data": {"samples": 45, "labels": [0] * 5 + [1] * 5}}
DEVICES = {"classes": [PHONE, LAPTOP], "deadline_s": 5.0}


def devices(*classes, **section) -> DevicesConfig:
    return DevicesConfig.model_validate({"classes": list(classes), "deadline_s": 5.0, **section})


def labelled(counts) -> np.ndarray:
    """Targets with ``counts[y]`` samples of label y, labels interleaved (as a shuffled set's)."""
    return np.concatenate([np.full(n, y) for y, n in enumerate(counts)])[np.random.default_rng(0).permutation(sum(counts))]


def test_largest_remainder_by_hand():
    assert largest_remainder(10, np.array([1, 1, 1])).tolist() == [4, 3, 3]  # 3.33 each: the first remainder wins the tie
    assert largest_remainder(7, np.array([0.5, 0.3, 0.2])).tolist() == [4, 2, 1]  # 3.5, 2.1, 1.4 -> 3, 2, 1 and one to 0.5
    assert largest_remainder(5, np.array([0, 2, 0])).tolist() == [0, 5, 0]


def test_each_device_class_holds_its_documented_label_mix_and_each_client_its_samples():
    """6 phones of 30 images with labels 0-4 weighted 4 and 5-9 weighted 1, 6 laptops of 45 with
    5-9 only: the phones hold 180 images, 28.8 of each of 0-4 and 7.2 of each of 5-9, floored to
    175, the 5 left to the largest remainders (0.8): 29 of each of 0-4, 7 of each of 5-9; the
    laptops 270: 54 of each of 5-9."""
    targets = labelled([100] * 10)
    d = devices(PHONE, LAPTOP)
    kinds = device_kinds(d.classes, 12, seed=3)
    parts = device_partition(targets, 10, kinds, d.classes, seed=3)
    per_class = [np.bincount(targets[np.concatenate([p for p, k in zip(parts, kinds) if k == c])], minlength=10) for c in (0, 1)]
    assert per_class[0].tolist() == [29, 29, 29, 29, 29, 7, 7, 7, 7, 7]
    assert per_class[1].tolist() == [0, 0, 0, 0, 0, 54, 54, 54, 54, 54]
    assert [len(p) for p in parts] == [30 if k == 0 else 45 for k in kinds]  # quantity skew: the class's samples each
    every = np.concatenate(parts)
    assert len(np.unique(every)) == len(every)  # no image held twice
    for p, k in zip(parts, kinds):  # without alpha each client holds the class mix, to rounding
        counts = np.bincount(targets[p], minlength=10)
        expected = [29 * 30 / 180] * 5 + [7 * 30 / 180] * 5 if k == 0 else [0] * 5 + [9] * 5
        assert np.abs(counts - expected).max() <= 1
    assert all(np.array_equal(a, b) for a, b in zip(parts, device_partition(targets, 10, kinds, d.classes, seed=3)))  # seeded
    assert not all(np.array_equal(a, b) for a, b in zip(parts, device_partition(targets, 10, kinds, d.classes, seed=4)))


def test_alpha_varies_the_clients_but_keeps_the_class_mix():
    targets = labelled([100] * 10)
    d = devices(PHONE | {"data": PHONE["data"] | {"alpha": 0.5}}, LAPTOP)
    kinds = device_kinds(d.classes, 12, seed=3)
    parts = device_partition(targets, 10, kinds, d.classes, seed=3)
    phones = [np.bincount(targets[p], minlength=10) for p, k in zip(parts, kinds) if k == 0]
    assert sum(phones).tolist() == [29, 29, 29, 29, 29, 7, 7, 7, 7, 7]  # the class's mix, exactly
    assert all(c.sum() == 30 for c in phones) and max(c.max() for c in phones) > 10  # skewed clients (the mix gives 5 or 6)


def test_the_default_mix_is_the_training_sets():
    targets = labelled([60, 30, 10])
    d = devices({**PHONE, "data": {"samples": 10}}, {**LAPTOP, "data": {"samples": 20}})
    kinds = device_kinds(d.classes, 4, seed=0)
    parts = device_partition(targets, 3, kinds, d.classes, seed=0)
    assert np.bincount(targets[np.concatenate(parts)], minlength=3).tolist() == [6 + 12 + 6 + 12, 3 + 6 + 3 + 6, 1 + 2 + 1 + 2]


def write_config(tmp_path: Path, **changes) -> Path:
    """A tiny YAML config whose device classes shape the data (``changes`` replace device-class fields)."""
    phone = PHONE | changes.get("phone", {})
    text = json.dumps({"name": "t", "rounds": 1, "spec": {"model": "resnet20", "model_args": {"in_chans": 1, "img_size": 8},
                                                        "tiers": [{"name": "g0.5", "gamma_w": 0.5}, {"name": "g1", "gamma_w": 1.0}]},
                       "data": {"dataset": "digits", "augment": False, "partition": "devices"}, "clients": {"num_clients": 4},
                       "devices": DEVICES | {"classes": [phone, LAPTOP]}})
    path = tmp_path / "cfg.yaml"
    path.write_text(text)  # JSON is YAML
    return path


@pytest.mark.parametrize("phone, field, message", [
    ({"data": {"samples": 700, "labels": [1] * 10}}, "devices.classes",  # 2 phones x 700 / 10 labels; digits has 133 zeros to train on
     "label 0: the classes' clients ask for 140 images, the training set has 133; lower data.samples or label 0's weight in data.labels"),
    ({"data": {"samples": 3, "labels": [1] * 9}}, "devices.classes[0].data.labels",
     "9 weights, but the dataset has 10 labels: give one weight per label"),
])
def test_a_partition_the_training_set_cannot_give_is_one_line_naming_file_and_field(tmp_path, phone, field, message):
    path = write_config(tmp_path, phone=phone)
    with pytest.raises(ConfigError) as info:
        Engine(load_config(path), tmp_path / "run")
    assert str(info.value) == f"{path}: {field}: {message}"
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("overrides, field, message", [
    ({"data__partition": "devices"}, "data.partition", "devices needs a devices: section"),
    ({"data__partition": "devices", "devices": DEVICES | {"classes": [PHONE, {k: v for k, v in LAPTOP.items() if k != "data"}]}},
     "devices.classes[1].data", "required with data.partition: devices"),
    ({"devices": DEVICES}, "devices.classes[0].data", "used only with data.partition: devices (it is iid)"),
    ({"devices": DEVICES | {"classes": [PHONE | {"data": {"samples": 0}}, LAPTOP]}, "data__partition": "devices"},
     "devices.classes[0].data.samples", "greater than or equal to 1"),
    ({"devices": DEVICES | {"classes": [PHONE | {"data": {"samples": 5, "labels": [0, 0]}}, LAPTOP]}, "data__partition": "devices"},
     "devices.classes[0].data.labels", "expected weights >= 0 with a positive sum"),
    ({"devices": DEVICES | {"classes": [PHONE | {"data": {"samples": 5, "alpha": 0}}, LAPTOP]}, "data__partition": "devices"},
     "devices.classes[0].data.alpha", "greater than 0"),
    ({"eval__device_classes": True}, "eval.device_classes", "needs a devices: section"),
    ({"eval__device_classes": True, "data__partition": "devices", "devices": DEVICES}, "eval.device_classes",
     "set data.local_split, e.g. [0.9, 0, 0.1]"),
])
def test_bad_device_data_settings_are_refused_in_one_line(overrides, field, message):
    with pytest.raises(ConfigError) as info:
        tiny(**overrides)
    assert info.value.field == field and message in info.value.message and "\n" not in str(info.value)


def scored(**more):
    """Two rounds of the tiny run on 2 phones and 2 laptops whose data their class shapes, each
    client holding out a fifth of its images, device classes scored after each round."""
    return tiny(rounds=2, devices=DEVICES, data__partition="devices", data__local_split=[0.8, 0.0, 0.2], eval__device_classes=True,
                eval__every=1, eval__bn_both=False, train__local_epochs=1, checkpoint_every=1, **more)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-classes") / "run"
    engine = Engine(scored(), out)
    engine.run()
    return engine, out


def test_each_device_class_is_scored_as_a_hand_computation_gives(straight):
    """Phones (too slow for any tier) run the smallest, g0.25; laptops the full model, g1. Each
    class's accuracy is its clients' right answers over their held-out images, counted here image
    by image on the saved global state."""
    engine, out = straight
    strategy, data = engine.strategy, engine.data
    state = load_file(str(out / "global.safetensors"))
    kinds = engine.clock.population.kind.tolist()
    phones, laptops = [c for c in range(4) if kinds[c] == 0], [c for c in range(4) if kinds[c] == 1]
    assert len(phones) == len(laptops) == 2

    def right(tier, clients):
        model = strategy.submodel(tier, SliceMap(dict(strategy.compiled[tier].slice_map)).extract(state)).eval()
        hits = 0
        with torch.no_grad():
            for c in clients:
                for i in data.holdout[c][1]:
                    x, y = data.train_eval[int(i)]
                    hits += int(model(x[None]).argmax(1).item() == int(y))
        return hits

    images = {name: sum(len(data.holdout[c][1]) for c in who) for name, who in (("phone", phones), ("laptop", laptops))}
    assert images == {"phone": 2 * 6, "laptop": 2 * 9}  # 30 and 45 images, a fifth held out
    expected = {"phone": {"tier": right("g0.25", phones) / 12, "full": right("g1", phones) / 12, "test_images": 12, "tiers": {"g0.25": 2}},
                "laptop": {"tier": right("g1", laptops) / 18, "full": right("g1", laptops) / 18, "test_images": 18, "tiers": {"g1": 2}}}
    last = records(out)[-1]
    assert last["device_accuracy"] == expected
    assert last["worst_device_class"] == pytest.approx(min(expected["phone"]["tier"], expected["laptop"]["tier"]), abs=1e-12)
    assert last["device_class_spread"] == pytest.approx(abs(expected["phone"]["tier"] - expected["laptop"]["tier"]), abs=1e-12)
    for record in records(out):  # updates per class: the per-client statuses counted by class
        by_class = {"phone": {"sampled": 0, "arrived": 0, "dropped": 0, "lost": 0}, "laptop": {"sampled": 0, "arrived": 0, "dropped": 0, "lost": 0}}
        for cid, client in record["per_client"].items():
            counts = by_class["phone" if int(cid) in phones else "laptop"]
            counts["sampled"] += 1
            counts[{"late": "dropped", "memory": "dropped"}.get(client["status"], client["status"])] += 1
        assert record["device_classes"] == by_class
        assert by_class["phone"]["sampled"] == 0 and by_class["laptop"]["arrived"] == 2  # phones fit no tier: never sent one
    csv = (out / "metrics.csv").read_text().splitlines()
    assert csv[0].split(",")[16:18] == ["worst_device_class", "device_class_spread"]


def test_device_class_scores_survive_a_kill_and_resume_bit_for_bit(straight, tmp_path, monkeypatch):
    _, out = straight
    crash_in_round(scored(), tmp_path / "resumed", monkeypatch, 1)
    Engine(scored(), tmp_path / "resumed").run(resume=True)
    assert records(tmp_path / "resumed") == records(out)
    assert same_tensors(out, tmp_path / "resumed")


def test_compare_reports_what_each_device_class_gets(straight, tmp_path):
    """From finished runs: the per-class table (the last evaluation), the updates summed over
    rounds, the tiers, device_classes.json, and the times to the full model's and the worst
    class's targets."""
    from nefl_zoo.fl.compare import Entry, report

    engine, out = straight
    for seed in (0, 1):  # the same run read as two seeds: the std is 0
        shutil.copytree(out, tmp_path / "nefl" / f"seed{seed}")
    result = RunResult(**json.loads((out / "summary.json").read_text()))
    comparison = report(engine.config, [Entry("nefl", "nefl")], {"nefl": [result, result]}, tmp_path, plot=False)
    last, logged = records(out)[-1], records(out)
    phone, laptop = (100 * last["device_accuracy"][n]["tier"] for n in ("phone", "laptop"))
    phone_full, laptop_full = (100 * last["device_accuracy"][n]["full"] for n in ("phone", "laptop"))
    arrived = sum(r["device_classes"]["laptop"]["arrived"] for r in logged)
    row = (f"| NeFL | {phone:.2f} ± 0.00 | {phone_full:.2f} ± 0.00 | {laptop:.2f} ± 0.00 | {laptop_full:.2f} ± 0.00 | "
           f"{min(phone, laptop):.2f} ± 0.00 | {abs(phone - laptop):.2f} ± 0.00 |")
    assert row in comparison.markdown.splitlines()
    assert f"| NeFL | 0.0 | 0.0 | {arrived:,.1f} | 0.0 |" in comparison.markdown.splitlines()
    assert "| NeFL | g0.25: 2 | g1: 2 |" in comparison.markdown.splitlines()
    saved = json.loads((tmp_path / "device_classes.json").read_text())["entries"]["nefl"]
    assert saved["classes"]["phone"]["tier"] == pytest.approx([phone, 0.0]) and saved["worst_class"] == pytest.approx([min(phone, laptop), 0.0])
    measures = json.loads((tmp_path / "time_to_accuracy.json").read_text())["measures"]
    evaluated = [r for r in logged if "acc" in r]
    worst = max(100 * r["worst_device_class"] for r in evaluated)  # one entry: the target is its best
    assert measures["worst device class"]["target"] == pytest.approx(worst)
    first = next(r["sim_time_s"] for r in evaluated if 100 * r["worst_device_class"] >= worst)
    assert measures["worst device class"]["entries"]["nefl"]["time_to_target_s"] == [first, first]
    assert measures["full model"]["target"] == pytest.approx(max(100 * r["acc"]["g1"] for r in evaluated))


def test_the_shipped_scenarios_give_each_class_its_documented_mix():
    """The three MNIST scenarios parse, and on MNIST's label counts each class holds 50 images per
    client in its documented mix (without reading MNIST)."""
    mnist = (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)
    targets = labelled(mnist)
    expected = {"iid": None, "label-skew": [[4] * 4 + [1] * 6, [1] * 4 + [4] * 4 + [1] * 2, [1] * 8 + [4] * 2],
                "unseen": [[1] * 10, [1] * 10, [1] * 9 + [0]]}
    for name, mixes in expected.items():
        config = load_config(ROOT / f"specs/train/mnist-devices-{name}.yaml")
        classes = config.devices.classes
        assert config.eval.device_classes and config.data.local_split == (0.9, 0.0, 0.1)
        kinds = device_kinds(classes, 1000, config.seed)
        parts = device_partition(targets, 10, kinds, classes, config.seed)
        assert {len(p) for p in parts} == {50}
        for c in range(3):
            held = np.bincount(targets[np.concatenate([p for p, k in zip(parts, kinds) if k == c])], minlength=10)
            mix = np.array(mnist) / sum(mnist) if mixes is None else np.array(mixes[c]) / sum(mixes[c])
            assert np.abs(held - mix * held.sum()).max() < 1  # the class mix, to rounding

"""Devices in time: tiers chosen from each device's resources, the virtual clock (deadline, wait for
all, offline clients), its resume, bad populations, and the time to accuracy of a comparison."""

import json

import numpy as np
import pytest
import torch

from nefl_zoo.fl.devices.clock import TierCosts, VirtualClock
from nefl_zoo.fl.config import ConfigError
from nefl_zoo.fl.engine import Engine
from nefl_zoo.fl.devices.population import DevicesConfig, Population
from nefl_zoo.fl.strategy.base import ClientInfo
from nefl_zoo.fl.devices.time_to_accuracy import default_target, time_table, time_to_accuracy

from .conftest import crash_in_round, records, same_tensors, tiny

torch.set_num_threads(1)

# three tiers: a client of 100 images on "l" computes 100 x 4e6 MACs and moves 4e5 bytes each way
COSTS = TierCosts(("s", "m", "l"), np.array([1e6, 2e6, 4e6]), np.array([1e5, 2e5, 4e5]), np.array([1e6, 2e6, 4e6]))
NET = {"uplink_mbps": 8, "downlink_mbps": 8}  # 1e6 bytes per second each way


def device(name, share, macs_per_s, memory_mb=8, **more):
    return {"name": name, "share": share, "macs_per_s": macs_per_s, "memory_mb": memory_mb, **NET, **more}


def clock(classes, clients=3, seed=0, **section):
    devices = DevicesConfig.model_validate({"classes": classes, "deadline_s": 2.0, **section})
    return VirtualClock(devices, COSTS, [100] * clients, seed)


def by_class(c: VirtualClock) -> dict[str, int]:
    """The client of each class (one client per class)."""
    return {c.devices.classes[k].name: int(cid) for cid, k in enumerate(c.population.kind)}


def test_classes_get_their_shares_of_the_clients_by_largest_remainder():
    # 7 clients: 3.15, 2.45 and 1.4 -> 3, 2, 1 and the one left to the largest remainder (0.45)
    devices = DevicesConfig.model_validate({"classes": [device("a", 0.45, 1e9), device("b", 0.35, 1e9), device("c", 0.2, 1e9)],
                                            "deadline_s": 2.0})
    assert np.bincount(Population(devices, 7, 0).kind).tolist() == [3, 3, 1]


def test_a_slower_or_smaller_device_gets_a_smaller_tier():
    c = clock([device("fast", 1 / 3, 1e9), device("slow", 1 / 3, 1e8), device("small", 1 / 3, 1e9, memory_mb=2)])
    levels = {info.cid: info.levels for info in c.available(0, [ClientInfo(i, ("s",)) for i in range(3)])}
    who = by_class(c)
    # fast: l takes 100 x 4e6 / 1e9 + 2 x 4e5 / 1e6 = 1.2 s, within the 2 s deadline
    assert levels[who["fast"]] == ("l",)
    # slow: m takes 2 + 0.4 = 2.4 s (too late), s takes 1 + 0.2 = 1.2 s
    assert levels[who["slow"]] == ("s",)
    # small: 2 MiB holds m (2e6 bytes), not l (4e6)
    assert levels[who["small"]] == ("m",)
    assert c.seconds(np.array([who["fast"], who["slow"]]), np.array([2, 0]), c.population.speeds(0)) == pytest.approx([1.2, 1.2], abs=1e-12)


def test_a_client_past_the_deadline_is_dropped_and_wait_all_waits_for_it():
    classes = [device("fast", 0.5, 1e9), device("slow", 0.5, 1e8)]
    c = clock(classes, clients=2, tiers="environment")
    who = by_class(c)
    timing = c.run_round(0, {who["fast"]: "l", who["slow"]: "l"})  # slow on l: 4 + 0.8 = 4.8 s
    assert timing.status == {who["fast"]: "arrived", who["slow"]: "late"}
    assert c.time_us == 2_000_000  # the round ends at the deadline
    record = timing.record(["s", "m", "l"])
    assert (record["dropped"], record["lost"], record["participation"], record["sim_time_s"]) == (1, 0, {"l": 1}, 2.0)
    timing = c.run_round(1, {who["fast"]: "l"})  # everyone back before the deadline: the round ends then
    assert (timing.duration_us, c.time_us) == (1_200_000, 3_200_000)

    waits = clock(classes, clients=2, tiers="environment", policy="wait_all")
    timing = waits.run_round(0, {who["fast"]: "l", who["slow"]: "l"})
    assert set(timing.status.values()) == {"arrived"} and waits.time_us == 4_800_000


def test_an_offline_client_is_not_reached_and_one_going_offline_is_lost():
    c = clock([device("a", 1.0, 1e9, availability={"kind": "periodic", "period_s": 10, "online_s": 5})], clients=50)
    online = {info.cid for info in c.available(0, [ClientInfo(i, ("s",)) for i in range(50)])}
    p = c.population
    expected = {i for i in range(50) if (0 - p.phase[i]) % 10 < 5}
    assert online == expected and 0 < len(online) < 50
    leaving = min(online, key=lambda i: p.online_until(0.0)[i])  # the first to go offline
    remaining = p.online_until(0.0)[leaving]
    assert remaining < 1.2  # it goes offline before l (1.2 s) is done
    timing = c.run_round(0, {leaving: "l"})
    assert timing.status == {leaving: "lost"} and c.time_us == 2_000_000  # the server waits to the deadline


def test_simulated_times_are_deterministic_given_the_seed():
    classes = [device("a", 0.7, 5e8, speed_jitter=0.5, availability={"kind": "periodic", "period_s": 9, "online_s": 6}),
               device("b", 0.3, 2e9, speed_jitter=0.2, memory_mb=3)]

    def history(seed):
        c, out = clock(classes, clients=40, seed=seed, tiers="environment"), []
        for r in range(15):
            clients = c.available(r, [ClientInfo(i, ("s",)) for i in range(40)])
            timing = c.run_round(r, {info.cid: "sml"[info.cid % 3] for info in clients[::2]})
            out.append((c.time_us, timing.status, timing.seconds))
        return out

    first = history(0)
    assert first == history(0)
    assert [t for t, _, _ in first] != [t for t, _, _ in history(1)]
    assert {s for _, status, _ in first for s in status.values()} == {"arrived", "late", "lost", "memory"}


DEVICES = {"classes": [
    {"name": "phone", "share": 0.5, "macs_per_s": 3e8, "speed_jitter": 0.5, "memory_mb": 64, "uplink_mbps": 10, "downlink_mbps": 10,
     "availability": {"kind": "periodic", "period_s": 20, "online_s": 12}},
    {"name": "laptop", "share": 0.5, "macs_per_s": 2e9, "speed_jitter": 0.3, "memory_mb": 64, "uplink_mbps": 20, "downlink_mbps": 20}],
    "deadline_s": 5.0}


def timed(devices=DEVICES):
    """Two rounds of the tiny run (4 clients) on ``devices``, checkpointed after each."""
    return tiny(rounds=2, devices=devices, train__local_epochs=1, eval__every=2, eval__bn_both=False, checkpoint_every=1)


def test_resume_after_a_kill_continues_the_clock_exactly(tmp_path, monkeypatch):
    config = timed()
    straight = Engine(config, tmp_path / "straight")
    straight.run()
    crash_in_round(config, tmp_path / "resumed", monkeypatch, 1)
    resumed = Engine(config, tmp_path / "resumed")
    resumed.run(resume=True)
    assert resumed.clock.time_us == straight.clock.time_us > 0
    assert records(tmp_path / "resumed") == records(tmp_path / "straight")
    assert same_tensors(tmp_path / "straight", tmp_path / "resumed")
    saved = json.loads((tmp_path / "resumed" / "checkpoint.json").read_text())
    assert saved["totals"]["sim_time_us"] == straight.clock.time_us
    history = records(tmp_path / "straight")
    assert [r["sim_time_s"] for r in history] == sorted({r["sim_time_s"] for r in history})  # time moves on every round
    assert all(sum(r["participation"].values()) == r["clients"] for r in history)


def test_an_offline_clients_update_never_arrives(tmp_path, monkeypatch):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,start_s,end_s\n0,0,0.5\n")  # online at the start, gone before it could finish
    engine = Engine(timed(devices=DEVICES | {"trace": str(trace)}), tmp_path / "run")
    trained = []
    original = engine.strategy.train
    monkeypatch.setattr(engine.strategy, "train", lambda instruction, *a: trained.append(instruction.config["client"]) or original(instruction, *a))
    engine.run()
    first, second = records(tmp_path / "run")
    assert first["per_client"]["0"]["status"] == "lost" and first["per_client"]["0"]["bytes_up"] == 0
    assert first["lost"] == 1 and first["clients"] == len(first["per_client"]) - 1
    assert "0" not in second["per_client"]  # offline: not reached again
    assert 0 not in trained and trained


@pytest.mark.parametrize("devices, field, message", [
    (DEVICES | {"classes": [DEVICES["classes"][0] | {"share": 0.4}, DEVICES["classes"][1]]}, "devices.classes", "shares sum to 0.9, expected 1"),
    (DEVICES | {"classes": [DEVICES["classes"][0] | {"macs_per_s": 0}, DEVICES["classes"][1]]}, "devices.classes[0].macs_per_s", "greater than 0"),
    ({k: v for k, v in DEVICES.items() if k != "deadline_s"}, "devices.deadline_s", "required key is missing"),
    (DEVICES | {"classes": [DEVICES["classes"][0] | {"availability": {"kind": "periodic", "period_s": 5, "online_s": 9}},
                            DEVICES["classes"][1]]}, "devices.classes[0].availability.periodic.online_s", "longer than period_s"),
])
def test_bad_populations_are_refused_in_one_line_naming_the_field(devices, field, message):
    with pytest.raises(ConfigError) as info:
        tiny(devices=devices)
    assert info.value.field == field and message in info.value.message and "\n" not in str(info.value)


def test_a_trace_naming_an_unknown_client_is_refused(tmp_path):
    trace = tmp_path / "trace.csv"
    for client in (4, 7):  # the first past the last, and beyond
        trace.write_text(f"client,start_s,end_s\n1,0,10\n{client},0,10\n")
        with pytest.raises(ConfigError) as info:
            tiny(devices=DEVICES | {"trace": str(trace)})
        assert str(info.value) == f"<config>: devices.trace: {trace}: line 3: client {client} is not one of the 4 clients (0..3)"


def test_time_to_accuracy_with_exact_numbers():
    curves = {"a": [(np.array([10.0, 20.0, 30.0]), np.array([50.0, 70.0, 90.0])),
                    (np.array([12.0, 24.0, 36.0]), np.array([60.0, 65.0, 80.0]))],
              "b": [(np.array([5.0, 15.0]), np.array([40.0, 75.0])), (np.array([5.0, 15.0]), np.array([40.0, 71.0]))]}
    assert time_to_accuracy([10, 20, 30], [50, 70, 90], 70) == 20.0
    assert time_to_accuracy([10, 20], [50, 60], 70) is None
    assert default_target(curves) == 73.0  # b's best: 75 and 71
    markdown, data = time_table({"a": "A", "b": "B"}, curves, 73.0, {"a": {"dropped": 3}, "b": {"dropped": 0}})
    assert data["a"]["time_to_target_s"] == [30.0, 36.0] and data["a"]["mean_time_to_target_s"] == 33.0
    assert data["b"]["time_to_target_s"] == [15.0, None] and data["b"]["mean_time_to_target_s"] == 15.0
    assert markdown.splitlines()[2:] == ["| A | 33 | 2/2 | 85.00 | 33 | 3 | ", "| B | 15 | 1/2 | 73.00 | 15 | 0 | "]
    markdown, data = time_table({"a": "A", "b": "B"}, curves, 73.0, {"a": {"dropped": 3}})  # b without totals
    assert data["a"]["target"] == 73.0 and "dropped" not in data["b"]
    assert markdown.splitlines()[2:] == ["| A | 33 | 2/2 | 85.00 | 33 | 3 | ", "| B | 15 | 1/2 | 73.00 | 15 | – | "]


def test_compare_reports_the_time_to_a_target_accuracy_on_the_simulated_clock(tmp_path):
    """`compare` on a config with `devices:`: per entry the simulated times of its evaluated rounds,
    the time to the target, the dropped and lost updates summed from metrics.jsonl, and the figure."""
    from nefl_zoo.fl.compare import Entry, compare_methods

    config = timed().model_copy(update={"rounds": 1})
    entries = [Entry("nefl", "nefl"), Entry("fedavg-wait", "fedavg", name="FedAvg (waits)", overrides={"devices.policy": "wait_all"})]
    result = compare_methods(config, entries, 1, tmp_path, plot=True, target=0.0)
    report = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert list(report["entries"]) == ["nefl", "fedavg-wait"] and report["entries"]["fedavg-wait"]["label"] == "FedAvg (waits)"
    for key, entry in report["entries"].items():
        logged = records(tmp_path / key / "seed0")
        evaluated = [r for r in logged if "acc" in r]
        assert entry["target"] == 0.0 and entry["time_to_target_s"] == [evaluated[0]["sim_time_s"]]  # any accuracy reaches 0%
        assert entry["final_time_s"] == evaluated[-1]["sim_time_s"] > 0
        assert entry["dropped"] == sum(r["dropped"] for r in logged) and entry["lost"] == sum(r["lost"] for r in logged)
    assert "Time to 0.00% worst-case accuracy" in result.markdown and "| FedAvg (waits) |" in result.markdown
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 10_000


def test_tier_costs_are_three_forward_macs_and_three_copies_of_the_weights_plus_activations():
    """A training step costs forward + backward (3x the forward MACs); its memory holds the
    weights, their gradients and the optimizer's copy (3x the bytes) and every layer's output
    per image of the batch."""
    from nefl_zoo.fl.devices.clock import activation_bytes
    from nefl_zoo.profile import macs_signature, tier_macs
    from nefl_zoo.slim import compile_spec

    strategy = tiny().build_strategy()
    costs = TierCosts.of(strategy, batch_size=5)
    compiled = compile_spec(strategy.run.spec)
    assert costs.names == tuple(sorted(compiled.tiers, key=lambda t: compiled.tiers[t].slice_map.numel()))
    for i, name in enumerate(costs.names):
        tier = compiled.tiers[name]
        forward = tier_macs(macs_signature(strategy.run.spec, tier.tier, compiled.input_size), tier.build)
        size = 4 * tier.slice_map.numel()
        assert costs.train_macs[i] == 3 * forward and costs.bytes[i] == size
        assert costs.memory[i] == 3 * size + 5 * activation_bytes(tier.build(), compiled.input_size)


def test_a_device_with_exactly_the_smallest_tiers_memory_trains_it():
    exact = 1e6 / 2**20  # MiB: the 1e6 bytes of tier s
    c = clock([device("tight", 1.0, 1e9, memory_mb=exact)], clients=1)
    assert c.available(0, [ClientInfo(0, ("s",))]) == [ClientInfo(0, ("s",))]
    with pytest.raises(ValueError, match=r"^devices.classes: no device has the memory to train the smallest tier \(s: 1.0 MiB\)$"):
        clock([device("short", 1.0, 1e9, memory_mb=exact * 0.999)], clients=1)


def test_time_report_writes_its_json_table_and_figure(tmp_path, monkeypatch):
    """Two entries of two seeds each: the default target (``default_target``), the JSON, the
    markdown with its figure link, and the figure: one colour and one legend label per entry
    (its seeds share them), the target dashed, 7 x 4.5 inches."""
    import matplotlib.figure

    from nefl_zoo.fl.devices.time_to_accuracy import time_report

    points = {"a": [[({"sim_time_s": 10.0}, 40.0), ({"sim_time_s": 20.0}, 60.0)]] * 2,
              "b": [[({"sim_time_s": 30.0}, 30.0), ({"sim_time_s": 90.0}, 70.0)]] * 2}
    dirs = {}
    for key in points:
        dirs[key] = []
        for seed in range(2):
            folder = tmp_path / f"{key}{seed}"
            folder.mkdir()
            folder.joinpath("metrics.jsonl").write_text("\n".join(json.dumps({"dropped": seed + 1, "lost": 2}) for _ in range(2)))
            dirs[key].append(folder)
    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig) or save(fig, *a, **k))
    curves = {k: [(np.array([10.0, 20.0]), np.array([40.0, 60.0]))] * 2 if k == "a" else
              [(np.array([30.0, 90.0]), np.array([30.0, 70.0]))] * 2 for k in points}
    target = default_target(curves)
    text = time_report({"a": "A", "b": "B"}, points, dirs, "recompute", None, tmp_path, True, "title")
    assert text.startswith(f"\nTime to {target:.2f}% worst-case accuracy (BN recompute) on the simulated clock")
    assert text.endswith("\n![accuracy vs simulated time](time_to_accuracy.png)\n") and (tmp_path / "time_to_accuracy.png").exists()
    raw = (tmp_path / "time_to_accuracy.json").read_text()
    assert raw.startswith('{\n  "treatment": "recompute",\n  "entries": ')
    assert json.loads(raw)["entries"] == time_table({"a": "A", "b": "B"}, curves, target, {k: {"dropped": 3.0, "lost": 4.0} for k in points})[1]
    (fig,) = figures
    ax = fig.axes[0]
    assert tuple(fig.get_size_inches()) == (7, 4.5)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["A", "B", f"target {target:.2f}%"]
    assert {t.get_fontsize() for t in ax.get_legend().get_texts()} == {8}
    seeds_a, seeds_b, line = ax.get_lines()[:2], ax.get_lines()[2:4], ax.get_lines()[4]
    assert seeds_a[0].get_color() == seeds_a[1].get_color() != seeds_b[0].get_color() == seeds_b[1].get_color()
    assert [seeds_a[0].get_label(), seeds_b[0].get_label()] == ["A", "B"]  # an entry's first seed carries its label
    assert seeds_a[1].get_label().startswith("_") and seeds_b[1].get_label().startswith("_")  # the others: none
    assert (line.get_linestyle(), line.get_linewidth(), line.get_ydata()[0]) == ("--", 1, target)
    assert time_report({"a": "A"}, {"a": points["a"]}, {"a": dirs["a"]}, "recompute", 50.0, tmp_path / "a0", False, "t").endswith(
        "| 3 | 4 | \n") and not (tmp_path / "a0" / "time_to_accuracy.png").exists()


def test_a_round_in_which_no_update_arrives_keeps_the_state_and_aggregates_no_client(tmp_path):
    engine = Engine(timed(devices=DEVICES | {"deadline_s": 0.001}), tmp_path / "run")  # nobody finishes in 1 ms
    torch.manual_seed(0)
    engine.state = state = engine.strategy.init_global_state()
    record = engine.run_round(0)
    assert record["clients"] == 0 and record["rejected"] == 0  # no client could finish: none was sent one
    assert all(engine.state[k] is state[k] for k in state)

"""What the virtual clock promises once the engine runs it, how populations change with the seed
and the round, and the time-to-accuracy target: each test pins a mistake that would leave a run
training and its figures plausible (TESTING.md, "Semantic mistakes").

The engine's rounds use hand-made tier costs (``TierCosts.of`` replaced) so that every round
time is exact: a client of ``n`` images at speed ``S`` on a tier of ``M`` training MACs per image
and ``B`` bytes takes ``n M / S + 2 B / 1e6`` seconds (8 Mbit/s each way)."""

import numpy as np
import pytest
import torch

from nefl_zoo.fl.devices.clock import TierCosts, VirtualClock
from nefl_zoo.fl.engine import Engine
from nefl_zoo.fl.devices.population import DevicesConfig, Population
from nefl_zoo.fl.devices.time_to_accuracy import default_target, time_table

from .conftest import tiny

torch.set_num_threads(1)
MIB = 2.0**20
# the tiny run's tiers, smallest first: training MACs per image, bytes each way, training memory
HAND = TierCosts(("g0.25", "g0.5", "g1"), np.array([2.5e5, 5e5, 1e6]), np.array([1.25e5, 2.5e5, 5e5]), np.array([1, 2, 4]) * MIB)
NET = {"uplink_mbps": 8, "downlink_mbps": 8}  # 1e6 bytes per second each way


def device(name, share, macs_per_s, memory_mb=64, **more):
    return {"name": name, "share": share, "macs_per_s": macs_per_s, "memory_mb": memory_mb, **NET, **more}


def engine_on(tmp_path, monkeypatch, classes, clients=4, deadline_s=2.0, **overrides) -> Engine:
    """The tiny run (one round) on ``classes`` with :data:`HAND`'s costs, its state initialised;
    ``engine.trained`` lists the clients whose local training ran."""
    monkeypatch.setattr(TierCosts, "of", classmethod(lambda cls, strategy, batch_size: HAND))
    devices = {"classes": classes, "deadline_s": deadline_s, **overrides.pop("devices", {})}
    config = tiny(rounds=1, train__local_epochs=overrides.pop("epochs", 1), clients__num_clients=clients, devices=devices, **overrides)
    engine = Engine(config, tmp_path / "run")
    torch.manual_seed(0)
    engine.state = engine.strategy.init_global_state()
    engine.trained = []
    train = engine.strategy.train
    monkeypatch.setattr(engine.strategy, "train", lambda instruction, *a: engine.trained.append(instruction.config["client"]) or train(instruction, *a))
    return engine


def of_class(engine: Engine, name: str) -> list[int]:
    """The clients of the device class ``name``."""
    k = [c.name for c in engine.config.devices.classes].index(name)
    return np.flatnonzero(engine.clock.population.kind == k).tolist()


# -- the clock inside the engine's round ---------------------------------------------------------
def test_a_late_client_is_neither_trained_nor_aggregated(tmp_path, monkeypatch):
    """Two fast clients arrive, two slow ones are late (337 images x 2.5e5 MACs at 1e5 MACs/s:
    843 s against a 2 s deadline): only the fast ones train, the new state is the method's own
    aggregation of their two replies alone, and the record counts the late ones as dropped.
    Broken by hand: ``training = instructions`` in ``Engine.run_round`` (every sampled client
    trained whatever the clock says) fails here."""
    engine = engine_on(tmp_path, monkeypatch, [device("fast", 0.5, 1e9), device("slow", 0.5, 1e5)],
                       devices={"tiers": "environment"}, clients__groups=[["g0.25"]])
    before = {k: v.clone() for k, v in engine.state.items()}
    record = engine.run_round(0)
    fast, slow = of_class(engine, "fast"), of_class(engine, "slow")
    assert len(fast) == len(slow) == 2
    assert sorted(engine.trained) == fast
    assert {int(c): r["status"] for c, r in record["per_client"].items()} == {**{c: "arrived" for c in fast}, **{c: "late" for c in slow}}
    assert all(record["per_client"][str(c)]["bytes_up"] == 0 for c in slow)
    assert (record["clients"], record["dropped"], record["lost"], record["participation"]) == (2, 2, 0, {"g0.25": 2})
    instructions = engine.strategy.configure_train(1, before, engine.clients)
    replies = {c: engine.strategy.train(instructions[c], engine.data.client_dataset(c), {}) for c in fast}
    expected = engine.strategy.aggregate_train(1, before, replies).state
    assert all(torch.equal(engine.state[k], expected[k]) for k in expected)
    assert not all(torch.equal(engine.state[k], before[k]) for k in before)


@pytest.mark.parametrize("edge, speed, memory_mb", [
    ("deadline", 449e6, 64),  # g1: 449 x 1e6 / 449e6 + 2 x 5e5 / 1e6 = 2.0 s, the deadline itself
    ("memory", 449e9, 4),  # 4 MiB: g1's training memory exactly
], ids=["deadline", "memory"])
def test_the_tier_offered_at_the_edge_is_the_tier_the_round_trains(tmp_path, monkeypatch, edge, speed, memory_mb):
    """A device that fits the largest tier exactly (its round time equal to the deadline, or its
    memory equal to the tier's) is offered that tier by ``available()``, trains it, and arrives:
    the clock's choice and its round count the edge alike. Broken by hand, each fails here:
    ``<`` for ``<=`` of the deadline or ``>`` for ``>=`` of the memory in ``available`` (g0.5
    offered), ``>=`` for ``>`` of the deadline (``late``) or ``<=`` for ``<`` of the memory
    (``memory``) in ``run_round``."""
    engine = engine_on(tmp_path, monkeypatch, [device("edge", 1.0, speed, memory_mb)], clients=3, clients__fraction=1 / 3)
    record = engine.run_round(0)
    ((cid, client),) = record["per_client"].items()
    assert (client["tier"], client["status"], engine.trained) == ("g1", "arrived", [int(cid)])
    assert (record["tiers"], record["participation"], record["dropped"]) == ({"g1": 1}, {"g1": 1}, 0)
    if edge == "deadline":
        assert client["sim_s"] == 2.0 and record["sim_round_s"] == 2.0


def test_an_out_of_memory_drop_is_in_the_round_record(tmp_path, monkeypatch):
    """``tiers: environment`` gives every client g1 (4 MiB to train) on 2 MiB devices: each is
    dropped for memory, untrained, and counted among the round's dropped updates. Broken by hand:
    ``dropped`` counting only ``late`` in ``RoundTiming.record``, or the memory check left out of
    ``run_round``, fails here."""
    engine = engine_on(tmp_path, monkeypatch, [device("small", 1.0, 1e9, memory_mb=2)], devices={"tiers": "environment"},
                       clients__groups=[["g1"]])
    state = engine.state
    record = engine.run_round(0)
    assert {r["status"] for r in record["per_client"].values()} == {"memory"} and len(record["per_client"]) == 4
    assert (record["clients"], record["dropped"], record["lost"], record["participation"]) == (0, 4, 0, {})
    assert engine.trained == [] and all(engine.state[k] is state[k] for k in state)
    assert record["sim_round_s"] == 2.0  # nobody arrives: the server waits to the deadline


def test_the_clock_counts_every_local_epoch(tmp_path, monkeypatch):
    """With ``local_epochs: 2`` a client computes twice its images: 2 x 337 x 2.5e5 / 1e9 +
    2 x 1.25e5 / 1e6 s (everyone is late for a 0.1 s deadline, so nothing trains). Broken by
    hand: the engine's clock given ``len(partition)`` samples (one epoch) fails here."""
    engine = engine_on(tmp_path, monkeypatch, [device("a", 1.0, 1e9)], deadline_s=0.1, epochs=2,
                       devices={"tiers": "environment"}, clients__groups=[["g0.25"]])
    record = engine.run_round(0)
    for cid, client in record["per_client"].items():
        images = len(engine.data.client_dataset(int(cid)))
        assert images in (336, 337) and client["status"] == "late"
        assert client["sim_s"] == pytest.approx(2 * images * 2.5e5 / 1e9 + 0.25, rel=1e-12)
    assert engine.trained == []


def test_tier_costs_run_from_the_smallest_tier_whatever_the_names_and_the_spec_order():
    """The clock offers "the last tier that fits" as the largest, so its costs must run by size:
    a spec listing large, small, medium (alphabetically large, medium, small) gives costs for
    small, medium, large, each larger than the one before. Broken by hand: the rows sorted by
    name, or left in spec order, fails here."""
    spec = {"model": "resnet20", "model_args": {"in_chans": 1, "img_size": 8},
            "tiers": [{"name": "large", "gamma_w": 1.0}, {"name": "small", "gamma_w": 0.25}, {"name": "medium", "gamma_w": 0.5}]}
    costs = TierCosts.of(tiny(spec=spec).build_strategy(), batch_size=8)
    assert costs.names == ("small", "medium", "large")
    for column in (costs.train_macs, costs.bytes, costs.memory):
        assert (np.diff(column) > 0).all()


# -- lost or dropped, and when a round ends --------------------------------------------------------
def trace_clock(tmp_path, offline_at, policy):
    """A clock of three clients of 100 images at 1e8 MACs/s, tiers of 1e6, 2e6 and 4e6 training
    MACs per image and 1e5, 2e5 and 4e5 bytes: client 0 goes offline at ``offline_at`` (a
    trace), clients 1 and 2 stay online."""
    trace = tmp_path / "trace.csv"
    trace.write_text(f"client,start_s,end_s\n0,0,{offline_at}\n1,0,1000\n2,0,1000\n")
    devices = DevicesConfig.model_validate({"classes": [device("a", 1.0, 1e8)], "trace": str(trace), "deadline_s": 2.0,
                                            "policy": policy, "tiers": "environment"})
    costs = TierCosts(HAND.names, np.array([1e6, 2e6, 4e6]), np.array([1e5, 2e5, 4e5]), HAND.memory)
    return VirtualClock(devices, costs, [100, 100, 100], seed=0)


@pytest.mark.parametrize("policy, offline_at, status, duration_s", [
    ("wait_all", 3.0, "lost", 3.0),  # offline between the deadline (2 s) and its finish (4.8 s): lost; the wait ends as it leaves
    ("wait_all", 1.0, "lost", 1.2),  # offline before client 1 arrives (1.2 s): the round ends with that arrival
    ("deadline", 3.0, "late", 2.0),  # the round ended at the deadline with it online and working: dropped as late
    ("deadline", 1.0, "lost", 2.0),  # offline before the deadline: lost
], ids=["wait_all-3.0", "wait_all-1.0", "deadline-3.0", "deadline-1.0"])
def test_a_client_leaving_before_its_finish_is_lost_and_the_round_ends_as_the_policy_says(tmp_path, policy, offline_at, status, duration_s):
    """Of three clients online, client 0 trains g1 for 4.8 s (100 x 4e6 / 1e8 + 2 x 4e5 / 1e6), client 1 g0.25 for 1.2 s.
    ``wait_all`` waits for every client still online: one that goes offline before it finishes
    is lost (never dropped) however long after the deadline it leaves, and the round ends at the
    last arrival or departure, never at the lost client's would-be finish. ``deadline`` stops
    waiting at the deadline: a client still online and working then is late (what the server
    sees), one that left before it is lost. Broken by hand, each fails here:
    ``np.minimum(seconds, deadline)`` under ``wait_all`` too (client 0 arrives), ``seconds[lost]``
    for ``offline_after[lost]`` in the wait (4.8 s), the lost clients left out of the wait (1.2 s
    for 3.0 s), ``seconds`` for ``np.minimum(seconds, deadline)`` under ``deadline`` (lost)."""
    c = trace_clock(tmp_path, offline_at, policy)
    timing = c.run_round(0, {0: "g1", 1: "g0.25"})
    assert timing.seconds == pytest.approx({0: 4.8, 1: 1.2}, abs=1e-12)
    assert timing.status == {0: status, 1: "arrived"}
    assert timing.duration_us == round(duration_s * 1e6) and c.time_us == timing.duration_us
    record = timing.record(list(HAND.names))
    assert (record["lost"], record["dropped"]) == ((1, 0) if status == "lost" else (0, 1))
    assert record["participation"] == {"g0.25": 1} and record["online"] == 3  # client 2 online, not in the round


# -- populations: the seed and the round -----------------------------------------------------------
def test_phases_and_speed_factors_follow_the_run_seed_and_speeds_change_every_round():
    """2,000 clients online 40 s of every 100 s, speed jitter 0.5: each client's phase is its own,
    drawn over the whole period from the run seed (another seed, other phases; the same seed, the
    same), and fixed for the run; the speed factor ``exp(0.5 z)`` is log-normal (log mean 0,
    std 0.5), drawn anew each round (two rounds uncorrelated) and from the run seed; the clients
    of each device class are dealt by the run seed too. Broken by
    hand, each fails here: the round left out of the speeds' seed, a fixed seed for the phases,
    the speeds or the classes, phases in [0, 1) unscaled by the period, the factor ``1 + 0.5 z``."""
    devices = DevicesConfig.model_validate({"classes": [device("a", 1.0, 1e9, speed_jitter=0.5,
                                                               availability={"kind": "periodic", "period_s": 100, "online_s": 40})],
                                            "deadline_s": 2.0})
    n = 2000
    first, again, other = Population(devices, n, 0), Population(devices, n, 0), Population(devices, n, 1)
    assert np.array_equal(first.phase, again.phase) and np.mean(first.phase == other.phase) == 0
    assert len(np.unique(first.phase)) == n and 0 <= first.phase.min() < 1 and 99 < first.phase.max() < 100
    assert not np.array_equal(first.online_until(0.0), other.online_until(0.0))
    online = np.isfinite(first.online_until(0.0))
    assert abs(online.mean() - 0.4) < 0.05  # 40 s of every 100 s, over the phases

    log_factor = [np.log(first.speeds(r) / 1e9) for r in range(3)]
    assert np.array_equal(first.speeds(1), again.speeds(1)) and not np.array_equal(first.speeds(1), other.speeds(1))
    assert abs(log_factor[0].mean()) < 4 * 0.5 / n**0.5 and abs(log_factor[0].std() / 0.5 - 1) < 0.06
    for a, b in ((0, 1), (1, 2)):
        assert abs(np.corrcoef(log_factor[a], log_factor[b])[0, 1]) < 0.1

    two = DevicesConfig.model_validate({"classes": [device("a", 0.5, 1e9), device("b", 0.5, 1e8)], "deadline_s": 2.0})
    kinds = [Population(two, 100, seed).kind for seed in (0, 0, 1)]  # who is which device: dealt by the run seed
    assert np.array_equal(kinds[0], kinds[1]) and not np.array_equal(kinds[0], kinds[2])
    assert np.bincount(kinds[0]).tolist() == np.bincount(kinds[2]).tolist() == [50, 50]


# -- time to accuracy --------------------------------------------------------------------------------
def test_the_default_target_is_the_best_accuracy_not_the_last():
    """Entry a's seeds peak at 80 and 70 and end at 60 and 65; b's peak at 90 and 85 and end
    there. The default target is the highest accuracy every entry reaches, the smaller of the
    seed means of the bests (a: 75, b: 87.5), while the final accuracy is the last evaluation's.
    Broken by hand: ``acc[-1]`` for ``acc.max()`` in ``default_target`` (62.5) fails here, and
    the best for the last in ``time_table``'s final accuracy."""
    curves = {"a": [(np.array([1.0, 2.0, 3.0]), np.array([50.0, 80.0, 60.0])), (np.array([1.0, 2.0, 3.0]), np.array([70.0, 68.0, 65.0]))],
              "b": [(np.array([2.0, 4.0]), np.array([40.0, 90.0])), (np.array([2.0, 4.0]), np.array([85.0, 85.0]))]}
    target = default_target(curves)
    assert target == 75.0
    _, data = time_table({"a": "A", "b": "B"}, curves, target, {})
    assert data["a"]["time_to_target_s"] == [2.0, None] and data["b"]["time_to_target_s"] == [4.0, 2.0]
    assert data["a"]["final_accuracy"] == 62.5 and data["b"]["final_accuracy"] == 87.5

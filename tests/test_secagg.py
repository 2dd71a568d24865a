"""Secure aggregation on Flower (``secure_aggregation:``, Flower's SecAgg+): one round of NeFL,
HeteroFL and FjORD gives the plain run's global model within SecAgg+'s quantisation error
(:func:`~nefl_zoo.fl.secagg.sum_error`), the server receives only masked vectors, dropouts are
handled as Flower handles them, and bad settings are refused in one line.

The protocol runs on an :class:`~.support.flower.InProcessGrid` with ``wire``: the nodes'
ClientApp in this process, every message serialised both ways as Flower sends it (no Ray). The
suite's one Flower simulation (Ray) runs NeFL under SecAgg+ too and must give the in-process
run's tensors bit for bit (``test_method_contract_flower.py``; rounding is seeded per client).

The bound, for ``n`` clients, clipping range ``c`` and quantisation range ``Q``: each summed
element (weighted change or weight) is off by less than ``e = n 2c / Q``; an element's mean with
summed weight ``W`` and mean change ``d`` by at most ``e (1 + |d|) / (W - e)``. One round only:
the tiny model's training is chaotic (a 3e-6 nudge of the state moves the next round's loss by
1%), so later rounds differ by more than the aggregation's error.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from nefl_zoo.fl.config import ConfigError  # noqa: E402
from nefl_zoo.fl.engine import Engine  # noqa: E402
from nefl_zoo.fl.flower import FlowerEngine, SimulatedRun, simulate_runs  # noqa: E402
from nefl_zoo.fl.flower.secure import check_secure  # noqa: E402
from nefl_zoo.fl.secagg import Layout, sum_error  # noqa: E402

from .conftest import records, same_tensors, tiny  # noqa: E402
from .support.flower import InProcessGrid  # noqa: E402

torch.set_num_threads(1)
METHODS = ["nefl", "heterofl", "fjord"]


def config(method: str = "nefl", clients: int = 3, **overrides):
    return tiny(method=method, rounds=1, clients__num_clients=clients, train__local_epochs=1, data__max_test_samples=64, **overrides)


def masked_stage(message) -> bool:
    """Whether ``message`` asks a node for its masked vector (SecAgg+'s 'collect masked vectors' stage)."""
    return Key.CIPHERTEXT_LIST in message.content.config_records.get(RECORD_KEY_CONFIGS, {})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per method: the plain embedded run and the secure run on the wire grid (one round), the
    initial global state, the partition sizes, the grid; the client vectors the nodes built."""
    out = tmp_path_factory.mktemp("secagg")
    vectors: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        from flwr.supercore.task_identity import TaskIdentity

        for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
            mp.setattr(TaskIdentity, name, value)
        build = Layout.client_vector
        mp.setattr(Layout, "client_vector", lambda self, *a: vectors.setdefault(len(vectors), build(self, *a)))
        result = {}
        for method in METHODS:
            plain = Engine(config(method), out / f"plain-{method}")
            plain.run()
            torch.manual_seed(0)
            initial = plain.strategy.init_global_state()
            grid = InProcessGrid(3, wire=True)
            secure = FlowerEngine(config(method, secure_aggregation={}), out / f"secure-{method}", grid, timeout=30)
            secure.run()
            sizes = [len(plain.data.client_dataset(c)) for c in range(3)]
            result[method] = (out, initial, sizes, grid, dict(vectors))
            vectors.clear()
    return result


@pytest.mark.parametrize("method", METHODS)
def test_secure_run_equals_the_plain_run_within_the_quantisation_bound(runs, method):
    out, initial, sizes, _, _ = runs[method]
    plain, secure = load_file(str(out / f"plain-{method}" / "global.safetensors")), load_file(str(out / f"secure-{method}" / "global.safetensors"))
    settings = config(method, secure_aggregation={}).secure_aggregation
    e = sum_error(settings, 3)
    assert e == 3 * 2 * 8.0 / 2**22
    w_min = min(sizes) / max(sizes) if method == "fjord" else 1.0  # FjORD weights by samples, scaled by the largest partition
    assert plain.keys() == secure.keys()
    worst = 0.0
    for key, p in plain.items():
        s = secure[key]
        assert s.dtype == p.dtype, key
        diff = (s.double() - p.double()).abs()
        if not p.is_floating_point():  # counters: the bounded mean, rounded
            assert diff.max() <= 1, key
            continue
        change = (p.double() - initial[key].double()).abs()
        bound = e * (1 + change) / (w_min - e) + 4 * torch.finfo(torch.float32).eps * p.double().abs()  # + float32 rounding
        assert bool((diff <= bound).all()), (key, float((diff - bound).max()))
        worst = max(worst, float(diff.max()))
    assert 0 < worst < e  # not bit-identical (quantised), far within the bound
    assert [r["clients"] for r in records(out / f"secure-{method}")] == [3]
    assert records(out / f"secure-{method}")[0]["acc"].keys() == records(out / f"plain-{method}")[0]["acc"].keys()


def test_the_server_receives_only_masked_vectors(runs):
    out, _, _, grid, vectors = runs["nefl"]
    settings = config(secure_aggregation={}).secure_aggregation
    c, q, m = settings.clipping_range, settings.quantization_range, settings.modulus_range
    # no reply carries a tensor: the update exists at the server only as a masked vector
    assert all(not a for r in grid.seen if not r.has_error() for rec in r.content.array_records.values() for a in rec.values())
    masked = [r for r in grid.seen if Key.MASKED_PARAMETERS in r.content.config_records.get(RECORD_KEY_CONFIGS, {})]
    assert len(masked) == len(vectors) == 3
    record = records(out / "secure-nefl")[0]
    for reply in masked:
        seen = np.concatenate([bytes_to_ndarray(b).reshape(-1) for b in reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]])
        assert seen.nbytes == record["per_client"][str(reply.metadata.src_node_id - 1000)]["bytes_up"]
        for (total, weights), _ in vectors.values():  # against every client's own vector: nothing of it shows
            own = np.concatenate([[q], np.round((np.concatenate([total, weights]) + c) * q / (2 * c))])
            assert np.mean(seen == own) < 1e-3
            assert abs(np.corrcoef(seen[1:].astype(float), np.concatenate([total, weights]))[0, 1]) < 0.02
        assert abs(seen.mean() / m - 0.5) < 0.01 and seen.min() >= 0 and seen.max() < m  # uniform over [0, M)
        outside = np.tile(vectors[0][0][1] == 0, 2)  # elements client 0's submodel does not hold
        assert len(np.unique(seen[1:][outside][:1000])) > 990  # masked as well


@pytest.mark.parametrize("dropped, kept", [({1003}, True), ({1002, 1003}, False)])
def test_dropouts_are_unmasked_while_the_threshold_is_met_else_the_round_keeps_the_state(server_identity, tmp_path, dropped, kept):
    # nodes leave after sharing their keys: they never answer the masked-vector stage; 3 of 4 shares unmask
    grid = InProcessGrid(4, {n: lambda answer, sent: None if masked_stage(sent) else answer for n in dropped}, wire=True)
    cfg = config(clients=4, secure_aggregation={"num_shares": 4, "reconstruction_threshold": 3})
    engine = FlowerEngine(cfg, tmp_path, grid, timeout=0.5)
    torch.manual_seed(0)
    engine.state = state = engine.strategy.init_global_state()
    record = engine.run_round(0)
    if not kept:
        assert record["clients"] == 0 and record["rejected"] == 4
        assert all(engine.state[k] is state[k] for k in state)
        return
    assert record["clients"] == 3 and record["rejected"] == 1
    instructions = engine.strategy.configure_train(1, state, engine.clients)
    replies = {cid: engine.strategy.train(instructions[cid], engine.data.client_dataset(cid), {}) for cid in range(3)}
    expected = engine.strategy.strategy.aggregate_train(1, state, replies).state
    e = sum_error(cfg.secure_aggregation, 3)
    for key, p in expected.items():
        if p.is_floating_point():
            assert bool(((engine.state[key].double() - p.double()).abs() <= e * (1 + (p.double() - state[key].double()).abs()) / (1 - e) + 1e-6).all()), key


@pytest.mark.parametrize("settings, message", [
    ({"num_shares": 2}, "secure_aggregation.num_shares: an integer must be above 2"),
    ({"reconstruction_threshold": 1.5}, "secure_aggregation.reconstruction_threshold: a share must be in (0, 1]"),
    ({"num_shares": 3, "reconstruction_threshold": 3}, "below num_shares"),
    ({"clipping_range": -1}, "secure_aggregation.clipping_range"),
    ({"modulus_range": 3000}, "must be a power of 2"),
])
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError) as info:
        config(secure_aggregation=settings)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    ({"method": "fedgh"}, "fedgh aggregates individual updates, not sums"),
    ({"aggregation": {"rule": "median"}}, "aggregation.rule, clip and dp (individual updates) cannot apply"),
    ({"clients__fraction": 0.25}, "SecAgg+ needs at least 2 clients per round"),
    ({"secure_aggregation": {"quantization_range": 2**31}}, "overflow modulus_range"),
])
def test_runs_secure_aggregation_cannot_serve_are_refused_before_they_start(overrides, message):
    overrides = dict(overrides)  # the parameter itself stays as written (mutmut runs the tests twice in one process)
    secure = overrides.pop("secure_aggregation", {})
    cfg = tiny(**{"secure_aggregation": secure, **overrides})
    with pytest.raises(ConfigError) as info:
        check_secure(cfg)
    assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError):
        simulate_runs([SimulatedRun(cfg, "unused")])  # before Ray starts


def test_the_in_process_engine_refuses_secure_aggregation_and_flower_refuses_the_virtual_clock(tmp_path):
    """The in-process server sees every update, so it does not pretend to aggregate securely;
    Flower's engine has no virtual clock. Both refuse in one line, before a run directory exists."""
    with pytest.raises(ConfigError, match=r"secure_aggregation: runs on Flower's SecAgg\+: add --engine flower") as info:
        Engine(config(secure_aggregation={}), tmp_path / "embedded")
    assert "\n" not in str(info.value) and not (tmp_path / "embedded").exists()
    laptop = {"name": "laptop", "share": 1.0, "macs_per_s": 2e9, "memory_mb": 64, "uplink_mbps": 20, "downlink_mbps": 20}
    clocked = tiny(devices={"classes": [laptop], "deadline_s": 5.0})
    with pytest.raises(ConfigError, match=r"devices: the virtual clock runs on the in-process engine") as info:
        simulate_runs([SimulatedRun(clocked, tmp_path / "flower")])  # before Ray starts
    assert "\n" not in str(info.value) and not (tmp_path / "flower").exists()


def test_a_secure_run_resumes_bit_for_bit_after_a_kill(tmp_path, monkeypatch):
    """Stochastic rounding is seeded by each client's training seed and the masks cancel, so a
    secure run killed after round 1 and resumed gives the uninterrupted run's tensors and records."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)
    cfg = tiny(method="nefl", rounds=2, checkpoint_every=1, clients__num_clients=3, train__local_epochs=1,
               data__max_test_samples=64, secure_aggregation={})
    FlowerEngine(cfg, tmp_path / "straight", InProcessGrid(3, wire=True), timeout=30).run()
    original = Engine.run_round

    def dies(self, index):
        if index == 1:
            raise KeyboardInterrupt("simulated crash")
        return original(self, index)

    monkeypatch.setattr(Engine, "run_round", dies)
    with pytest.raises(KeyboardInterrupt):
        FlowerEngine(cfg, tmp_path / "resumed", InProcessGrid(3, wire=True), timeout=30).run()
    monkeypatch.setattr(Engine, "run_round", original)
    FlowerEngine(cfg, tmp_path / "resumed", InProcessGrid(3, wire=True), timeout=30).run(resume=True)
    assert same_tensors(tmp_path / "straight", tmp_path / "resumed")
    assert records(tmp_path / "resumed") == records(tmp_path / "straight") and len(records(tmp_path / "straight")) == 2

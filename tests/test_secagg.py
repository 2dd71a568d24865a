"""Secure aggregation on Flower (``secure_aggregation:``, Flower's SecAgg+): one round of NeFL,
HeteroFL and FjORD gives the plain run's global model within SecAgg+'s quantisation error
(:func:`~nefl_zoo.fl.aggregation.secagg.sum_error`), the server receives only masked vectors, dropouts are
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

from flwr.app import RecordDict  # noqa: E402
from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from nefl_zoo.fl.config import ConfigError  # noqa: E402
from nefl_zoo.fl.engine import Engine  # noqa: E402
from nefl_zoo.fl.flower import FlowerEngine, SimulatedRun, simulate_runs  # noqa: E402
from nefl_zoo.fl.flower.secure import check_secure  # noqa: E402
from nefl_zoo.fl.aggregation.secagg import Layout, SecureAggregation, sum_error
from nefl_zoo.fl.methods.common import weight_scale  # noqa: E402

from .conftest import records, same_tensors, set_server_identity, tiny  # noqa: E402
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
        set_server_identity(mp)
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


def test_client_weights_are_scaled_into_0_1_and_one_lost_in_the_quantisation_is_refused():
    """Sample weights are divided by the largest partition (per-client weights are 1 already); a
    smallest weight within twice the sum's error would read as 'no client held it': refused."""
    settings = SecureAggregation()
    samples = config(train__weighting="samples").build_strategy()
    assert weight_scale(samples, [100, 300, 200], settings, 3) == 1 / 300
    assert 2 * sum_error(settings, 2) == 2 * 2 * 16 / 2**22  # 1 / 10**6 is well within it
    with pytest.raises(ValueError, match=r"smallest client weight \(1e-06 scaled\) is within .*raise quantization_range"):
        weight_scale(samples, [1, 10**6], settings, 2)
    assert weight_scale(config(train__weighting="clients").build_strategy(), [1, 10**6], settings, 2) == 1.0


def test_a_client_vector_refuses_what_aggregation_would_and_sums_treat_weights_within_the_error_as_unheld():
    strategy = config().build_strategy()
    state = strategy.init_global_state()
    layout = Layout(strategy, state)
    level = strategy.info.levels[0]
    sent = {k: torch.zeros(e.shape) for k, e in strategy.entries(level).items()}
    returned = dict(sent)
    key = next(k for k, t in sent.items() if t.is_floating_point())
    returned[key] = torch.full(sent[key].shape, float("nan"))
    with pytest.raises(ValueError, match=f"update rejected: {key}: contains NaN or Inf"):
        layout.client_vector(sent, returned, level, 1.0, 8.0)
    first, shape = next(iter(layout.shapes.items()))
    n = int(np.prod(shape))
    error = 1e-5
    weights = np.zeros(sum(int(np.prod(s)) for s in layout.shapes.values()))
    weights[:3] = [error, 2 * error, 1.0]  # exactly the error: unheld; above it: held
    total = np.ones_like(weights)
    sums = layout.sums(state, total, weights, error)
    held = sums.weight[first].reshape(-1)[:3]
    assert held.tolist() == [0.0, 2 * error, 1.0] and n >= 3
    expected = total[:3] * layout.units[first] * (held > 0).numpy() + held.numpy() * state[first].reshape(-1)[:3].double().numpy()
    assert sums.total[first].reshape(-1)[:3].tolist() == expected.tolist()


def test_protocol_bytes_are_every_secagg_message_down_and_every_answer_up(runs):
    """A round's ``secagg_bytes``: the content of every protocol message pushed (down) and of every
    answer delivered (up), evaluation messages aside; content_bytes counts array data, bytes and
    strings by length and any other config value as 8."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from nefl_zoo.fl.flower.secure import content_bytes

    array = Array(np.zeros((2, 3), dtype=np.float32))  # its data: the .npy bytes, a 128-byte header and 24 of floats
    content = RecordDict({"a": ArrayRecord({"x": array}),
                          "c": ConfigRecord({"b": b"abc", "s": "hello", "i": 7, "l": [b"ab", b"c"], "f": [1.5, 2.5]})})
    assert len(array.data) == 128 + 24 and content_bytes(content) == len(array.data) + 3 + 5 + 8 + (2 + 1) + (8 + 8)
    _, _, _, grid, _ = runs["nefl"]
    protocol = [m for m in grid.pushed if RECORD_KEY_CONFIGS in m.content.config_records]
    answers = [r for r in grid.seen if not r.has_error() and RECORD_KEY_CONFIGS in r.content.config_records]
    assert len(protocol) == len(answers) >= 3 * 4  # four SecAgg+ stages, three nodes
    assert {m.metadata.group_id for m in protocol} == {"1"}  # the workflow is told the round
    down, up = sum(content_bytes(m.content) for m in protocol), sum(content_bytes(r.content) for r in answers)
    out = runs["nefl"][0]
    assert records(out / "secure-nefl")[0]["secagg_bytes"] == {"down": down, "up": up} and 0 < down and 0 < up


def test_the_node_side_passes_other_messages_and_answers_a_failure_with_an_error_reply(server_identity, caplog):
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from nefl_zoo.fl.flower.secure import secure_mod

    context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    plain = Message(RecordDict(), dst_node_id=5, message_type="train")
    seen = []
    assert secure_mod(plain, context, lambda m, c: seen.append((m, c)) or "answer") == "answer"
    assert seen == [(plain, context)]
    broken = Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({"stage": "no such stage"})}), dst_node_id=5, message_type="train")
    state = np.random.get_state()
    with caplog.at_level("WARNING", logger="nefl_zoo.fl.flower.secure"):
        reply = secure_mod(broken, context, lambda m, c: pytest.fail("a broken SecAgg+ message reached training"))
    assert reply.has_error() and reply.error.reason.startswith("secure aggregation: ")
    assert [r.getMessage() for r in caplog.records] == [f"secure aggregation failed on this node: {reply.error.reason.removeprefix('secure aggregation: ')}"]
    assert all((a == b).all() if isinstance(a, np.ndarray) else a == b for a, b in zip(np.random.get_state(), state))


def test_a_clipped_update_and_rejected_replies_are_logged_by_client(caplog):
    from nefl_zoo.fl.flower.secure import SecureMethod, secure_content
    from nefl_zoo.fl.strategy.base import ClientInfo, Reply

    strategy = config().build_strategy()
    state = strategy.init_global_state()
    level = strategy.info.levels[-1]
    instruction = strategy.configure_train(1, state, [ClientInfo(0, (level,))])[0]
    key = next(k for k, t in instruction.arrays.items() if t.is_floating_point() and t.numel() > 1)
    returned = {k: t + 3.0 if k == key else t.clone() for k, t in instruction.arrays.items()}
    with caplog.at_level("WARNING", logger="nefl_zoo.fl.flower.secure"):
        secure_content(strategy, instruction, Reply(returned, num_samples=10, level=level), {"scale": 1.0, "clip": 2.0})
        method = SecureMethod(strategy, SecureAggregation(), 1.0, timeout=1.0, poll=0.01, stop=None)
        kept = method.aggregate_train(1, state, {7: Reply({}, error="no reply"), 9: Reply({}, error="bad shape")})
    n = instruction.arrays[key].numel()
    assert [r.getMessage() for r in caplog.records] == [
        f"{n} elements of this client's update exceed secure_aggregation.clipping_range and are clipped",
        "client 7: reply rejected: no reply", "client 9: reply rejected: bad shape"]
    assert kept.rejected == [(7, "no reply"), (9, "bad shape")] and kept.accepted == 0 and kept.state == state


def test_a_stopped_run_stops_waiting_for_secure_aggregation_replies(server_identity):
    import threading

    from nefl_zoo.fl.flower.nodes import Stopped
    from nefl_zoo.fl.flower.secure import SecureMethod

    class Silent:  # a grid whose nodes never answer
        def get_node_ids(self):
            return [1, 2]

        def push_messages(self, messages):
            return [f"m{i}" for i, _ in enumerate(messages)]

        def pull_messages(self, ids):
            return []

    stop = threading.Event()
    stop.set()
    method = SecureMethod(config().build_strategy(), SecureAggregation(), 1.0, timeout=5.0, poll=0.01, stop=stop)
    with pytest.raises(Stopped):
        method.exchange(Silent(), 1, {1: (0, RecordDict(), 1), 2: (1, RecordDict(), 2)})


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


def test_a_secure_run_resumes_bit_for_bit_after_a_kill(tmp_path, monkeypatch, server_identity):
    """Stochastic rounding is seeded by each client's training seed and the masks cancel, so a
    secure run killed after round 1 and resumed gives the uninterrupted run's tensors and records."""
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

"""The strategy interface: hooks driven by hand (no engine), the registry, FedProx, and the
per-client / server state the engine keeps and checkpoints."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from nefl_zoo.fl.strategy import registry
from nefl_zoo.fl.engine import Engine
from nefl_zoo.fl.methods.nefl import NeFL
from nefl_zoo.fl.strategy.registry import register_method
from nefl_zoo.fl.strategy.base import ClientInfo, Reply
from nefl_zoo.slim import tier_key

from .conftest import crash_in_round, same_tensors, tiny

torch.set_num_threads(1)


def filled(strategy, tier, value):
    """A reply of ``tier`` whose every tensor is ``value`` (what a client of that tier returns)."""
    entries = strategy.entries(tier)
    arrays = {k: torch.full(e.shape, value, dtype=strategy.compiled.full_dtypes[k]) for k, e in entries.items()}
    return Reply(arrays, num_samples=10, loss=1.0, level=tier)


def test_aggregate_train_on_hand_made_replies_rejects_failed_and_nan_and_still_produces_the_state():
    # Prepare
    strategy = tiny().build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    nan = filled(strategy, "g0.5", 5.0)
    nan.arrays["layer1.0.conv1.weight"][0, 0, 0, 0] = float("nan")
    replies = {
        0: filled(strategy, "g0.25", 1.0),
        1: Reply({}, {}, error="client ran out of memory"),
        2: nan,
        3: filled(strategy, "g1", 3.0),
        4: Reply(filled(strategy, "g0.5", 7.0).arrays, num_samples=10),  # does not say its level
    }
    # Execute
    result = strategy.aggregate_train(1, state, replies)
    # Assert
    assert result.accepted == 2
    assert [cid for cid, _ in sorted(result.rejected)] == [1, 2, 4]
    assert "out of memory" in dict(result.rejected)[1] and "NaN" in dict(result.rejected)[2]
    assert "level None is not a submodel" in dict(result.rejected)[4]
    new = result.state
    narrow = strategy.compiled["g0.25"].slice_map["layer1.0.conv1.weight"].shape
    conv = new["layer1.0.conv1.weight"]
    assert torch.equal(conv[: narrow[0], : narrow[1]], torch.full_like(conv[: narrow[0], : narrow[1]], 2.0))  # (1 + 3) / 2
    assert bool((conv[narrow[0]:] == 3.0).all()) and bool((conv[:, narrow[1]:] == 3.0).all())  # only g1 holds these
    assert bool((new[tier_key("bn1.weight", "g0.25")] == 1.0).all())  # FedAvg within tier g0.25
    for key in state:  # the rejected g0.5 reply changed nothing of its own tier
        if key.endswith("@g0.5"):
            assert new[key] is state[key]


def test_configure_train_sends_each_sampled_client_its_submodel():
    strategy = tiny(clients__fraction=0.5).build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    clients = [ClientInfo(c, ("g0.25", "g0.5", "g1")) for c in range(4)]
    instructions = strategy.configure_train(3, state, clients)
    assert len(instructions) == 2 and list(instructions) == sorted(instructions)
    for cid, instruction in instructions.items():
        tier = instruction.level
        expected = strategy.compiled[tier].extract(state)
        assert instruction.arrays.keys() == expected.keys()
        assert all(torch.equal(instruction.arrays[k], expected[k]) for k in expected)
        assert instruction.config["round"] == 3 and instruction.config["client"] == cid
        assert instruction.config["lr"] == 0.1 and instruction.config["local_epochs"] == 2
    assert strategy.configure_train(3, state, clients).keys() == instructions.keys()  # seeded by round


@pytest.mark.parametrize("method, trained", [("fedavg", {0, 1, 2, 3}), ("fedavg_full", {2, 3})])
def test_fedavg_trains_the_full_model_on_every_client_or_only_on_full_model_clients(method, trained):
    """``fedavg`` sends every sampled client the full model whatever its levels; ``fedavg_full``
    only the clients whose environment allows it (the others sit the round out)."""
    strategy = tiny(method=method, clients__fraction=1.0).build_strategy()
    state = strategy.init_global_state()
    clients = [ClientInfo(0, ("g0.25",)), ClientInfo(1, ("g0.25", "g0.5")), ClientInfo(2, ("g0.5", "g1")), ClientInfo(3, ("g1",))]
    instructions = strategy.configure_train(1, state, clients)
    assert set(instructions) == trained and {i.level for i in instructions.values()} == {"g1"}


def test_fedavg_min_trains_the_smallest_tier_by_size_not_by_name():
    tiers = [{"name": "full", "gamma_w": 1.0}, {"name": "half", "gamma_w": 0.5}, {"name": "quarter", "gamma_w": 0.25}]
    strategy = tiny(method="fedavg_min", spec__tiers=tiers).build_strategy()
    state = strategy.init_global_state()
    clients = [ClientInfo(0, ("quarter",)), ClientInfo(1, ("half", "full")), ClientInfo(2, ("full",))]
    instructions = strategy.configure_train(1, state, clients)
    assert strategy.info.levels == ("quarter",)
    assert set(instructions) == {0, 1, 2} and {i.level for i in instructions.values()} == {"quarter"}


def test_fedavgm_moves_the_global_model_by_server_momentum_and_averages_statistics():
    strategy = tiny(method="fedavgm", method_args={"server_lr": 0.5, "momentum": 0.25}).build_strategy()
    torch.manual_seed(0)
    w0 = strategy.init_global_state()
    weight, stat = "layer1.0.conv1.weight", next(k for k in w0 if "running_mean" in k)
    # round 1: both replies hold 1 (w_avg = 1): d = w0 - 1, v = d, w1 = w0 - 0.5 * d
    first = strategy.aggregate_train(1, w0, {0: filled(strategy, "g1", 1.0), 1: filled(strategy, "g1", 1.0),
                                             2: Reply({}, {}, error="client ran out of memory")})
    assert first.accepted == 2 and [cid for cid, _ in first.rejected] == [2]
    d1 = w0[weight] - 1.0
    assert torch.allclose(first.state[weight], w0[weight] - 0.5 * d1)
    assert torch.equal(first.state[stat], torch.ones_like(w0[stat]))  # statistics averaged, not moved
    assert stat not in strategy.server_state() and torch.allclose(strategy.server_state()[weight], d1)
    # round 2: replies hold 3: v = 0.25 * v + (w1 - 3), w2 = w1 - 0.5 * v
    w1 = first.state
    second = strategy.aggregate_train(2, w1, {0: filled(strategy, "g1", 3.0)})
    v2 = 0.25 * d1 + (w1[weight] - 3.0)
    assert torch.allclose(second.state[weight], w1[weight] - 0.5 * v2)
    # a round without an accepted reply changes neither the model nor the momentum
    idle = strategy.aggregate_train(3, second.state, {0: Reply({}, {}, error="gone")})
    assert idle.accepted == 0 and torch.equal(idle.state[weight], second.state[weight])
    assert torch.allclose(strategy.server_state()[weight], v2)
    # the momentum is server state: a fresh strategy loaded with it takes the same next step
    resumed = tiny(method="fedavgm", method_args={"server_lr": 0.5, "momentum": 0.25}).build_strategy()
    resumed.load_server_state(strategy.server_state())
    replies = {0: filled(strategy, "g1", 2.0)}
    assert torch.equal(resumed.aggregate_train(3, second.state, replies).state[weight],
                       strategy.aggregate_train(3, second.state, replies).state[weight])
    bad = {f"w{i}": torch.zeros(1) for i in range(5)}
    with pytest.raises(ValueError) as error:
        resumed.load_server_state(bad)
    assert str(error.value) == "fedavgm: server state holds ['w0', 'w1', 'w2'], not momentum of the global state"


def test_registry_refuses_a_second_method_of_the_same_name():
    with pytest.raises(ValueError, match="'nefl' is registered twice"):
        register_method("nefl", label="again")(type("Again", (NeFL,), {}))


def test_fedprox_adds_the_proximal_term_to_the_loss():
    strategy = tiny(method="fedprox", method_args={"mu": 0.5}).build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    local = strategy.client_model("g0.25", strategy.compiled["g0.25"].extract(state))
    local.eval()
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    fc = local.base.net.fc.weight
    with torch.no_grad():
        assert float(local.loss(x, y)[0] - local.base.loss(x, y)[0]) == 0.0  # at the received weights
        fc.add_(0.1)  # every classifier weight moves 0.1 from what the client received
        loss, _ = local.loss(x, y)
        base, _ = local.base.loss(x, y)
    assert float(loss - base) == pytest.approx(0.5 / 2 * fc.numel() * 0.1**2, rel=1e-4)
    assert torch.equal(local(x), local.base(x))  # the term is in the loss only
    # the received values are buffers that move with the model but are not part of its state
    assert any(k.startswith("anchor") for k, _ in local.named_buffers())
    assert not any(k.startswith("anchor") for k in local.state_dict())


def test_fedprox_with_mu_zero_gives_nefl_tensors_exactly_and_mu_changes_the_update(tmp_path):
    def final(method, **args):
        out = tmp_path / f"{method}-{args}"
        # FedProx averages by samples by default; with NeFL's weights (1 per client) and mu = 0 it is NeFL
        Engine(tiny(method=method, rounds=1, train__local_epochs=1, eval__every=1, method_args=args, train__weighting="clients"), out).run()
        return load_file(str(out / "global.safetensors"))

    nefl, prox0, prox = final("nefl"), final("fedprox", mu=0.0), final("fedprox", mu=1.0)
    assert nefl.keys() == prox0.keys() == prox.keys()
    assert all(torch.equal(nefl[k], prox0[k]) for k in nefl)
    assert not torch.equal(nefl["layer1.0.conv1.weight"], prox["layer1.0.conv1.weight"])


class Counting(NeFL):
    """NeFL that counts, per client, the rounds it trained (client state) and, on the server,
    the aggregations (server state)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aggregations = torch.zeros((), dtype=torch.int64)

    def train(self, instruction, data, client_state):
        client_state["rounds"] = client_state.get("rounds", torch.zeros((), dtype=torch.int64)) + 1
        return super().train(instruction, data, client_state)

    def aggregate_train(self, server_round, global_state, replies):
        self.aggregations = self.aggregations + 1
        return super().aggregate_train(server_round, global_state, replies)

    def server_state(self):
        return {"aggregations": self.aggregations}

    def load_server_state(self, state):
        self.aggregations = state["aggregations"]


def test_client_and_server_state_survive_a_crash_and_resume(tmp_path, monkeypatch):
    """A method registered from outside the package: the engine keeps its client and server state."""
    monkeypatch.setattr(registry, "_METHODS", registry.registered_methods())
    register_method("counting", label="Counting")(Counting)
    # 3 clients, one sampled per round, one local epoch, 3 rounds, checkpoint every round
    config = tiny(method="counting", rounds=3, checkpoint_every=1, clients__num_clients=3, clients__fraction=0.34,
                  train__local_epochs=1, eval__every=3, data__max_test_samples=16)

    Engine(config, tmp_path / "straight").run()
    crash_in_round(config, tmp_path / "resumed", monkeypatch, 1)
    Engine(config, tmp_path / "resumed").run(resume=True)

    for run in ("straight", "resumed"):
        clients = load_file(str(tmp_path / run / "clients.safetensors"))
        assert sum(int(v) for v in clients.values()) == 3  # one client trained per round
        assert int(load_file(str(tmp_path / run / "server.safetensors"))["aggregations"]) == 3
        assert json.loads((tmp_path / run / "checkpoint.json").read_text())["round"] == 3
    assert same_tensors(tmp_path / "straight", tmp_path / "resumed")
    assert same_tensors(tmp_path / "straight", tmp_path / "resumed", "clients.safetensors")


BUILTIN_METHODS = ["depthfl", "fedavg", "fedavg_min", "fedavg_full", "fedavgm", "fedgh", "fedlps", "fedprox", "fjord",
                   "heterofl", "nefl"]  # by module name, then in each module's registration order


def test_the_builtin_methods_are_found_in_a_fresh_process_in_module_order():
    import subprocess
    import sys

    code = ("from nefl_zoo.fl.strategy.registry import registered_methods, _BUILTIN_MODULES\n"
            "print(','.join(registered_methods())); print(','.join(_BUILTIN_MODULES))")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert lines[0].split(",") == BUILTIN_METHODS
    assert lines[1].split(",") == [f"nefl_zoo.fl.methods.{m}" for m in
                                   ("common", "depthfl", "fedavg", "fedavgm", "feddyn", "fedgh", "fedlps", "fedprox", "fjord",
                                    "heterofl", "nefl")]  # common and feddyn: shared, registering nothing


def test_an_unknown_method_lists_the_known_ones():
    with pytest.raises(KeyError) as unknown:
        registry.get_method("fedsgd")
    assert unknown.value.args[0] == f"unknown method 'fedsgd'; one of {', '.join(BUILTIN_METHODS)}"


def test_the_strategy_base_refuses_in_words_that_name_the_method():
    from types import SimpleNamespace

    from nefl_zoo.fl.strategy.base import MethodInfo, Strategy

    spec = tiny().submodel_spec()
    with pytest.raises(ValueError, match=r"^worst_case 'g2' is not one of eval_names \['g0\.25', 'g1'\]$"):
        MethodInfo(spec, (1, 8, 8), 10, ("g1",), ("g0.25", "g1"), worst_case="g2")
    info = MethodInfo(spec, (1, 8, 8), 10, ("g1",), ("g0.25", "g1"), worst_case="g0.25")
    assert info.summary({"g1": 0.5, "g0.25": 0.25}) == {"worst": 0.25, "avg": 0.375, "min": 0.25}
    assert math.isnan(info.summary({"g1": 0.5})["worst"])  # the worst case was not evaluated

    class Bare(Strategy):  # no registered name
        init_global_state = configure_train = aggregate_train = evaluate = train = lambda self, *args: None

    class Named(Bare):
        name = "named"

    robust = SimpleNamespace(aggregation=SimpleNamespace(plain=False))
    tail = " does not average nested updates, so robust rules, clipping and dp cannot apply; remove the section"
    for cls, name in ((Bare, "Bare"), (Named, "named")):
        with pytest.raises(ValueError) as info_:
            cls(robust)
        assert str(info_.value) == f"aggregation: {name}{tail}"
    plain = Named(SimpleNamespace(aggregation=SimpleNamespace(plain=True)))
    with pytest.raises(NotImplementedError, match=r"^named does not evaluate on clients$"):
        plain.evaluate_client(None, None, {})
    plain.load_server_state({})  # nothing kept, nothing to restore
    with pytest.raises(ValueError, match=r"^named: keeps no server state, got \['a', 'b', 'c'\]$"):
        plain.load_server_state({k: torch.zeros(1) for k in "dcba"})


def test_per_client_evaluation_scores_each_clients_largest_tier_on_its_own_data(caplog):
    """``eval.per_client``: a client gets the submodel of its largest level and scores it on its
    data; a rejected train reply is logged with the client's id."""
    import logging

    from torch.utils.data import TensorDataset

    strategy = tiny(eval__per_client=True).build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    clients = [ClientInfo(0, ("g0.25", "g0.5")), ClientInfo(1, ("g1",)), ClientInfo(2, ("g0.25",))]
    instructions = strategy.configure_evaluate(1, state, clients)
    assert {c: i.level for c, i in instructions.items()} == {0: "g0.5", 1: "g1", 2: "g0.25"}
    data = TensorDataset(torch.randn(40, 1, 8, 8), torch.arange(40) % 10)
    for cid, instruction in instructions.items():
        model = strategy.compiled[instruction.level].load(state).eval()
        with torch.no_grad():
            expected = int((model(data.tensors[0]).argmax(1) == data.tensors[1]).sum()) / 40
        reply = strategy.evaluate_client(instruction, data, {})
        assert (reply.metrics, reply.num_samples, reply.level) == ({"accuracy": expected}, 40, instruction.level)
    assert tiny().build_strategy().configure_evaluate(1, state, clients) == {}  # off by default
    with caplog.at_level(logging.WARNING):
        strategy.configure_train(1, state, [ClientInfo(0, ("g1",))])
        kept = strategy.aggregate_train(1, state, {0: Reply({}, error="no reply within 5 s")})
    assert kept.rejected == [(0, "no reply within 5 s")]
    assert "client 0: reply rejected: no reply within 5 s" in [r.getMessage() for r in caplog.records]

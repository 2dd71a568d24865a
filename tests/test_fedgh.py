"""FedGH: LARs, the server-side header update, reply checks, per-client held-out splits and a
few rounds on digits with personalised extractors (their bit-identical resume:
tests/test_method_contract.py)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from nefl_zoo.data.loading import local_split
from nefl_zoo.fl.engine import Engine
from nefl_zoo.fl.methods.fedgh import local_averaged_representations
from nefl_zoo.fl.strategy.base import Reply

from .conftest import tiny

torch.set_num_threads(1)


def fedgh(**overrides):
    """Six clients, one fixed extractor type per pair, two label shards each, 8:1:1 local splits."""
    args = dict(method="fedgh", clients__num_clients=6, clients__fraction=1.0, clients__environment="fixed",
                data__partition="shards", data__local_split=[0.8, 0.1, 0.1], method_args={"rep_dim": 32},
                train__lr=0.05)
    return tiny(**(args | overrides))


def test_lars_are_the_class_means_of_the_representations():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [10.0, 0.0], [5.0, 6.0], [0.0, 20.0]])
    y = torch.tensor([1, 1, 4, 1, 4])
    lar, classes = local_averaged_representations(nn.Identity(), TensorDataset(x, y), seed=0, batch_size=2)
    assert classes.tolist() == [1, 4] and classes.dtype == torch.int64
    assert torch.equal(lar, torch.tensor([[3.0, 4.0], [5.0, 10.0]]))


def test_server_trains_the_global_header_with_its_own_sgd_one_step_per_lar():
    strategy = fedgh(method_args={"rep_dim": 3, "server_lr": 0.5}).build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    lar = torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 3.0]])
    classes = torch.tensor([2, 7])
    reply = Reply({"lar": lar, "lar_classes": classes}, num_samples=5, level="g1")
    result = strategy.aggregate_train(1, state, {0: reply})
    # by hand: for linear logits z = Wx + b, dCE/dW = (softmax(z) - onehot(y)) x^T, dCE/db = softmax(z) - onehot(y)
    w, b = state["header.weight"].clone(), state["header.bias"].clone()
    for x, c in zip(lar, classes.tolist()):
        err = torch.softmax(w @ x + b, 0)
        err[c] -= 1
        w, b = w - 0.5 * torch.outer(err, x), b - 0.5 * err
    torch.testing.assert_close(result.state["header.weight"], w, rtol=0, atol=1e-6)
    torch.testing.assert_close(result.state["header.bias"], b, rtol=0, atol=1e-6)
    before = nn.functional.cross_entropy(lar @ state["header.weight"].T + state["header.bias"], classes)
    after = nn.functional.cross_entropy(lar @ result.state["header.weight"].T + result.state["header.bias"], classes)
    assert float(after) < float(before) and result.accepted == 1


@pytest.mark.parametrize("server_lr", ["default", None])
def test_the_header_learns_at_the_papers_fixed_rate_by_default_or_at_the_local_schedule(server_lr):
    """The paper trains the header at a fixed 0.01; ``server_lr: null`` follows the local lr."""
    from nefl_zoo.fl.training.client import learning_rate

    args = {"rep_dim": 3} | ({} if server_lr == "default" else {"server_lr": None})
    config = fedgh(method_args=args, train__schedule="step")
    strategy = config.build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    x, c = torch.tensor([1.0, -2.0, 0.5]), 4
    for server_round in (1, config.rounds):
        lr = 0.01 if server_lr == "default" else learning_rate(config.train, server_round - 1, config.rounds)
        result = strategy.aggregate_train(server_round, state, {0: Reply({"lar": x[None], "lar_classes": torch.tensor([c])}, level="g1")})
        err = torch.softmax(state["header.weight"] @ x + state["header.bias"], 0)
        err[c] -= 1
        torch.testing.assert_close(result.state["header.bias"], state["header.bias"] - lr * err, rtol=0, atol=1e-7)
    assert learning_rate(config.train, 0, config.rounds) != 0.01 != learning_rate(config.train, config.rounds - 1, config.rounds)
    assert learning_rate(config.train, 0, config.rounds) != learning_rate(config.train, config.rounds - 1, config.rounds)


def test_bad_replies_are_rejected_and_the_header_still_updates():
    strategy = fedgh(method_args={"rep_dim": 3}).build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    good = Reply({"lar": torch.ones(1, 3), "lar_classes": torch.tensor([1])}, level="g1")
    replies = {
        0: good,
        1: Reply({"lar": torch.full((1, 3), float("nan")), "lar_classes": torch.tensor([1])}, {}),
        2: Reply({"lar": torch.ones(2, 4), "lar_classes": torch.tensor([1, 2])}, {}),
        3: Reply({"lar": torch.ones(2, 3), "lar_classes": torch.tensor([1, 1])}, {}),
        4: Reply({}, {}, error="crashed"),
    }
    result = strategy.aggregate_train(1, state, replies)
    assert result.accepted == 1 and dict(result.rejected) == {
        1: "lar contains NaN or Inf", 2: "lar shape (2, 4) and classes (2,) do not match (N, 3) and (N,)",
        3: "lar_classes must be distinct class indices", 4: "crashed"}
    # what a client downloads and uploads per round: the header, (rep_dim + 1) x classes
    assert set(strategy.info.numel.values()) == {(3 + 1) * strategy.num_classes}
    assert not torch.equal(result.state["header.weight"], state["header.weight"])


def test_local_split_is_8_1_1_disjoint_and_seeded():
    parts = [np.arange(0, 50), np.arange(50, 70)]
    train, holdout = local_split(parts, (0.8, 0.1, 0.1), seed=3)
    assert [len(t) for t in train] == [40, 16] and [(len(v), len(t)) for v, t in holdout] == [(5, 5), (2, 2)]
    for part, tr, (val, test) in zip(parts, train, holdout):
        together = np.concatenate([tr, val, test])
        assert sorted(together.tolist()) == part.tolist()  # disjoint and complete
    again, _ = local_split(parts, (0.8, 0.1, 0.1), seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(train, again))


def test_fedgh_learns_personalised_models(tmp_path):
    """(Resuming bit-identically with the extractors as client state: tests/test_method_contract.py.)"""
    result = Engine(fedgh(rounds=3, eval__every=3), tmp_path / "straight").run()
    assert set(result.acc) == {"g0.25", "g0.5", "g1"}  # every extractor type is evaluated
    assert all(acc > 0.5 for acc in result.acc.values()), result.acc  # chance is 0.1
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    extractor_bytes = 4 * sum(t.numel() for t in load_file(str(tmp_path / "straight" / "clients.safetensors")).values()) / 6
    assert all(r["bytes_up_per_client"] < extractor_bytes / 100 for r in records)  # only LARs go up
    assert set(load_file(str(tmp_path / "straight" / "global.safetensors"))) == {"header.weight", "header.bias"}


def test_clients_score_their_locally_trained_models_and_the_global_header_is_an_extra(tmp_path):
    """The authors' protocol: each client's own model (its extractor and the header it trained
    locally) on its own test split, mean per extractor type; its extractor with the global header
    is ``global_header/TIER``. Both recomputed here from the saved client and global state."""
    engine = Engine(fedgh(rounds=1, train__local_epochs=1, eval__every=1), tmp_path)
    result = engine.run()
    clients = load_file(str(tmp_path / "clients.safetensors"))
    glob = load_file(str(tmp_path / "global.safetensors"))
    strategy = engine.strategy
    own: dict[str, list[float]] = {}
    shared: dict[str, list[float]] = {}
    for client in engine.clients:
        state = {k.split("/", 1)[1]: v for k, v in clients.items() if k.split("/", 1)[0] == str(client.cid)}
        assert {"header.weight", "header.bias"} <= state.keys()  # the local header stays on the client
        tier = strategy.extractor_tier(client)
        extractor = strategy.extractor(tier, client.cid, state).eval()
        test = engine.data.client_test(client.cid)
        with torch.no_grad():
            feats = torch.stack([extractor(x[None])[0] for x, _ in test])
        labels = torch.tensor([int(y) for _, y in test])
        for out, header in ((own, state), (shared, glob)):
            logits = feats @ header["header.weight"].T + header["header.bias"]
            out.setdefault(tier, []).append(int((logits.argmax(1) == labels).sum()) / len(labels))
    assert result.acc.keys() == own.keys()
    for tier in own:
        assert result.acc[tier] == pytest.approx(np.mean(own[tier]), abs=1e-9)
        assert result.extra[f"global_header/{tier}"] == pytest.approx(np.mean(shared[tier]), abs=1e-9)
    assert any(abs(result.acc[t] - result.extra[f"global_header/{t}"]) > 1e-9 for t in own)  # two different models


def test_client_test_needs_a_local_split(tmp_path):
    with pytest.raises(ValueError, match="set data.local_split"):
        Engine(fedgh(data__local_split=None, rounds=1, train__local_epochs=1, clients__fraction=0.2), tmp_path).run()


def test_per_client_evaluation_scores_each_clients_deployed_submodel_on_its_own_test_split(tmp_path):
    config = fedgh(method="nefl", rounds=1, method_args={}, eval__per_client=True)
    engine = Engine(config, tmp_path)
    result = engine.run()
    state = load_file(str(tmp_path / "global.safetensors"))
    expected: dict[str, list[float]] = {}
    for client in engine.clients:  # environment fixed: client groups of 2 hold g0.25, g0.5, g1
        tier = client.levels[-1]
        model = engine.strategy.compiled[tier].load(state).eval()
        test = engine.data.client_test(client.cid)
        with torch.no_grad():
            correct = sum(int((model(x[None]).argmax(1) == y).sum()) for x, y in test)
        expected.setdefault(tier, []).append(correct / len(test))
    assert result.acc.keys() == expected.keys()
    for tier, accs in expected.items():
        assert result.acc[tier] == pytest.approx(sum(accs) / len(accs), abs=1e-12)


def test_server_batch_client_takes_one_mean_loss_step_per_client():
    """``server_batch: client``: one SGD step per client on the mean cross-entropy of its LARs, so
    one client with two LARs moves the header by the mean of their two gradients, once, and two
    clients with one LAR each take two steps in client order. Catches the one-line change
    ``F.cross_entropy(header(x), y, reduction="sum")`` in FedGH's ``aggregate_train`` (a step
    twice as long for two LARs)."""
    strategy = fedgh(method_args={"rep_dim": 3, "server_lr": 0.5, "server_batch": "client"}).build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    lar = torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 3.0]])
    classes = torch.tensor([2, 7])
    w0, b0 = state["header.weight"].clone(), state["header.bias"].clone()

    def gradient(w, b, x, c):  # by hand: d CE(Wx + b, c) / d(W, b) = (softmax - onehot) x^T, softmax - onehot
        err = torch.softmax(w @ x + b, 0)
        err[c] -= 1
        return torch.outer(err, x), err

    one = strategy.aggregate_train(1, state, {0: Reply({"lar": lar, "lar_classes": classes}, {"tier": "g1"})})
    (gw1, gb1), (gw2, gb2) = (gradient(w0, b0, x, c) for x, c in zip(lar, classes.tolist()))
    assert one.accepted == 1
    torch.testing.assert_close(one.state["header.weight"], w0 - 0.5 * (gw1 + gw2) / 2, rtol=0, atol=1e-6)
    torch.testing.assert_close(one.state["header.bias"], b0 - 0.5 * (gb1 + gb2) / 2, rtol=0, atol=1e-6)

    replies = {cid: Reply({"lar": lar[cid : cid + 1], "lar_classes": classes[cid : cid + 1]}, {"tier": "g1"}) for cid in (0, 1)}
    two = strategy.aggregate_train(1, state, replies)
    w, b = w0, b0
    for x, c in zip(lar, classes.tolist()):
        gw, gb = gradient(w, b, x, c)
        w, b = w - 0.5 * gw, b - 0.5 * gb
    assert two.accepted == 2
    torch.testing.assert_close(two.state["header.weight"], w, rtol=0, atol=1e-6)
    torch.testing.assert_close(two.state["header.bias"], b, rtol=0, atol=1e-6)

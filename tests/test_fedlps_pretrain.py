"""FedLPS's default backbone and its masks: ``pretrained: public`` pre-trains the backbone on the
held-out split when the run first needs it (the weights ``pretrain_backbone`` saves, bit for bit,
not the seed's random initialisation, the caller's RNG untouched), a resume rebuilds it bit for
bit and the checkpoint's fingerprint refuses another; the opt-outs and their errors; and a
client's masks chosen from its predictors after its first local training (the authors' code),
kept in later rounds."""

import re

import pytest
import torch
from safetensors.torch import load_file

from nefl_zoo.fl.config import ConfigError
from nefl_zoo.data.loading import load_data
from nefl_zoo.fl.engine import Engine
from nefl_zoo.fl.methods.fedlps import l1_channels, load_backbone, pretrain_backbone
from nefl_zoo.fl.methods.fedlps.method import BACKBONE_SHA256
from nefl_zoo.fl.strategy.base import ClientInfo, Instruction

from .conftest import assert_equal_tensors, crash_in_round, records, same_tensors, tiny

torch.set_num_threads(1)
LEVELS = {"levels": [0.0, 0.4, 0.8]}  # tiny()'s tiers g1, g0.5, g0.25 (largest first)
A = "digits0-4"  # the first of the default tasks (digit groups)


def fedlps(method_args=None, **overrides):
    """Three clients (levels g0.25, g0.5, g1), 30% of the digits held out, a short pre-training."""
    args = dict(method="fedlps", clients__num_clients=3, clients__environment="fixed", train__local_epochs=1, rounds=2,
                eval__every=2, checkpoint_every=1, eval__bn="recompute", data__public_fraction=0.3,
                method_args={**LEVELS, "pretrain_epochs": 3, **(method_args or {})})
    return tiny(**(args | overrides))


def test_the_default_backbone_is_the_one_pre_trained_on_the_held_out_split(tmp_path):
    config = fedlps()
    strategy = config.build_strategy()
    assert strategy.settings.pretrained == "public"  # the default
    random = load_backbone(config.submodel_spec(), config.seed, None).state_dict()
    assert all(torch.equal(v, random[k]) for k, v in strategy.backbone.state_dict().items())  # building it trains nothing

    torch.manual_seed(0)
    state = strategy.init_global_state()  # the first hook that needs the weights pre-trains them
    weights = tmp_path / "backbone.safetensors"
    accuracy = pretrain_backbone(config, 3, weights)
    assert accuracy > 0.5  # alone, on the test split: chance is 0.1
    saved = load_file(str(weights))
    backbone = strategy.backbone.state_dict()
    assert saved.keys() == backbone.keys() and all(torch.equal(v, saved[k]) for k, v in backbone.items())  # bit for bit
    changed = [k for k, v in backbone.items() if v.is_floating_point() and not torch.equal(v, random[k])]
    assert len(changed) > len(backbone) // 2 and "conv1.weight" in changed  # not the seed's random initialisation
    assert torch.equal(state[f"{A}.layer3.2.conv2.weight"], saved["layer3.2.conv2.weight"])  # predictors start from it
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        by_hand = _stem_and_stage1(load_backbone(config.submodel_spec(), config.seed, str(weights)), x)
        assert torch.equal(strategy.encoder(x), by_hand)  # the encoder computes with the pre-trained weights

    # the heads drew from the caller's RNG as if nothing had been pre-trained before them
    opted_out = fedlps({"pretrained": "none"}).build_strategy()
    torch.manual_seed(0)
    heads = {k: v for k, v in opted_out.init_global_state().items() if ".head." in k}
    assert all(torch.equal(v, state[k]) for k, v in heads.items())
    assert not torch.equal(opted_out.backbone.conv1.weight, strategy.backbone.conv1.weight)


def _stem_and_stage1(net, x):
    """The stem and the first stage of a resnet20 (its first 3 of 9 blocks): the encoder, by hand."""
    return net.layer1(net.forward_stem(x))


def test_null_and_none_opt_out_to_the_seed_and_a_run_without_a_held_out_split_is_refused():
    for value in (None, "none"):
        strategy = fedlps({"pretrained": value}, data__public_fraction=0.0).build_strategy()
        assert strategy.settings.pretrained == "none"
        torch.manual_seed(0)
        strategy.init_global_state()
        random = load_backbone(strategy.run.spec, 0, None).state_dict()
        assert all(torch.equal(v, random[k]) for k, v in strategy.backbone.state_dict().items())
    with pytest.raises(ValueError, match=r"^fedlps: method_args.pretrained: public pre-trains .* set data.public_fraction") as err:
        fedlps(data__public_fraction=0.0).build_strategy()
    assert "\n" not in str(err.value)
    for bad, field in (({"pretrained": ""}, "pretrained"), ({"pretrain_epochs": 0}, "pretrain_epochs"),
                       ({"pretrain_lr": -1.0}, "pretrain_lr"), ({"pretrain_epoch": 3}, "pretrain_epoch"),
                       ({"mask_from": "before"}, "mask_from")):
        with pytest.raises(ConfigError, match=rf"^<config>: method_args.{field}: fedlps: "):
            fedlps(bad)


def test_a_resume_pre_trains_the_same_backbone_and_refuses_another(tmp_path, monkeypatch):
    config = fedlps({"pretrain_epochs": 1})
    straight = Engine(config, tmp_path / "straight")
    straight.run()
    crash_in_round(config, tmp_path / "resumed", monkeypatch, 1)
    Engine(config, tmp_path / "resumed").run(resume=True)  # a new strategy: it pre-trains again
    for name in ("global.safetensors", "clients.safetensors", "server.safetensors"):
        assert same_tensors(tmp_path / "straight", tmp_path / "resumed", name), name
    assert records(tmp_path / "resumed") == records(tmp_path / "straight")

    saved = load_file(str(tmp_path / "straight" / "server.safetensors"))
    assert bytes(saved[BACKBONE_SHA256].tolist()).hex() == straight.strategy.backbone_sha256
    other = fedlps({"pretrain_epochs": 2}).build_strategy()  # another backbone than the checkpoint's
    with pytest.raises(ValueError, match=r"^fedlps: this backbone \(sha256 \w+\) is not the one the checkpoint was trained with"):
        other.load_server_state(saved)
    straight.strategy.load_server_state(saved)  # its own: accepted


def test_a_reply_from_a_client_with_another_encoder_is_rejected():
    strategy = fedlps({"pretrained": "none"}).build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    instruction = strategy.configure_train(1, state, [ClientInfo(0, ("g0.25",))])[0]
    data = _client_data(strategy)
    reply = strategy.train(instruction, data, {})
    assert reply.metrics[BACKBONE_SHA256] == strategy.backbone_sha256
    reply.metrics[BACKBONE_SHA256] = "0" * 64
    result = strategy.aggregate_train(1, state, {0: reply})
    assert result.accepted == 0 and "is not the server's" in result.rejected[0][1]


def _client_data(strategy, client: int = 0):
    config = fedlps({"pretrained": "none"})
    return load_data(config.data, config.data_root(), strategy.info.input_size, 3, config.seed).client_dataset(client)


def test_the_first_round_chooses_the_masks_from_the_locally_trained_predictors_and_later_rounds_keep_them():
    strategy = fedlps({"pretrained": "none"}).build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    conv1 = f"{A}.layer3.1.conv1.weight"  # its 64 filters all alike: the received weights' L1 ties keep the first 13
    state[conv1] = state[conv1][:1].expand_as(state[conv1]).clone()
    instruction = strategy.configure_train(1, state, [ClientInfo(0, ("g0.25",))])[0]
    assert instruction.config["rho"] == 0.8
    data = _client_data(strategy)

    # rho = 0 keeps every channel: the reply is the full predictors after this round's training
    full = strategy.train(Instruction(instruction.arrays, {**instruction.config, "rho": 0.0}, "g1"), data, {})
    trained = {k: v for k, v in full.arrays.items() if not k.startswith("mask.")}
    assert trained.keys() == state.keys() and not torch.equal(trained[f"{A}.layer3.1.conv2.weight"], state[f"{A}.layer3.1.conv2.weight"])

    client_state = {}
    reply = strategy.train(instruction, data, client_state)
    stream, inner = client_state[f"mask.{A}.layer3.0.stream"], client_state[f"mask.{A}.layer3.1.conv1"]
    score = sum(trained[f"{A}.{k}"].abs().flatten(1).sum(1) for k in
                ("layer3.0.downsample.0.weight", "layer3.0.conv2.weight", "layer3.1.conv2.weight", "layer3.2.conv2.weight"))
    assert torch.equal(stream, l1_channels(score, 0.8))  # by L1 norm of the trained filters
    assert torch.equal(inner, l1_channels(trained[conv1], 0.8))
    received = strategy.choose_masks(state, 0.8)
    assert torch.equal(received[f"mask.{A}.layer3.1.conv1"], torch.arange(13))  # the ties
    assert not torch.equal(inner, torch.arange(13))  # not the masks of the received weights: training broke the ties
    # the reply: the trained full predictors' kept entries (outputs: the stream, inputs: the block's inner channels)
    conv2 = trained[f"{A}.layer3.1.conv2.weight"]
    assert torch.equal(reply.arrays[f"{A}.layer3.1.conv2.weight"], conv2[stream][:, inner])
    assert torch.equal(reply.arrays[f"{A}.head.weight"], trained[f"{A}.head.weight"][:, stream])
    assert reply.loss == full.loss and reply.num_samples == full.num_samples  # the same training: the full predictors
    assert strategy.aggregate_train(1, state, {0: reply}).accepted == 1

    # round 2: the kept masks, the pruned predictors trained
    kept = {k: v.clone() for k, v in client_state.items()}
    later = Instruction(state, {**instruction.config, "round": 2, "seed": int(instruction.config["seed"]) + 1}, "g0.25")
    second = strategy.train(later, data, client_state)
    assert client_state.keys() == kept.keys() and all(torch.equal(client_state[k], v) for k, v in kept.items())
    assert all(torch.equal(second.arrays[k], v) for k, v in kept.items())
    assert second.arrays[f"{A}.layer3.1.conv2.weight"].shape == (13, 13, 3, 3)

    # mask_from: received (the paper's Algorithm 1): the masks of the received weights, then the pruned predictors trained
    paper = fedlps({"pretrained": "none", "mask_from": "received"}).build_strategy()
    before = {}
    pruned_first = paper.train(instruction, data, before)
    assert before.keys() == received.keys() and all(torch.equal(before[k], v) for k, v in received.items())
    assert pruned_first.arrays[f"{A}.layer3.1.conv2.weight"].shape == (13, 13, 3, 3)
    assert pruned_first.loss != reply.loss


def test_pre_training_is_plain_sgd_over_seeded_shuffles_of_full_batches_and_is_logged(caplog, tmp_path):
    import logging

    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from nefl_zoo.fl.methods.fedlps.pretrain import pretrain, public_data
    from nefl_zoo.models import create_model

    config = fedlps({"pretrain_epochs": 1, "pretrain_lr": 0.05}, train__batch_size=64)
    _, public, (model, model_args) = public_data(config)
    assert len(public) > 64 and len(public) % 64  # a last, incomplete batch to drop
    torch.manual_seed(5)
    by_hand = create_model(model, **model_args)
    optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.05, momentum=config.train.momentum,
                                weight_decay=config.train.weight_decay)
    by_hand.train()
    for x, y in DataLoader(public, batch_size=64, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(5)):
        optimizer.zero_grad()
        F.cross_entropy(by_hand(x), y).backward()
        optimizer.step()
    net = pretrain(model, model_args, public, config.train, 5, 1, config.placement(), 0.05)
    assert_equal_tensors(net.state_dict(), by_hand.state_dict())

    strategy = config.build_strategy()  # pretrain_lr and pretrain_epochs reach the run's pre-training
    with caplog.at_level(logging.INFO, logger="nefl_zoo.fl.methods.fedlps.pretrain"):
        strategy.init_global_state()
    pretrain_backbone(config, 1, tmp_path / "backbone.safetensors", lr=0.05)  # what pretrain_lr: 0.05 loads
    assert_equal_tensors(strategy.backbone.state_dict(), load_file(str(tmp_path / "backbone.safetensors")))
    message = caplog.records[-1].getMessage()
    assert re.fullmatch(rf"fedlps: backbone pre-trained on the {len(public)} held-out images, 1 epochs, in \d\.\d s "
                        r"\(test accuracy 0\.\d{4}\)", message), message


def test_pre_training_for_a_run_without_its_data_section_says_how_to_build_it():
    from types import SimpleNamespace

    from nefl_zoo.fl.methods.fedlps.pretrain import pretrain_for_run

    with pytest.raises(ValueError, match=r"^fedlps: method_args\.pretrained: public pre-trains on the run's held-out data, "
                                         r"which this Run does not carry \(Run\.data\); build the strategy with "
                                         r"RunConfig\.build_strategy$"):
        pretrain_for_run(SimpleNamespace(), None, (1, 8, 8))

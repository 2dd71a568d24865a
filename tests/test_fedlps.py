"""FedLPS: L1 channel selection, index-tensor slice maps of pruned predictors, the server's
backbone fill-in and per-task weighted averaging, reply checks, and a few rounds on digits
that learn every task (its bit-identical resume: tests/test_method_contract.py)."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nefl_zoo.fl.config import ConfigError
from nefl_zoo.fl.engine import Engine
from nefl_zoo.fl.methods.fedlps import l1_channels, load_backbone, pretrain_backbone, weighted_average
from nefl_zoo.fl.strategy import Reply
from nefl_zoo.slim import SliceMap

from .conftest import TINY_VIT, tiny

torch.set_num_threads(1)
LEVELS = {"levels": [0.0, 0.4, 0.8]}  # tiny()'s tiers g1, g0.5, g0.25 (largest first)


def fedlps(**overrides):
    """Three clients, one resource level each (g0.25, g0.5, g1), tasks class and parity."""
    args = dict(method="fedlps", clients__num_clients=3, clients__environment="fixed", method_args=LEVELS,
                train__local_epochs=1, rounds=3, eval__every=3, eval__bn="recompute")
    return tiny(**(args | overrides))


@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    """tiny()'s resnet20 pre-trained for one epoch on the pooled digits (about a second)."""
    path = tmp_path_factory.mktemp("backbone") / "resnet20.safetensors"
    accuracy = pretrain_backbone(fedlps(), 1, path)
    assert accuracy > 0.5, accuracy  # the test split, not trained on
    return str(path)


def regions(entries, shapes) -> dict[str, torch.Tensor]:
    """Per global key, a boolean mask of the elements the entries cover."""
    covered = {k: torch.zeros(s, dtype=torch.bool) for k, s in shapes.items()}
    SliceMap(entries).scatter_(covered, {k: torch.ones(e.shape, dtype=torch.bool) for k, e in entries.items()})
    return covered


def test_l1_selection_keeps_the_filters_with_the_largest_l1_norm():
    conv = nn.Conv2d(2, 5, 1, bias=False)
    with torch.no_grad():  # filter L1 norms 3, 1, 4, 1, 5
        conv.weight.copy_(torch.tensor([[1.5, -1.5], [0.5, 0.5], [-3.0, 1.0], [0.0, -1.0], [2.5, 2.5]]).view(5, 2, 1, 1))
    assert l1_channels(conv.weight, 0.4).tolist() == [0, 2, 4]  # round(0.4 * 5) = 2 smallest removed
    assert l1_channels(conv.weight, 0.6).tolist() == [2, 4]
    assert l1_channels(conv.weight, 0.0).tolist() == [0, 1, 2, 3, 4]
    assert l1_channels(conv.weight, 0.95).tolist() == [4]  # at least one channel stays
    ties = torch.tensor([2.0, -2.0, 2.0, 1.0]).view(4, 1, 1, 1)
    assert l1_channels(ties, 0.5).tolist() == [0, 1]  # ties go to the lower index
    assert l1_channels(ties, 0.5).dtype == torch.int64


def test_pruned_predictor_maps_through_index_tensors_and_equals_the_cut_full_one():
    strategy = fedlps().build_strategy()
    assert strategy.num_encoder_blocks == 3 and [b.path for b in strategy.prunable][:2] == ["layer2.0", "layer2.1"]
    torch.manual_seed(0)
    state = strategy.init_global_state()
    masks = strategy.choose_masks(state, 0.4)
    info = strategy.prunable[0]
    kept = masks[f"mask.parity.{info.path}.0"]
    assert len(kept) == 32 - round(0.4 * 32)
    assert not torch.equal(kept, torch.arange(len(kept)))  # not a prefix: index tensors are needed
    assert torch.equal(kept, l1_channels(state[f"parity.{info.path}.{info.convs[0]}.weight"], 0.4))
    _, entries = strategy.predictor("parity", masks)
    sub = SliceMap(entries).extract(state)
    assert all(tuple(sub[k].shape) == e.shape for k, e in entries.items())
    conv1 = entries[f"{info.path}.{info.convs[0]}.weight"]
    assert conv1.shape[0] == len(kept) and torch.equal(sub[f"{info.path}.{info.convs[0]}.weight"], state[conv1.global_key][kept])

    # extract then scatter: the covered elements come back, nothing else is written
    blank = {k: torch.zeros_like(v) for k, v in state.items()}
    SliceMap(entries).scatter_(blank, sub)
    again = SliceMap(entries).extract(blank)
    assert all(torch.equal(again[k], sub[k]) for k in sub)
    covered = regions(entries, {k: v.shape for k, v in state.items()})
    assert sum(int(c.sum()) for c in covered.values()) == sum(e.numel for e in entries.values())
    assert all(torch.equal(blank[k][~covered[k]], torch.zeros(int((~covered[k]).sum()))) for k in state if state[k].is_floating_point())

    # the physically pruned predictor computes what the full one computes with the pruned inner
    # channels cut off (their outgoing weights zeroed), in eval mode
    pruned = strategy.load_predictor("parity", state, masks).eval()
    cut = dict(state)
    for block in strategy.prunable:
        key = f"parity.{block.path}.{block.convs[1]}.weight"
        keep = torch.zeros(cut[key].shape[1], dtype=torch.bool)
        keep[masks[f"mask.parity.{block.path}.0"]] = True
        cut[key] = cut[key] * keep.view(1, -1, 1, 1)
    full = strategy.load_predictor("parity", cut).eval()
    embedding = strategy.encoder(torch.randn(4, 1, 8, 8))
    torch.testing.assert_close(pruned(embedding), full(embedding))
    assert sum(p.numel() for p in pruned.parameters()) < 0.7 * sum(p.numel() for p in full.parameters())


def _reply(strategy, state, masks, level, samples, value=None):
    """A client's reply: its pruned predictors cut from ``state`` (or filled with ``value``)."""
    arrays = dict(masks)
    for task in strategy.tasks:
        _, entries = strategy.predictor(task, masks)
        for k, v in SliceMap(entries).extract(state).items():
            arrays[entries[k].global_key] = v if value is None or not v.is_floating_point() else torch.full_like(v, value)
    metrics = {f"num_samples.{t}": n for t, n in samples.items()}
    return Reply(arrays, metrics, num_samples=max(samples.values()), level=level)


def test_server_fills_pruned_entries_from_the_backbone_predictor():
    strategy = fedlps().build_strategy()
    torch.manual_seed(0)
    state = {k: v + 10 if v.is_floating_point() else v for k, v in strategy.init_global_state().items()}  # != backbone
    masks = strategy.choose_masks(state, 0.8)
    reply = _reply(strategy, state, masks, "g0.25", {"class": 5, "parity": 5}, value=7.0)
    result = strategy.aggregate_train(1, state, {0: reply})
    assert result.accepted == 1 and not result.rejected
    for task in strategy.tasks:
        _, entries = strategy.predictor(task, masks)
        covered = regions(entries, {k: v.shape for k, v in state.items()})
        for key, entry in entries.items():
            gk, new = entry.global_key, result.state[entry.global_key]
            if not new.is_floating_point():
                continue
            assert bool((new[covered[gk]] == 7.0).all()), gk  # what the client trained
            if key in strategy.backbone_predictor:  # pruned elements: the backbone's, not the old global
                assert torch.equal(new[~covered[gk]], strategy.backbone_predictor[key][~covered[gk]]), gk
            else:  # the head is never pruned
                assert bool(covered[gk].all()), gk
    conv1 = f"class.{strategy.prunable[0].path}.{strategy.prunable[0].convs[0]}.weight"
    assert int((result.state[conv1] == 7.0).sum()) == 6 * 16 * 9  # 32 - round(0.8 * 32) filters of 16 x 3 x 3 kept


def test_per_task_average_is_weighted_by_the_clients_task_samples():
    mean = weighted_average([({"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(2)}, 1.0),
                             ({"w": torch.tensor([5.0, 0.0]), "n": torch.tensor(7)}, 3.0)])
    assert torch.equal(mean["w"], torch.tensor([4.0, 0.5])) and torch.equal(mean["n"], torch.tensor(6))  # n: 23 / 4, rounded
    strategy = fedlps().build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    small = strategy.choose_masks(state, 0.8)
    replies = {
        0: _reply(strategy, state, small, "g0.25", {"class": 1, "parity": 3}, value=1.0),
        1: _reply(strategy, state, strategy.choose_masks(state, 0.0), "g1", {"class": 3, "parity": 1}, value=5.0),
    }
    result = strategy.aggregate_train(1, state, replies)
    assert result.accepted == 2
    for task, (w_small, w_full) in {"class": (1, 3), "parity": (3, 1)}.items():
        _, entries = strategy.predictor(task, small)
        info = strategy.prunable[0]
        key = f"{info.path}.{info.convs[0]}.weight"
        new, backbone = result.state[f"{task}.{key}"], strategy.backbone_predictor[key]
        kept = small[f"mask.{task}.{info.path}.0"]
        pruned = torch.ones(new.shape[0], dtype=torch.bool)
        pruned[kept] = False
        # by hand: kept by both clients (w_s * 1 + w_f * 5) / 4; pruned by the small one: its backbone value instead of 1
        torch.testing.assert_close(new[kept], torch.full_like(new[kept], (w_small * 1.0 + w_full * 5.0) / 4))
        torch.testing.assert_close(new[pruned], (w_small * backbone[pruned] + w_full * 5.0) / 4)
        head = result.state[f"{task}.head.weight"]
        torch.testing.assert_close(head, torch.full_like(head, (w_small * 1.0 + w_full * 5.0) / 4))


def test_bad_replies_are_rejected_and_the_round_goes_on():
    strategy = fedlps().build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    masks = strategy.choose_masks(state, 0.4)
    samples = {"class": 4, "parity": 4}
    good = _reply(strategy, state, masks, "g0.5", samples, value=1.0)
    key = f"mask.class.{strategy.prunable[0].path}.0"
    out_of_range = _reply(strategy, state, masks, "g0.5", samples)
    out_of_range.arrays[key] = torch.cat([masks[key][:-1], torch.tensor([99])])
    no_mask = _reply(strategy, state, masks, "g0.5", samples)
    del no_mask.arrays[key]
    nan = _reply(strategy, state, masks, "g0.5", samples, value=float("nan"))
    full_tensor = _reply(strategy, state, masks, "g0.5", samples)
    conv = f"class.{strategy.prunable[0].path}.{strategy.prunable[0].convs[0]}.weight"
    full_tensor.arrays[conv] = state[conv]
    no_count = _reply(strategy, state, masks, "g0.5", samples)
    del no_count.metrics["num_samples.parity"]
    replies = {0: good, 1: out_of_range, 2: no_mask, 3: nan, 4: full_tensor, 5: no_count,
               6: _reply(strategy, state, masks, "g9", samples), 7: Reply({}, {}, error="crashed")}
    result = strategy.aggregate_train(1, state, replies)
    assert result.accepted == 1 and [cid for cid, _ in result.rejected] == [1, 2, 3, 4, 5, 6, 7]
    assert "shape" in dict(result.rejected)[4] and "NaN" in dict(result.rejected)[3]
    assert bool((result.state[conv][masks[key]] == 1.0).all())


def test_levels_tasks_and_models_are_checked():
    with pytest.raises(ValueError, match="levels has 5 pruning ratios but the spec has 3 tiers"):
        fedlps(method_args={}).build_strategy()
    with pytest.raises(ConfigError, match="method_args.tasks: fedlps: .*distinct"):
        fedlps(method_args={**LEVELS, "tasks": ["class", "class"]})
    vit = {"model": "vit_tiny_16", "model_args": TINY_VIT, "tiers": [{"name": "a", "gamma_w": 0.5}, {"name": "b"}]}
    with pytest.raises(ValueError, match="not a chain of convolutions"):
        fedlps(spec=vit, method_args={"levels": [0, 0.5]}).build_strategy()


def test_level_costs_shrink_with_the_pruning_ratio():
    strategy = fedlps(method_args={**LEVELS, "tasks": ["class", "parity", "mod3"]}).build_strategy()
    costs = {c.level: c for c in strategy.level_costs()}
    assert [c.rho for c in costs.values()] == [0.8, 0.4, 0.0]  # spec order g0.25, g0.5, g1
    assert costs["g0.25"].macs < costs["g0.5"].macs < costs["g1"].macs < costs["g1"].full_macs  # one shared encoder
    assert costs["g0.25"].predictor_params < costs["g0.5"].predictor_params < costs["g1"].predictor_params
    assert strategy.submodel_numel("g1") == sum(strategy.submodel_numel(t) for t in strategy.tasks)


def test_fedlps_learns_every_task_from_a_pretrained_backbone(tmp_path, backbone):
    config = fedlps(method_args={**LEVELS, "pretrained": backbone})
    engine = Engine(config, tmp_path)
    result = engine.run()
    assert set(result.acc) == {"class", "parity"} and set(result.extra) == {"recompute/class", "recompute/parity"}
    columns = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert [c for c in columns if c.startswith("acc_")] == ["acc_class", "acc_parity"]  # tasks, not resource levels
    assert result.acc["class"] > 0.6 and result.acc["parity"] > 0.8, result.acc  # chance: 0.1 and 0.5
    masks = load_file(str(tmp_path / "clients.safetensors"))  # per-client state: the masks only
    assert all(k.split("/", 1)[1].startswith("mask.") for k in masks)
    sizes = {cid: len(masks[f"{cid}/mask.class.layer3.0.0"]) for cid in range(3)}
    assert sizes == {0: 64 - round(0.8 * 64), 1: 64 - round(0.4 * 64), 2: 64}  # levels g0.25, g0.5, g1
    assert set(load_file(str(tmp_path / "global.safetensors"))) == set(config.build_strategy().init_global_state())
    fresh = load_backbone(config.submodel_spec(), config.seed, backbone).state_dict()  # the encoder stayed frozen
    assert all(torch.equal(v, fresh[k]) for k, v in engine.strategy.backbone.state_dict().items())

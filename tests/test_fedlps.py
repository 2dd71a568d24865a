"""FedLPS: L1 pruning of every predictor layer as index-tensor slice maps (kept count by hand,
equal to the dense predictor with the pruned channels zeroed), the server's backbone fill-in and
per-task weighted averaging, reply checks, tasks that never share images, and a few rounds on
digits from a backbone pre-trained on a held-out split no client holds (its bit-identical
resume: tests/test_method_contract.py). The default backbone (pre-trained when the run starts),
its resume and the masks chosen after the first local training: tests/test_fedlps_pretrain.py.
Tasks from folders: tests/test_fedlps_data.py."""

import copy

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nefl_zoo.fl.training.bn import recompute_bn
from nefl_zoo.fl.config import ConfigError
from nefl_zoo.data.loading import load_data
from nefl_zoo.fl.engine import Engine
from nefl_zoo.fl.methods.fedlps import l1_channels, load_backbone, pretrain_backbone, weighted_average
from nefl_zoo.fl.methods.fedlps.method import BACKBONE_SHA256
from nefl_zoo.fl.methods.fedlps.pretrain import public_data
from nefl_zoo.fl.strategy.base import Reply
from nefl_zoo.models import create_model
from nefl_zoo.profile import count_macs
from nefl_zoo.slim import SliceMap

from .conftest import TINY_VIT, tiny

torch.set_num_threads(1)
# tiny()'s tiers g1, g0.5, g0.25 (largest first); a random encoder: these tests are not about its
# weights (the default, pre-trained on the held-out split: tests/test_fedlps_pretrain.py)
LEVELS = {"levels": [0.0, 0.4, 0.8], "pretrained": "none"}
A, B = "digits0-4", "digits5-9"  # the default tasks: disjoint digit groups


def fedlps(**overrides):
    """Three clients, one resource level each (g0.25, g0.5, g1), the two digit-group tasks."""
    args = dict(method="fedlps", clients__num_clients=3, clients__environment="fixed", method_args=LEVELS,
                train__local_epochs=1, rounds=3, eval__every=3, eval__bn="recompute")
    return tiny(**(args | overrides))


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
    assert l1_channels(conv.weight, 0.95).tolist() == [4]  # at least one channel stays
    ties = torch.tensor([2.0, -2.0, 2.0, 1.0]).view(4, 1, 1, 1)
    assert l1_channels(ties, 0.5).tolist() == [0, 1] and l1_channels(ties, 0.5).dtype == torch.int64  # ties: lower index


def test_every_layer_is_pruned_and_a_predictor_keeps_4_percent_at_rho_0_8():
    strategy = fedlps().build_strategy()
    assert strategy.num_encoder_blocks == 3  # ceil(0.25 * 9): stage 1; the predictor: stages 2 and 3
    masks = strategy.level_masks("g0.25")  # rho 0.8
    pruned, _ = strategy.predictor(A, masks)
    full, _ = strategy.predictor(A)
    k2, k3, c = 32 - round(0.8 * 32), 64 - round(0.8 * 64), 5  # 6 and 13 channels; 5 classes
    bn = 2  # weight and bias per channel
    first = 16 * k2 * 9 + bn * k2 + k2 * k2 * 9 + bn * k2 + 1 + 16 * k2 + bn * k2  # conv1 (all 16 encoder channels in), conv2, step, projection
    rest2 = k2 * k2 * 9 + bn * k2 + k2 * k2 * 9 + bn * k2 + 1
    first3 = k2 * k3 * 9 + bn * k3 + k3 * k3 * 9 + bn * k3 + 1 + k2 * k3 + bn * k3
    rest3 = k3 * k3 * 9 + bn * k3 + k3 * k3 * 9 + bn * k3 + 1
    by_hand = first + 2 * rest2 + first3 + 2 * rest3 + k3 * c + c
    dense = (16 * 32 * 9 + 64 + 32 * 32 * 9 + 64 + 1 + 16 * 32 + 64) + 2 * (2 * 32 * 32 * 9 + 2 * 64 + 1) \
        + (32 * 64 * 9 + 128 + 64 * 64 * 9 + 128 + 1 + 32 * 64 + 128) + 2 * (2 * 64 * 64 * 9 + 2 * 128 + 1) + 64 * c + c
    assert (by_hand, dense) == (11307, 257675)
    assert sum(p.numel() for p in pruned.parameters()) == by_hand and sum(p.numel() for p in full.parameters()) == dense
    assert by_hand / dense < 0.045  # the authors' code: about (1 - rho)^2 = 4%; the issue's bound: 10%
    shapes = {n: tuple(m.weight.shape) for n, m in pruned.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert shapes["layer2.0.conv1"] == (k2, 16, 3, 3) and shapes["layer2.1.conv1"] == (k2, k2, 3, 3)  # inputs follow the stream
    assert shapes["layer3.0.downsample.0"] == (k3, k2, 1, 1) and shapes["head"] == (c, k3)


BACKBONES = {"resnet18": {"backbone": "resnet18", "backbone_args": {"planes": [4, 8, 8, 16]}},
             "shufflenet_v2_x0_5": {"backbone": "shufflenet_v2_x0_5"}}


def test_resnet18_and_shufflenet_backbones_from_method_args():
    resnet18 = fedlps(method_args={**LEVELS, **BACKBONES["resnet18"]}).build_strategy()
    assert resnet18.num_encoder_blocks == 2 and resnet18.block_keys[0] == ("layer2", "0")  # ceil(0.25 * 8): layer1
    kept = sum(p.numel() for p in resnet18.predictor(A, resnet18.level_masks("g0.25"))[0].parameters())
    assert kept / sum(p.numel() for p in resnet18.predictor(A)[0].parameters()) < 0.10  # 5.6% (narrow: rounding)
    shuffle = fedlps(method_args={**LEVELS, **BACKBONES["shufflenet_v2_x0_5"]}).build_strategy()
    assert shuffle.num_encoder_blocks == 4 and shuffle.norms == ["conv5"]  # stage2; conv5 is the predictors' (trained)
    pruned = shuffle.predictor(A, shuffle.level_masks("g0.25"))[0]
    assert pruned.conv5[0].weight.shape == (1024 - round(0.8 * 1024), 192, 1, 1) and pruned.head.weight.shape == (5, 205)
    assert pruned.stage3[1].branch2[3].weight.shape == (10, 1, 3, 3) and pruned.stage3[1].branch2[5].weight.shape == (48, 10, 1, 1)


def test_moving_the_client_model_moves_the_frozen_backbone_behind_its_encoder():
    # what fit's .to(device) does on a GPU, shown with a dtype (the same Module._apply path)
    method = fedlps().build_strategy()
    model = method.model({task: method.predictor(task)[0] for task in method.tasks}).double()
    backbone = model.encoder._net[0]
    assert {p.dtype for p in backbone.parameters()} == {torch.float64}
    assert model.embed(torch.zeros(2, 1, 8, 8, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("backbone", [None, "resnet18", "shufflenet_v2_x0_5"])
def test_pruned_predictor_equals_the_dense_one_with_the_pruned_channels_zeroed(backbone):
    strategy = fedlps(method_args={**LEVELS, **BACKBONES.get(backbone, {})}).build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    masks = strategy.choose_masks(state, 0.4)
    if backbone is None:
        _resnet20_stream_is_chosen_by_l1(state, masks)

    # extract then scatter: the covered elements come back, nothing else is written
    _, entries = strategy.predictor(B, masks)
    sub = SliceMap(entries).extract(state)
    blank = {k: torch.zeros_like(v) for k, v in state.items()}
    SliceMap(entries).scatter_(blank, sub)
    covered = regions(entries, {k: v.shape for k, v in state.items()})
    assert sum(int(c.sum()) for c in covered.values()) == sum(e.numel for e in entries.values())
    assert all(torch.equal(blank[k][covered[k]], state[k][covered[k]]) and not blank[k][~covered[k]].any()
               for k in state if k.startswith(B) and state[k].is_floating_point())

    # the dense predictor with every pruned channel's activation zeroed computes the same (eval mode)
    pruned = strategy.load_predictor(B, state, masks).eval()
    dense = strategy.load_predictor(B, state).eval()
    for layer in strategy.pruning.layers:
        module = dense.get_submodule(layer.path)
        if isinstance(module, nn.BatchNorm2d) and layer.out is not None:
            keep = torch.zeros(module.num_features)
            keep[masks[f"mask.{B}.{layer.out}"]] = 1
            module.register_forward_hook(lambda m, i, out, keep=keep: out * keep.view(1, -1, 1, 1))
    embedding = strategy.encoder(torch.randn(4, 1, 8, 8))
    torch.testing.assert_close(pruned(embedding), dense(embedding))


def _resnet20_stream_is_chosen_by_l1(state, masks):
    stream = masks[f"mask.{B}.layer3.0.stream"]
    assert len(stream) == 64 - round(0.4 * 64) and not torch.equal(stream, torch.arange(len(stream)))  # index tensors, not a prefix
    score = sum(state[f"{B}.{k}"].abs().flatten(1).sum(1) for k in
                ("layer3.0.downsample.0.weight", "layer3.0.conv2.weight", "layer3.1.conv2.weight", "layer3.2.conv2.weight"))
    assert torch.equal(stream, l1_channels(score, 0.4))  # the stream's filters' L1 norms, summed


def _reply(strategy, state, masks, level, samples, value=None):
    """A client's reply: its pruned predictors cut from ``state`` (or filled with ``value``)."""
    arrays = dict(masks)
    for task in strategy.tasks:
        _, entries = strategy.predictor(task, masks)
        for k, v in SliceMap(entries).extract(state).items():
            arrays[entries[k].global_key] = v if value is None or not v.is_floating_point() else torch.full_like(v, value)
    metrics = {f"num_samples.{t}": n for t, n in samples.items()} | {BACKBONE_SHA256: strategy.backbone_sha256}
    return Reply(arrays, metrics, num_samples=sum(samples.values()), level=level)


@pytest.mark.parametrize("fill", ["backbone", "global"])
def test_server_fills_pruned_entries_from_the_backbone_predictor(fill):
    strategy = fedlps(method_args={**LEVELS, "fill": fill}).build_strategy()
    torch.manual_seed(0)
    state = {k: v + 10 if v.is_floating_point() else v for k, v in strategy.init_global_state().items()}  # != backbone
    masks = strategy.choose_masks(state, 0.8)
    result = strategy.aggregate_train(1, state, {0: _reply(strategy, state, masks, "g0.25", {A: 5, B: 5}, value=7.0)})
    assert result.accepted == 1 and not result.rejected
    for task in strategy.tasks:
        _, entries = strategy.predictor(task, masks)
        covered = regions(entries, {k: v.shape for k, v in state.items()})
        for key, entry in entries.items():
            gk, new = entry.global_key, result.state[entry.global_key]
            if not new.is_floating_point():
                continue
            assert bool((new[covered[gk]] == 7.0).all()), gk  # what the client trained
            in_backbone = fill == "backbone" and key in strategy.backbone_predictor
            source = strategy.backbone_predictor[key] if in_backbone else state[gk]  # the head: the old global
            assert torch.equal(new[~covered[gk]], source[~covered[gk]]), gk
    conv2 = result.state[f"{A}.layer3.1.conv2.weight"]
    assert int((conv2 == 7.0).sum()) == 13 * 13 * 9  # 13 of 64 output and 13 of 64 input channels


def test_per_task_average_is_weighted_by_the_clients_task_images():
    mean = weighted_average([({"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(2)}, 1.0),
                             ({"w": torch.tensor([5.0, 0.0]), "n": torch.tensor(7)}, 3.0)])
    assert torch.equal(mean["w"], torch.tensor([4.0, 0.5])) and torch.equal(mean["n"], torch.tensor(6))  # n: 23 / 4, rounded
    strategy = fedlps().build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    small = strategy.choose_masks(state, 0.8)
    replies = {0: _reply(strategy, state, small, "g0.25", {A: 1, B: 3}, value=1.0),
               1: _reply(strategy, state, strategy.choose_masks(state, 0.0), "g1", {A: 3, B: 1}, value=5.0),
               2: _reply(strategy, state, small, "g0.25", {A: 0, B: 4}, value=9.0)}  # no images of A: A's predictor untrained
    result = strategy.aggregate_train(1, state, {0: replies[0], 1: replies[1]})
    with_idle = strategy.aggregate_train(1, state, replies)
    key = "layer3.1.conv2.weight"
    for task, (w_small, w_full) in {A: (1, 3), B: (3, 1)}.items():
        new, backbone = result.state[f"{task}.{key}"], strategy.backbone_predictor[key]
        out_kept, in_kept = torch.zeros(64, dtype=torch.bool), torch.zeros(64, dtype=torch.bool)
        out_kept[small[f"mask.{task}.layer3.0.stream"]] = True
        in_kept[small[f"mask.{task}.layer3.1.conv1"]] = True
        both = out_kept.view(-1, 1) & in_kept.view(1, -1)
        # by hand: kept by both clients (w_s * 1 + w_f * 5) / 4; pruned by the small one: its backbone value instead of 1
        torch.testing.assert_close(new[both], torch.full_like(new[both], (w_small * 1.0 + w_full * 5.0) / 4))
        torch.testing.assert_close(new[~both], (w_small * backbone[~both] + w_full * 5.0) / 4)
        head = result.state[f"{task}.head.weight"]
        assert bool((head[:, small[f"mask.{task}.layer3.0.stream"]] == (w_small * 1.0 + w_full * 5.0) / 4).all())
    assert torch.equal(with_idle.state[f"{A}.{key}"], result.state[f"{A}.{key}"])  # the idle client left A alone
    assert not torch.equal(with_idle.state[f"{B}.{key}"], result.state[f"{B}.{key}"])


def test_bad_replies_are_rejected_and_the_round_goes_on():
    strategy = fedlps().build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    masks = strategy.choose_masks(state, 0.4)
    samples = {A: 4, B: 4}
    good = _reply(strategy, state, masks, "g0.5", samples, value=1.0)
    key = f"mask.{A}.layer2.0.stream"
    out_of_range = _reply(strategy, state, masks, "g0.5", samples)
    out_of_range.arrays[key] = torch.cat([masks[key][:-1], torch.tensor([99])])
    no_mask = _reply(strategy, state, masks, "g0.5", samples)
    del no_mask.arrays[key]
    nan = _reply(strategy, state, masks, "g0.5", samples, value=float("nan"))
    full_tensor = _reply(strategy, state, masks, "g0.5", samples)
    conv = f"{A}.layer2.0.conv1.weight"
    full_tensor.arrays[conv] = state[conv]
    no_count = _reply(strategy, state, masks, "g0.5", samples)
    del no_count.metrics[f"num_samples.{B}"]
    no_images = _reply(strategy, state, masks, "g0.5", {A: 0, B: 0})
    repeated = _reply(strategy, state, masks, "g0.5", samples)
    repeated.arrays[key] = torch.cat([masks[key][:1], masks[key][:-1]])  # its first index twice
    two_d = _reply(strategy, state, masks, "g0.5", samples)
    two_d.arrays[key] = masks[key].view(1, -1)
    replies = {0: good, 1: out_of_range, 2: no_mask, 3: nan, 4: full_tensor, 5: no_count, 6: no_images,
               7: _reply(strategy, state, masks, "g9", samples), 8: Reply({}, {}, error="crashed"), 9: repeated, 10: two_d}
    result = strategy.aggregate_train(1, state, replies)
    assert result.accepted == 1 and [cid for cid, _ in result.rejected] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    width = strategy.pruning.spaces["layer2.0.stream"].width
    for cid in (1, 9, 10):
        assert dict(result.rejected)[cid].endswith(f"{key}: expected ascending distinct channel indices below {width}"), cid
    assert "shape" in dict(result.rejected)[4] and "NaN" in dict(result.rejected)[3]


def test_tasks_levels_and_models_are_checked():
    with pytest.raises(ValueError, match="levels has 5 pruning ratios but the spec has 3 tiers"):
        fedlps(method_args={}).build_strategy()
    with pytest.raises(ConfigError, match=r"^<config>: method_args.tasks: fedlps: .*removed: the relabelling tasks"):
        fedlps(method_args={**LEVELS, "tasks": ["class", "parity"]})
    with pytest.raises(ConfigError, match="a label belongs to two tasks"):
        fedlps(method_args={**LEVELS, "tasks": [{"name": "a", "labels": [0, 1, 2]}, {"name": "b", "labels": [2, 3]}]})
    with pytest.raises(ValueError, match=r"must be the dataset's labels 0..9, each in one task"):
        fedlps(method_args={**LEVELS, "tasks": [{"name": "a", "labels": [0, 1, 2]}, {"name": "b", "labels": [3, 4]}]}).build_strategy()
    vit = {"model": "vit_tiny_16", "model_args": TINY_VIT, "tiers": [{"name": "a", "gamma_w": 0.5}, {"name": "b"}]}
    with pytest.raises(ValueError, match="FedLPS prunes ResNet and ShuffleNetV2 blocks"):
        fedlps(spec=vit, method_args={"levels": [0, 0.5]}).build_strategy()


def test_tasks_never_share_images_and_each_predictor_learns_from_its_own_only():
    config = fedlps()
    strategy = config.build_strategy()
    data = load_data(config.data, config.data_root(), (1, 8, 8), 3, config.seed)
    for client in range(3):
        labels = torch.as_tensor(data.targets[data.partitions[client]])
        routes = strategy.taskset.route(labels)
        rows = {t: set(r.tolist()) for t, (r, _) in routes.items()}
        assert rows[A].isdisjoint(rows[B]) and rows[A] | rows[B] == set(range(len(labels)))  # each image in one task
        assert bool((labels[list(rows[A])] < 5).all() and (labels[list(rows[B])] >= 5).all())
    # one batch of both tasks: A's predictor gets exactly the gradient of A's images alone
    torch.manual_seed(0)
    state = strategy.init_global_state()
    x, y = torch.randn(8, 1, 8, 8), torch.tensor([0, 7, 3, 9, 4, 5, 1, 6])
    grads = []
    for xs, ys in ((x, y), (x[y < 5], y[y < 5])):
        model = strategy.model({t: strategy.load_predictor(t, state) for t in strategy.tasks}).train()
        for p in model.parameters():
            p.requires_grad_(True)
        loss, logits = model.loss(xs, ys)
        loss.backward()
        grads.append(model.predictors[A].layer3[0].conv1.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])
    assert bool(torch.isinf(logits[:, 5:]).all())  # an image's logits only at its own task's labels


def test_level_costs_shrink_with_the_pruning_ratio():
    strategy = fedlps().build_strategy()
    costs = {c.level: c for c in strategy.level_costs()}
    assert [c.rho for c in costs.values()] == [0.8, 0.4, 0.0]  # spec order g0.25, g0.5, g1
    assert costs["g0.25"].macs < costs["g0.5"].macs < costs["g1"].macs < costs["g1"].full_macs  # one shared encoder
    assert costs["g0.25"].predictor_params < costs["g0.5"].predictor_params < costs["g1"].predictor_params
    assert strategy.submodel_numel("g1") == sum(strategy.submodel_numel(t) for t in strategy.tasks)
    # against one full model per task, with that task's classes
    spec = strategy.run.spec
    full = sum(count_macs(create_model(spec.model, **{**spec.model_args, "num_classes": strategy.task_classes[task]}),
                          strategy.info.input_size) for task in strategy.tasks)
    assert all(c.full_macs == full for c in costs.values()) and costs["g0.5"].macs_ratio == costs["g0.5"].macs / full


def test_fedlps_learns_every_task_from_a_backbone_pretrained_on_data_no_client_holds(tmp_path):
    config = fedlps(data__public_fraction=0.3)
    data, public, _ = public_data(config)
    held = set(data.public.tolist())
    assert len(held) == sum(round(0.3 * int((data.targets == y).sum())) for y in range(10))
    assert all(held.isdisjoint(p.tolist()) for p in data.partitions)  # no pre-training image in any client's data
    assert held | {i for p in data.partitions for i in p.tolist()} == set(range(len(data.targets)))
    assert public.indices == sorted(held)
    with pytest.raises(ValueError, match="set data.public_fraction"):
        pretrain_backbone(fedlps(), 1, tmp_path / "x.safetensors")

    weights = tmp_path / "resnet20.safetensors"
    assert pretrain_backbone(config, 2, weights) > 0.5  # the test split; chance 0.1
    config = fedlps(data__public_fraction=0.3, method_args={**LEVELS, "pretrained": str(weights)}, rounds=2, eval__every=2)
    engine = Engine(config, tmp_path / "run")
    result = engine.run()
    assert set(result.acc) == {A, B} and set(result.extra) == {f"recompute/{A}", f"recompute/{B}"}
    columns = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert [c for c in columns if c.startswith("acc_")] == [f"acc_{A}", f"acc_{B}"]  # tasks, not resource levels
    assert result.acc[A] > 0.6 and result.acc[B] > 0.6, result.acc  # chance: 0.2
    masks = load_file(str(tmp_path / "run" / "clients.safetensors"))  # per-client state: the masks only
    assert all(k.split("/", 1)[1].startswith("mask.") for k in masks)
    sizes = {cid: len(masks[f"{cid}/mask.{A}.layer3.0.stream"]) for cid in range(3)}
    assert sizes == {0: 64 - round(0.8 * 64), 1: 64 - round(0.4 * 64), 2: 64}  # levels g0.25, g0.5, g1
    fresh = load_backbone(config.submodel_spec(), config.seed, str(weights)).state_dict()  # the encoder stayed frozen
    assert all(torch.equal(v, fresh[k]) for k, v in engine.strategy.backbone.state_dict().items())


def test_a_task_with_one_image_in_a_training_batch_is_left_out_and_recompute_uses_each_tasks_own_images():
    from nefl_zoo.fl.methods.fedlps.networks import with_task_bn

    method = fedlps().build_strategy()
    torch.manual_seed(0)
    state = method.init_global_state()
    method.prepare_backbone()
    model = method.model({task: method.load_predictor(task, state) for task in method.tasks})
    x, y = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 7, 8, 2])  # A: 3 images, B: 2
    assert list(model.train().routed(x[:3], y[:3])) == [A]  # B's single image: no BatchNorm batch
    assert list(model.train().routed(x[:4], y[:4])) == [A, B]  # two images each: both train
    assert list(model.eval().routed(x[:3], y[:3])) == [A, B]
    def first_norm(predictor):
        return next(m for m in predictor.modules() if isinstance(m, nn.BatchNorm2d))

    before = {t: copy.deepcopy(p) for t, p in model.predictors.items()}
    assert with_task_bn(model, "running", [(x, y)]) is model and not model.training
    assert all(torch.equal(first_norm(p).running_mean, first_norm(before[t]).running_mean) for t, p in model.predictors.items())
    with_task_bn(model, "recompute", [(x, y)])
    assert not model.training
    for task, (rows, local) in model.tasks.route(y).items():  # each predictor's statistics: its own task's images only
        own, every = copy.deepcopy(before[task]), copy.deepcopy(before[task])
        recompute_bn(nn.Sequential(model.encoder, own), [(x[rows], local)])
        recompute_bn(nn.Sequential(model.encoder, every), [(x, y)])
        got = first_norm(model.predictors[task]).running_mean
        assert torch.equal(got, first_norm(own).running_mean) and not torch.allclose(got, first_norm(every).running_mean), task

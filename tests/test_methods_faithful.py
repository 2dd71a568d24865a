"""The baselines as their papers define them (FjORD, DepthFL, FedAvg), the shared BN recompute at
evaluation, and the comparison's paired statistics; each checked against an expectation
computed another way."""

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from nefl_zoo_cli.app import app
from nefl_zoo.fl.compare import Entry, entry_config, flatness, parse_entry, results_table
from nefl_zoo.fl.config import ConfigError, load_config, parse_config
from nefl_zoo.fl.engine import RunResult
from nefl_zoo.fl.methods.depthfl import nefl_depth_spec
from nefl_zoo.fl.methods.fjord import distillation_loss, nested_entry
from nefl_zoo.fl.strategy.base import Instruction, Reply
from nefl_zoo.fl.methods.common import bn_treatments, module_macs, with_bn
from nefl_zoo.profile import count_params
from nefl_zoo.slim import SliceEntry, SliceMap
from nefl_zoo.spec import parse_spec

from .conftest import records

LEVELS = ["g0.2", "g0.4", "g0.6", "g0.8", "g1"]
DIGITS_W = "specs/resnet20/nefl-w.yaml"


def config(method, spec=DIGITS_W, **sections):
    """A run config of ``method`` on ``spec`` (``sections``: further top-level keys)."""
    return parse_config({"method": method, "spec": spec, "data": {"augment": False}, **sections}, "<test>", ".")


# -- FjORD -----------------------------------------------------------------------------------

def fjord_local(kd=True, top="g0.8"):
    method = config("fjord", method_args={"kd": kd}).build_strategy()
    torch.manual_seed(0)
    state = method.init_global_state()
    tier = method.assign([top], None)
    arrays = SliceMap(dict(method.entries(tier))).extract(state)
    return method, state, tier, method.client_model(tier, arrays)


def test_fjord_samples_every_width_up_to_the_clients_maximum_uniformly():
    method, _, tier, local = fjord_local(top="g0.8")
    # a client whose environment allows only g0.8 still trains g0.2 .. g0.8 (not g1)
    assert tier == "g0.8" and local.widths == ["g0.2", "g0.4", "g0.6", "g0.8"]
    assert method.assign(["g0.4", "g0.6"], None) == "g0.6"
    torch.manual_seed(1)
    draws = torch.tensor([local.sample_width() for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.full((4,), 0.25), atol=0.03), freq  # binomial sd ~0.007


def test_fjord_self_distillation_is_on_by_default_and_matches_the_papers_loss(monkeypatch):
    x, y = torch.randn(6, 1, 16, 16, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 1, 2, 3, 4, 5])
    losses = {}
    for kd in (False, True):
        method, state, _, local = fjord_local(kd=kd)
        monkeypatch.setattr(local, "sample_width", lambda: 1)  # g0.4
        local.train()
        losses[kd], _ = local.loss(x, y)
    # the same batch through models loaded independently from the global state (train-mode BN)
    teacher = method.compiled["g0.8"].load(state).train()(x)
    student = method.compiled["g0.4"].load(state).train()(x)
    p = teacher.softmax(1)
    kl = (p * (p.log() - student.log_softmax(1))).sum(1).mean()
    assert torch.allclose(losses[False], F.cross_entropy(student, y), atol=1e-5)
    assert torch.allclose(losses[True], F.cross_entropy(teacher, y) + kl, atol=1e-5)
    assert config("fjord").build_strategy().settings.distil is True
    monkeypatch.setattr(local, "sample_width", lambda: 3)  # the widest width drawn: it is its own teacher, run once
    assert torch.allclose(local.loss(x, y)[0], F.cross_entropy(teacher, y), atol=1e-5)
    monkeypatch.setattr(local, "sample_width", lambda: 2)  # the width below the widest is a student too
    student = method.compiled["g0.6"].load(state).train()(x)
    kl = (p * (p.log() - student.log_softmax(1))).sum(1).mean()
    assert torch.allclose(local.loss(x, y)[0], F.cross_entropy(teacher, y) + kl, atol=1e-5)


def test_fjord_places_a_narrower_widths_region_inside_the_wider_ones():
    outer = SliceEntry("w", (torch.tensor([0, 2, 4, 6]), slice(0, 3)), (4, 3), "weight", True)
    inner = nested_entry(SliceEntry("w", (torch.tensor([0, 4]), slice(0, 2)), (2, 2), "norm", False), outer, "w@g0.2")
    assert (inner.global_key, inner.index[0].tolist(), inner.index[1], inner.shape, inner.kind, inner.consistent) == \
        ("w@g0.2", [0, 2], slice(0, 2), (2, 2), "norm", False)
    prefix = nested_entry(SliceEntry("w", (torch.tensor([0, 2]), slice(0, 1)), (2, 1), "weight", True), outer, "w")
    assert prefix.index == (slice(0, 2), slice(0, 1))  # the outer region's first two positions
    whole = nested_entry(SliceEntry("s", (), (), "steps", False), outer, "s@g0.2")
    assert (whole.index, whole.shape, whole.kind, whole.consistent) == ((), (), "steps", False)
    with pytest.raises(ValueError, match=r"^w: the narrower region is not inside the wider one$"):
        nested_entry(SliceEntry("w", (torch.tensor([1]), slice(0, 1)), (1, 1), "weight", True), outer, "w")


def test_fjord_distillation_at_another_temperature_and_weight_is_the_papers_formula():
    student, teacher = torch.randn(5, 4, generator=torch.Generator().manual_seed(3)), torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    y, alpha, t = torch.tensor([0, 1, 2, 3, 0]), 0.3, 2.5
    p, log_q = (teacher / t).softmax(1), (student / t).log_softmax(1)
    by_hand = (1 - alpha) * F.cross_entropy(student, y) + alpha * t * t * (p * (p.log() - log_q)).sum(1).mean()
    assert torch.allclose(distillation_loss(student, teacher, y, alpha, t), by_hand, atol=1e-6)


@pytest.mark.parametrize("kd", [False, True])
def test_fjord_counts_a_uniformly_drawn_width_and_with_distillation_the_widest_on_every_batch(kd):
    method = config("fjord", method_args={"kd": kd}).build_strategy()
    macs = [module_macs(method.compiled[w].build(), method.compiled.input_size) for w in ("g0.2", "g0.4", "g0.6")]
    expected = macs[2] + (macs[0] + macs[1]) / 3 if kd else sum(macs) / 3
    assert method.client_macs("g0.6") == pytest.approx(expected, rel=1e-12) and macs[0] < macs[1] < macs[2]


# -- DepthFL ---------------------------------------------------------------------------------

def test_depthfl_prefixes_sit_at_the_nearest_block_boundary():
    method = config("depthfl").build_strategy()
    # ResNet20 blocks (stage order) end at parameter ratios .02 .04 .05 .11 .17 .24 .45 .73 1 (plus the
    # downsampling projections of skipped stages): nearest to .19/.39/.6/.8/1 are 5, 7, 8, 8, 9 blocks
    assert method.prefixes.bounds == {"g0.2": 5, "g0.4": 7, "g0.6": 8, "g0.8": 8, "g1": 9}
    full = count_params(method.compiled.create_global_model())
    ratios = [count_params(method.compiled[t].build()) / full for t in LEVELS]
    assert [round(r, 3) for r in ratios] == [0.184, 0.456, 0.728, 0.728, 1.0]
    assert method.prefixes.exits_of("g0.6") == ["g0.2", "g0.4", "g0.6"]
    assert not any(k.startswith("fc.") for k in method.entries("g1"))


def test_depthfl_tiers_match_gamma_within_005_where_blocks_allow():
    spec = {"model": "resnet56", "model_args": {"num_classes": 10},
            "tiers": [{"name": f"g{g}", "gamma": g, "gamma_w": g} for g in (0.2, 0.4, 0.6, 0.8, 1)]}
    method = parse_config({"method": "depthfl", "spec": spec}, "<test>").build_strategy()
    full = count_params(method.compiled.create_global_model())
    for t in method.info.levels:
        ratio = count_params(method.compiled[t].build()) / full  # without exits: the tier's own classifier
        assert abs(ratio - method.compiled[t].tier.gamma) <= 0.05, (t, ratio)


def test_depthfl_exits_are_bottlenecks_on_the_features_at_their_prefix():
    """Exit i reads the features after its prefix through a bottleneck (a SepConv per stage the
    prefix does not reach) and a linear classifier; with shared BN, in train mode, exit 0 of the full
    tier's forward equals the g0.2 slim network's stage-2 output through exit 0, and exit 4 the full
    network with exit 4's classifier."""
    method = config("depthfl").build_strategy()
    torch.manual_seed(0)
    state = method.init_global_state()
    assert not any("@" in k for k in state)  # DepthFL's own: nothing per submodel
    local = method.client_model("g1", SliceMap(dict(method.entries("g1"))).extract(state)).train()
    # bounds 5, 7, 8, 8, 9 blocks: only g0.2's prefix ends in stage 2 (16/32/64 channels)
    assert [len(local.exits[str(i)].bottleneck) for i in range(5)] == [1, 0, 0, 0, 0]
    shapes = [tuple(p.shape) for p in local.exits["0"].bottleneck.parameters()]
    assert shapes == [(32, 1, 3, 3), (32, 32, 1, 1), (32,), (32,), (32, 1, 3, 3), (64, 32, 1, 1), (64,), (64,)]
    assert local.exits["0"].bottleneck[0][0].stride == (2, 2)
    x = torch.randn(6, 1, 16, 16, generator=torch.Generator().manual_seed(3))
    logits = local.all_logits(x)
    exit0 = local.exits["0"]
    features = method.compiled["g0.2"].load(state).train().forward_intermediates(x, [1], intermediates_only=True)[0]
    assert features.shape == (6, 32, 8, 8) and exit0.bottleneck(features).shape == (6, 64, 4, 4)
    assert torch.allclose(logits[0], exit0.fc(exit0.bottleneck(features).mean((2, 3))), atol=1e-5)
    net = method.compiled["g1"].load(state)
    net.fc.weight.data, net.fc.bias.data = state["exits.4.fc.weight"], state["exits.4.fc.bias"]
    assert torch.allclose(logits[4], net.train()(x), atol=1e-5)


def test_depthfl_mutual_distillation_is_the_ramped_average_kl_between_exits():
    x, y = torch.randn(6, 1, 16, 16, generator=torch.Generator().manual_seed(4)), torch.arange(6)
    method = config("depthfl").build_strategy()
    torch.manual_seed(0)
    arrays = SliceMap(dict(method.entries("g0.6"))).extract(method.init_global_state())
    losses = {}
    for w in (0.0, 0.25):
        local = method.prefixes.model("g0.6", arrays, w).train()
        losses[w], _ = local.loss(x, y)
        logits = local.all_logits(x)
    assert torch.allclose(losses[0.0], sum(F.cross_entropy(z, y) for z in logits), atol=1e-5)
    logp = [z.log_softmax(1) for z in logits]
    kd_term = sum((logp[j].exp() * (logp[j] - logp[i])).sum(1).mean() for i in range(3) for j in range(3) if i != j) / 2
    assert kd_term > 0.001 and torch.allclose(losses[0.25] - losses[0.0], 0.25 * kd_term, atol=1e-5)


def test_depthfl_distillation_weight_ramps_up_as_the_papers_formula(monkeypatch):
    from nefl_zoo.fl.methods.depthfl import Prefixes, kd_weight
    from nefl_zoo.fl.strategy.base import Instruction

    # exp(-5 (1 - t/R)^2), t = round - 1 capped at R = 0.3 T: the authors' 300 of 1000 rounds
    assert kd_weight(1, 1000, 0.3) == pytest.approx(math.exp(-5), rel=1e-12)  # 0.0067 at the start
    assert kd_weight(151, 1000, 0.3) == pytest.approx(math.exp(-1.25), rel=1e-12)
    assert kd_weight(301, 1000, 0.3) == 1.0 and kd_weight(1000, 1000, 0.3) == 1.0
    assert kd_weight(3, 10, 0.3) == pytest.approx(math.exp(-5 / 9), rel=1e-12)  # R = 3, t = 2
    method = config("depthfl", rounds=10).build_strategy()
    seen = []

    class Built(Exception):
        pass

    def model(self, tier, arrays, weight=0.0):  # what the client's step would train, then stop
        seen.append(weight)
        raise Built

    monkeypatch.setattr(Prefixes, "model", model)
    with pytest.raises(Built):
        method.train(Instruction({}, {"round": 3}, "g0.2"), None, {})
    assert seen == [pytest.approx(math.exp(-5 / 9), rel=1e-12)]


def test_feddyn_client_and_server_updates_by_hand():
    from nefl_zoo.fl.methods.feddyn import FedDynLocal, client_update, is_parameter, server_update
    from nefl_zoo.fl.strategy.local_model import SubmodelLocal

    # server: h <- h - alpha n/M (w_avg - w_old); w = w_avg - h/alpha; statistics untouched
    h = {"a.weight": torch.tensor([1.0, 0.0])}
    old = {"a.weight": torch.tensor([0.0, 2.0]), "b.bias": torch.tensor([1.0]), "bn.running_mean": torch.tensor([5.0])}
    avg = {"a.weight": torch.tensor([2.0, 2.0]), "b.bias": torch.tensor([3.0]), "bn.running_mean": torch.tensor([7.0])}
    new = server_update(h, old, avg, {"a.weight": 2, "b.bias": 1, "bn.running_mean": 2}, num_clients=4, alpha=0.5)
    assert torch.equal(h["a.weight"], torch.tensor([1.0 - 0.5 * 0.5 * 2, 0.0])) and torch.equal(h["b.bias"], torch.tensor([-0.25]))
    assert torch.equal(new["a.weight"], torch.tensor([2.0 - 0.5 / 0.5, 2.0])) and torch.equal(new["b.bias"], torch.tensor([3.5]))
    assert torch.equal(new["bn.running_mean"], torch.tensor([7.0])) and "bn.running_mean" not in h
    # client: g <- g - alpha (w - w_received); the loss adds -<w, g> + alpha/2 ||w - w_received||^2
    grads = {}
    client_update(grads, {"a.weight": torch.tensor([1.0, 1.0])}, {"a.weight": torch.tensor([3.0, 0.0]), "bn.running_var": torch.ones(1)}, 0.1)
    assert torch.allclose(grads["a.weight"], torch.tensor([-0.2, 0.1])) and set(grads) == {"a.weight"}
    client_update(grads, {"a.weight": torch.tensor([0.0, 0.0])}, {"a.weight": torch.tensor([1.0, 1.0])}, 0.1)
    assert torch.allclose(grads["a.weight"], torch.tensor([-0.3, 0.0]))  # kept between rounds: it accumulates
    # per-tier tensors (key@tier) are parameters or statistics by their name before the "@"
    assert is_parameter("layer1.0.bn1.weight@g0.2") and is_parameter("fc.bias@g1") and is_parameter("conv1.weight")
    assert not is_parameter("layer1.0.bn1.running_mean@g0.2") and not is_parameter("layer1.0.step@g0.2")
    # a statistic before a parameter in holders: the parameter is still moved
    h2 = {}
    new2 = server_update(h2, old, avg, {"bn.running_mean": 2, "a.weight": 2}, num_clients=4, alpha=0.5)
    assert set(h2) == {"a.weight"} and torch.equal(new2["a.weight"], torch.tensor([2.0 + 0.5 * 2 / 4 * 2.0 / 0.5, 2.0]))  # h = -0.5
    net = nn.Linear(2, 2, bias=False)
    base = SubmodelLocal(net)
    local = FedDynLocal(base, {"weight": net.weight}, {"weight": torch.full((2, 2), 0.5)}, alpha=2.0)
    x, y = torch.randn(3, 2), torch.tensor([0, 1, 1])
    with torch.no_grad():
        net.weight.add_(0.1)
        expected = base.loss(x, y)[0] - 0.5 * float(net.weight.sum()) + 2.0 / 2 * 4 * 0.1**2
        assert float(local.loss(x, y)[0]) == pytest.approx(float(expected), rel=1e-6)
        assert torch.equal(local(x), base(x))  # the regulariser changes the loss, not the function


def test_feddyn_server_term_counts_only_the_replies_it_accepted():
    """DepthFL (its paper's) with FedDyn, 3 clients in the round, one reply an error: the
    server's h moves by alpha * 2/3 of the average's change (n = 2 replies held the tensor, of
    M = 3 clients), and the new global tensor is the average minus h / alpha."""
    import dataclasses

    method = config("depthfl", method_args={"variant": "original"}).build_strategy()
    assert method.settings.dynamic
    torch.manual_seed(0)
    state = method.init_global_state()
    top = list(method.compiled.tiers)[-1]
    entries = dict(method.entries(top))
    base = SliceMap(entries).extract(state)
    key = next(k for k in base if k.startswith("conv1") and k.endswith("weight"))  # the stem: in every prefix
    target = entries[key].global_key
    replies = {}
    for cid, shift in enumerate((1.0, 3.0, 100.0)):
        arrays = {k: v.clone() for k, v in base.items()}
        arrays[key] += shift
        replies[cid] = Reply(arrays, {}, num_samples=10, level=top)
    replies[2] = dataclasses.replace(replies[2], error="out of memory")
    method.num_clients = 3
    alpha = method.settings.feddyn_alpha
    result = method.aggregate_train(1, state, replies)
    assert result.accepted == 2 and [cid for cid, _ in result.rejected] == [2]
    change = 2.0  # the average of the two accepted shifts, 1 and 3
    assert torch.allclose(method.h[target], torch.full_like(state[target], -alpha * 2 / 3 * change))
    assert torch.allclose(result.state[target], state[target] + change + 2 / 3 * change)
    untouched = next(k for k in state if k != target and k in method.h)
    assert torch.equal(method.h[untouched], torch.zeros_like(state[untouched]))  # no change, no term


# -- FedAvg ----------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["fedavg", "fedavg_min"])
def test_fedavg_has_no_step_sizes_to_learn(method):
    strategy = config(method, spec="specs/resnet20/nefl-d.yaml").build_strategy()
    torch.manual_seed(0)
    state = strategy.init_global_state()
    tier = strategy.info.levels[0]
    assert not any(k.endswith("step") or ".step@" in k for k in state)
    local = strategy.client_model(tier, SliceMap(dict(strategy.entries(tier))).extract(state))
    steps = {k: p for k, p in local.net.named_parameters() if k.endswith("step")}
    assert steps and all(not p.requires_grad and p.item() == 1.0 for p in steps.values())
    assert local.state().keys() == strategy.entries(tier).keys()


# -- HeteroFL --------------------------------------------------------------------------------

def test_heterofl_divides_every_convolution_by_its_width_rate_in_training_only_and_keeps_bn_static():
    method = config("heterofl").build_strategy()
    torch.manual_seed(0)
    state = method.init_global_state()
    tier = "g0.4"
    local = method.client_model(tier, SliceMap(dict(method.entries(tier))).extract(state))
    rate = math.sqrt(method.compiled[tier].tier.gamma_w)  # the width (channel) ratio: gamma_w is the parameter ratio
    convs = [m for m in local.net.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) > 20  # resnet20: every convolution of every block, the stem and the shortcuts
    for conv in convs:
        x = torch.randn(2, conv.in_channels, 8, 8)
        raw = F.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        local.train()
        assert torch.allclose(conv(x), raw / rate)
        local.eval()  # at test time without the scaler
        assert torch.equal(conv(x), raw)
    # static BN: training uses batch statistics and leaves the running ones untouched
    norms = [m for m in local.net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(m.track_running_stats is False for m in norms)
    before = [m.running_mean.clone() for m in norms]
    local.train()
    local(torch.randn(8, 1, 8, 8))
    assert all(torch.equal(m.running_mean, b) for m, b in zip(norms, before))
    assert not any(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in local.state())


# -- BN statistics at evaluation -------------------------------------------------------------

def test_recompute_gives_the_same_statistics_whichever_method_calls_it():
    images = torch.randn(96, 1, 16, 16, generator=torch.Generator().manual_seed(5))
    data = SimpleNamespace(train_eval=TensorDataset(images, torch.zeros(96, dtype=torch.long)))
    sections = {"eval": {"bn": "recompute", "bn_batches": 3}, "train": {"batch_size": 48}}
    methods = [config(m, **sections).build_strategy() for m in ("nefl", "heterofl", "fjord", "depthfl")]
    torch.manual_seed(0)
    net = methods[0].compiled["g1"].load(methods[0].init_global_state())
    stats = []
    for m in methods:
        model = with_bn(copy.deepcopy(net), "recompute", m.run, data)
        stats.append({k: v for k, v in model.state_dict().items() if "running" in k or "tracked" in k})
    assert all(s.keys() == stats[0].keys() and all(torch.equal(s[k], stats[0][k]) for k in s) for s in stats)
    # independently: 96 samples make two batches of 48 (of the 3 asked for); bn1 follows the stem
    # conv, and its statistics are the two batches' means and unbiased variances, averaged
    assert stats[0]["bn1.num_batches_tracked"].item() == 2
    with torch.no_grad():
        out = net.conv1(images)
    assert torch.allclose(stats[0]["bn1.running_mean"], out.mean((0, 2, 3)), atol=1e-5)  # equal batches: the mean of all
    per_channel = out.transpose(0, 1).flatten(1)
    assert torch.all(stats[0]["bn1.running_var"] > 0.5 * per_channel.var(1)) and torch.all(stats[0]["bn1.running_var"] < 2 * per_channel.var(1))
    # running: the statistics are the global state's, untouched
    kept = with_bn(copy.deepcopy(net), "running", methods[0].run, data)
    assert torch.equal(kept.bn1.running_mean, net.bn1.running_mean)


def test_eval_bn_both_reports_both_treatments_and_heterofl_always_recomputes():
    assert bn_treatments(config("nefl", eval={"bn": "recompute", "bn_both": True}).build_strategy().run) == ("recompute", "running")
    assert bn_treatments(config("nefl").build_strategy().run) == ("running",)
    net = nn.Sequential(nn.BatchNorm1d(2))
    data = SimpleNamespace(train_eval=TensorDataset(torch.randn(40, 2), torch.zeros(40, dtype=torch.long)))
    heterofl = config("heterofl").build_strategy()
    out = with_bn(net, "recompute", heterofl.run, data)
    assert out[0].num_batches_tracked.item() == 2 and not out.training  # 40 samples: batches of 32 and 8
    assert heterofl.static_bn and not config("nefl").build_strategy().static_bn  # HeteroFL: recomputed whatever eval.bn says


def test_bad_eval_and_method_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"eval\.bn_batches.*greater than or equal to 1"):
        config("nefl", eval={"bn_batches": 0})
    with pytest.raises(ConfigError, match=r"method_args\.kd_alpha.*fjord: Input should be less than or equal to 1"):
        config("fjord", method_args={"kd_alpha": 2})
    for methods, start in (("nefl=resnet20/nope", "error: --methods: resnet20/nope"),
                           ("nefl=resnet20/nefl-d,fjord=specs/resnet20/nefl-d.yaml", "error: --methods: two entries share a name")):
        result = CliRunner().invoke(app, ["compare", "specs/train/digits-compare.yaml", "--methods", methods])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(start), result.output


def test_a_compare_entry_runs_a_method_on_another_spec():
    entry = parse_entry("nefl=resnet20/nefl-d")
    assert (entry.key, entry.method, entry.label) == ("nefl-d", "nefl", "NeFL (nefl-d)")
    cfg = entry_config(config("nefl"), entry, seed=3)
    assert cfg.seed == 3 and cfg.submodel_spec().tiers[0].steps == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
    assert parse_entry("fjord") == Entry("fjord", "fjord")


# -- the comparison's statistics -------------------------------------------------------------

def test_results_table_pairs_seeds_and_counts_nefl_wins():
    def run(worst, other):
        acc = {"g0.2": worst, "g1": other}
        return RunResult(acc, worst, (worst + other) / 2, min(acc.values()), "g0.2", 0, 0, 1, {f"running/{t}": a for t, a in acc.items()})

    runs = {"nefl": [run(0.60, 0.9), run(0.50, 0.9), run(0.70, 0.9)],
            "heterofl": [run(0.55, 0.8), run(0.52, 0.8), run(0.61, 0.46)]}
    table = results_table(config("nefl"), [Entry("nefl", "nefl"), Entry("heterofl", "heterofl")], runs)
    # the worst case is the smallest submodel (g0.2), also where g1 is weaker (HeteroFL's seed 2):
    # NeFL - HeteroFL per seed: +5, -2, +9 points: mean 4.00, sample std sqrt(((1)^2 + (6)^2 + (5)^2) / 2) = 5.57; 2 wins of 3
    assert "| HeteroFL | 4.00 ± 5.57 (2/3) |" in table
    assert "| resnet20 | NeFL | 60.00 ± 10.00 | 75.00 ± 5.00 | 60.00 ± 10.00 |" in table
    # the minimum over submodels is its own column: 55, 52, 46: mean 51.00, std sqrt((16 + 1 + 25) / 2) = 4.58
    assert "| resnet20 | HeteroFL | 56.00 ± 4.58 | 62.33 ± 7.69 | 51.00 ± 4.58 |" in table
    assert "**recompute**" not in table


def test_a_curve_is_flat_when_its_last_change_is_within_the_seed_std_or_the_test_sets_standard_error():
    rounds = np.array([30, 35, 40])
    # seeds agree closely (std 0.1): the test set's resolution decides; at 95%, 450 images give
    # sqrt(0.95 * 0.05 / 450) = 1.03 points, so a 0.5-point change is flat and a 1.5-point one not
    agree = np.array([[90.0, 94.5, 95.0], [90.0, 94.5, 95.1], [90.0, 94.5, 94.9]])
    change, noise = flatness((rounds, agree), test_images=450)
    assert change == pytest.approx(0.5) and noise == pytest.approx(100 * math.sqrt(0.95 * 0.05 / 450))
    rising = agree + np.array([0.0, -1.0, 0.0])
    change, noise = flatness((rounds, rising), 450)
    assert change == pytest.approx(1.5) and noise < change
    # seeds disagree: their std (sample, ddof 1) is the noise
    spread = np.array([[80.0, 88.0, 90.0], [80.0, 92.0, 94.0], [80.0, 84.0, 86.0]])
    assert flatness((rounds, spread), 450) == pytest.approx((2.0, 4.0))


# -- the comparison's NeFL specs -------------------------------------------------------------

@pytest.mark.parametrize("name", ["nefl-w", "nefl-d", "nefl-wd"])
def test_resnet20_comparison_specs_are_within_002_of_gamma(name):
    from nefl_zoo.models import create_model
    from nefl_zoo.spec import load_spec

    path = f"specs/resnet20/{name}.yaml"
    spec = load_spec(path)

    def count(**kw):
        with torch.device("meta"):
            return sum(p.numel() for p in create_model(spec.model, **spec.model_args, **kw).parameters())

    ratios = [count(gamma_w=t.gamma_w, steps=t.steps) / count() for t in spec.tiers]
    assert [t.name for t in spec.tiers] == LEVELS
    assert all(abs(r - t.gamma) <= 0.02 for r, t in zip(ratios, spec.tiers)), ratios
    text = open(path).read()
    assert all(f"measured params ratio {r:.3f}" in text for r in ratios)  # the comments state what is measured


# -- variants: the NeFL paper's FjORD and DepthFL ---------------------------------------------

def test_fjord_nefl_trains_one_width_per_client_round_and_is_nefl_w_with_fixed_steps(tmp_path):
    """The NeFL authors' FjORD: the width a client draws this round (as NeFL draws submodels),
    cross-entropy, fixed steps, 1 per client: bit-identical to NeFL on the same widths with N/L steps."""
    from nefl_zoo.fl.engine import Engine
    from nefl_zoo.fl.strategy.local_model import SubmodelLocal

    from .conftest import tiny

    spec = tiny().to_dict()["spec"]
    fixed = {**spec, "tiers": [{**t, "learnable_steps": False} for t in spec["tiers"]]}
    runs = {}
    for name, kw in (("fjord", dict(method="fjord", method_args={"variant": "nefl"})), ("nefl", dict(method="nefl", spec=fixed))):
        engine = Engine(tiny(rounds=1, train__local_epochs=1, eval__every=1, data__max_test_samples=32, **kw), tmp_path / name)
        engine.run()
        runs[name] = (engine, load_file(str(tmp_path / name / "global.safetensors")), records(tmp_path / name))
    (fjord, a, rec_a), (_, b, rec_b) = runs["fjord"], runs["nefl"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert rec_a[0]["per_client"] == rec_b[0]["per_client"] and len(set(c["tier"] for c in rec_a[0]["per_client"].values())) > 1
    assert fjord.strategy.weighting == "clients"
    local = fjord.strategy.client_model("g0.5", SliceMap(dict(fjord.strategy.entries("g0.5"))).extract(a))
    assert isinstance(local, SubmodelLocal) and not any(p.requires_grad for k, p in local.net.named_parameters() if k.endswith("step"))
    with pytest.raises(ConfigError, match=r"method_args: fjord: kd: variant nefl"):
        config("fjord", method_args={"variant": "nefl", "kd": True})


def test_depthfl_nefl_is_the_nefl_d_blocks_with_one_shared_classifier_and_bn():
    method = config("depthfl", spec="specs/resnet20/nefl-d.yaml", method_args={"variant": "nefl"}).build_strategy()
    torch.manual_seed(0)
    state = method.init_global_state()
    assert not any("@" in k or k.startswith("exits") or k.endswith("step") for k in state)
    # g0.2 of NeFL-D keeps blocks [[1, 1, 1], [1, 1, 0], [0, 0, 0]]: non-contiguous, stage 3's projection kept
    held = method.entries("g0.2")
    assert "layer2.1.conv1.weight" in held and "layer2.2.conv1.weight" not in held and "layer3.1.conv1.weight" not in held
    assert "layer3.0.downsample.0.weight" in held and "layer3.0.conv1.weight" not in held
    assert all(held[k].global_key == k for k in ("fc.weight", "bn1.weight"))  # shared, not per tier
    local = method.client_model("g0.2", SliceMap(dict(held)).extract(state))
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        assert float(local.loss(x, y)[0]) == pytest.approx(float(F.cross_entropy(local(x), y)), rel=1e-6)
    assert method.weighting == "clients" and method.local_model is not None
    with pytest.raises(ValueError, match="depth-only"):
        config("depthfl", method_args={"variant": "nefl"}).build_strategy()
    # the blocks a tier keeps at step 1, fixed, whatever steps the NeFL-D spec starts from
    spec = parse_spec({"model": "resnet20", "tiers": [{"name": "g", "learnable_steps": True, "steps": [[0.5, 1, 0], [1, 0, 0], [2, 0, 0]]}]})
    tier = nefl_depth_spec(spec).tiers[0]
    assert not tier.learnable_steps and tier.steps == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert config("depthfl").build_strategy().local_model(Instruction({}, {}, "g0.2")) is None  # the original: its own step
    with pytest.raises(ConfigError, match=r"method_args: depthfl: feddyn: variant nefl"):
        config("depthfl", method_args={"variant": "nefl", "feddyn": True})


# -- each method's own averaging weights ------------------------------------------------------

def test_each_method_weights_as_its_paper_unless_train_weighting_says_otherwise():
    expected = {"nefl": "clients", "heterofl": "clients", "fedavg": "samples", "fedavg_min": "samples", "fedprox": "samples",
                "fedavgm": "samples", "fjord": "samples"}
    assert {m: config(m).build_strategy().weighting for m in expected} == expected
    assert config("fjord", method_args={"variant": "nefl"}).build_strategy().weighting == "clients"

    def final(weighting):
        strategy = config("fedavg", train={"weighting": weighting}).build_strategy()
        torch.manual_seed(0)
        state = strategy.init_global_state()

        def reply(value, n):
            return Reply({k: torch.full(e.shape, value, dtype=state[e.global_key].dtype) for k, e in strategy.entries("g1").items()},
                         num_samples=n, level="g1")

        return strategy.aggregate_train(1, state, {0: reply(1.0, 10), 1: reply(3.0, 30)}).state["fc.weight"]

    assert torch.all(final(None) == 2.5)  # (10 * 1 + 30 * 3) / 40: FedAvg's n_k / n
    assert torch.all(final("clients") == 2.0)  # (1 + 3) / 2


# -- compare --preset nefl-table1 -------------------------------------------------------------

def test_compare_preset_nefl_table1_runs_every_row_with_its_macs_per_client_round(tmp_path):
    """One round, two clients (one per round), on digits: every row of the NeFL paper's Table 1 and
    its ablation, and the MACs column; FedAvg's value recomputed here: local epochs x the client's
    training samples x fvcore's forward MACs of the full ResNet20 at 1x8x8."""
    from nefl_zoo.fl.compare import PRESETS, compare_methods
    from nefl_zoo.data.loading import load_data
    from nefl_zoo.models import create_model
    from nefl_zoo.profile import count_macs

    config = load_config("specs/train/digits-table1.yaml", ["rounds=1", "clients.num_clients=2", "clients.fraction=0.5",
                                                             "train.local_epochs=1", "data.max_test_samples=16", "eval.bn_batches=1"])
    result = compare_methods(config, PRESETS["nefl-table1"](config), 1, tmp_path, plot=False)
    table = result.markdown.split("BN statistics at evaluation: **recompute**")[0]
    rows = {line.split(" | ")[1]: line.split(" | ")[-1].strip(" |") for line in table.splitlines() if line.startswith("| resnet20 |")}
    assert list(rows) == ["NeFL-W", "NeFL-W (N/L)", "NeFL-D", "NeFL-D (N/L)", "NeFL-D_O", "NeFL-D_O (N/L)", "NeFL-WD",
                          "NeFL-WD (N/L)", "HeteroFL", "FjORD (NeFL's)", "DepthFL (NeFL's)", "DepthFL (NeFL's, nested)",
                          "FedAvg (full model)"]
    assert "| Model | Method | Worst | Avg | Min | MACs per client-round (M) |" in table
    # NeFL-D_O: NeFL-D's blocks, each kept block starting at 1 + the skipped blocks after it; N/L keeps them
    preset = {e.key: entry_config(config, e, 0).submodel_spec() for e in PRESETS["nefl-table1"](config)}
    assert preset["nefl-d_o"].tiers[0].steps == [[1, 1, 1], [1, 2, 0], [0, 0, 0]] and preset["nefl-d_o"].tiers[0].learnable_steps
    assert preset["nefl-d_o-nl"].tiers[3].steps == [[1, 2, 0], [0, 0, 0], [1, 1, 1]] and not preset["nefl-d_o-nl"].tiers[3].learnable_steps
    assert [[bool(s) for s in st] for st in preset["nefl-d_o"].tiers[2].steps] == [[bool(s) for s in st] for st in preset["nefl-d"].tiers[2].steps]
    nested = entry_config(config, next(e for e in PRESETS["nefl-table1"](config) if e.key == "depthfl-nested"), 0)
    assert nested.method_args == {"variant": "nefl", "nested": True} and nested.build_strategy().prefix_blocks == {
        "g0.2": 5, "g0.4": 7, "g0.6": 8, "g0.8": 8, "g1": 9}
    record = records(tmp_path / "fedavg" / "seed0")[0]
    (cid,) = (int(c) for c in record["per_client"])
    data = load_data(config.data, config.data_root(), (1, 8, 8), 2, 0)
    macs = count_macs(create_model("resnet20", num_classes=10, in_chans=1, img_size=8), (1, 8, 8))
    assert rows["FedAvg (full model)"] == f"{1 * len(data.client_dataset(cid)) * macs / 1e6:.1f}"
    assert float(rows["NeFL-W"]) < float(rows["FedAvg (full model)"]) and all(float(v) > 0 for v in rows.values())
    args = ["compare", "specs/train/digits-table1.yaml", "--out", str(tmp_path / "cli")]
    for extra, start in ((["--preset", "nefl-table1", "--methods", "nefl"], "error: --preset: give --preset or --methods, not both"),
                         (["--preset", "table9"], "error: --preset: expected nefl-table1, time-to-accuracy, got 'table9'")):
        refused = CliRunner().invoke(app, args + extra)
        assert refused.exit_code == 2 and refused.output.startswith(start), refused.output

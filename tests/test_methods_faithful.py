"""The baselines as their papers define them (FjORD, DepthFL, FedAvg), the shared BN recompute at
evaluation, and the comparison's paired statistics; each checked against an expectation
computed another way."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

from nefl_zoo_cli.app import app
from nefl_zoo.fl.compare import Entry, entry_config, parse_entry, results_table
from nefl_zoo.fl.config import ConfigError, parse_config
from nefl_zoo.fl.engine import RunResult
from nefl_zoo.fl.strategy_utils import bn_treatments, with_bn
from nefl_zoo.profile import count_params
from nefl_zoo.slim import SliceMap

LEVELS = ["g0.2", "g0.4", "g0.6", "g0.8", "g1"]
DIGITS_W = "specs/resnet20/nefl-w.yaml"


def config(method, spec=DIGITS_W, **sections):
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
    assert config("fjord").build_strategy().settings.kd is True


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


def test_depthfl_exits_read_the_features_at_their_prefix():
    """At initialisation every tier's BN affine is the same, so in train mode exit i of the full
    tier's one forward equals tier i's own slim network with its classifier replaced by exit i."""
    method = config("depthfl").build_strategy()
    torch.manual_seed(0)
    state = method.init_global_state()
    local = method.client_model("g1", SliceMap(dict(method.entries("g1"))).extract(state)).train()
    x = torch.randn(6, 1, 16, 16, generator=torch.Generator().manual_seed(3))
    logits = local.all_logits(x)
    for i, tier in enumerate(LEVELS):
        net = method.compiled[tier].load(state)
        net.fc.weight.data, net.fc.bias.data = state[f"exits.{i}.weight"], state[f"exits.{i}.bias"]
        assert torch.allclose(logits[i], net.train()(x), atol=1e-5), tier


def test_depthfl_mutual_distillation_is_the_average_kl_between_exits():
    x, y = torch.randn(6, 1, 16, 16, generator=torch.Generator().manual_seed(4)), torch.arange(6)
    losses = {}
    for kd in (False, True):
        method = config("depthfl", method_args={"kd": kd}).build_strategy()
        torch.manual_seed(0)
        state = method.init_global_state()
        local = method.client_model("g0.6", SliceMap(dict(method.entries("g0.6"))).extract(state)).train()
        losses[kd], _ = local.loss(x, y)
        logits = local.all_logits(x)
    assert torch.allclose(losses[False], sum(F.cross_entropy(z, y) for z in logits), atol=1e-5)
    logp = [z.log_softmax(1) for z in logits]
    kd_term = sum((logp[j].exp() * (logp[j] - logp[i])).sum(1).mean() for i in range(3) for j in range(3) if i != j) / 2
    assert kd_term > 0.001 and torch.allclose(losses[True] - losses[False], kd_term, atol=1e-5)


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
        return RunResult(acc, worst, (worst + other) / 2, 0, 0, 1, {f"running/{t}": a for t, a in acc.items()})

    runs = {"nefl": [run(0.60, 0.9), run(0.50, 0.9), run(0.70, 0.9)],
            "heterofl": [run(0.55, 0.8), run(0.52, 0.8), run(0.61, 0.8)]}
    table = results_table(config("nefl"), [Entry("nefl", "nefl"), Entry("heterofl", "heterofl")], runs)
    # NeFL - HeteroFL per seed: +5, -2, +9 points: mean 4.00, sample std sqrt(((1)^2 + (6)^2 + (5)^2) / 2) = 5.57; 2 wins of 3
    assert "| HeteroFL | 4.00 ± 5.57 (2/3) |" in table
    assert "| resnet20 | NeFL | 60.00 ± 10.00 | 75.00 ± 5.00 |" in table
    assert "**recompute**" not in table


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

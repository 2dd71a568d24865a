import json

import pytest
import torch
from torch import nn

from nefl_zoo.auto import auto_tier
from nefl_zoo.models import create_model
from nefl_zoo.profile import count_macs, count_params, profile_tiers, to_csv, to_json, to_markdown
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import SubmodelSpec


@pytest.mark.parametrize("model, gamma, mode", [("resnet110", 0.2, "balanced"), ("resnet110", 0.4, "depth"), ("resnet56", 0.6, "balanced"), ("resnet18", 0.2, "width"), ("resnet34", 0.5, "balanced")])
def test_auto_tier_reaches_the_target_within_one_percent(model, gamma, mode):
    found = auto_tier(model, gamma, mode)
    assert found.within_tolerance and not found.note
    slim = create_model(model, gamma_w=found.tier.gamma_w, steps=found.tier.steps)
    with torch.device("meta"):
        full = create_model(model)
    measured = count_params(slim) / count_params(full)
    assert measured == pytest.approx(found.params_ratio, abs=1e-12)
    assert abs(measured - gamma) <= 0.01 * gamma


def test_auto_tier_modes_differ_as_named():
    width = auto_tier("resnet56", 0.5, "width").tier
    depth = auto_tier("resnet56", 0.5, "depth").tier
    balanced = auto_tier("resnet56", 0.25, "balanced").tier
    assert width.steps is None and width.gamma_w < 1
    assert depth.gamma_w == 1 and any(0 in stage for stage in depth.steps)
    assert balanced.gamma_w == 0.5 and any(0 in stage for stage in balanced.steps)


def test_auto_tier_says_when_it_cannot():
    found = auto_tier("resnet18", 0.2, "depth")  # ResNet18 has too few blocks for 0.2 by depth alone
    assert not found.within_tolerance
    assert "cannot reach parameter ratio 0.2 within 1%" in found.note
    with pytest.raises(ValueError, match=r"gamma must be in \(0, 1\]"):
        auto_tier("resnet20", 1.5)


def expected_macs(model: nn.Module, input_size) -> int:
    """Independent count with forward hooks: conv/linear MACs, BN (2 per element, eval, affine),
    adaptive average pool (1 per input element), residual add and step multiply (1 per element)."""
    total = 0

    def hook(module, inputs, output):
        nonlocal total
        if isinstance(module, nn.Conv2d):
            total += output.numel() * module.in_channels * module.kernel_size[0] * module.kernel_size[1]
        elif isinstance(module, nn.Linear):
            total += output.numel() * module.in_features
        elif isinstance(module, nn.BatchNorm2d):
            total += 2 * output.numel()
        elif isinstance(module, nn.AdaptiveAvgPool2d):
            total += inputs[0].numel()
        elif getattr(module, "step_names", ()):  # a residual block with its branch
            total += 2 * output.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    with torch.no_grad():
        model.eval()(torch.zeros(1, *input_size))
    for h in handles:
        h.remove()
    return total


def test_macs_count_convolutions_norms_and_the_step_multiply_and_add():
    for m in (create_model("resnet20"), create_model("resnet20", gamma_w=0.25, steps=[[1, 0, 1], [0, 1, 1], [1, 1, 0]])):
        assert count_macs(m, (3, 32, 32)) == expected_macs(m, (3, 32, 32))


def test_profile_tiers_and_formats(resnet20_spec):
    profiles = profile_tiers(compile_spec(resnet20_spec), latency_batch=2)
    full = profiles[-1]
    assert (full.params_ratio, full.macs_ratio, full.blocks_per_stage) == (1.0, 1.0, [3, 3, 3])
    small = profiles[0]
    assert small.blocks_per_stage == [2, 2, 2]  # layer2.0 keeps only its projection shortcut
    assert small.params == count_params(compile_spec(resnet20_spec)["small"].build())
    assert 0 < small.macs_ratio < profiles[1].macs_ratio < 1
    assert all(p.latency_ms > 0 for p in profiles)
    md = to_markdown(profiles)
    assert md.splitlines()[0].startswith("| tier | gamma | gamma_w | params |") and "fvcore" in md
    rows = to_csv(profiles).splitlines()
    assert rows[0].startswith("name,gamma,gamma_w,params,params_ratio,macs") and len(rows) == 4
    data = json.loads(to_json(profiles))
    assert [t["name"] for t in data["tiers"]] == ["small", "medium", "full"]


def test_vit_macs_count_attention_matmuls(vit_spec):
    profiles = profile_tiers(compile_spec(vit_spec))
    assert profiles[-1].macs_ratio == 1.0
    full = compile_spec(vit_spec).create_global_model()
    tokens, dim, hidden, depth = 17, 64, 256, 2
    linear = tokens * dim * (3 * dim + dim + 2 * hidden)
    attention = 2 * tokens * tokens * dim  # q @ k^T and attn @ v over all heads
    core = 16 * dim * 3 * 8 * 8 + depth * (linear + attention) + dim * 10
    # the rest is norms, the step multiplies and residual adds: a few percent
    assert core < count_macs(full, (3, 32, 32)) < 1.1 * core


def test_width_ratio_is_a_parameter_ratio_against_the_full_model():
    spec = SubmodelSpec(model="resnet20", tiers=[{"name": "only", "gamma_w": 0.5}])
    (p,) = profile_tiers(compile_spec(spec))
    assert 0.5 <= p.params_ratio < 0.55  # against the full model, not the largest tier

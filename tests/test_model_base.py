"""The model contract's helpers in ``models/base.py``, with values worked out by hand: the width
rules, stage-index selection, step validation, ``forward_intermediates`` and parameter kinds
(the survivors of the first mutation run of this module, see TESTING.md)."""

import re

import pytest
import torch

from nefl_zoo.models import create_model
from nefl_zoo.models.base import resolve_steps, scale_width, take_indices

torch.set_num_threads(1)


@pytest.mark.parametrize(
    "channels, gamma_w, multiple, expected",
    [
        (1, 0.01, 1, 1),  # the paper's rule: ceil(0.1) = 1
        (202, 0.25, 8, 104),  # 101 -> nearest multiple of 8 is 104 (3 away), not 96 (5 away)
        (204, 0.25, 8, 104),  # 102 -> 104
        (88, 0.25, 8, 48),  # 44 is halfway between 40 and 48: rounds up, as timm's make_divisible
        (20, 0.25, 9, 9),  # 10 -> 9, exactly 90% of 10: kept (only *below* 90% goes up a multiple)
        (20, 0.36, 8, 16),  # 12 -> 16 (8 would be 67%, below 90%)
    ],
)
def test_scale_width_by_hand(channels, gamma_w, multiple, expected):
    assert scale_width(channels, gamma_w, multiple) == expected


def test_scale_width_defaults_to_the_papers_rule():
    assert scale_width(20, 0.5) == 15  # ceil(14.14); a multiple of 2 would give 14


def test_take_indices_by_hand():
    assert take_indices(3, None) == [0, 1, 2]
    assert take_indices(3, 2) == [1, 2]
    assert take_indices(3, [-1, 0]) == [2, 0]
    with pytest.raises(ValueError, match=re.escape("indices: the last 0 of 3 stages do not exist")):
        take_indices(3, 0)
    with pytest.raises(ValueError, match=re.escape("indices: expected stage indices in 0..2, got [3]")):
        take_indices(3, [3])
    with pytest.raises(ValueError, match=re.escape("indices: expected stage indices in 0..2, got []")):
        take_indices(3, [])


def test_resolve_steps_errors_name_the_stage():
    with pytest.raises(ValueError, match=re.escape("expected 3 stages of steps, got 2")):
        resolve_steps([[1] * 3, [1] * 3], (3, 3, 3))
    with pytest.raises(ValueError, match=re.escape("stage 2 has 3 blocks, got 2 steps")):
        resolve_steps([[1] * 3, [1] * 2, [1] * 3], (3, 3, 3))


def test_forward_intermediates_stops_early_only_when_asked():
    model = create_model("resnet20", num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stage0 = model.layer1(model.forward_stem(x))
        features, intermediates = model.forward_intermediates(x, indices=[0])
        assert torch.equal(features, model.forward_features(x))
        assert len(intermediates) == 1 and torch.equal(intermediates[0], stage0)
        early, intermediates = model.forward_intermediates(x, indices=[0], stop_early=True)
        assert torch.equal(early, model.forward_norm(stage0)) and early.shape == (2, 16, 32, 32)


def test_param_kinds_of_resnet20():
    model = create_model("resnet20", num_classes=10)
    kinds = model.param_kinds()
    assert kinds.keys() == model.state_dict().keys()
    assert set(kinds.values()) == {"weight", "norm", "steps"}
    assert kinds["conv1.weight"] == kinds["layer2.0.conv1.weight"] == kinds["fc.bias"] == "weight"
    assert kinds["bn1.weight"] == kinds["bn1.running_mean"] == kinds["layer3.2.bn2.num_batches_tracked"] == "norm"
    assert [k for k, v in kinds.items() if v == "steps"] == [f"layer{s}.{b}.step" for s in (1, 2, 3) for b in range(3)]


def test_compiled_spec_records_what_the_model_declares(tmp_path):
    from safetensors.torch import save_file

    from nefl_zoo.slim import compile_spec
    from nefl_zoo.spec import parse_spec

    spec = parse_spec({"model": "resnet20", "model_args": {"num_classes": 10}, "tiers": [{"name": "g0.5", "gamma_w": 0.5}, {"name": "g1"}]})
    compiled = compile_spec(spec)
    assert compiled.input_size == (3, 32, 32) and compiled.stage_names == ("layer1", "layer2", "layer3")
    # ceil(16 * sqrt(0.5)) = 12 output channels; BN per tier (inconsistent by default), whole
    conv, norm = compiled["g0.5"].slice_map["conv1.weight"], compiled["g0.5"].slice_map["bn1.weight"]
    assert (conv.global_key, conv.shape, conv.kind, conv.consistent) == ("conv1.weight", (12, 3, 3, 3), "weight", True)
    assert (norm.global_key, norm.index, norm.shape, norm.kind, norm.consistent) == ("bn1.weight@g0.5", (), (12,), "norm", False)
    shapes = compiled.global_shapes()
    assert "conv1.weight" in shapes and "bn1.weight" not in shapes and shapes["bn1.weight@g0.5"] == (12,)
    # create_global_model passes pretrained weights on
    weights = {k: torch.full_like(v, 0.5) if v.is_floating_point() else v for k, v in create_model("resnet20", num_classes=10).state_dict().items()}
    save_file(weights, str(tmp_path / "w.safetensors"))
    model = compiled.create_global_model(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "channels, gamma_w, multiple, expected",
    [
        (24, 0.17, 8, 16),  # 9.90 -> 8 is 80.8% of it: raised
        (16, 0.35, 8, 16),  # 9.47 -> 8 is 84.5%: raised
        (64, 0.35, 16, 48),  # 37.86 -> 32 is 84.5%: raised
        (64, 0.085, 16, 32),  # 18.66 -> 16 is 85.7%: raised
        (20, 0.2, 8, 16),  # 8.94 -> 8 is 89.4%: raised
        (16, 0.31, 8, 16),  # 8.91 -> 8 is 89.8%: raised
        (16, 0.3025, 8, 8),  # 8.8 -> 8 is 90.9%: kept
    ],
)
def test_scale_width_raises_every_width_between_80_and_90_percent(channels, gamma_w, multiple, expected):
    """An aligned width below 90% of ``C * sqrt(gamma_w)`` goes up one multiple, however close to
    90% it is (the bound was pinned only at exactly 90% and at 79%). Catches the one-line change
    ``if width < 0.8 * exact:`` (or any bound from 0.8 to 0.898) in ``scale_width``."""
    assert scale_width(channels, gamma_w, multiple) == expected

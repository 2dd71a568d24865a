"""``nefl_zoo.nest.nest``: a user's module registered as a zoo model under its class name, with
its own weights, classes, channels and size; bad example inputs and other sizes refused in one
line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nefl_zoo.models import create_model
from nefl_zoo.models.args import ModelArgsError
from nefl_zoo.models.registry import model_info
from nefl_zoo.nest import NestError, nest


class TwoWords(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 8, 1), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


def test_a_module_is_registered_under_its_class_name_with_its_weights_copied():
    torch.manual_seed(0)
    net, x = TwoWords().eval(), torch.randn(2, 2, 4, 4)
    with torch.no_grad():
        expected = net(x)
    name = nest(net, torch.zeros(5, 2, 4, 4))  # an example tensor: its channels and size count
    assert name == "two_words" and model_info(name).summary == "TwoWords, nested automatically (nefl_zoo.nest)."
    with torch.no_grad():
        net.conv.weight.add_(1)  # a later change of the module is not the model's
        full = create_model(name)
        assert torch.equal(full(x), expected)
    assert (full.num_classes, full.default_cfg["input_size"]) == (3, (2, 4, 4))
    narrow = create_model(name, gamma_w=0.5)  # ceil(8 sqrt(0.5)) = 6 channels; to whole fours: 8
    assert narrow.conv.weight.shape == (6, 2, 1, 1) and create_model(name, gamma_w=0.5, channel_multiple=4).conv.weight.shape == (8, 2, 1, 1)
    assert create_model(name, gamma_w=0.3).conv.weight.shape == (5, 2, 1, 1)  # ceil(8 sqrt(0.3)) = 5: no rounding by default


def test_a_nested_module_declares_its_arguments():
    name = nest(TwoWords(), (1, 2, 4, 4))
    with pytest.raises(ModelArgsError, match="^gamma_w: "):
        create_model(name, gamma_w=1.5)


def test_the_analysis_at_nest_serves_every_tier(monkeypatch):
    from nefl_zoo.nest import plan

    analysed = []
    monkeypatch.setattr(plan, "make_plan", lambda *args, make=plan.make_plan: analysed.append(args[1:]) or make(*args))
    name = nest(TwoWords(), (1, 2, 4, 4))
    assert analysed == [(2, 4)]  # analysed by nest itself: a module that cannot be nested is refused there
    create_model(name)
    create_model(name, gamma_w=0.5)
    assert analysed == [(2, 4)]


def test_a_second_module_under_a_name_replaces_the_first():
    class Wider(TwoWords):
        def __init__(self):
            super().__init__()
            self.conv, self.head = nn.Conv2d(2, 12, 1), nn.Linear(12, 3)

    nest(TwoWords(), (1, 2, 4, 4), name="same")
    with pytest.warns(UserWarning, match="model 'same' .* replaces"):
        nest(Wider(), (1, 2, 4, 4), name="same")
    assert create_model("same").conv.weight.shape == (12, 2, 1, 1)


@pytest.mark.parametrize("kwargs", [{"num_classes": 10}, {"in_chans": 3}, {"img_size": 8}])
def test_a_nested_module_keeps_its_classes_channels_and_size(kwargs):
    name = nest(TwoWords(), (1, 2, 4, 4), name=f"kept_{next(iter(kwargs))}")
    with pytest.raises(NestError) as refused:
        create_model(name, **kwargs)
    assert str(refused.value) == f"{name}: a user module keeps its 3 classes, 2 channels, size 4"


@pytest.mark.parametrize("shape", [(1, 2, 4, 5), (2, 4, 4)])
def test_an_example_input_that_is_not_a_square_batch_of_images_is_refused(shape):
    with pytest.raises(NestError) as refused:
        nest(TwoWords(), shape)
    assert str(refused.value) == f"example_input: expected a square (N, C, H, W) input, got {shape}"

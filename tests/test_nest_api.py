"""``nefl_zoo.nesting.nest``: a user's module registered as a zoo model under its class name, with
its own weights, classes, channels and size; bad example inputs and other sizes refused in one
line."""

from __future__ import annotations

import collections
import copy
import re

import pytest
import torch
from torch import nn

from nefl_zoo.models import create_model
from nefl_zoo.models.args import ModelArgsError
from nefl_zoo.models.registry import model_info
from nefl_zoo.nesting import NestError, nest


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
    from nefl_zoo.nesting import plan

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


Outputs = collections.namedtuple("Outputs", "logits features")


class Several(nn.Module):
    """A classifier whose forward returns more than its logits, in the form ``kind`` names."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv, self.head, self.aux = nn.Conv2d(2, 8, 1), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x):
        maps = torch.relu(self.conv(x))
        features = maps.mean((2, 3))
        logits = self.head(features)
        if self.kind == "dict":
            return {"logits": logits, "aux": self.aux(features)}
        if self.kind == "namedtuple":
            return Outputs(logits, features)
        if self.kind == "tuple with a map":
            return logits, maps
        if self.kind == "two heads":
            return logits, self.aux(features)
        return logits, features


@pytest.mark.parametrize("kind", ["dict", "namedtuple", "tuple with a map"])
def test_a_forward_returning_several_outputs_is_nested_by_its_one_logits_tensor(kind):
    torch.manual_seed(0)
    net, x = Several(kind).eval(), torch.randn(2, 2, 4, 4)
    with torch.no_grad():
        out = net(x)
    expected = out["logits"] if kind == "dict" else out[0]
    name = nest(net, (1, 2, 4, 4), name=f"several_{kind.replace(' ', '_')}")
    full, narrow = create_model(name).eval(), create_model(name, gamma_w=0.5).eval()
    with torch.no_grad():
        assert torch.equal(full(x), expected) and narrow(x).shape == (2, 3)
    assert full.num_classes == 3 and not hasattr(full, "aux")  # layers of the other outputs are not the tier's


@pytest.mark.parametrize("kind, outputs", [("tuple", "[0]: (1, 3), [1]: (1, 8)"), ("two heads", "[0]: (1, 3), [1]: (1, 3)")],
                         ids=["features", "two heads"])
def test_outputs_without_one_clear_logits_tensor_are_refused_by_name(kind, outputs):
    with pytest.raises(NestError) as refused:
        nest(Several(kind), (1, 2, 4, 4), name="several_refused")
    assert str(refused.value) == (f"Several: forward returns a tuple ({outputs}) and no single logits tensor among them; "
                                  "return the logits alone, or name them 'logits' (a dict key or a namedtuple field)")


class Flat(nn.Module):
    """A linear layer over the flattened 4x4 maps: it takes one size only."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 4, 1), nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


BAD_EXAMPLES = [
    ((1, 3, 4, 4), r"Flat cannot run an input of shape \(1, 3, 4, 4\) \(RuntimeError: Given groups=1, weight of size \[4, 2, 1, 1\], "
                   r"expected input\[1, 3, 4, 4\] to have 2 channels, but got 3 channels instead\); give the \(N, C, H, W\) its forward takes$"),
    (torch.zeros(1, 2, 8, 8), r"Flat cannot run an input of shape \(1, 2, 8, 8\) \(RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    ((0, 2, 4, 4), r"expected sizes of at least 1, got \(0, 2, 4, 4\)$"),
    ((1, 2, -4, -4), r"expected sizes of at least 1, got \(1, 2, -4, -4\)$"),
    ((1, 2.0, 4, 4), r"expected a tensor or a shape \(N, C, H, W\) of whole numbers, got \(1, 2.0, 4, 4\)$"),
    ((True, 2, 4, 4), r"of whole numbers, got \(True, 2, 4, 4\)$"),
    (4, r"of whole numbers, got 4$"),
]


@pytest.mark.parametrize("example, message", BAD_EXAMPLES,
                         ids=["channels", "size", "empty batch", "negative", "float", "bool", "int"])
def test_an_example_input_the_forward_does_not_take_is_refused_in_one_line(example, message):
    with pytest.raises(NestError) as refused:
        nest(Flat(), example, name="flat_refused")
    text = str(refused.value)
    assert "\n" not in text and text.startswith("example_input: ") and re.search(message, text), text


class Counting(nn.Module):
    """Batch norm with running statistics, dropout, and a count of calls its forward updates in
    place whatever its mode (and reads: the tier keeps it)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.drop, self.head = nn.Conv2d(2, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Dropout(0.1), nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        calls = self.calls.add_(1)
        return self.head(self.drop(torch.relu(self.bn(self.conv(x)))).mean((2, 3))) + 0 * calls


def _snapshot(net: nn.Module) -> tuple:
    """Everything nesting must leave as it was: every tensor's values, which tensor objects the
    module holds and whether they need gradients, and every other attribute of every module."""
    state = {k: v.clone() for k, v in net.state_dict(keep_vars=True).items()}
    held = [(k, id(v), v.requires_grad) for k, v in net.state_dict(keep_vars=True).items()]
    attributes = {name: {k: copy.copy(v) for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")}
                  for name, m in net.named_modules()}
    return state, held, attributes


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_users_module_is_never_modified_and_every_tier_starts_from_its_weights(mode):
    torch.manual_seed(0)
    net = Counting()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(4, 2, 4, 4))  # running statistics of its own, 3 calls
    net.train(mode == "train")
    net.conv.bias.requires_grad_(False)
    before = _snapshot(net)

    name = nest(net, torch.randn(5, 2, 4, 4), name=f"counting_{mode}")
    full, narrow = create_model(name), create_model(name, gamma_w=0.5)
    full(torch.randn(4, 2, 4, 4)).sum().backward()  # a tier trained in place
    torch.optim.SGD(full.parameters(), lr=1.0).step()
    again = create_model(name)

    after = _snapshot(net)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0]) and before[1:] == after[1:]
    for tier in (again, narrow):
        assert all(m.training for m in tier.modules())  # as every created model
    tier_state = again.state_dict()
    assert all(torch.equal(tier_state[k], v) for k, v in before[0].items())  # calls included: the user's 3, not 4
    kept = narrow.conv.weight.shape[0]
    assert kept < 8 and torch.equal(narrow.conv.weight, before[0]["conv.weight"][:kept])
    assert torch.equal(narrow.bn.running_var, before[0]["bn.running_var"][:kept]) and int(narrow.calls) == 3
    assert not narrow.conv.bias.requires_grad

"""Residual blocks of automatically nested networks (nefl_zoo/nesting/residual.py) and how the
nested net carries them (nefl_zoo/nesting/net.py): stages of nested modules, adds of every call
form, layer scales, and the traced module's own tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from nefl_zoo.models import create_model
from nefl_zoo.nesting import NestError, nest
from nefl_zoo.nesting.net import AutoArgs, model_info
from nefl_zoo.nesting.verify import zeroed_parity
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec


class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return x + self.conv(x)


class Outer(nn.Module):
    """A block whose branch follows an inner block: both adds belong to this module's tree."""

    def __init__(self):
        super().__init__()
        self.inner, self.conv = Res(), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        x = self.inner(x)
        return x + self.conv(x)


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.body, self.fc = nn.Conv2d(1, 8, 3, padding=1), nn.Module(), nn.Linear(8, 3)
        self.body.stages = nn.Sequential(nn.Sequential(Outer()), nn.Sequential(nn.Conv2d(8, 8, 3, 2, 1), Res()))

    def forward(self, x):
        return self.fc(self.body.stages(self.stem(x)).mean((2, 3)))


def test_a_stage_is_named_by_the_module_its_blocks_share_however_deep():
    net = create_model(nest(Deep(), (1, 1, 8, 8), name="deep_stages"))
    assert net.stage_names == ("body.stages.0", "body.stages.1") and net.stage_depths == (2, 1)
    assert [(f["module"], f["reduction"]) for f in net.feature_info] == [("body.stages.0", 1), ("body.stages.1", 2)]
    assert all(type(f["reduction"]) is int for f in net.feature_info)
    assert net.step_keys() == {"body.stages.0.0.inner.step": (0, 0), "body.stages.0.0.step": (0, 1), "body.stages.1.1.step": (1, 0)}


class Forms(nn.Module):
    """Blocks through a functional dropout and ``torch.clone`` shortcut, an ``x.add(...)``
    block, a layer-scaled block and a block that is only a layer scale; and what is no residual
    add at all (a gate, a constant, a parameter, two heads of a pooled vector)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.a, self.b, self.c, self.d, self.g = (nn.Conv2d(8, 8, 3, padding=1) for _ in range(5))
        self.gamma = nn.Parameter(torch.full((1, 8, 1, 1), 0.5))
        self.scale = nn.Parameter(torch.linspace(-1, 1, 8).view(1, 8, 1, 1))
        self.offset = nn.Parameter(torch.linspace(0, 1, 8).view(1, 8, 1, 1))
        self.register_buffer("mask", torch.ones(1, 8, 1, 1))
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 8).view(1, 8, 1, 1))  # the traced module's own buffer
        self.bias_table = torch.tensor([0.25])  # a plain tensor: torch.fx keeps it as a constant
        self.p, self.q, self.fc = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        x = self.stem(x) - self.shift
        x = F.dropout(x, 0.1, self.training) + self.a(x)
        x = torch.clone(x) + self.b(x)
        x = x.add(self.c(x))
        x = x + self.gamma * self.d(x)
        x = x + self.scale * x
        x = x + self.mask * x  # a buffer is no parameter: nothing to skip
        x = x * torch.sigmoid(self.g(x)) * self.bias_table
        x = 1.0 + x
        x = x + self.offset
        h = x.mean((2, 3))
        return self.fc(self.p(h) + self.q(h))


@pytest.fixture(scope="module")
def forms():
    torch.manual_seed(0)
    module = Forms().eval()
    return module, nest(module, (1, 1, 4, 4), name="add_forms")


def test_every_call_form_of_a_residual_add_is_found_and_other_adds_are_left_alone(forms):
    module, name = forms
    net = create_model(name).eval()
    assert [b.add for b in net.plan.blocks] == ["add", "add_1", "add_2", "add_3", "add_4"]
    assert net.plan.unskippable == ["add_5: its branch has no parameters"]
    assert net.stage_depths == (5,)
    x = torch.randn(2, 1, 4, 4)
    with torch.no_grad():  # the buffer and the constant are the traced net's own
        assert torch.equal(net(x), module(x))
    assert torch.equal(net.shift, module.shift) and "shift" in dict(net.named_buffers())


def test_a_block_carries_the_parameters_its_branch_reads_directly(forms):
    _, name = forms
    views = [view for _, _, view in create_model(name).residual_blocks()]
    assert [v.step_names for v in views] == [("step",), ("step_1",), ("step_2",), ("step_3",), ("step_4",)]
    assert [v.step_key for v in views] == ["step", "step_1", "step_2", "step_3", "step_4"]
    assert views[3].keys == ("d.weight", "d.bias", "gamma") and views[4].keys == ("scale",)
    assert [k for k, _ in views[4].branch_parameters()] == ["scale", "step_4"]


def test_tiers_skip_layer_scaled_blocks_and_cut_the_traced_nets_own_tensors(forms):
    _, name = forms
    compiled = compile_spec(parse_spec({"model": name, "tiers": [
        {"name": "t", "gamma_w": 0.5, "steps": [[1, 0, 1, 0, 0]]}, {"name": "f"}]}))
    assert zeroed_parity(compiled, "t", torch.randn(2, 1, 4, 4)) < 1e-6
    tier = compiled["t"].build()
    assert tier.shift.shape == (1, 6, 1, 1) and not hasattr(tier, "scale") and not hasattr(tier, "gamma")


def test_a_kept_blocks_step_scales_its_branch(forms):
    module, name = forms
    net, x = create_model(name).eval(), torch.randn(2, 1, 4, 4)
    with torch.no_grad():
        reference = module(x)
        net.get_parameter("step_3").zero_()  # the layer-scaled block, as if its scale were 0
        gamma = module.gamma.clone()
        module.gamma.zero_()
        try:
            assert torch.equal(net(x), module(x)) and not torch.equal(net(x), reference)
        finally:
            module.gamma.copy_(gamma)


def test_two_tiers_that_keep_different_channels_of_one_shape_are_refused(forms):
    _, name = forms
    plan = create_model(name, gamma_w=0.5).plan
    key = ("a.weight", (6, 6, 3, 3))  # ceil(8 sqrt(0.5)) channels
    kept = plan.index_cache[key]
    plan.index_cache[key] = tuple(torch.arange(n - 1, -1, -1) if isinstance(i, slice) else i
                                  for i, n in zip(kept, key[1]))  # the same shape, other channels
    try:
        with pytest.raises(NestError, match=r"^a\.weight: two tiers of shape \(6, 6, 3, 3\) keep different channels$"):
            create_model(name, gamma_w=0.5)
    finally:
        plan.index_cache[key] = kept


def test_a_tier_lists_the_blocks_it_keeps_after_a_removed_one_and_refuses_a_shape_it_never_built(forms):
    _, name = forms
    tier = create_model(name, gamma_w=0.5, steps=[[1, 0, 1, 0, 1]])
    assert [view.step_key for _, _, view in tier.residual_blocks()] == ["step", "step_2", "step_4"]
    with pytest.raises(NestError, match=r"^a\.weight: no tier of shape \(5, 5, 3, 3\) was built from this plan$"):
        tier.slice_index("a.weight", torch.Size((5, 5, 3, 3)), torch.Size((8, 8, 3, 3)))


def test_library_models_register_their_arguments_and_summary():
    from nefl_zoo.models.registry import UnknownModelError

    info = model_info("torchvision:resnet18")
    assert info.args is AutoArgs and info.module == "nefl_zoo.nesting.net"
    assert info.summary == "torchvision:resnet18, nested automatically (channel-dependency graph)."
    with pytest.raises(UnknownModelError, match=r"^unknown model 'torchvision:resnet_nope': no such torchvision or timm model$"):
        model_info("torchvision:resnet_nope")


class ListedScale(nn.Module):
    """A per-channel scale kept in a list: torch.fx names it (``_tensor_constant0``), and a new
    instance of the module does not have that name."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 8, 1), nn.Linear(8, 2)
        self.scales = [torch.linspace(0.5, 1, 8).view(1, 8, 1, 1)]

    def forward(self, x):
        return self.fc((self.conv(x) * self.scales[0]).mean((2, 3)))


def test_a_tensor_the_forward_reads_from_a_list_is_carried_into_every_tier_and_cut():
    torch.manual_seed(0)
    module = ListedScale().eval()
    compiled = compile_spec(parse_spec({"model": nest(module, (1, 1, 2, 2), name="listed_scale"),
                                        "tiers": [{"name": "t", "gamma_w": 0.5}, {"name": "f"}]}))
    x = torch.randn(2, 1, 2, 2)
    with torch.no_grad():
        assert torch.equal(compiled.create_global_model().eval()(x), module(x))
    assert zeroed_parity(compiled, "t", x) < 1e-6
    assert torch.equal(compiled["t"].build()._tensor_constant0, module.scales[0][:, :6])


class MetaScale(ListedScale):
    def __init__(self):
        super().__init__()
        self.scales = [torch.ones(1, 8, 1, 1, device="meta")]  # shape only: no values to carry


def test_a_listed_tensor_without_values_is_refused_in_one_line_when_a_tier_needs_data():
    from nefl_zoo.nesting.net import build_tier
    from nefl_zoo.nesting.sources import Source

    with torch.device("meta"):  # shape-only tiers need no values
        assert build_tier(("meta_scale",), lambda: Source("module:meta_scale", MetaScale), 1, 2, 2)._tensor_constant0.is_meta
    with pytest.raises(NestError, match=r"^module:meta_scale: _tensor_constant0: a tensor its forward reads from outside "
                                        r"its parameters and buffers \(from a list or a global\) has no values here; "
                                        r"register it as a buffer$"):
        build_tier(("meta_scale",), lambda: Source("module:meta_scale", MetaScale), 1, 2, 2)

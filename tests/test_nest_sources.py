"""Where automatically nested networks come from (nefl_zoo/nesting/sources.py): library
constructors with their arguments, the first convolution re-made for other input channels,
construction on the meta device, and tracing (optional arguments, shape assertions, refusals)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nefl_zoo.nesting.sources import NestError, Source, _optional_arguments, _replace_first_conv, construct, library_source, trace


@pytest.mark.parametrize("name", ["googlenet", "inception_v3"])
def test_torchvision_inception_networks_are_built_without_auxiliary_heads_and_with_their_own_init(name):
    import torchvision

    torch.manual_seed(0)
    net = library_source(f"torchvision:{name}", 10, 1).make()
    torch.manual_seed(0)
    theirs = torchvision.models.get_model(name, weights=None, num_classes=10, aux_logits=False, init_weights=True)
    assert net.aux_logits is False and not any("aux" in k.lower() for k, _ in net.named_children())
    first = next(k for k, m in net.named_modules() if isinstance(m, nn.Conv2d))
    assert net.get_submodule(first).in_channels == 1 and net.fc.out_features == 10
    ours = net.state_dict()
    assert list(ours) == list(theirs.state_dict())
    for key, value in theirs.state_dict().items():  # torchvision's own init, drawn the same
        assert key.startswith(f"{first}.") or torch.equal(ours[key], value), key


def test_timm_networks_take_the_input_channels_at_construction():
    net = library_source("timm:resnet18", 7, 2).make()
    assert net.conv1.in_channels == 2 and net.fc.out_features == 7


def test_the_first_convolution_is_remade_for_other_input_channels_keeping_its_settings():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1, 1, 1, False, "reflect"), nn.Conv2d(4, 4, 1))
    _replace_first_conv(model, 1)
    conv = model[0]
    assert (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding) == (1, 4, (3, 3), (2, 2), (1, 1))
    assert conv.bias is None and conv.padding_mode == "reflect" and model[1].in_channels == 4
    with pytest.raises(NestError, match=r"^in_chans: no convolution found to take 1 input channels$"):
        _replace_first_conv(nn.Sequential(nn.Linear(2, 2)), 1)


def test_construction_on_the_meta_device_puts_every_tensor_there_in_one_go():
    calls = []
    with torch.device("meta"):
        made = construct(Source("module:linear", lambda: calls.append(1) or nn.Linear(2, 3)))
    assert made.weight.is_meta and made.bias.is_meta
    assert calls == [1]  # built once, parameters straight onto meta (not again on the CPU, as a fallback)
    assert not construct(Source("module:linear", lambda: nn.Linear(2, 3))).weight.is_meta


class Options(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 1)

    def forward(self, x, mask=None, flip=False, scale=2.0, *, extra=None):
        return self.conv(x) * scale


def test_only_forwards_none_or_flag_defaults_are_fixed_when_tracing():
    assert _optional_arguments(Options()) == {"mask": None, "flip": False}


class Asserts(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 1)

    def forward(self, x):
        y = self.conv(x)
        torch._assert(y.shape[1] == 2, "two channels")
        torch._assert_async(y.sum() != 12345.0)
        return y


def test_the_trace_keeps_the_class_name_and_drops_shape_assertions():
    model = Asserts()
    gm = trace(Source("module:asserts", Asserts), model)
    assert type(gm).__name__ == "Asserts"
    names = {getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"}
    assert not names & {"_assert", "_assert_async", "sum"}  # the assertions and what they alone read
    x = torch.randn(1, 1, 2, 2)
    assert torch.equal(gm(x), model(x))


class Silent(nn.Module):
    def forward(self, x):
        raise RuntimeError("")


def test_a_trace_error_without_a_message_still_names_the_source_and_the_error():
    with pytest.raises(NestError, match=r"^module:silent: torch\.fx cannot trace it: RuntimeError: $"):
        trace(Source("module:silent", Silent), Silent())

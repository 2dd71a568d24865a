"""Graph surgery before export: rewrites of a tier module that keep its outputs.

:func:`fold_batchnorm` folds BatchNorms into the preceding convolutions; :func:`pad_channels`
zero-pads inner channel counts to an aligned width for faster CPU kernels. The exporter
(:mod:`nefl_zoo.export.tiers`) checks each result against the original before using it.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn


def fold_batchnorm(module: nn.Module) -> nn.Module:
    """A copy of an eval-mode ``module`` with every BatchNorm that alone consumes a
    convolution's output folded into that convolution (``module`` itself if it has none).

    Args:
        module: the module, in eval mode.

    Returns:
        The module with its BatchNorms folded; its outputs are unchanged.
    """
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return module
    from torch.fx.experimental.optimization import fuse

    return fuse(module.eval())


def pad_channels(module: nn.Module, align: int) -> nn.Module:
    """A copy of ``module`` with every inner channel count rounded up to a multiple of
    ``align`` by zero weights, so the output is unchanged while CPU kernels see aligned widths.

    For networks of ``Conv2d``, ``BatchNorm2d`` and ``Linear`` layers and scalar parameters
    such as step sizes (the zoo's ResNets):
    convolutions reading the network input keep their input channels, ``Linear`` layers
    their outputs.

    Args:
        module: the module.
        align: the multiple to pad inner channel counts to.

    Returns:
        The padded module; its outputs are unchanged.

    Raises:
        ValueError: another layer with parameters (e.g. LayerNorm, whose statistics padding
            would change), or a grouped convolution.
    """
    for name, m in module.named_modules():
        if isinstance(m, (nn.BatchNorm2d, nn.Linear)) or (isinstance(m, nn.Conv2d) and m.groups == 1):
            continue
        for tensor_name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.ndim > 0:
                raise ValueError(
                    f"cannot pad channels of {'.'.join(filter(None, (name, tensor_name)))} "
                    f"({type(m).__name__}): only Conv2d/BatchNorm2d/Linear layers and scalars are supported"
                )
    traced = copy.deepcopy(module if isinstance(module, torch.fx.GraphModule) else torch.fx.symbolic_trace(module))
    reads_input = {
        node.target
        for node in traced.graph.nodes
        if node.op == "call_module" and any(arg.op == "placeholder" for arg in node.all_input_nodes)
    }
    for name, m in list(traced.named_modules()):
        if isinstance(m, nn.Conv2d):
            cin = m.in_channels if name in reads_input else _round_up(m.in_channels, align)
            new = nn.Conv2d(cin, _round_up(m.out_channels, align), m.kernel_size, m.stride, m.padding,
                            m.dilation, bias=m.bias is not None, padding_mode=m.padding_mode)
        elif isinstance(m, nn.Linear):
            new = nn.Linear(_round_up(m.in_features, align), m.out_features, bias=m.bias is not None)
        elif isinstance(m, nn.BatchNorm2d):
            new = nn.BatchNorm2d(_round_up(m.num_features, align), eps=m.eps).eval()
        else:
            continue
        _copy_into_zeros(new, m)
        traced.set_submodule(name, new)
    return traced


def _round_up(n: int, align: int) -> int:
    return math.ceil(n / align) * align


@torch.no_grad()
def _copy_into_zeros(padded: nn.Module, original: nn.Module) -> None:
    """Zero the parameters of ``padded`` (BN: identity statistics) and copy ``original``'s
    tensors into their leading corner."""
    for (name, new), old in zip(padded.state_dict().items(), original.state_dict().values()):
        if name != "num_batches_tracked":
            new.fill_(1.0 if name == "running_var" else 0.0)
        new[tuple(slice(0, n) for n in old.shape)] = old

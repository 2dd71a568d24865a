"""Build one tier of a plan: step sizes inserted, skipped blocks cut out of the graph, every
tensor cut to its kept channels and every layer told its new widths."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .plan import NestPlan
from .sources import NestError, construct


def _module_at(root: nn.Module, path: str) -> nn.Module:
    """``root``'s submodule ``path``, creating empty containers on the way."""
    module = root
    for part in filter(None, path.split(".")):
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    return module


def cut_blocks(gm: torch.fx.GraphModule, plan: NestPlan, steps: list[list[float]]) -> None:
    """Insert ``y = x + s * F(x)`` for kept blocks, ``y = x`` for removed ones (in place)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for b in plan.blocks:
        value = steps[b.stage][b.index]
        add, branch, shortcut = nodes[b.add], nodes[b.branch_out], nodes[b.shortcut]
        if value == 0:
            add.replace_all_uses_with(shortcut)
            gm.graph.erase_node(add)
            continue
        owner = _module_at(gm, b.owner)
        owner.register_parameter(b.step, nn.Parameter(torch.tensor(float(value))))
        with gm.graph.inserting_before(add):
            step = gm.graph.get_attr(f"{b.owner}.{b.step}" if b.owner else b.step)
            scaled = gm.graph.call_function(torch.mul, (step, branch))
        add.args = tuple(scaled if a is branch else a for a in add.args)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()


@torch.no_grad()
def cut_channels(gm: torch.fx.GraphModule, plan: NestPlan, keep: torch.Tensor) -> dict[str, tuple]:
    """Replace every tensor by its kept channels; returns each key's full-model index."""
    from ..slim.slicemap import SliceEntry

    where = {}
    for prefix, module in gm.named_modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            key = f"{prefix}.{name}" if prefix else name
            index = plan.index(key, keep)
            full = tuple(slice(0, n) if i is None else i for i, n in zip(index, t.shape)) if index else ()
            where[key] = full
            if all(isinstance(i, slice) and i.stop == n for i, n in zip(full, t.shape)):
                continue
            shape = tuple(i.stop if isinstance(i, slice) else len(i) for i in full)
            value = torch.empty(shape, dtype=t.dtype, device=t.device) if t.is_meta else SliceEntry(key, full, shape, "", True).gather(t).clone()
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(value, requires_grad=t.requires_grad)
            else:
                module._buffers[name] = value
    for prefix, module in gm.named_modules():
        _retell(prefix, module, plan)
    _patch_functions(gm, plan)
    return where


def _retell(prefix: str, m: nn.Module, plan: NestPlan) -> None:
    """Set a layer's width attributes from its (cut) weight."""
    if isinstance(m, nn.modules.conv._ConvNd):
        key = f"{prefix}.weight"
        if key in plan.channels.convs:
            groups, cin = plan.channels.convs[key]
            m.groups = m.weight.shape[0] // (cin // groups)
        m.out_channels, m.in_channels = m.weight.shape[0], m.weight.shape[1] * m.groups
    elif isinstance(m, nn.Linear):
        m.out_features, m.in_features = m.weight.shape
    elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
        m.num_features = m.running_mean.shape[0]
    elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.weight is not None:
        m.num_features = m.weight.shape[0]
    elif isinstance(m, nn.LayerNorm) and m.weight is not None:
        m.normalized_shape = (m.weight.shape[0],)
    elif isinstance(m, nn.GroupNorm) and m.weight is not None:
        per = plan.channels.norm_groups[f"{prefix}.weight"]
        m.num_channels, m.num_groups = m.weight.shape[0], m.weight.shape[0] // per


def _patch_functions(gm: torch.fx.GraphModule, plan: NestPlan) -> None:
    """Widths written into the graph as constants: a functional convolution's groups, a
    functional layer norm's shape."""
    from .channels import op_name

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = op_name(n)
        if name in ("conv1d", "conv2d", "conv3d") and n.args[1].target in plan.channels.convs:
            groups, cin = plan.channels.convs[n.args[1].target]
            w = gm.get_parameter(n.args[1].target)
            args = list(n.args) + [None] * (7 - len(n.args))
            if len(n.args) > 6:
                args[6] = w.shape[0] // (cin // groups)
                n.args = tuple(args)
            else:
                n.kwargs = {**n.kwargs, "groups": w.shape[0] // (cin // groups)}
        elif name == "layer_norm":
            weight = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
            if hasattr(weight, "target"):
                n.args = (n.args[0], (gm.get_parameter(weight.target).shape[0],), *n.args[2:])
        elif name == "group_norm":
            raise NestError(f"{n.name}: functional group norm (nesting needs nn.GroupNorm)")


SELECTIONS = {"chunk", "split", "split_with_sizes", "getitem", "narrow"}


def _dim(n, position: int, default: int) -> int:
    value = n.args[position] if len(n.args) > position else n.kwargs.get("dim", default)
    return value % len(n.args[0].meta["nest_shape"])


def patch_selections(gm: torch.fx.GraphModule, keep: torch.Tensor) -> None:
    """Channel selections written into the graph as constants (``chunk``, ``split``, a slice
    ``x[:, a:b]``, ``narrow``) cut where the full graph cuts, counted in kept channels."""
    from .channels import op_name

    for n in list(gm.graph.nodes):
        name = op_name(n) if n.op in ("call_function", "call_method") else ""
        src = n.args[0] if name in SELECTIONS and n.args else None
        if not hasattr(src, "meta") or len(src.meta.get("nest_shape", ())) < 2 or "nest_ids" not in src.meta:
            continue
        kept = keep[src.meta["nest_ids"]].long()
        total = len(kept)
        before = lambda i: int(kept[:i].sum())  # noqa: E731 - kept channels before full position i
        if name == "getitem":
            index = n.args[1]
            if not (isinstance(index, tuple) and len(index) > 1 and isinstance(index[1], slice)):
                continue
            start, stop, step = index[1].indices(total)
            if step != 1:
                raise NestError(f"{n.name}: a strided channel slice")
            n.args = (src, (index[0], slice(before(start), before(stop)), *index[2:]))
        elif name == "narrow" and n.args[1] % len(src.meta["nest_shape"]) == 1:
            start, length = n.args[2], n.args[3]
            n.args = (src, 1, before(start), before(start + length) - before(start))
        elif name in ("chunk", "split", "split_with_sizes") and _dim(n, 2, 0) == 1:
            if name == "chunk":
                sizes = [len(c) for c in torch.arange(total).chunk(n.args[1])]
            else:
                sizes = n.args[1] if isinstance(n.args[1], (list, tuple)) else [len(c) for c in torch.arange(total).split(n.args[1])]
            bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            slim = [before(b) - before(a) for a, b in zip(bounds, bounds[1:])]
            if 0 in slim:
                raise NestError(f"{n.name}: a channel {name} leaves a part without channels")
            n.target = torch.split if n.op == "call_function" else "split"
            n.args, n.kwargs = (src, slim), {"dim": 1}


def build_graph(plan: NestPlan, keep: torch.Tensor, steps: list[list[float]], device: torch.device):
    """The tier's graph module on ``device`` and each tensor's full-model index (``keep``: the
    kept channel ids, :meth:`NestPlan.keep`)."""
    with torch.device(device):
        model = construct(plan.source)
        gm = torch.fx.GraphModule(model, copy.deepcopy(plan.graph), type(model).__name__)
        cut_blocks(gm, plan, steps)
    where = cut_channels(gm, plan, keep)
    patch_selections(gm, keep)
    gm.recompile()
    return gm, where

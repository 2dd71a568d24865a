"""Build one tier of a plan: step sizes inserted, skipped blocks cut out of the graph, every
tensor cut to its kept channels, every layer told its new widths, channel counts written into
the graph re-cut; a tier with data runs once on meta tensors first (:func:`dry_run`)."""

from __future__ import annotations

import contextlib
import copy
import operator

import torch
from torch import nn

from .plan import NestPlan, kept_ids, split_sizes
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
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for b in plan.blocks:
        value = steps[b.stage][b.index]
        add, branch, shortcut = nodes[b.add], nodes[b.branch_out], nodes[b.shortcut]
        if value == 0:
            add.replace_all_uses_with(shortcut)
            gm.graph.erase_node(add)
            nodes[b.add] = shortcut  # a later block whose input this add was now starts from its shortcut
            continue
        owner = _module_at(gm, b.owner)
        owner.register_parameter(b.step, nn.Parameter(torch.tensor(float(value))))
        with gm.graph.inserting_before(add):
            step = gm.graph.get_attr(f"{b.owner}.{b.step}" if b.owner else b.step)
            scaled = gm.graph.call_function(torch.mul, (step, branch))
        add.args = tuple(scaled if a is branch else a for a in add.args)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    called = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    for target in read - {n.target for n in gm.graph.nodes if n.op == "get_attr"}:  # read only by removed blocks
        owner, _, leaf = target.rpartition(".")
        if any(owner == c or owner.startswith(f"{c}.") for c in called):
            continue  # a module the tier still calls keeps its tensors
        with contextlib.suppress(AttributeError):  # its module may have gone with the block
            delattr(gm.get_submodule(owner), leaf)


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
    for prefix, module in list(gm.named_modules()):
        _retell(prefix, module, plan)
        if isinstance(module, nn.MultiheadAttention) and module.in_proj_weight.shape[0] != 3 * module.embed_dim:
            parent, _, leaf = prefix.rpartition(".")
            setattr(gm.get_submodule(parent), leaf, HeadsAttention(module))
    _patch_functions(gm, plan)
    return where


class HeadsAttention(nn.Module):
    """``nn.MultiheadAttention`` (self-attention) keeping some of its heads: the same tensors
    (``in_proj_weight``, ``in_proj_bias``, ``out_proj``), the embedding whole."""

    def __init__(self, m: nn.MultiheadAttention):
        super().__init__()
        self.in_proj_weight, self.in_proj_bias, self.out_proj = m.in_proj_weight, m.in_proj_bias, m.out_proj
        self.head_dim, self.batch_first, self.dropout = m.head_dim, m.batch_first, m.dropout
        self.num_heads = m.in_proj_weight.shape[0] // (3 * m.head_dim)

    def forward(self, query: torch.Tensor, key=None, value=None, **kwargs):
        x = query if self.batch_first else query.transpose(0, 1)
        b, n, _ = x.shape
        qkv = nn.functional.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        out = self.out_proj(out.transpose(1, 2).reshape(b, n, -1))
        return (out if self.batch_first else out.transpose(0, 1)), None


def _retell(prefix: str, m: nn.Module, plan: NestPlan) -> None:
    """Set a layer's width attributes from its (cut) weight."""
    if isinstance(m, nn.modules.conv._ConvNd):
        key = f"{prefix}.weight"
        if key in plan.channels.convs:
            groups, _, cout = plan.channels.convs[key]
            m.groups = m.weight.shape[0] // (cout // groups)
        m.out_channels, m.in_channels = m.weight.shape[0], m.weight.shape[1] * m.groups
    elif isinstance(m, nn.Linear):
        m.out_features, m.in_features = m.weight.shape
    elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
        m.num_features = m.running_mean.shape[0]
    elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.weight is not None:
        m.num_features = m.weight.shape[0]
    elif isinstance(m, nn.LayerNorm) and m.weight is not None:
        m.normalized_shape = (m.weight.shape[0],)
    elif isinstance(m, nn.GroupNorm) and f"{prefix}.weight" in plan.channels.norm_groups:  # traced through: F.group_norm's
        per = plan.channels.norm_groups[f"{prefix}.weight"]                                    # groups are re-counted instead
        m.num_channels, m.num_groups = m.weight.shape[0], m.weight.shape[0] // per


def _tensor(gm: torch.fx.GraphModule, target: str) -> torch.Tensor:
    """A parameter or buffer of ``gm`` (a fixed filter: a buffer used as a weight)."""
    try:
        return gm.get_parameter(target)
    except AttributeError:
        return gm.get_buffer(target)


def _patch_functions(gm: torch.fx.GraphModule, plan: NestPlan) -> None:
    """Widths written into the graph as constants: a functional convolution's groups, a
    functional layer norm's shape."""
    from .channels import op_name

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = op_name(n)
        if name in ("conv1d", "conv2d", "conv3d") and n.args[1].target in plan.channels.convs:
            groups, _, cout = plan.channels.convs[n.args[1].target]
            w = _tensor(gm, n.args[1].target)
            args = list(n.args) + [None] * (7 - len(n.args))
            if len(n.args) > 6:
                args[6] = w.shape[0] // (cout // groups)
                n.args = tuple(args)
            else:
                n.kwargs = {**n.kwargs, "groups": w.shape[0] // (cout // groups)}
        elif name == "layer_norm":
            weight = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
            if hasattr(weight, "target"):
                n.args = (n.args[0], (_tensor(gm, weight.target).shape[0],), *n.args[2:])
        elif name == "group_norm":  # F.group_norm(x, num_groups, weight, ...): the kept groups
            weight = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
            if not hasattr(weight, "target") or len(n.args) < 2:
                raise NestError(f"{n.name}: functional group norm without a weight (nesting needs nn.GroupNorm)")
            n.args = (n.args[0], _tensor(gm, weight.target).shape[0] // n.meta["nest_group_size"], *n.args[2:])


def patch_selections(gm: torch.fx.GraphModule, keep: torch.Tensor) -> None:
    """Channel selections written into the graph as constants (``chunk``, ``split``, a slice
    ``x[:, a:b]``, ``narrow``) cut where the full graph cuts, counted in kept channels, and
    channel counts written into a view's shape set to the kept count."""
    from .channels import op_name

    for n in list(gm.graph.nodes):
        if n.op == "call_method" and n.target == "view":
            n.target = "reshape"  # narrower dimensions may not be viewable where the full ones were
        if "nest_split" in n.meta:  # heads: each split dimension keeps its kept positions
            dims, grid = n.meta["nest_split"]
            packed = len(n.args) == 2 and isinstance(n.args[1], (tuple, list))
            sizes = list(n.args[1] if packed else n.args[1:])
            if len(sizes) == len(n.meta["nest_shape"]):
                for d, count in zip(dims, split_sizes(keep, grid)):
                    if isinstance(sizes[d], torch.fx.Node) and _from_batch(sizes[d]):
                        sizes[d] = _per_batch(gm, n, sizes[d], count, n.meta["nest_shape"][d])
                    elif isinstance(sizes[d], torch.fx.Node) or (isinstance(sizes[d], int) and sizes[d] >= 0):
                        sizes[d] = count
            n.args = (n.args[0], tuple(sizes)) if packed else (n.args[0], *sizes)
        if "nest_cut" not in n.meta:
            continue
        name, src = op_name(n), n.args[0]
        d, ids = n.meta["nest_cut"]
        kept = kept_ids(keep, ids).long()
        before = lambda i: int(kept[:i].sum())  # noqa: E731 - kept channels before full position i
        if name == "getitem":
            index = list(n.args[1]) if isinstance(n.args[1], tuple) else [n.args[1]]
            start, stop, _ = index[d].indices(len(kept))
            index[d] = slice(before(start), before(stop))
            n.args = (src, tuple(index) if isinstance(n.args[1], tuple) else index[0])
        elif name == "narrow":
            start, length = n.args[2], n.args[3]
            n.args = (src, d, before(start), before(start + length) - before(start))
        else:
            if name == "chunk":
                sizes = [len(c) for c in torch.arange(len(kept)).chunk(n.args[1])]
            else:
                sizes = n.args[1] if isinstance(n.args[1], (list, tuple)) else [len(c) for c in torch.arange(len(kept)).split(n.args[1])]
            bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            slim = [before(b) - before(a) for a, b in zip(bounds, bounds[1:])]
            if 0 in slim:
                raise NestError(f"{n.name}: a channel {name} leaves a part without channels")
            n.target = torch.split if n.op == "call_function" else "split"
            n.args, n.kwargs = (src, slim), {"dim": d}


def _from_batch(node: torch.fx.Node) -> bool:
    """Whether a size computed in the graph depends on a tensor's first dimension (the batch):
    followed through size arithmetic, not through tensors."""
    todo, seen = [node], {node}
    while todo:
        a = todo.pop()
        if _batch_size(a):
            return True
        fresh = [i for i in a.all_input_nodes if "nest_shape" not in i.meta and i not in seen]
        seen.update(fresh)
        todo += fresh
    return False


def _batch_size(a: torch.fx.Node) -> bool:
    """``x.shape[0]`` / ``x.size(0)``."""
    if a.op == "call_method" and a.target == "size":
        return a.args[1:2] == (0,)
    if a.op == "call_function" and a.target is operator.getitem and a.args[1] == 0:
        shape = a.args[0]
        return isinstance(shape, torch.fx.Node) and (shape.op == "call_function" and shape.target is getattr and
                                                     shape.args[1] == "shape" or shape.op == "call_method" and shape.target == "size")
    return False


def _per_batch(gm: torch.fx.GraphModule, view: torch.fx.Node, size: torch.fx.Node, count: int, full: int):
    """A view's size that holds the batch and ``full`` heads at the analysis's batch of one:
    ``x.shape[0]`` of a tensor that already holds the kept heads stays; ``batch * heads``
    becomes ``batch * count``; any other form is refused."""
    if count == full or _batch_size(size):
        return size
    if size.op == "call_function" and size.target is operator.mul and full in size.args:
        with gm.graph.inserting_before(view):
            batch = size.args[0] if size.args[1] == full else size.args[1]
            return gm.graph.call_function(operator.mul, (batch, count))
    raise NestError(f"{view.name}: a view that merges the batch with narrowed channels")


def build_graph(plan: NestPlan, keep: torch.Tensor, steps: list[list[float]], device: torch.device):
    """The tier's graph module on ``device`` and each tensor's full-model index (``keep``: the
    kept channel ids, :meth:`NestPlan.keep`)."""
    with torch.device(device):
        model = construct(plan.source)
        for name, value in plan.constants.items():  # a new instance lacks the tracer's names
            if value.is_meta and device.type != "meta":
                raise NestError(f"{plan.source.name}: {name}: a tensor its forward reads from outside its parameters and "
                                "buffers (from a list or a global) has no values here; register it as a buffer")
            model.register_buffer(name, value.to(device))
        gm = torch.fx.GraphModule(model, copy.deepcopy(plan.graph), type(model).__name__)
        cut_blocks(gm, plan, steps)
    where = cut_channels(gm, plan, keep)
    patch_selections(gm, keep)
    gm.recompile()
    return gm, where


def dry_run(gm: torch.fx.GraphModule, shape: tuple[int, ...], model: str) -> None:
    """Run a tier once on meta tensors (no memory, no compute): a tier that would fail at its
    first forward is refused when it is built, in one line naming the model and the node."""
    from .channels import op_name

    node = None

    class Nodes(torch.fx.Interpreter):
        def run_node(self, n):
            nonlocal node
            node = n
            return super().run_node(n)

    class Run(nn.Module):
        def __init__(self):
            super().__init__()
            self.gm = gm

        def forward(self, x):
            return Nodes(self.gm).run(x)

    state = {f"gm.{k}": torch.empty_like(v, device="meta") for k, v in [*gm.named_parameters(), *gm.named_buffers()]}
    modes = {m: m.training for m in gm.modules()}
    gm.eval()
    try:
        with torch.no_grad(), torch.device("meta"):
            torch.func.functional_call(Run(), state, (torch.empty(shape),))
    except Exception as exc:  # noqa: BLE001 - whatever the tier's first forward would raise
        what = f"{node.name} ({op_name(node) if node.op in ('call_function', 'call_method') else node.target})" if node else "forward"
        raise NestError(f"{model}: {what}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]) from None
    finally:
        for m, training in modes.items():
            m.train(training)

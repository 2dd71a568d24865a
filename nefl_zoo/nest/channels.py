"""Channel-dependency analysis: which channels of a traced network must be kept together.

The traced graph is run on *id tensors*: every element holds the id of the channel it belongs
to (an int64 tensor of the activation's shape; ``-1`` for values that belong to no single
channel, such as a mean over channels). Data movement (view, reshape, cat, chunk, getitem,
transpose, flatten, channel shuffle...) runs natively on them, so ids follow the channels
wherever they go. A convolution or linear layer starts a new *space* of ids for its outputs; an
element-wise operation between two tensors (residual add, squeeze-excitation multiply, layer
scale) unites the ids it combines (union-find); a depthwise or grouped convolution whose output
count equals its input count passes the ids through (output channel i lives and dies with input
channel i). Afterwards every parameter dimension is a vector of ids (:attr:`Channels.dims`),
and a *class* (union-find root) of ids is kept or removed as a whole.
"""

from __future__ import annotations


import torch
from torch import nn

from .sources import NestError

BINARY = {"add", "sub", "mul", "truediv", "div", "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_",
          "maximum", "minimum", "rsub"}
UNARY = {"relu", "relu_", "relu6", "sigmoid", "sigmoid_", "tanh", "tanh_", "hardswish", "hardsigmoid", "silu",
         "silu_", "gelu", "mish", "elu", "leaky_relu", "hardtanh", "hardtanh_", "softplus", "dropout", "dropout2d",
         "contiguous", "clone", "float", "to", "type_as", "neg", "abs", "exp", "clamp", "clamp_", "clamp_min",
         "stochastic_depth", "sqrt", "rsqrt", "pow", "erf", "detach", "hard_sigmoid", "hard_swish", "swish",
         "gelu_tanh", "sign", "floor", "ceil", "round", "reciprocal", "log", "square"}
MOVE = {"view", "reshape", "flatten", "permute", "transpose", "cat", "concat", "chunk", "split", "getitem",
        "squeeze", "unsqueeze", "expand", "expand_as", "size", "dim", "getattr", "narrow", "flip", "roll",
        "unbind", "stack", "tensor_split", "movedim", "swapaxes", "t", "unflatten", "repeat", "tile", "numel",
        "floordiv", "mod", "sym_size", "_assert", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_",
        "split_with_sizes", "index_select", "type"}
REDUCE = {"mean", "sum", "amax", "amin", "max", "min", "std", "var", "logsumexp", "norm"}
POOL = {"adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "avg_pool2d", "max_pool2d",
        "max_pool2d_with_indices", "avg_pool1d", "max_pool1d", "interpolate", "upsample", "adaptive_avg_pool3d",
        "lp_pool2d", "pixel_shuffle"}
NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)
CHANNEL_NORMS = (nn.GroupNorm, nn.LayerNorm)  # statistics over channels: nest, but not by zeroing
PARAM_FREE_SPATIAL = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.MaxPool1d,
                      nn.AvgPool1d, nn.AdaptiveAvgPool1d, nn.Upsample, nn.ZeroPad2d, nn.LPPool2d)


def op_name(node) -> str:
    """The bare name of a call_function / call_method target (``add``, ``conv2d``, ``view``)."""
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


class Channels:
    """Union-find over channel ids, the spaces that created them and every parameter's ids."""

    def __init__(self):
        self.parent: list[int] = []
        self.spaces: list[tuple[str, int, int]] = []  # (name, first id, size)
        self.dims: dict[str, list[torch.Tensor | None]] = {}  # state key -> per dimension ids (None: whole)
        self.quantum: list[tuple[torch.Tensor, int]] = []  # ids whose kept count must be a multiple of q
        self.convs: dict[str, tuple[int, int]] = {}  # grouped conv weight key -> (groups, in channels)
        self.norm_groups: dict[str, int] = {}  # GroupNorm weight key -> channels per group
        self.channel_views: list[tuple[str, torch.Tensor]] = []  # (what, ids): views that need all these ids
        self.parts: list[list[torch.Tensor]] = []  # the parts of every channel split
        self.channel_stats: list[str] = []  # where statistics over channels are taken (not zero-exact)
        self.fixed: set[int] = set()  # ids that must stay (input and output channels)

    def new(self, name: str, size: int) -> torch.Tensor:
        base = len(self.parent)
        self.parent.extend(range(base, base + size))
        self.spaces.append((name, base, size))
        return torch.arange(base, base + size)

    def find(self, i: int) -> int:
        parent = self.parent
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:
            parent[i], i = root, parent[i]
        return root

    def union(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a, b = torch.broadcast_tensors(a, b)
        pairs = torch.stack([a.reshape(-1), b.reshape(-1)], 1)
        pairs = pairs[(pairs >= 0).all(1)]
        for x, y in torch.unique(pairs, dim=0).tolist():
            rx, ry = self.find(x), self.find(y)
            if rx != ry:
                self.parent[max(rx, ry)] = min(rx, ry)

    def roots(self) -> torch.Tensor:
        """The class (root id) of every id."""
        return torch.tensor([self.find(i) for i in range(len(self.parent))], dtype=torch.long)


def channel_vector(ids: torch.Tensor, dim: int, where: str) -> torch.Tensor:
    """The ids along ``dim``, which must not vary along the other dimensions."""
    vec = ids.movedim(dim, -1).reshape(-1, ids.shape[dim])
    if not bool((vec == vec[:1]).all()):
        raise NestError(f"{where}: its channels are mixed with other dimensions")
    return vec[0]


def varies(ids: torch.Tensor, dim: int) -> bool:
    return ids.shape[dim] > 1 and not bool((ids == ids.narrow(dim, 0, 1)).all())


def spread(vec: torch.Tensor, shape: torch.Size, dim: int = 1) -> torch.Tensor:
    """``vec`` along ``dim`` of a tensor of ``shape`` (a broadcast view)."""
    view = [1] * len(shape)
    view[dim] = -1
    return vec.view(view).expand(shape)


def meta_like(x):
    return torch.empty(x.shape, device="meta") if isinstance(x, torch.Tensor) else x


def _meta_args(args):
    return torch.utils._pytree.tree_map(meta_like, args)


class ShapeError(NestError):
    """An operation of the network failed on the analysis's input (its shapes may depend on the size)."""


def analyse(gm: torch.fx.GraphModule, example: torch.Size, model: str) -> Channels:
    """Run ``gm`` (on the meta device) on id tensors for an input of shape ``example``; an
    operation that fails is a :class:`ShapeError` naming ``model`` and the node."""
    import torch.fx as fx

    ch = Channels()
    params = dict(gm.named_parameters()) | dict(gm.named_buffers())
    for n in gm.graph.nodes:  # from an analysis at another size
        n.meta.pop("nest_view", None), n.meta.pop("nest_cut", None)

    class Interp(fx.Interpreter):
        def run_node(self, n):
            self.node = n
            try:
                out = super().run_node(n)
                if isinstance(out, torch.Tensor):
                    n.meta["nest_shape"] = tuple(out.shape)
                    if out.ndim >= 2 and n.op != "get_attr":
                        n.meta["nest_ids"] = out.movedim(1, -1).reshape(-1, out.shape[1])[0]
                return out
            except NestError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise ShapeError(f"{model}: {n.name} ({op_name(n) if n.op.startswith('call_f') or n.op == 'call_method' else n.target}): "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]) from None

        def placeholder(self, target, args, kwargs):
            ids = spread(ch.new("input", example[1]), example)
            ch.fixed.update(ids[0, :, *[0] * (len(example) - 2)].tolist())
            return ids

        def get_attr(self, target, args, kwargs):
            value = super().get_attr(target, args, kwargs)
            if not isinstance(value, torch.Tensor):
                return value
            ids = ch.new(target, value.numel()).view(value.shape)
            ch.dims.setdefault(target, ["elements"])
            return ids

        def call_module(self, target, args, kwargs):
            m = self.module.get_submodule(target)
            x = args[0]
            where = f"{target} ({type(m).__name__})"
            if isinstance(m, nn.modules.conv._ConvNd) and not isinstance(m, nn.modules.conv._ConvTransposeNd):
                out_shape = m(meta_like(x)).shape
                return conv(where, target, x, m.weight.shape[0], m.groups, m.bias is not None, out_shape)
            if isinstance(m, nn.Linear):
                return linear(where, target, x, m.out_features, m.bias is not None)
            if isinstance(m, NORMS):
                return norm(where, target, m, x)
            if any(True for _ in m.parameters(recurse=True)):
                raise NestError(f"{where}: a layer with parameters that nesting does not know")
            out = m(*_meta_args(args), **_meta_args(kwargs))
            if isinstance(m, nn.Flatten) or isinstance(m, nn.Unflatten):
                return m(x)
            if isinstance(m, PARAM_FREE_SPATIAL):
                return spread(channel_vector(x, 1, where), out.shape)
            if isinstance(out, torch.Tensor) and out.shape == x.shape:
                return x  # activations, dropout, identity
            raise NestError(f"{where}: a layer that changes the shape {tuple(x.shape)} -> nesting does not know")

        def call_function(self, target, args, kwargs):
            return self.function(op_name(self.node), target, args, kwargs, lambda: target(*args, **kwargs))

        def call_method(self, target, args, kwargs):
            return self.function(target, target, args, kwargs, lambda: getattr(args[0], target)(*args[1:], **kwargs))

        def function(self, name, target, args, kwargs, native):  # noqa: C901 - one branch per kind of operation
            n = self.node
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            where = f"{n.name} ({name})"
            if name in MOVE or not tensors:
                args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)  # ids are often broadcast views: view() needs real strides
                out = target(*args, **kwargs) if n.op == "call_function" else getattr(args[0], target)(*args[1:], **kwargs)
                if isinstance(args[0], torch.Tensor) and args[0].ndim >= 1:
                    moved(n, name, args, kwargs, out, where)
                return out
            x = tensors[0]
            if name in BINARY:
                if len(tensors) == 2:
                    a, b = torch.broadcast_tensors(*tensors)
                    ch.union(a, b)
                    return torch.where(a >= 0, a, b)
                return x
            if name in UNARY:
                return x
            if name in REDUCE or name in POOL:
                out = native_meta(target, args, kwargs, n.op)
                shape = out[0].shape if isinstance(out, tuple) else out.shape
                if name in POOL:
                    res = spread(channel_vector(x, 1, where), shape)
                else:
                    dims = args[1] if len(args) > 1 else kwargs.get("dim", list(range(x.ndim)))
                    dims = [d % x.ndim for d in ([dims] if isinstance(dims, int) else dims)]
                    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
                    if any(varies(x, d) for d in dims):
                        ch.channel_stats.append(where)
                        res = torch.full(shape if not isinstance(out, tuple) else out[0].shape, -1, dtype=torch.long)
                    else:
                        res = x.amax(dim=dims, keepdim=bool(keep))
                return (res, res) if isinstance(out, tuple) else res
            if name in ("conv1d", "conv2d", "conv3d"):
                key = n.args[1].target
                groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
                out = native_meta(target, args, kwargs, n.op)
                return conv(where, key.rpartition(".")[0], x, params[key].shape[0], groups, args[2] is not None if len(args) > 2 else kwargs.get("bias") is not None, out.shape, key)
            if name == "linear":
                key = n.args[1].target
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return linear(where, key.rpartition(".")[0], x, params[key].shape[0], bias is not None, key)
            if name in ("layer_norm", "group_norm", "batch_norm", "instance_norm"):
                dim = -1 if name == "layer_norm" else 1
                for a in list(args[1:]) + list(kwargs.values()):
                    if isinstance(a, torch.Tensor):
                        ch.union(a.reshape(-1), channel_vector(x, dim % x.ndim, where))
                if name in ("layer_norm", "group_norm"):
                    ch.channel_stats.append(where)
                if name == "group_norm":
                    ch.quantum.append((channel_vector(x, 1, where), x.shape[1] // args[1]))
                return x
            if name in ("softmax", "log_softmax") and not varies(x, (args[1] if len(args) > 1 else kwargs["dim"]) % x.ndim):
                return x
            raise NestError(f"{where}: an operation nesting does not know")

    def moved(n, name, args, kwargs, out, where):
        """Record what a view or selection does to channels: a view that splits them into several
        dimensions (refused when narrowed), a channel count written into a view's shape and a
        selection along the channels (both re-cut when the tier is built)."""
        x = args[0]
        if name in ("view", "reshape", "unflatten") and isinstance(out, torch.Tensor):
            before = [d for d in range(x.ndim) if varies(x, d)]
            after = [d for d in range(out.ndim) if varies(out, d)]
            if before and len(after) > len(before):
                kind = "(channel shuffle)" if before == [1] and after[:2] == [1, 2] else "into several dimensions (heads)"
                ch.channel_views.append((f"{n.name}: a view that splits the channels {kind}", x[x >= 0].unique()))
            elif len(after) == 1 and name != "unflatten":
                shape = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else n.args[1:]
                if len(shape) == out.ndim and isinstance(shape[after[0]], int) and shape[after[0]] >= 0:
                    n.meta["nest_view"] = (after[0], channel_vector(out, after[0], where))
        elif name in ("chunk", "split", "split_with_sizes", "narrow"):
            d = (args[1] if name == "narrow" else args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
            if varies(x, d):  # a channel split: each part nests on its own
                n.meta["nest_cut"] = (d, channel_vector(x, d, where))
                if name != "narrow":
                    ch.parts.append([channel_vector(o, d, where) for o in out])
        elif name == "getitem" and isinstance(x, torch.Tensor):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            dims = sum(1 for i in index if i is not None and i is not Ellipsis)
            d = 0
            for p, i in enumerate(index):
                if i is Ellipsis:
                    d += x.ndim - dims
                    continue
                if i is not None and d < x.ndim and varies(x, d) and not (isinstance(i, slice) and i == slice(None)):
                    if not isinstance(i, slice):
                        ch.channel_views.append((f"{n.name}: an index that picks channels by position", channel_vector(x, d, where)))
                    elif i.step not in (None, 1):
                        raise NestError(f"{where}: a strided channel slice")
                    else:
                        n.meta["nest_cut"] = (p, channel_vector(x, d, where))
                d += i is not None

    def native_meta(target, args, kwargs, op):
        margs, mkw = _meta_args(args), _meta_args(kwargs)
        return target(*margs, **mkw) if op == "call_function" else getattr(margs[0], target)(*margs[1:], **mkw)

    def conv(where, owner, x, cout, groups, bias, out_shape, wkey=None):
        wkey = wkey or f"{owner}.weight"
        vec = channel_vector(x, 1, where)
        cin = vec.numel()
        extra = [None] * (params[wkey].ndim - 2)
        if groups == 1:
            out = ch.new(wkey, cout)
            ch.dims[wkey] = [out, vec, *extra]
        elif cout == cin:
            out = vec
            ch.dims[wkey] = [vec, None, *extra]
            ch.quantum.append((vec, cin // groups))
            ch.convs[wkey] = (groups, cin)
        else:
            raise NestError(f"{where}: grouped convolution {cin} -> {cout} channels in {groups} groups "
                            "(the channels per group change)")
        if bias:
            ch.dims[f"{owner}.bias"] = [out]
        return spread(out, out_shape)

    def linear(where, owner, x, cout, bias, wkey=None):
        wkey = wkey or f"{owner}.weight"
        vec = channel_vector(x, x.ndim - 1, where)
        out = ch.new(wkey, cout)
        ch.dims[wkey] = [out, vec]
        if bias:
            ch.dims[f"{owner}.bias"] = [out]
        return spread(out, (*x.shape[:-1], cout), x.ndim - 1)

    def norm(where, owner, m, x):
        if isinstance(m, nn.LayerNorm):
            if len(m.normalized_shape) != 1:
                raise NestError(f"{where}: LayerNorm over {len(m.normalized_shape)} dimensions")
            vec = channel_vector(x, x.ndim - 1, where)
        else:
            vec = channel_vector(x, 1, where)
        if isinstance(m, CHANNEL_NORMS):
            ch.channel_stats.append(where)
        if isinstance(m, nn.GroupNorm):
            ch.quantum.append((vec, m.num_channels // m.num_groups))
            ch.norm_groups[f"{owner}.weight"] = m.num_channels // m.num_groups
        for key, value in list(m.named_parameters(owner)) + list(m.named_buffers(owner)):
            ch.dims[key] = [vec] if value.ndim == 1 else [None] * value.ndim
        return x

    try:
        out = Interp(gm).run(torch.empty(example, device="meta"))
    except NestError as exc:  # fx appends the node's code on further lines
        raise type(exc)(str(exc).split("\n")[0]) from None
    for leaf in torch.utils._pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            ch.fixed.update(int(i) for i in leaf.unique().tolist() if i >= 0)
    return ch

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

:func:`analyse` runs the graph with :class:`IdInterpreter`: layers called as modules, then every
function or method by its kind (:data:`OPERATIONS`); what each layer records is :mod:`.layers`.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from .attention import attention, contract, einsum, gather, multihead, self_attention, unite
from .ids import Channels, _meta_args, channel_vector, layer_norm_vector, meta_like, spread, varies
from .layers import conv, keep_whole, linear, norm
from .movement import branch_dim, folded, opaque, pad, record_move, unfolded
from .sources import NestError

BINARY = {"add", "sub", "mul", "truediv", "div", "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_",
          "maximum", "minimum", "rsub"}
UNARY = {"relu", "relu_", "relu6", "sigmoid", "sigmoid_", "tanh", "tanh_", "hardswish", "hardsigmoid", "silu",
         "silu_", "gelu", "mish", "elu", "leaky_relu", "hardtanh", "hardtanh_", "softplus", "dropout", "dropout2d",
         "contiguous", "clone", "float", "to", "type_as", "neg", "abs", "exp", "clamp", "clamp_", "clamp_min",
         "stochastic_depth", "sqrt", "rsqrt", "pow", "erf", "detach", "hard_sigmoid", "hard_swish", "swish",
         "gelu_tanh", "sign", "floor", "ceil", "round", "reciprocal", "log", "square", "sin", "cos"}
MOVE = {"view", "reshape", "flatten", "permute", "transpose", "cat", "concat", "chunk", "split", "getitem",
        "squeeze", "unsqueeze", "expand", "expand_as", "size", "dim", "getattr", "narrow", "flip", "roll",
        "unbind", "stack", "tensor_split", "movedim", "swapaxes", "t", "unflatten", "repeat", "tile", "numel",
        "floordiv", "mod", "sym_size", "_assert", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_",
        "split_with_sizes", "index_select", "type", "reshape_as", "view_as", "repeat_interleave"}
WEIGHTED = {"linear", "conv1d", "conv2d", "conv3d"}  # functional layers: their weight is read by key
REDUCE = {"mean", "sum", "amax", "amin", "max", "min", "std", "var", "logsumexp", "norm"}
POOL = {"adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "avg_pool2d", "max_pool2d",
        "max_pool2d_with_indices", "avg_pool1d", "max_pool1d", "interpolate", "upsample", "adaptive_avg_pool3d",
        "lp_pool2d", "pixel_shuffle"}
NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)
PARAM_FREE_SPATIAL = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.MaxPool1d,
                      nn.AvgPool1d, nn.AdaptiveAvgPool1d, nn.Upsample, nn.ZeroPad2d, nn.LPPool2d)


def op_name(node) -> str:
    """The bare name of a call_function / call_method target (``add``, ``conv2d``, ``view``)."""
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


class ShapeError(NestError):
    """An operation of the network failed on the analysis's input (its shapes may depend on the size)."""


def analyse(gm: torch.fx.GraphModule, example: torch.Size, model: str) -> Channels:
    """Run ``gm`` (on the meta device) on id tensors for an input of shape ``example``; an
    operation that fails is a :class:`ShapeError` naming ``model`` and the node."""
    for n in gm.graph.nodes:  # from an analysis at another size
        for key in ("nest_cut", "nest_split"):
            n.meta.pop(key, None)
    interpreter = IdInterpreter(gm, example, model)
    try:
        out = interpreter.run(torch.empty(example, device="meta"))
    except NestError as exc:  # fx appends the node's code on further lines
        raise type(exc)(str(exc).split("\n")[0]) from None
    ch = interpreter.ch
    for leaf in torch.utils._pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            ch.fixed.update(int(i) for i in leaf.unique().tolist() if i >= 0)
    return ch


class IdInterpreter(torch.fx.Interpreter):
    """Runs a traced graph on id tensors, recording in :attr:`ch` (:class:`Channels`) which
    channels each operation ties together and the id vector of every parameter dimension.

    Layers called as modules go through :meth:`call_module`, functions and methods through
    :meth:`function`, which hands each kind of operation to its own method (:data:`OPERATIONS`).
    """

    def __init__(self, gm: torch.fx.GraphModule, example: torch.Size, model: str):
        super().__init__(gm)
        self.ch = Channels()
        self.params = dict(gm.named_parameters()) | dict(gm.named_buffers())
        self.example, self.model = example, model

    def run_node(self, n):
        self.node = n
        try:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                n.meta["nest_shape"] = tuple(out.shape)
                if out.ndim >= 2 and out.numel() and n.op != "get_attr":
                    n.meta["nest_ids"] = out.movedim(1, -1).reshape(-1, out.shape[1])[0]
            return out
        except NestError:
            raise
        except Exception as exc:  # noqa: BLE001
            kind = op_name(n) if n.op.startswith("call_f") or n.op == "call_method" else n.target
            raise ShapeError(f"{self.model}: {n.name} ({kind}): "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]) from None

    def placeholder(self, target, args, kwargs):
        ch, example = self.ch, self.example
        if any(space[0] == "input" for space in ch.spaces):  # optional arguments (an attention mask): their defaults
            return super().placeholder(target, args, kwargs)
        ids = spread(ch.new("input", example[1]), example)
        ch.fixed.update(ids[0, :, *[0] * (len(example) - 2)].tolist())
        return ids

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if not isinstance(value, torch.Tensor):
            return value
        weight_only = all(op_name(u) in WEIGHTED and (u.args[1:2] == (self.node,) or u.kwargs.get("weight") is self.node)
                          for u in self.node.users)
        if not value.is_floating_point() or weight_only:  # an index or mask of positions, a layer's weight
            return torch.tensor(-1).expand(value.shape)
        ch = self.ch
        ids = ch.new(target, value.numel()).view(value.shape)
        ch.element_ranges.append((int(ids.min()), value.numel()) if value.numel() else (0, 0))
        ch.dims.setdefault(target, ["elements"])
        return ids

    # ---- layers called as modules -----------------------------------------------------------
    def call_module(self, target, args, kwargs):
        m = self.module.get_submodule(target)
        x = args[0] if args else None
        where = f"{target} ({type(m).__name__})"
        if not any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
            return self.generated(m, target, where, args, kwargs)
        if isinstance(m, nn.modules.conv._ConvNd) and not isinstance(m, nn.modules.conv._ConvTransposeNd):
            out_shape = m(meta_like(x)).shape
            return conv(self.ch, self.params, where, target, x, m.weight.shape[0], m.groups, m.bias is not None, out_shape)
        if isinstance(m, nn.Linear):
            return linear(self.ch, where, target, x, m.out_features, m.bias is not None)
        if isinstance(m, nn.Unfold):
            return unfolded(x, m)
        if isinstance(m, nn.Fold):
            return folded(x, m, where)
        if isinstance(m, NORMS):
            return norm(self.ch, where, target, m, x)
        if isinstance(m, nn.MultiheadAttention) and self_attention(m, args, kwargs):
            return multihead(self.ch, target, m, x, where)
        out = m(*_meta_args(args), **_meta_args(kwargs))
        if any(True for _ in m.parameters(recurse=True)):
            return self.unknown_layer(m, target, where, args, kwargs, out)
        if isinstance(m, nn.Flatten) or isinstance(m, nn.Unflatten):
            return m(x)
        if isinstance(m, PARAM_FREE_SPATIAL):
            return spread(channel_vector(x, 1, where, self.ch, shared=True), out.shape)
        if isinstance(out, torch.Tensor) and out.shape == x.shape:
            return x  # activations, dropout, identity
        after = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise NestError(f"{where}: a layer that changes the shape {tuple(x.shape)} -> {after}, which nesting does not know")

    def unknown_layer(self, m, target, where, args, kwargs, out):
        """A layer with parameters that nesting does not know, which keeps its input's shape: kept
        whole, with every channel of its inputs (and all tied to them)."""
        x, ch = args[0] if args else None, self.ch
        first = out[0] if isinstance(out, tuple) and out else out  # nn.MultiheadAttention: (output, weights)
        if not (isinstance(first, torch.Tensor) and isinstance(x, torch.Tensor) and first.shape == x.shape):
            raise NestError(f"{where}: a layer with parameters that nesting does not know")
        ch.kept_whole.append(where)  # untouched: its channels (and all tied to them) keep their width
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                ch.fixed.update(int(i) for i in a.unique().tolist() if i >= 0)
        keep_whole(self.ch, m, target)
        if isinstance(out, tuple):
            return (x, *[torch.full(o.shape, -1, dtype=torch.long) if isinstance(o, torch.Tensor) else o for o in out[1:]])
        return x

    def generated(self, m, target, where, args, kwargs):
        """A layer that makes a tensor from sizes alone (a Fourier position encoding): kept
        whole, with every channel its output meets."""
        out = m(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.ndim < 2:
            raise NestError(f"{where}: a layer with parameters that nesting does not know")
        dim = 1 if out.ndim == 4 else out.ndim - 1
        ids = spread(self.ch.new(target, out.shape[dim]), out.shape, dim)
        self.ch.fixed.update(ids.unique().tolist())
        self.ch.kept_whole.append(where)
        keep_whole(self.ch, m, target)
        return ids

    # ---- functions and methods ----------------------------------------------------------------
    def call_function(self, target, args, kwargs):
        return self.function(op_name(self.node), target, args, kwargs)

    def call_method(self, target, args, kwargs):
        return self.function(target, target, args, kwargs)

    def function(self, name, target, args, kwargs):
        """One function or method call: the steps shared by every kind of operation, then the
        method :data:`OPERATIONS` names for ``name``."""
        n = self.node
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        where = f"{n.name} ({name})"
        if name == "linear":
            return self.op_linear(n, args, kwargs, where)
        if name in ("getitem", "index_select") and tensors:
            out = self.op_index(name, args, tensors, where)
            if out is not None:
                return out
        if name == "pad":
            return pad(tensors[0], args[1] if len(args) > 1 else kwargs["pad"], where, native_meta(target, args, kwargs, n.op).shape)
        if name in MOVE or not tensors:
            return self.op_move(n, name, target, args, kwargs, where)
        operation = OPERATIONS.get(name)
        if operation is not None:
            return getattr(self, operation)(name, target, args, kwargs, tensors, where)
        if n.op == "call_function" and isinstance(target, types.FunctionType) and target.__module__.split(".")[0] != "torch":
            return opaque(target, args, kwargs, where)  # a function the tracer kept whole (timm's window_reverse)
        raise NestError(f"{where}: an operation nesting does not know")

    def op_linear(self, n, args, kwargs, where):
        """``F.linear(input, weight, bias)``, positional or by keyword."""
        x, weight, bias = (list(args) + [None] * 3)[:3]
        x, weight, bias = kwargs.get("input", x), kwargs.get("weight", weight), kwargs.get("bias", bias)
        key = weight_key(n, where)
        own = own_bias(n, key)
        out = linear(self.ch, where, key.rpartition(".")[0], x, self.params[key].shape[0], own, key)
        return unite(self.ch, out, bias) if isinstance(bias, torch.Tensor) and not own else out

    def op_index(self, name, args, tensors, where):
        """``x[..., index]`` or ``index_select`` by an index tensor (``None``: no index tensor)."""
        index = args[1] if name == "getitem" else (slice(None),) * args[1] + (args[2],)
        index = index if isinstance(index, tuple) else (index,)
        positions = [p for p, i in enumerate(index) if isinstance(i, torch.Tensor)]
        if not positions:
            return None
        if len(positions) > 1 or any(i != slice(None) for i in index[:positions[0]]):
            raise NestError(f"{where}: indexing by several tensors")
        return gather(self.ch, tensors[0], positions[0], index[positions[0]].shape, where)

    def op_move(self, n, name, target, args, kwargs, where):
        """Data movement (and tensors made from sizes): run natively on the ids."""
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)  # ids are often broadcast views: view() needs real strides
        out = target(*args, **kwargs) if n.op == "call_function" else getattr(args[0], target)(*args[1:], **kwargs)
        made = not any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs)))
        if made and isinstance(out, torch.Tensor):  # made from no tensor (arange, zeros): no channel
            return torch.full(out.shape, -1, dtype=torch.long)
        if isinstance(args[0], torch.Tensor) and args[0].ndim >= 1:
            record_move(self.ch, n, name, args, kwargs, out, where)
        return out

    def op_binary(self, name, target, args, kwargs, tensors, where):
        return unite(self.ch, *tensors) if len(tensors) == 2 else tensors[0]

    def op_product(self, name, target, args, kwargs, tensors, where):
        return contract(self.ch, tensors[0], tensors[1], where)

    def op_attention(self, name, target, args, kwargs, tensors, where):
        q, k, v = args[:3]
        return attention(self.ch, q, k, v, args[3] if len(args) > 3 else kwargs.get("attn_mask"), where)

    def op_unary(self, name, target, args, kwargs, tensors, where):
        return tensors[0]

    def op_reduce(self, name, target, args, kwargs, tensors, where):
        """A pooling (per channel) or a reduction (over the dimensions it names)."""
        x, ch = tensors[0], self.ch
        out = native_meta(target, args, kwargs, self.node.op)
        shape = out[0].shape if isinstance(out, tuple) else out.shape
        if name in POOL:
            res = spread(channel_vector(x, 1, where, ch), shape)
        else:
            dims = args[1] if len(args) > 1 else kwargs.get("dim", list(range(x.ndim)))
            dims = [d % x.ndim for d in ([dims] if isinstance(dims, int) else dims)]
            keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
            branches = [d for d in dims if varies(x, d) and branch_dim(x, d)]
            if branches:  # a sum over stacked branches (selective kernels): channel by channel
                ch.union(x, x.amax(branches, keepdim=True))
            if any(varies(x, d) for d in dims if d not in branches):
                ch.channel_stats.append((where, x[x >= 0].unique()))
                res = torch.full(shape if not isinstance(out, tuple) else out[0].shape, -1, dtype=torch.long)
            else:
                res = x.amax(dim=dims, keepdim=bool(keep))
        return (res, res) if isinstance(out, tuple) else res

    def op_conv(self, name, target, args, kwargs, tensors, where):
        """``F.conv*d(input, weight, bias, stride, padding, dilation, groups)``."""
        n, x = self.node, tensors[0]
        key = weight_key(n, where)
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        bias, own = args[2] if len(args) > 2 else kwargs.get("bias"), own_bias(n, key)
        out = conv(self.ch, self.params, where, key.rpartition(".")[0], x, self.params[key].shape[0], groups, own,
                   native_meta(target, args, kwargs, n.op).shape, key)
        if isinstance(bias, torch.Tensor) and not own:  # another tensor as bias: one per output channel
            return unite(self.ch, out, bias.view(-1, *[1] * (out.ndim - 2)))
        return out

    def op_norm(self, name, target, args, kwargs, tensors, where):
        """``F.layer_norm``, ``F.group_norm``, ``F.batch_norm``, ``F.instance_norm``."""
        x, ch = tensors[0], self.ch
        if name == "layer_norm":
            vec = layer_norm_vector(ch, x, x.ndim - 1, where)
            if vec is None:
                return x
        else:
            vec = channel_vector(x, 1, where, ch)
        for a in list(args[1:]) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                ch.union(a.reshape(-1), vec)
        if name in ("layer_norm", "group_norm"):
            ch.channel_stats.append((where, vec))
        if name == "group_norm":
            self.node.meta["nest_group_size"] = x.shape[1] // args[1]  # kept in the tier: its groups are re-counted
            ch.quantum.append((vec, x.shape[1] // args[1]))
        return x

    def op_over_channels(self, name, target, args, kwargs, tensors, where):
        """A softmax or normalisation over channels (channel attention, cosine attention): those
        channels are kept or removed together."""
        x = tensors[0]
        dim = (args[1] if len(args) > 1 else kwargs.get("dim")) % x.ndim  # F.normalize, F.softmax: by keyword
        self.ch.union(x, x.amax(dim, keepdim=True))
        return x

    def op_einsum(self, name, target, args, kwargs, tensors, where):
        return einsum(self.ch, args[0], [a for a in args[1:] if isinstance(a, torch.Tensor)] or list(args[1]), where)

    def op_add_product(self, name, target, args, kwargs, tensors, where):
        """``addcmul`` / ``addcdiv``: all three tensors' channels together."""
        return unite(self.ch, unite(self.ch, tensors[0], tensors[1]), tensors[2])

    def op_unfold(self, name, target, args, kwargs, tensors, where):
        """``Tensor.unfold(dim, size, step)`` (sliding windows) or ``F.unfold`` (as nn.Unfold)."""
        x = tensors[0]
        if self.node.op == "call_method":
            if varies(x, args[1] % x.ndim):
                raise NestError(f"{where}: windows along the channels")
            return x.unfold(*args[1:], **kwargs)
        return unfolded(x, lambda v: target(v, *args[1:], **kwargs))

    def op_fold(self, name, target, args, kwargs, tensors, where):
        return folded(tensors[0], lambda v: target(v, *args[1:], **kwargs), where)

OPERATIONS = {  # operation name -> the IdInterpreter method that runs it (after the shared steps)
    **dict.fromkeys(BINARY, "op_binary"),
    **dict.fromkeys(("matmul", "bmm"), "op_product"),
    "scaled_dot_product_attention": "op_attention",
    **dict.fromkeys(UNARY, "op_unary"),
    **dict.fromkeys(REDUCE | POOL, "op_reduce"),
    **dict.fromkeys(("conv1d", "conv2d", "conv3d"), "op_conv"),
    **dict.fromkeys(("layer_norm", "group_norm", "batch_norm", "instance_norm"), "op_norm"),
    **dict.fromkeys(("softmax", "log_softmax", "normalize"), "op_over_channels"),
    "einsum": "op_einsum",
    **dict.fromkeys(("addcmul", "addcdiv"), "op_add_product"),
    "unfold": "op_unfold",
    "fold": "op_fold",
}


def weight_key(n, where) -> str:
    """The parameter a functional convolution or linear layer reads as its weight."""
    weight = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
    if getattr(weight, "op", None) != "get_attr":
        raise NestError(f"{where}: a weight computed in the forward (weight standardisation: statistics over "
                        "its input channels)")
    return weight.target


def own_bias(n, key: str) -> bool:
    """Whether a functional layer's bias is its weight's sibling ``{owner}.bias`` (recorded
    with the layer); any other bias tensor is united with the output channels instead."""
    bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    return getattr(bias, "op", None) == "get_attr" and bias.target == f"{key.rpartition('.')[0]}.bias"


def native_meta(target, args, kwargs, op):
    """The operation run natively on meta tensors of its arguments' shapes."""
    margs, mkw = _meta_args(args), _meta_args(kwargs)
    return target(*margs, **mkw) if op == "call_function" else getattr(margs[0], target)(*margs[1:], **mkw)

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


import types
import torch
from torch import nn

from .attention import attention, contract, einsum, gather, multihead, self_attention, unite
from .ids import Channels, _meta_args, channel_vector, layer_norm_vector, meta_like, spread, varies
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
CHANNEL_NORMS = (nn.GroupNorm, nn.LayerNorm)  # statistics over channels: nest, but not by zeroing
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
    import torch.fx as fx

    ch = Channels()
    params = dict(gm.named_parameters()) | dict(gm.named_buffers())
    for n in gm.graph.nodes:  # from an analysis at another size
        for key in ("nest_cut", "nest_split"):
            n.meta.pop(key, None)

    class Interp(fx.Interpreter):
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
                raise ShapeError(f"{model}: {n.name} ({op_name(n) if n.op.startswith('call_f') or n.op == 'call_method' else n.target}): "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]) from None

        def placeholder(self, target, args, kwargs):
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
            ids = ch.new(target, value.numel()).view(value.shape)
            ch.element_ranges.append((int(ids.min()), value.numel()) if value.numel() else (0, 0))
            ch.dims.setdefault(target, ["elements"])
            return ids

        def call_module(self, target, args, kwargs):
            m = self.module.get_submodule(target)
            x = args[0] if args else None
            where = f"{target} ({type(m).__name__})"
            if not any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
                return self.generated(m, target, where, args, kwargs)
            if isinstance(m, nn.modules.conv._ConvNd) and not isinstance(m, nn.modules.conv._ConvTransposeNd):
                out_shape = m(meta_like(x)).shape
                return conv(where, target, x, m.weight.shape[0], m.groups, m.bias is not None, out_shape)
            if isinstance(m, nn.Linear):
                return linear(where, target, x, m.out_features, m.bias is not None)
            if isinstance(m, nn.Unfold):
                return unfolded(x, m)
            if isinstance(m, nn.Fold):
                return folded(x, m, where)
            if isinstance(m, NORMS):
                return norm(where, target, m, x)
            if isinstance(m, nn.MultiheadAttention) and self_attention(m, args, kwargs):
                return multihead(ch, target, m, x, where)
            out = m(*_meta_args(args), **_meta_args(kwargs))
            if any(True for _ in m.parameters(recurse=True)):
                first = out[0] if isinstance(out, tuple) and out else out  # nn.MultiheadAttention: (output, weights)
                if not (isinstance(first, torch.Tensor) and isinstance(x, torch.Tensor) and first.shape == x.shape):
                    raise NestError(f"{where}: a layer with parameters that nesting does not know")
                ch.kept_whole.append(where)  # untouched: its channels (and all tied to them) keep their width
                for a in (*args, *kwargs.values()):
                    if isinstance(a, torch.Tensor):
                        ch.fixed.update(int(i) for i in a.unique().tolist() if i >= 0)
                keep_whole(m, target)
                if isinstance(out, tuple):
                    return (x, *[torch.full(o.shape, -1, dtype=torch.long) if isinstance(o, torch.Tensor) else o for o in out[1:]])
                return x
            if isinstance(m, nn.Flatten) or isinstance(m, nn.Unflatten):
                return m(x)
            if isinstance(m, PARAM_FREE_SPATIAL):
                return spread(channel_vector(x, 1, where, ch, shared=True), out.shape)
            if isinstance(out, torch.Tensor) and out.shape == x.shape:
                return x  # activations, dropout, identity
            after = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise NestError(f"{where}: a layer that changes the shape {tuple(x.shape)} -> {after}, which nesting does not know")

        def generated(self, m, target, where, args, kwargs):
            """A layer that makes a tensor from sizes alone (a Fourier position encoding): kept
            whole, with every channel its output meets."""
            out = m(*args, **kwargs)
            if not isinstance(out, torch.Tensor) or out.ndim < 2:
                raise NestError(f"{where}: a layer with parameters that nesting does not know")
            dim = 1 if out.ndim == 4 else out.ndim - 1
            ids = spread(ch.new(target, out.shape[dim]), out.shape, dim)
            ch.fixed.update(ids.unique().tolist())
            ch.kept_whole.append(where)
            keep_whole(m, target)
            return ids

        def call_function(self, target, args, kwargs):
            return self.function(op_name(self.node), target, args, kwargs)

        def call_method(self, target, args, kwargs):
            return self.function(target, target, args, kwargs)

        def function(self, name, target, args, kwargs):  # noqa: C901 - one branch per kind of operation
            n = self.node
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            where = f"{n.name} ({name})"
            if name == "linear":  # F.linear(input, weight, bias), positional or by keyword
                x, weight, bias = (list(args) + [None] * 3)[:3]
                x, weight, bias = kwargs.get("input", x), kwargs.get("weight", weight), kwargs.get("bias", bias)
                key = weight_key(n, where)
                own = own_bias(n, key)
                out = linear(where, key.rpartition(".")[0], x, params[key].shape[0], own, key)
                return unite(ch, out, bias) if isinstance(bias, torch.Tensor) and not own else out
            if name in ("getitem", "index_select") and tensors:
                index = args[1] if name == "getitem" else (slice(None),) * args[1] + (args[2],)
                index = index if isinstance(index, tuple) else (index,)
                positions = [p for p, i in enumerate(index) if isinstance(i, torch.Tensor)]
                if positions:
                    if len(positions) > 1 or any(i != slice(None) for i in index[:positions[0]]):
                        raise NestError(f"{where}: indexing by several tensors")
                    return gather(ch, tensors[0], positions[0], index[positions[0]].shape, where)
            if name == "pad":
                return pad(tensors[0], args[1] if len(args) > 1 else kwargs["pad"], where, native_meta(target, args, kwargs, n.op).shape)
            if name in MOVE or not tensors:
                args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)  # ids are often broadcast views: view() needs real strides
                out = target(*args, **kwargs) if n.op == "call_function" else getattr(args[0], target)(*args[1:], **kwargs)
                made = not any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((args, kwargs)))
                if made and isinstance(out, torch.Tensor):  # made from no tensor (arange, zeros): no channel
                    return torch.full(out.shape, -1, dtype=torch.long)
                if isinstance(args[0], torch.Tensor) and args[0].ndim >= 1:
                    record_move(ch, n, name, args, kwargs, out, where)
                return out
            x = tensors[0]
            if name in BINARY:
                return unite(ch, *tensors) if len(tensors) == 2 else x
            if name in ("matmul", "bmm"):
                return contract(ch, tensors[0], tensors[1], where)
            if name == "scaled_dot_product_attention":
                q, k, v = args[:3]
                return attention(ch, q, k, v, args[3] if len(args) > 3 else kwargs.get("attn_mask"), where)
            if name in UNARY:
                return x
            if name in REDUCE or name in POOL:
                out = native_meta(target, args, kwargs, n.op)
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
            if name in ("conv1d", "conv2d", "conv3d"):
                key = weight_key(n, where)
                groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
                bias, own = args[2] if len(args) > 2 else kwargs.get("bias"), own_bias(n, key)
                out = conv(where, key.rpartition(".")[0], x, params[key].shape[0], groups, own,
                           native_meta(target, args, kwargs, n.op).shape, key)
                if isinstance(bias, torch.Tensor) and not own:  # another tensor as bias: one per output channel
                    return unite(ch, out, bias.view(-1, *[1] * (out.ndim - 2)))
                return out
            if name in ("layer_norm", "group_norm", "batch_norm", "instance_norm"):
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
                    n.meta["nest_group_size"] = x.shape[1] // args[1]  # kept in the tier: its groups are re-counted
                    ch.quantum.append((vec, x.shape[1] // args[1]))
                return x
            if name in ("softmax", "log_softmax", "normalize"):  # over channels (channel attention, cosine attention):
                dim = (args[1] if len(args) > 1 else kwargs.get("dim")) % x.ndim  # F.normalize, F.softmax: by keyword
                ch.union(x, x.amax(dim, keepdim=True))  # those channels are kept or removed together
                return x
            if name == "einsum":
                return einsum(ch, args[0], [a for a in args[1:] if isinstance(a, torch.Tensor)] or list(args[1]), where)
            if name in ("addcmul", "addcdiv"):
                return unite(ch, unite(ch, tensors[0], tensors[1]), tensors[2])
            if name == "unfold" and n.op == "call_method":  # Tensor.unfold(dim, size, step): sliding windows
                if varies(x, args[1] % x.ndim):
                    raise NestError(f"{where}: windows along the channels")
                return x.unfold(*args[1:], **kwargs)
            if name == "unfold":  # F.unfold: positions move, as nn.Unfold
                return unfolded(x, lambda v: target(v, *args[1:], **kwargs))
            if name == "fold":
                return folded(x, lambda v: target(v, *args[1:], **kwargs), where)
            if n.op == "call_function" and isinstance(target, types.FunctionType) and target.__module__.split(".")[0] != "torch":
                return opaque(target, args, kwargs, where)  # a function the tracer kept whole (timm's window_reverse)
            raise NestError(f"{where}: an operation nesting does not know")

    def keep_whole(m, owner, x=None):
        """Every tensor of layer ``m`` stays whole in every tier; returns ``x``."""
        for key, value in [*m.named_parameters(owner), *m.named_buffers(owner)]:
            ch.dims[key] = [None] * value.ndim
        return x

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
        margs, mkw = _meta_args(args), _meta_args(kwargs)
        return target(*margs, **mkw) if op == "call_function" else getattr(margs[0], target)(*margs[1:], **mkw)

    def conv(where, owner, x, cout, groups, bias, out_shape, wkey=None):
        wkey = wkey or f"{owner}.weight"
        vec = channel_vector(x, 1, where, ch, shared=True)
        cin = vec.numel()
        extra = [None] * (params[wkey].ndim - 2)
        if groups == 1:
            out = ch.new(wkey, cout)
            ch.dims[wkey] = [out, vec, *extra]
        elif cout == cin:
            out = vec
            ch.dims[wkey] = [vec, None, *extra]
            ch.quantum.append((vec, cin // groups))
            ch.convs[wkey] = (groups, cin, cout)
        else:  # the channels per group change (a depthwise multiplier, ResNeSt): whole groups nest
            grouped = vec.view(groups, cin // groups)
            ch.union(grouped, grouped[:, :1])
            out = grouped[:, 0].repeat_interleave(cout // groups)
            ch.dims[wkey] = [out, None, *extra]
            ch.convs[wkey] = (groups, cin, cout)
        if bias:
            ch.dims[f"{owner}.bias"] = [out]
        return spread(out, out_shape)

    def linear(where, owner, x, cout, bias, wkey=None):
        wkey = wkey or f"{owner}.weight"
        if not varies(x, x.ndim - 1) and any(varies(x, d) for d in range(x.ndim - 1)):
            # mixing tokens (MLP-Mixer), or one small layer over each channel's value (a last
            # dimension of 1): shared by every channel, which it keeps
            ch.dims[wkey] = [None, None]
            if bias:
                ch.dims[f"{owner}.bias"] = [None]
            return x.narrow(-1, 0, 1).expand(*x.shape[:-1], cout)
        vec = channel_vector(x, x.ndim - 1, where, ch, shared=True)
        out = ch.new(wkey, cout)
        ch.dims[wkey] = [out, vec]
        if bias:
            ch.dims[f"{owner}.bias"] = [out]
        return spread(out, (*x.shape[:-1], cout), x.ndim - 1)

    def norm(where, owner, m, x):
        if isinstance(m, nn.LayerNorm):
            if len(m.normalized_shape) != 1:
                raise NestError(f"{where}: LayerNorm over {len(m.normalized_shape)} dimensions")
            vec = layer_norm_vector(ch, x, x.ndim - 1, where)
            if vec is None:
                return keep_whole(m, owner, x)
        else:
            vec = channel_vector(x, 1, where, ch)
        if isinstance(m, CHANNEL_NORMS):
            ch.channel_stats.append((where, vec))
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

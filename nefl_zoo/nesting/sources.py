"""Where automatically nested networks come from: ``torchvision:NAME``, ``timm:NAME`` or a user's
``nn.Module``, and how they are traced with torch.fx.

A source builds the network without weights (no network access); ``nefl-zoo --pretrained
torchvision:NAME`` loads weights afterwards through :func:`nefl_zoo.models.load_pretrained`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..models.registry import NestError

PREFIXES = ("torchvision", "timm")


@dataclass(frozen=True)
class Source:
    """A network's constructor and the tracer that understands it."""

    name: str  # e.g. "torchvision:resnet18", or "module:ClassName"
    make: Callable[[], nn.Module]  # builds the full network on the current default device
    leaf_types: tuple[type, ...] = ()  # modules traced as one call (beyond torch.nn's own)
    autowrap: tuple[Callable, ...] = ()  # functions recorded as one call
    output: tuple = ()  # where the logits sit in what forward returns (a key or index per level; () the output itself)


@contextlib.contextmanager
def _parameters_on_meta():
    """Construct on the CPU (constructors that compute widths with tensors need one) while
    every parameter and buffer lands on the meta device (no memory, no init cost)."""
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter(self, name, param):
        register_parameter(self, name, param)
        if param is not None:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    def buffer(self, name, tensor, persistent=True):
        register_buffer(self, name, tensor, persistent)
        if tensor is not None:
            self._buffers[name] = tensor.to("meta")

    inits = {name: getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")}
    nn.Module.register_parameter, nn.Module.register_buffer = parameter, buffer
    for name in inits:  # initialising shape-only tensors is wasted time
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer
        for name, fn in inits.items():
            setattr(nn.init, name, fn)


def construct(source: Source) -> nn.Module:
    """``source.make()`` on the current default device (meta: parameters only on meta)."""
    if torch.empty(0).device.type != "meta":
        return source.make()
    try:
        with _parameters_on_meta():
            return source.make().to("meta")  # a copied module (nest()) brings its own tensors
    except Exception:  # noqa: BLE001 - a constructor that runs its layers (to size them) needs real tensors
        with torch.device("cpu"):
            return source.make().to("meta")


def split_name(name: str) -> tuple[str, str] | None:
    """``("torchvision", "resnet18")`` for ``"torchvision:resnet18"``; ``None`` for a zoo name."""
    prefix, sep, rest = name.partition(":")
    return (prefix, rest) if sep and prefix in PREFIXES and rest else None


@functools.cache
def torchvision_names() -> tuple[str, ...]:
    """torchvision's classification models (``list_models(module=torchvision.models)``)."""
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def exists(name: str) -> bool:
    """Whether ``name`` (``torchvision:NAME`` / ``timm:NAME``) names a model of that library."""
    parts = split_name(name)
    if parts is None:
        return False
    prefix, model = parts
    if prefix == "torchvision":
        return model in torchvision_names()
    import timm

    return timm.is_model(model)


def _replace_first_conv(model: nn.Module, in_chans: int) -> None:
    """Give the first convolution ``in_chans`` input channels (torchvision builds 3)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            if module.in_channels == in_chans:
                return
            new = nn.Conv2d(
                in_chans, module.out_channels, module.kernel_size, module.stride, module.padding,
                module.dilation, module.groups, module.bias is not None, module.padding_mode,
            )
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, new)
            return
    raise NestError(f"in_chans: no convolution found to take {in_chans} input channels")


def library_source(name: str, num_classes: int, in_chans: int) -> Source:
    """The source of ``torchvision:NAME`` / ``timm:NAME`` with ``num_classes`` outputs."""
    parts = split_name(name)
    if parts is None or not exists(name):
        raise NestError(f"unknown model {name!r} (torchvision:NAME or timm:NAME)")
    prefix, model = parts
    if prefix == "torchvision":
        import torchvision

        def make() -> nn.Module:
            kwargs = {"aux_logits": False, "init_weights": True} if model in ("googlenet", "inception_v3") else {}
            net = torchvision.models.get_model(model, weights=None, num_classes=num_classes, **kwargs)
            _replace_first_conv(net, in_chans)
            return net

        return Source(name, make)
    import timm
    from timm.models._features_fx import get_notrace_functions, get_notrace_modules

    def make_timm() -> nn.Module:
        return timm.create_model(model, pretrained=False, num_classes=num_classes, in_chans=in_chans)

    return Source(name, make_timm, tuple(get_notrace_modules()), tuple(get_notrace_functions()))


def _outputs(out, path: tuple = (), name: str | None = None):
    """``(path, name, value)`` of every leaf of a forward's output: tuples, lists, named
    tuples and dicts followed (``name``: the dict key or named-tuple field holding it)."""
    if isinstance(out, dict):
        for key, value in out.items():
            yield from _outputs(value, (*path, key), str(key))
    elif isinstance(out, (tuple, list)):
        fields = getattr(out, "_fields", None)
        for i, value in enumerate(out):
            yield from _outputs(value, (*path, i), fields[i] if fields else None)
    else:
        yield path, name, out


def find_logits(out, model: str) -> tuple[tuple, torch.Tensor]:
    """``(path, logits)`` of what a user's forward returned: the output itself if a tensor; in a
    tuple, list or dict the one tensor named ``logits`` (a dict key, a named-tuple field), else
    the only one of shape (N, classes); anything else refused, naming the outputs."""
    if isinstance(out, torch.Tensor):
        return (), out
    leaves = list(_outputs(out))
    tensors = [(p, v) for p, name, v in leaves if isinstance(v, torch.Tensor)]
    named = [(p, v) for p, name, v in leaves if name == "logits" and isinstance(v, torch.Tensor)]
    flat = [(p, v) for p, v in tensors if v.ndim == 2]
    for found in (named, flat):
        if len(found) == 1:
            return found[0]
    shown = ", ".join(f"{''.join(f'[{k!r}]' for k in p)}: "
                      f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}" for p, _, v in leaves[:6])
    more = f" and {len(leaves) - 6} more" if len(leaves) > 6 else ""
    raise NestError(f"{model}: forward returns a {type(out).__name__} ({shown}{more}) and no single logits tensor "
                    "among them; return the logits alone, or name them 'logits' (a dict key or a namedtuple field)")


def example_shape(example_input) -> tuple[int, int, int, int]:
    """The ``(N, C, H, W)`` of :func:`~nefl_zoo.nesting.nest`'s example input (a tensor or a
    shape): whole, positive sizes of a square image, else one line saying what it got."""
    raw = example_input.shape if isinstance(example_input, torch.Tensor) else example_input
    try:
        sizes = list(raw)
        if any(isinstance(d, bool) for d in sizes):
            raise TypeError("a bool")
        shape = tuple(operator.index(d) for d in sizes)
    except TypeError:
        raise NestError(f"example_input: expected a tensor or a shape (N, C, H, W) of whole numbers, got {example_input!r}"[:300]) from None
    if len(shape) != 4 or shape[2] != shape[3]:
        raise NestError(f"example_input: expected a square (N, C, H, W) input, got {shape}")
    if min(shape) < 1:
        raise NestError(f"example_input: expected sizes of at least 1, got {shape}")
    return shape


def user_source(module: nn.Module, shape: tuple[int, int, int, int], name: str) -> tuple[Source, int, nn.Module]:
    """``(source, classes, template)`` of a user's module: the module copied once as it is now
    (weights, buffers, training flags; the user's object is never touched again, every tier is a
    copy of the template), a throwaway copy run once in eval mode on a zero input of ``shape``
    (a forward that updates buffers changes neither) to find its logits (:func:`find_logits`).
    A module that cannot be copied, or an input its forward does not take, is one line."""
    model = type(module).__name__
    try:
        template = copy.deepcopy(module)
        probe = copy.deepcopy(template).eval()
    except Exception as exc:  # noqa: BLE001 - whatever a module holding a lock, a file or a generator raises
        raise NestError(f"{model}: cannot be copied ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})"[:300]
                        + "; nesting works on a copy so that it never changes the module") from None
    like = next((t for t in (*probe.parameters(), *probe.buffers()) if t.is_floating_point()), None)
    x = torch.zeros(1, *shape[1:], dtype=like.dtype if like is not None else None, device=like.device if like is not None else None)
    try:
        with torch.no_grad():
            out = probe(x)
    except Exception as exc:  # noqa: BLE001 - whatever the forward raises on an input of another shape
        raise NestError(f"example_input: {model} cannot run an input of shape {shape} ({type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0]})"[:300] + "; give the (N, C, H, W) its forward takes") from None
    path, logits = find_logits(out, model)
    return Source(f"module:{name}", lambda: copy.deepcopy(template), output=path), int(logits.shape[-1]), template


def _select_output(graph: "torch.fx.Graph", path: tuple, model: str) -> None:
    """Make the traced graph return only the logits at ``path`` of its output (what else it
    returned, and the layers computing only that, are dropped once it is a graph module)."""
    import torch.fx as fx

    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    value = out.args[0]
    for key in path:
        if isinstance(value, fx.Node) and value.op == "call_function" and hasattr(value.target, "_fields"):
            fields = value.target._fields  # the tracer records a named tuple as a call of its class
            value = (*value.args, *[value.kwargs[f] for f in fields[len(value.args):]])
        value = value[key]
    if not isinstance(value, fx.Node):
        raise NestError(f"{model}: the logits it returns are not computed from its input")
    out.args = (value,)


def _optional_arguments(model: nn.Module) -> dict:
    """``forward``'s optional arguments (a mask, a flag) fixed to their defaults: traced as the
    plain classifier call ``model(x)``."""
    import inspect

    parameters = list(inspect.signature(model.forward).parameters.values())[1:]
    return {p.name: p.default for p in parameters
            if p.kind is p.POSITIONAL_OR_KEYWORD and (p.default is None or isinstance(p.default, bool))}


def trace(source: Source, model: nn.Module, leaves: bool = True) -> torch.fx.GraphModule:
    """``model`` traced by torch.fx (eval mode) with the source's leaf modules (timm's "notrace"
    list) kept as single calls, else, where that fails (or ``leaves`` is false), through every module."""
    import torch.fx as fx

    model.eval()
    error = None
    for leaves in dict.fromkeys([source.leaf_types if leaves else (), ()]):

        class Tracer(fx.Tracer):
            proxy_buffer_attributes = True  # buffers (position indices, masks) by name, not as constants

            def is_leaf_module(self, m: nn.Module, qualname: str, leaves=leaves) -> bool:
                return isinstance(m, leaves) or super().is_leaf_module(m, qualname)

        try:
            graph = Tracer(autowrap_functions=source.autowrap).trace(model, concrete_args=_optional_arguments(model))
            if source.output:  # a user's forward returning several outputs: its logits only
                _select_output(graph, source.output, source.name)
            gm = fx.GraphModule(model, graph, type(model).__name__)
            for node in list(gm.graph.nodes):  # shape assertions hold for the full widths only
                if node.op == "call_function" and getattr(node.target, "__name__", "") in ("_assert", "_assert_async"):
                    gm.graph.erase_node(node)
            gm.graph.eliminate_dead_code()  # and the shape look-ups they read
            if source.output:
                gm.delete_all_unused_submodules()  # the layers of the other outputs
            return gm
        except NestError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the network's forward does with proxies
            text = str(exc).strip().splitlines()
            error = f"{source.name}: torch.fx cannot trace it: {type(exc).__name__}: {text[0] if text else ''}"[:300]
    raise NestError(error)

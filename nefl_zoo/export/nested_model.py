"""One standard ONNX model holding every tier: the nested model (``nested.PREC.onnx``).

The model takes the images (``input``) and an int64 scalar ``tier`` (0 = the first tier of its
table ... T-1 = the last; negative values count from the end, as in Python) and gives the
chosen tier's ``logits``. Every shared tensor of the global model is stored once, as a
top-level initializer; each tier is a branch of a balanced tree of ``If`` nodes (depth
ceil(log2 T)) whose ops cut the tier's weights out of the shared tensors (``Slice``,
``Gather``, a ``Mul`` by a folded BatchNorm's per-channel factor, ``Cast``, ``Pad``) and then
call the tier's graph, a model-local function (domain ``nefl_zoo.tier``) that every tier of
the same structure calls, so that the graph too is stored once; the tier's small tensors
(folded biases, step sizes, quantization scales) are initializers of its branch, named
``tN/...``, each distinct value once. A tier value outside the table fails in the ``Gather``
node named ``tier_out_of_range``.

onnxruntime folds the cuts at session creation (their inputs are all constant), so each tier
runs on constant weights with the same kernels as its own self-contained file. The tier table
(names, parameters, MACs, accuracy, input and output, class names) is in the model's
``metadata_props`` under :data:`~nefl_zoo.runtime.nested.METADATA_KEY` (JSON), so an app that
has only the file can list and choose its tiers.
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..manifest import InputSpec, OutputSpec, TierEntry
from ..runtime.nested import METADATA_FORMAT, METADATA_KEY, TIER_INPUT
from .nested import NestedEntry, Slice
from .onnx_file import INPUT_NAME, OUTPUT_NAME
from .verify import ExportError

GUARD_NODE = "tier_out_of_range"
FUNCTION_DOMAIN = "nefl_zoo.tier"  # the model-local functions holding the tiers' graphs
_CHECKED_TIER = "tier_checked"
_ONNX_TYPES = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT}


def _sorted(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes in an order where each comes after the nodes it reads (onnxruntime
    runs an unsorted graph, as onnxruntime's FP16 converter may leave one; the checker refuses it)."""
    produced = {o: k for k, node in enumerate(graph.node) for o in node.output}
    order, done, visiting = [], set(), set()
    for start in range(len(graph.node)):
        stack = [(start, False)]
        while stack:
            k, expanded = stack.pop()
            if k in done:
                continue
            if expanded:
                done.add(k)
                order.append(graph.node[k])
                continue
            if k in visiting:
                raise ExportError(f"the tier graph has a cycle through node {graph.node[k].name or graph.node[k].op_type}")
            visiting.add(k)
            stack.append((k, True))
            stack.extend((produced[i], False) for i in reversed(graph.node[k].input) if i in produced and produced[i] not in done)
    return order


class _Branch:
    """One tier's branch: its nodes and its own initializers. Every tensor a layer of the branch
    reads is a constant *of the branch's graph*: onnxruntime fuses and pre-packs a layer's
    weights for its fast kernels only then. So the tier's own tensors are initializers of the
    branch (at the top level, they made the full tier of a ResNet20 2x slower than its file),
    and a shared tensor the tier takes whole goes through a one-input ``Concat`` that
    onnxruntime folds into a branch constant (read from the top level, an INT8 ``QLinearConv``
    repacked its weight on every run: up to 1.9x slower). The tier's graph is one call of a
    function in ``functions`` (keyed by the graph's structure, added when new), its arguments
    the branch's constants and cuts (onnxruntime inlines it when it loads the model)."""

    def __init__(self, index: int, entry: NestedEntry, shared: Mapping[str, np.ndarray],
                 functions: dict[bytes, onnx.FunctionProto]):
        self.prefix = f"t{index}/"
        self.initializers: list[onnx.TensorProto] = []
        self._constants: dict[tuple, str] = {}  # (dtype, shape, bytes) -> the branch initializer holding it
        self.nodes: list[onnx.NodeProto] = []
        graph = entry.graph.graph
        self._local = {graph.input[0].name: INPUT_NAME}  # the tier graph's names -> the branch's
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
            raise ExportError(f"tier {entry.name}: its graph has subgraphs, which a nested model does not nest")
        if entry.graph.functions:
            raise ExportError(f"tier {entry.name}: its model has local functions, which a nested model does not nest")
        self.half_weights = entry.half_weights
        for name in entry.literals:
            self._literal(name, entry.arrays[name])
        for cut in entry.slices:
            self._cut(cut, shared, entry.arrays)
        self.nodes.append(self._call(graph, list(entry.graph.opset_import), functions))
        self.output_type = graph.output[0].type

    @property
    def output(self) -> str:
        return self.prefix + OUTPUT_NAME

    def _constant(self, name: str, array: np.ndarray) -> str:
        """The branch initializer holding ``array`` (named ``name`` when its value is new; one
        initializer per distinct value, however many tensors of the tier or cuts hold it)."""
        array = np.asarray(array)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            self._constants[key] = self.prefix + name
            self.initializers.append(numpy_helper.from_array(array, self.prefix + name))
        return self._constants[key]

    def _literal(self, name: str, array: np.ndarray) -> None:
        """A tensor of the tier's own; with half-precision weights, cast to float32 for the graph."""
        if self.half_weights and array.dtype == np.float16:
            stored = self._constant(f"{name}~half", array)
            self._local[name] = self._node("Cast", [stored], self.prefix + name, to=TensorProto.FLOAT)
        else:
            self._local[name] = self._constant(name, array)

    def _call(self, graph: onnx.GraphProto, opsets: list, functions: dict[bytes, onnx.FunctionProto]) -> onnx.NodeProto:
        """The node calling the function that runs ``graph``: its body is the graph's nodes with
        their values renamed in order of use (``x0`` ... for what the graph reads, ``v0`` ... for
        what it computes), so tiers of one structure give the same body and share its function."""
        nodes = _sorted(graph)
        computed = {o for node in nodes for o in node.output}
        canonical: dict[str, str] = {}
        arguments: list[str] = []

        def rename(name: str) -> str:
            if name and name not in canonical:
                if name in computed:
                    canonical[name] = f"v{len(canonical)}"
                else:
                    canonical[name] = f"x{len(arguments)}"
                    arguments.append(name)
            return canonical.get(name, "")

        body = []
        for node in nodes:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.input[:] = [rename(n) for n in node.input]
            copy.output[:] = [rename(n) for n in node.output]
            body.append(copy)
        output = rename(graph.output[0].name)
        key = b"".join(node.SerializeToString() for node in body) + output.encode()
        if key not in functions:
            functions[key] = helper.make_function(FUNCTION_DOMAIN, f"tier_graph{len(functions)}",
                                                  [canonical[n] for n in arguments], [output], body, opsets)
        return helper.make_node(functions[key].name, [self._local[n] for n in arguments], [self.output],
                                domain=FUNCTION_DOMAIN)

    def _node(self, op: str, inputs: list[str], output: str, **attributes) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], **attributes))
        return output

    def _index(self, array: np.ndarray) -> str:
        """The branch's int64 constant of the 1-D ``array`` (of Slice bounds or pads), one per
        value however many cuts read it."""
        return self._constant("~" + "_".join(str(int(v)) for v in array), array)

    def _cut(self, cut: Slice, shared: Mapping[str, np.ndarray], tier: Mapping[str, np.ndarray]) -> None:
        """The nodes that make initializer ``cut.name`` from its shared tensor (as
        :func:`~nefl_zoo.export.nested.materialize` computes it)."""
        source = shared[cut.shared]
        value, shape, step = cut.shared, list(source.shape), f"{cut.name}~"
        ranges = [(d, i) for d, i in enumerate(cut.index) if isinstance(i, tuple) and i != (0, source.shape[d])]
        if ranges:
            starts = np.array([i[0] for _, i in ranges], np.int64)
            ends = np.array([i[1] for _, i in ranges], np.int64)
            axes = np.array([d for d, _ in ranges], np.int64)
            inputs = [value, self._index(starts), self._index(ends), self._index(axes)]
            value = self._node("Slice", inputs, self.prefix + step + "slice")
            for d, (start, stop) in ranges:
                shape[d] = stop - start
        for d, i in enumerate(cut.index):
            if isinstance(i, str):
                value = self._node("Gather", [value, self._constant(i, tier[i])], f"{self.prefix}{step}gather{d}", axis=d)
                shape[d] = len(tier[i])
        if cut.scale is not None:
            factor = tier[cut.scale].astype(np.float32).reshape(-1, *[1] * (len(shape) - 1))
            if source.dtype != np.float32:
                value = self._node("Cast", [value], self.prefix + step + "float", to=TensorProto.FLOAT)
            value = self._node("Mul", [value, self._constant(f"{step}scale", factor)], self.prefix + step + "scaled")
            if cut.dtype is not None and np.dtype(cut.dtype) != np.float32:
                value = self._node("Cast", [value], self.prefix + step + "cast", to=_ONNX_TYPES[np.dtype(cut.dtype)])
        if cut.transpose:
            value = self._node("Transpose", [value], self.prefix + step + "transposed", perm=[1, 0])
            shape = shape[::-1]
        if self.half_weights:  # before the Pad: onnxruntime's CPU provider folds no half-precision Pad
            value = self._node("Cast", [value], self.prefix + step + "float32", to=TensorProto.FLOAT)
        if cut.pad is not None and list(cut.pad) != shape:
            pads = np.array([0] * len(shape) + [p - n for p, n in zip(cut.pad, shape)], np.int64)
            value = self._node("Pad", [value, self._index(pads)], self.prefix + step + "pad")
        if value == cut.shared:  # the whole tensor: a one-input Concat, folded into a constant of the branch
            value = self._node("Concat", [value], self.prefix + step + "whole", axis=0)
        self.nodes[-1].output[0] = self._local[cut.name] = self.prefix + cut.name  # the last step makes the tier's tensor


def _tree(branches: Sequence[_Branch], lo: int, hi: int, output: str, initializers: list) -> list[onnx.NodeProto]:
    """The nodes that compute ``output`` from the branch of the tier in ``[lo, hi)`` the
    checked tier selects: the branch itself, or an ``If`` over the two halves."""
    if hi - lo == 1:
        branch = branches[lo]
        return [*branch.nodes, helper.make_node("Identity", [branch.output], [output])]
    mid = (lo + hi) // 2
    bound = f"tier<{mid}"
    if not any(t.name == bound for t in initializers):
        initializers.append(numpy_helper.from_array(np.array(mid, np.int64), bound))

    def half(a: int, b: int) -> onnx.GraphProto:
        out = f"tiers[{a}:{b}]"
        value = helper.make_value_info(out, branches[a].output_type)
        local = branches[a].initializers if b - a == 1 else []
        return helper.make_graph(_tree(branches, a, b, out, initializers), out, [], [value], local)

    return [
        helper.make_node("Less", [_CHECKED_TIER, bound], [f"{output}?"], name=f"{output}?"),
        helper.make_node("If", [f"{output}?"], [output], name=f"{output}~if",
                         then_branch=half(lo, mid), else_branch=half(mid, hi)),
    ]


def nested_model(entries: Sequence[NestedEntry], shared: Mapping[str, np.ndarray], metadata: dict) -> onnx.ModelProto:
    """The nested model of ``entries`` (in table order: ``tier`` = position) over the
    ``shared`` tensors they slice, with the tier table ``metadata`` in ``metadata_props``."""
    if not entries:
        raise ExportError("a nested model needs at least one tier")
    functions: dict[bytes, onnx.FunctionProto] = {}
    branches = [_Branch(i, entry, shared, functions) for i, entry in enumerate(entries)]
    first = entries[0].graph
    opsets = {(o.domain, o.version) for e in entries for o in e.graph.opset_import}
    if len({domain for domain, _ in opsets}) != len(opsets):
        raise ExportError(f"the tiers' models import different opsets: {sorted(opsets)}")
    used = {n for b in branches for node in b.nodes for n in node.input}
    initializers = [numpy_helper.from_array(np.asarray(a), k) for k, a in sorted(shared.items()) if k in used]
    clash = {t.name for t in initializers} & {t.name for b in branches for t in b.initializers}
    if clash:
        raise ExportError(f"shared tensor {sorted(clash)[0]} is named like a tier's own tensor")
    if len(branches) == 1:
        initializers.extend(branches[0].initializers)
    tiers = np.arange(len(entries), dtype=np.int64)
    initializers.append(numpy_helper.from_array(tiers, "tiers"))
    guard = helper.make_node("Gather", ["tiers", TIER_INPUT], [_CHECKED_TIER], name=GUARD_NODE, axis=0)
    nodes = [guard, *_tree(branches, 0, len(branches), OUTPUT_NAME, initializers)]
    graph = helper.make_graph(
        nodes, "nested", [first.graph.input[0], helper.make_tensor_value_info(TIER_INPUT, TensorProto.INT64, [])],
        [first.graph.output[0]], initializers,
    )
    model = helper.make_model(graph, opset_imports=[*first.opset_import, helper.make_opsetid(FUNCTION_DOMAIN, 1)],
                              functions=list(functions.values()), ir_version=first.ir_version, producer_name="nefl-zoo",
                              doc_string=__doc__.split("\n\n")[1].replace("\n", " "))
    helper.set_model_props(model, {METADATA_KEY: json.dumps(metadata, separators=(",", ":"))})
    return model


def nested_table(precision: str, entries: Sequence[TierEntry], input_spec: InputSpec, output_spec: OutputSpec,
                 class_names: list[str] | None) -> dict:
    """The tier table of a nested model's ``metadata_props`` (entries in ``tier`` order)."""
    keys = ("name", "params", "params_ratio", "macs", "macs_ratio", "gamma_w", "accuracy")
    return {
        "format": METADATA_FORMAT, "version": 1, "precision": precision, "tier_input": TIER_INPUT,
        "input": input_spec.model_dump(), "output": output_spec.model_dump(), "class_names": class_names,
        "tiers": [{"index": i, **{k: getattr(e, k) for k in keys}} for i, e in enumerate(entries)],
    }

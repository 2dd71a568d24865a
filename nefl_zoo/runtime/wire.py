"""Just enough of protobuf's wire format to check ONNX models without ``onnx``.

The runtime needs numpy and onnxruntime only, yet it must refuse a model that refers to
external data before onnxruntime sees it (onnxruntime would open that file by path, outside
every hash check): a small walk over the serialized ``ModelProto`` (field numbers from
``onnx/onnx.proto``).
"""

from __future__ import annotations

from typing import Iterator

# ModelProto
_MODEL_GRAPH, _MODEL_FUNCTIONS = 7, 25
# GraphProto
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER = 1, 5, 15
# NodeProto / FunctionProto
_NODE_ATTRIBUTE, _FUNCTION_NODE = 5, 7
# AttributeProto: t, g, tensors, graphs, sparse_tensor, sparse_tensors
_ATTR_T, _ATTR_G, _ATTR_TENSORS, _ATTR_GRAPHS, _ATTR_SPARSE, _ATTR_SPARSES = 5, 6, 10, 11, 22, 23
# SparseTensorProto: values, indices
_SPARSE_VALUES, _SPARSE_INDICES = 1, 2
# TensorProto
_TENSOR_NAME, _TENSOR_EXTERNAL, _TENSOR_LOCATION = 8, 13, 14
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL

class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def fields(data: bytes | memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """``(field number, wire type, value)`` of every field of one message: an int for
    varints and fixed-width fields, the payload's bytes for length-delimited ones."""
    data = memoryview(data)
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(data, pos)
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            if pos + size > len(data):
                raise WireError("truncated fixed-width field")
            value, pos = int.from_bytes(data[pos : pos + size], "little"), pos + size
        elif wire_type == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise WireError("truncated length-delimited field")
            value, pos = data[pos : pos + size], pos + size
        else:
            raise WireError(f"unsupported wire type {wire_type}")
        if number == 0:
            raise WireError("field number 0")
        yield number, wire_type, value


def _tensor_external(tensor: memoryview) -> str | None:
    """The tensor's name when it stores its data outside the model, else ``None``."""
    name, external = "", False
    for number, wire_type, value in fields(tensor):
        if number == _TENSOR_NAME and wire_type == 2:
            name = bytes(value).decode("utf-8", "replace")
        elif number == _TENSOR_EXTERNAL and wire_type == 2:
            external = True
        elif number == _TENSOR_LOCATION and wire_type == 0 and value == _EXTERNAL:
            external = True
    return (name or "<unnamed tensor>") if external else None


def _graph_external(graph: memoryview) -> Iterator[str]:
    for number, wire_type, value in fields(graph):
        if wire_type != 2:
            continue
        if number == _GRAPH_INITIALIZER:
            found = _tensor_external(value)
            if found:
                yield found
        elif number == _GRAPH_SPARSE_INITIALIZER:
            yield from _sparse_external(value)
        elif number == _GRAPH_NODE:
            yield from _node_external(value)


def _sparse_external(sparse: memoryview) -> Iterator[str]:
    for number, wire_type, value in fields(sparse):
        if wire_type == 2 and number in (_SPARSE_VALUES, _SPARSE_INDICES):
            found = _tensor_external(value)
            if found:
                yield found


def _node_external(node: memoryview) -> Iterator[str]:
    for number, wire_type, attribute in fields(node):
        if number != _NODE_ATTRIBUTE or wire_type != 2:
            continue
        for field, kind, value in fields(attribute):
            if kind != 2:
                continue
            if field in (_ATTR_T, _ATTR_TENSORS):
                found = _tensor_external(value)
                if found:
                    yield found
            elif field in (_ATTR_SPARSE, _ATTR_SPARSES):
                yield from _sparse_external(value)
            elif field in (_ATTR_G, _ATTR_GRAPHS):
                yield from _graph_external(value)


def external_tensors(model: bytes) -> list[str]:
    """Names of every tensor of the serialized ``ModelProto`` ``model`` whose data lives in
    an external file: initializers, sparse initializers, Constant-node and other attribute
    tensors, in the main graph, every subgraph and every model-local function.
    :class:`WireError` when the bytes are not a protobuf message."""
    found: list[str] = []
    for number, wire_type, value in fields(model):
        if wire_type != 2:
            continue
        if number == _MODEL_GRAPH:
            found.extend(_graph_external(value))
        elif number == _MODEL_FUNCTIONS:
            for field, kind, node in fields(value):
                if field == _FUNCTION_NODE and kind == 2:
                    found.extend(_node_external(node))
    return found

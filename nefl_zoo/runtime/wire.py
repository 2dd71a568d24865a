"""Just enough of protobuf's wire format to check and assemble ONNX models without ``onnx``.

The runtime needs numpy and onnxruntime only, yet it must (a) refuse a model that refers to
external data before onnxruntime sees it (onnxruntime would open that file by path, outside
every hash check) and (b) give a weights-free tier graph its initializers from memory. Both are
small walks over the serialized ``ModelProto`` (field numbers from ``onnx/onnx.proto``).

Assembly relies on protobuf's merge rule: parsing ``A + B`` where both encode a ``ModelProto``
equals merging B into A, and a repeated field (``GraphProto.initializer``) is appended to. So
``graph_bytes + encode(ModelProto(graph=GraphProto(initializer=[...])))`` is the graph with
those initializers, and onnxruntime treats them as the model's own constant initializers (it
folds and prepacks them at session creation as it would a self-contained file's).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

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
_TENSOR_DIMS, _TENSOR_TYPE, _TENSOR_NAME, _TENSOR_RAW, _TENSOR_EXTERNAL, _TENSOR_LOCATION = 1, 2, 8, 9, 13, 14
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL

#: numpy dtype -> TensorProto.DataType
ONNX_DTYPES = {
    np.dtype(np.float32): 1, np.dtype(np.uint8): 2, np.dtype(np.int8): 3, np.dtype(np.int32): 6,
    np.dtype(np.int64): 7, np.dtype(np.bool_): 9, np.dtype(np.float16): 10, np.dtype(np.float64): 11,
}


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


def _key(number: int, wire_type: int) -> bytes:
    return _encode_varint(number << 3 | wire_type)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _length_delimited(number: int, payload: bytes | memoryview) -> bytes:
    return _key(number, 2) + _encode_varint(len(payload)) + bytes(payload)


def tensor_proto(name: str, array: np.ndarray) -> bytes:
    """A serialized ``TensorProto`` holding ``array`` (little-endian raw data) under ``name``."""
    array = np.asarray(array)
    native = array.dtype.newbyteorder("=")
    if native not in ONNX_DTYPES:
        raise ValueError(f"{name}: dtype {array.dtype} has no ONNX tensor type here")
    out = bytearray()
    for dim in array.shape:
        out += _key(_TENSOR_DIMS, 0) + _encode_varint(int(dim))
    out += _key(_TENSOR_TYPE, 0) + _encode_varint(ONNX_DTYPES[native])
    out += _length_delimited(_TENSOR_NAME, name.encode("utf-8"))
    out += _length_delimited(_TENSOR_RAW, array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
    return bytes(out)


def with_initializers(model: bytes, initializers: Mapping[str, np.ndarray]) -> bytes:
    """The serialized model ``model`` with ``initializers`` appended to its main graph."""
    tensors = b"".join(_length_delimited(_GRAPH_INITIALIZER, tensor_proto(n, a)) for n, a in initializers.items())
    return bytes(model) + _length_delimited(_MODEL_GRAPH, tensors)

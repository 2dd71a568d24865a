"""The runtime's numpy-only readers: safetensors files, protobuf walks for external data and
initializer assembly, and slice materialization (no export needed)."""

import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from nefl_zoo.runtime.arrays import ArrayFileError, parse_header
from nefl_zoo.export.nested import Slice, materialize
from nefl_zoo.runtime.wire import WireError, external_tensors, fields


def framed(header: bytes | dict, body: bytes) -> bytes:
    """A safetensors file: the header's length, the header, the data bytes."""
    header = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(header).to_bytes(8, "little") + header + body


@pytest.mark.parametrize("data, message", [
    (b"abc", "shorter than the 8-byte header length"),
    (bytes(8), "header is not JSON (Expecting value: line 1 column 1 (char 0))"),  # 8 bytes: an empty header
    ((10**9).to_bytes(8, "little") + b"{}", "header length 1000000000 runs past the end of the file"),
    ((10).to_bytes(8, "little") + b"{}", "header length 10 runs past the end of the file"),
    (framed(b"not json", b""), "header is not JSON (Expecting value: line 1 column 1 (char 0))"),
    (framed(b"[]", b""), "header is not a JSON object"),
    (framed({"__metadata__": "x"}, b""), "__metadata__ must map names to strings"),
    (framed({"__metadata__": {"k": 1}}, b""), "__metadata__ must map names to strings"),
])
def test_safetensors_header_reader_refuses_malformed_files_in_one_line(data: bytes, message: str):
    with pytest.raises(ArrayFileError) as error:
        parse_header(data)
    assert str(error.value) == message


def test_safetensors_header_reader_reads_what_safetensors_writes():
    from safetensors.numpy import save

    header, metadata, start = parse_header(save({"a": np.arange(4, dtype=np.float32)}, metadata={"k": "v"}))
    assert metadata == {"k": "v"} and header == {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    assert parse_header(framed({}, b"")) == ({}, {}, 10)


def test_wire_walk_finds_external_data_anywhere():
    weight = numpy_helper.from_array(np.arange(3, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["input", "w"], ["logits"])], "g",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [None, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    model.graph.initializer.append(weight)
    assert external_tensors(model.SerializeToString()) == []
    external = onnx.TensorProto()
    external.CopyFrom(weight)
    external.ClearField("raw_data")
    external.data_location = onnx.TensorProto.EXTERNAL
    branch = helper.make_graph([helper.make_node("Constant", [], ["c"], value=external)], "b", [],
                               [helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [3])])
    model.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=branch, else_branch=branch))
    assert external_tensors(model.SerializeToString()) == ["w", "w"]  # inside both subgraphs


def test_materialize_refuses_regions_that_do_not_fit():
    shared = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    tier = {"i": np.array([2, 0], np.int64), "f": np.array([2.0, 3.0], np.float32)}
    np.testing.assert_array_equal(materialize(Slice("x", "w", ("i", (1, 3)), "f"), shared, tier), [[18, 20], [3, 6]])
    padded = materialize(Slice("x", "w", ((0, 1), None), pad=(2, 5)), shared, tier)
    np.testing.assert_array_equal(padded, [[0, 1, 2, 3, 0], [0, 0, 0, 0, 0]])
    for cut, message in [
        (Slice("x", "v", (None, None)), "shared tensor v is not in the shared file"),
        (Slice("x", "w", ((0, 4), None)), r"index\[0\] \[0, 4\] runs past w's 3"),
        (Slice("x", "w", (None,)), "1 index dimensions for w of shape"),
        (Slice("x", "w", ("f", None)), "is not a 1-D int64 tensor"),
        (Slice("x", "w", (None, None), "f"), "scale f is not a tier tensor of 3 values"),
        (Slice("x", "w", (None, None), pad=(2, 4)), "pad .* is smaller than its slice"),
    ]:
        with pytest.raises(ValueError, match=message):
            materialize(cut, shared, tier)


# -- protobuf wire format -------------------------------------------------------------------------


def key(number: int, wire_type: int) -> bytes:
    """A field's key, for field numbers below 16 (one byte)."""
    assert number < 16
    return bytes([number << 3 | wire_type])


@pytest.mark.parametrize("encoded, value", [
    (b"\x00", 0), (b"\x01", 1), (b"\x7f", 127), (b"\x80\x01", 128), (b"\xac\x02", 300), (b"\xff\xff\xff\xff\x0f", 2**32 - 1),
    (b"\xff" * 8 + b"\x7f", 2**63 - 1), (b"\xff" * 9 + b"\x01", 2**64 - 1),
])
def test_varints_decode_up_to_ten_bytes(encoded: bytes, value: int):
    assert list(fields(key(1, 0) + encoded)) == [(1, 0, value)]


def test_fields_reads_every_wire_type_and_skips_nothing():
    data = (key(1, 0) + b"\x96\x01" + key(2, 1) + (2**40 + 5).to_bytes(8, "little") + key(3, 5) + (70000).to_bytes(4, "little")
            + key(4, 2) + b"\x03abc" + key(4, 2) + b"\x00" + key(15, 2) + b"\x80\x01" + bytes(range(128)))
    out = [(n, t, bytes(v) if isinstance(v, memoryview) else v) for n, t, v in fields(data)]
    assert out == [(1, 0, 150), (2, 1, 2**40 + 5), (3, 5, 70000), (4, 2, b"abc"), (4, 2, b""), (15, 2, bytes(range(128)))]
    model = helper.make_model(helper.make_graph([], "g", [], []), producer_name="p", ir_version=8,
                              opset_imports=[helper.make_opsetid("", 17)])
    assert [(n, t) for n, t, _ in fields(model.SerializeToString())] == [(1, 0), (2, 2), (7, 2), (8, 2)]


@pytest.mark.parametrize("data, message", [
    (key(1, 0), "truncated or overlong varint"),
    (key(1, 0) + b"\x80", "truncated or overlong varint"),
    (key(1, 0) + b"\xff" * 10 + b"\x01", "truncated or overlong varint"),  # eleven bytes
    (key(2, 1) + bytes(7), "truncated fixed-width field"),
    (key(3, 5) + bytes(3), "truncated fixed-width field"),
    (key(4, 2) + b"\x04abc", "truncated length-delimited field"),
    (key(4, 3), "unsupported wire type 3"),
    (key(4, 6), "unsupported wire type 6"),
    (b"\x00\x00", "field number 0"),
])
def test_malformed_messages_raise_one_line(data: bytes, message: str):
    with pytest.raises(WireError) as error:
        list(fields(data))
    assert str(error.value) == message
    assert list(fields(key(2, 1) + bytes(8))) == [(2, 1, 0)] and list(fields(key(3, 5) + bytes(4))) == [(3, 5, 0)]


def external(name: str, by: str = "location") -> onnx.TensorProto:
    """A tensor whose data is in ``weights.bin``: marked by data_location, or by its external_data entries only."""
    tensor = numpy_helper.from_array(np.arange(3, dtype=np.float32), name)
    tensor.ClearField("raw_data")
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "weights.bin"
    if by == "location":
        tensor.data_location = onnx.TensorProto.EXTERNAL
    return tensor


def model_with(graph_nodes=(), initializers=(), sparse=(), functions=()) -> onnx.ModelProto:
    graph = helper.make_graph(list(graph_nodes), "g", [], [], initializer=list(initializers), sparse_initializer=list(sparse))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
                             ir_version=8, functions=list(functions))


def test_external_data_is_found_in_every_place_a_tensor_can_be():
    inside = numpy_helper.from_array(np.arange(3, dtype=np.float32), "inside")
    sparse = helper.make_sparse_tensor(external("sv"), numpy_helper.from_array(np.array([0, 1, 2], np.int64), "si"), [3])
    sparse_index = helper.make_sparse_tensor(inside, external("sidx", by="entries"), [3])
    attribute_sparse = helper.make_sparse_tensor(external("asv"), numpy_helper.from_array(np.array([1], np.int64), "ai"), [3])
    subgraph = helper.make_graph([], "sub", [], [], initializer=[external("in_subgraph")])
    node = helper.make_node("Custom", ["x"], ["y"], domain="local", t=external("t"), tensors=[inside, external("ts")],
                            sparse=attribute_sparse, sparses=[attribute_sparse], g=subgraph, graphs=[subgraph, subgraph])
    function = helper.make_function("local", "F", ["x"], ["y"], [helper.make_node("Constant", [], ["y"], value=external("in_f"))],
                                    [helper.make_opsetid("", 17)])
    model = model_with([node], [inside, external("init"), external("by_entries", by="entries")], [sparse, sparse_index], [function])
    assert external_tensors(model.SerializeToString()) == [
        "in_subgraph", "in_subgraph", "in_subgraph", "asv", "asv", "t", "ts",  # the node's attributes (sorted by name)
        "init", "by_entries", "sv", "sidx", "in_f",  # initializers, sparse ones, then the model-local function
    ]
    assert external_tensors(model_with([], [inside]).SerializeToString()) == []


@pytest.mark.parametrize("count, more", [(1, ""), (2, " (and 1 more)"), (3, " (and 2 more)")])
def test_a_model_with_external_data_is_refused_naming_the_first_tensor_and_the_count(count, more):
    from nefl_zoo.manifest import ManifestError
    from nefl_zoo.runtime.session import check_self_contained

    model = model_with([], [external(f"w{i}") for i in range(count)]).SerializeToString()
    with pytest.raises(ManifestError) as refused:
        check_self_contained(model, "m.onnx")
    assert str(refused.value) == f"m.onnx: tensor w0{more} is stored as external data, which no hash covers (refused; export self-contained files)"
    check_self_contained(model_with([], []).SerializeToString(), "m.onnx")  # self-contained
    check_self_contained(b"\xff not protobuf", "m.onnx")  # left to onnxruntime's own error


def test_a_session_uses_the_providers_it_is_given():
    import onnxruntime as ort

    from nefl_zoo.runtime.session import session_from_bytes

    providers = tuple(ort.get_available_providers())  # this build's, CPU last; without a list onnxruntime takes CPU only
    if len(providers) < 2:
        pytest.skip("this onnxruntime build has no provider besides the CPU's")
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", 1, [1])],
                              [helper.make_tensor_value_info("y", 1, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    assert session_from_bytes(model, "m.onnx", providers).get_providers() == list(providers)


def test_external_data_is_found_whatever_the_field_order_and_unknown_fields():
    tensor = external("w").SerializeToString()
    unknown = b"\xf8\x06\x01"  # field 111, varint 1: skipped like any unknown field
    attribute = b"".join([key(1, 2), b"\x05value", b"\xa0\x01\x04", key(5, 2), bytes([len(tensor)]), tensor])  # type (20) before t
    node = key(4, 2) + b"\x08Constant" + key(5, 2) + bytes([len(attribute)]) + attribute
    graph = unknown + key(1, 2) + bytes([len(node)]) + node + key(5, 2) + bytes([len(tensor)]) + tensor
    model = b"\x08\x08" + key(7, 2) + bytes([len(graph)]) + graph
    assert external_tensors(model) == ["w", "w"]
    bad_utf8 = tensor.replace(b"\x42\x01w", b"\x42\x01\xff")  # name field 8: "w" -> one invalid byte
    assert external_tensors(b"\x08\x08" + key(7, 2) + bytes([len(bad_utf8) + 2]) + key(5, 2) + bytes([len(bad_utf8)]) + bad_utf8) == ["\ufffd"]
    nameless = onnx.TensorProto(data_location=onnx.TensorProto.EXTERNAL).SerializeToString()
    graph = key(5, 2) + bytes([len(nameless)]) + nameless
    assert external_tensors(key(7, 2) + bytes([len(graph)]) + graph) == ["<unnamed tensor>"]
    plain = numpy_helper.from_array(np.arange(2, dtype=np.float32), "v").SerializeToString()
    # field 13 as a varint (not an external_data entry); data_location DEFAULT; an unknown data_location
    for payload in (plain + b"\x68\x00", plain + b"\x70\x00", plain + b"\x70\x02"):
        graph = key(5, 2) + bytes([len(payload)]) + payload
        assert external_tensors(key(7, 2) + bytes([len(graph)]) + graph) == []


def test_an_unknown_field_is_not_read_as_a_tensor():
    """onnxruntime skips unknown fields, so a tensor hidden in one is never loaded: not reported."""
    hidden = external("hidden").SerializeToString()
    values = numpy_helper.from_array(np.arange(1, dtype=np.float32), "v").SerializeToString()
    sparse = key(1, 2) + bytes([len(values)]) + values + key(9, 2) + bytes([len(hidden)]) + hidden
    graph = key(15, 2) + bytes([len(sparse)]) + sparse + key(9, 2) + bytes([len(hidden)]) + hidden
    assert external_tensors(key(7, 2) + bytes([len(graph)]) + graph) == []

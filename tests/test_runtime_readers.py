"""The runtime's numpy-only readers: safetensors files, protobuf walks for external data and
initializer assembly, and slice materialization (no export needed)."""

import json
import re

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from nefl_zoo.runtime.arrays import ArrayFileError, parse_safetensors
from nefl_zoo.runtime.nested import Slice, materialize
from nefl_zoo.runtime.wire import external_tensors, with_initializers


def test_safetensors_reader_refuses_malformed_files():
    from safetensors.numpy import save

    good = save({"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 2), np.int8)}, metadata={"k": "v"})
    arrays, metadata = parse_safetensors(good)
    np.testing.assert_array_equal(arrays["a"], np.arange(4)) and metadata == {"k": "v"}
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    framed = lambda h, body: len(h).to_bytes(8, "little") + h + body  # noqa: E731
    cases = [
        (b"abc", "shorter than the 8-byte header length"),
        ((10**9).to_bytes(8, "little") + b"{}", "runs past the end"),
        (framed(b"not json", b""), "header is not JSON"),
        (framed(header, b"\0" * 4), "outside the 4 data bytes"),
        (framed(header, b"\0" * 12), "data bytes 8..12 belong to no tensor"),
        (framed(header.replace(b"F32", b"F64"), b"\0" * 8), "needs dtype"),
        (framed(header.replace(b"[2]", b"[3]"), b"\0" * 8), "does not fill data_offsets"),
    ]
    for data, message in cases:
        with pytest.raises(ArrayFileError, match=re.escape(message)):
            parse_safetensors(data)


def test_wire_walk_finds_external_data_anywhere_and_assembly_round_trips():
    weight = numpy_helper.from_array(np.arange(3, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["input", "w"], ["logits"])], "g",
        [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [None, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assembled = onnx.load_model_from_string(with_initializers(model.SerializeToString(), {"w": np.arange(3, dtype=np.float32)}))
    assert [t.name for t in assembled.graph.initializer] == ["w"]
    np.testing.assert_array_equal(numpy_helper.to_array(assembled.graph.initializer[0]), np.arange(3))
    assert external_tensors(assembled.SerializeToString()) == []
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

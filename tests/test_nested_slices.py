"""The exporter's slices (nefl_zoo/export/nested.py): the initializers they cut from the shared
tensors (ranges, index tensors, scale, cast, pad), each slice that does not fit refused in one
line."""

from __future__ import annotations

import numpy as np
import pytest

from nefl_zoo.export.nested import Slice, materialize

W = np.arange(30, dtype=np.float32).reshape(2, 5, 3)


def test_a_slice_is_cut_by_ranges_and_index_tensors_scaled_cast_and_padded():
    tier = {"~i": np.array([4, 0, 2], dtype=np.int64), "~s": np.array([2.0, -1.0], dtype=np.float32)}
    cut = Slice("w", "W", ((0, 2), "~i", (1, 3)), scale="~s", dtype="float16", pad=(3, 4, 2))
    out = materialize(cut, {"W": W}, tier)
    expected = np.zeros((3, 4, 2), np.float16)
    expected[:2, :3] = W[:, [4, 0, 2], 1:3] * np.array([2.0, -1.0], np.float32).reshape(2, 1, 1)
    assert out.dtype == np.float16 and np.array_equal(out, expected)
    plain = materialize(Slice("v", "W", (None, (1, 3), (0, 2))), {"W": W}, {})
    assert np.array_equal(plain, W[:, 1:3, :2]) and plain.flags["C_CONTIGUOUS"]  # written in order, not a view's strides
    empty = materialize(Slice("e", "W", (None, "~none", None)), {"W": W}, {"~none": np.zeros(0, np.int64)})
    assert empty.shape == (2, 0, 3)


@pytest.mark.parametrize("cut, tier, message", [
    (Slice("w", "nope", (None,)), {}, "w: shared tensor nope is not in the shared file"),
    (Slice("w", "W", (None, None)), {}, "w: 2 index dimensions for W of shape [2, 5, 3]"),
    (Slice("w", "W", (None, (0, 6), None)), {}, "w: index[1] [0, 6] runs past W's 5"),
    (Slice("w", "W", (None, "~i", None)), {}, "w: index[1] ~i is not a 1-D int64 tensor of the tier file"),
    (Slice("w", "W", (None, "~i", None)), {"~i": np.zeros((1, 2), np.int64)}, "w: index[1] ~i is not a 1-D int64 tensor of the tier file"),
    (Slice("w", "W", (None, "~i", None)), {"~i": np.zeros(2, np.int32)}, "w: index[1] ~i is not a 1-D int64 tensor of the tier file"),
    (Slice("w", "W", (None, "~i", None)), {"~i": np.array([5], np.int64)}, "w: index[1] ~i points outside W's 5"),
    (Slice("w", "W", (None, "~i", None)), {"~i": np.array([-1], np.int64)}, "w: index[1] ~i points outside W's 5"),
    (Slice("w", "W", (None, (1, 4), None), scale="~s"), {"~s": np.ones(3, np.float32)}, "w: scale ~s is not a tier tensor of 2 values"),
    (Slice("w", "W", (None, (1, 4), None), pad=(2, 2, 3)), {}, "w: pad [2, 2, 3] is smaller than its slice [2, 3, 3]"),
    (Slice("w", "W", (None, None, None), pad=(2, 5)), {}, "w: pad [2, 5] is smaller than its slice [2, 5, 3]"),
    (Slice("w", "W", (None, None, None), transpose=True), {}, "w: transpose of a 3-D slice (only 2-D slices are transposed)"),
])
def test_a_slice_that_does_not_fit_is_one_line(cut, tier, message):
    with pytest.raises(ValueError) as refused:
        materialize(cut, {"W": W}, tier)
    assert str(refused.value) == message


M = np.arange(24, dtype=np.float32).reshape(4, 6) - 7


def test_a_2d_slice_is_transposed_before_it_is_padded():
    cut = Slice("m", "M", ((1, 3), (0, 5)), transpose=True, pad=(6, 3))
    expected = np.zeros((6, 3), np.float32)
    expected[:5, :2] = M[1:3, :5].T
    assert np.array_equal(materialize(cut, {"M": M}, {}), expected)


def test_the_nested_models_branch_ops_cut_exactly_what_materialize_proves():
    """Every form of slice, built as ONNX ops in a branch and run by onnxruntime, gives the
    array :func:`materialize` gives (the exporter proves slices with materialize)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from nefl_zoo.export.nested import NestedEntry
    from nefl_zoo.export.nested_model import nested_model

    shared = {"W": W, "M": M, "H": M.astype(np.float16)}
    # a scale whose products fp16 cannot hold exactly: a half-precision cut is rounded after scaling, as materialize does
    tier = {"~i": np.array([4, 0, 2], np.int64), "~s": np.array([1.1, -0.3], np.float32), "~r": np.array([-1], np.int64)}
    cuts = [
        Slice("a", "W", ((0, 2), "~i", (1, 3)), scale="~s", pad=(3, 4, 2)),
        Slice("b", "W", (None, (1, 3), (0, 2))),
        Slice("c", "M", ((1, 3), (0, 5)), transpose=True, pad=(6, 3)),
        Slice("d", "M", (None, None)),
        Slice("e", "H", ((0, 2), None), scale="~s", dtype="float16"),
    ]
    flat = [helper.make_node("Reshape", [c.name, "~r"], [f"{c.name}/flat"]) for c in cuts]
    flat[-1].input[0] = "e/float"
    nodes = [helper.make_node("Cast", ["e"], ["e/float"], to=TensorProto.FLOAT), *flat,
             helper.make_node("Concat", [f"{c.name}/flat" for c in cuts] + ["input"], ["logits"], axis=0)]
    graph = helper.make_graph(nodes, "tier", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None])])
    tier_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    entry = NestedEntry("t", tier_model, {"~r": tier["~r"], **tier}, ("~r",), tuple(cuts))
    model = nested_model([entry, entry], shared, {})
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString())
    expected = np.concatenate([materialize(c, shared, tier).astype(np.float32).ravel() for c in cuts] + [np.zeros(1, np.float32)])
    for index in (0, 1, -1):
        out = session.run(None, {"input": np.zeros(1, np.float32), "tier": np.array(index, np.int64)})[0]
        np.testing.assert_array_equal(out, expected)

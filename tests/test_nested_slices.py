"""The exporter's slices (nefl_zoo/export/nested.py): the initializers they cut from the shared
tensors (ranges, index tensors, scale, cast, pad), each slice that does not fit refused in one
line."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save

from nefl_zoo.export.nested import Slice, materialize

ARRAYS = {"head.bias": np.arange(3, dtype=np.float32), "~index/head": np.array([0, 2], dtype=np.int64),
          "~scale/conv": np.ones(4, dtype=np.float32)}
SLICES = [
    Slice("conv.weight", "conv.weight", ((0, 4), None, (0, 3), (0, 3)), scale="~scale/conv", dtype="float16", pad=(8, 0, 3, 3)),
    Slice("head.weight", "head.weight", ((0, 3), "~index/head")),
]


def tier_file(metadata: dict[str, str], arrays=ARRAYS) -> bytes:
    return save(dict(arrays), metadata=metadata)


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
])
def test_a_slice_that_does_not_fit_is_one_line(cut, tier, message):
    with pytest.raises(ValueError) as refused:
        materialize(cut, {"W": W}, tier)
    assert str(refused.value) == message

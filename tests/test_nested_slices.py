"""A nested package's per-tier file (nefl_zoo/runtime/nested.py): its slice map written and read
back in every form, each malformed map refused in one line naming the file and the field, and
the initializers its slices cut from the shared tensors (ranges, index tensors, scale, cast,
pad), each slice that does not fit refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save

from nefl_zoo.manifest import ManifestError
from nefl_zoo.runtime.nested import SLICES_KEY, Slice, materialize, parse_tier_file, tier_metadata

ARRAYS = {"head.bias": np.arange(3, dtype=np.float32), "~index/head": np.array([0, 2], dtype=np.int64),
          "~scale/conv": np.ones(4, dtype=np.float32)}
SLICES = [
    Slice("conv.weight", "conv.weight", ((0, 4), None, (0, 3), (0, 3)), scale="~scale/conv", dtype="float16", pad=(8, 0, 3, 3)),
    Slice("head.weight", "head.weight", ((0, 3), "~index/head")),
]


def tier_file(metadata: dict[str, str], arrays=ARRAYS) -> bytes:
    return save(dict(arrays), metadata=metadata)


def test_a_slice_map_of_every_form_reads_back_as_written():
    metadata = tier_metadata(["head.bias"], SLICES)
    assert json.loads(metadata[SLICES_KEY])["slices"][1] == {"name": "head.weight", "shared": "head.weight",
                                                              "index": [[0, 3], "~index/head"]}
    tier = parse_tier_file(tier_file(metadata), "t.tensors.safetensors")
    assert tier.literals == ("head.bias",) and tier.slices == tuple(SLICES)
    assert tier.arrays.keys() == ARRAYS.keys() and all(np.array_equal(tier.arrays[k], v) for k, v in ARRAYS.items())


def slices(*items, literals=("head.bias",)) -> dict[str, str]:
    return {SLICES_KEY: json.dumps({"literals": list(literals), "slices": list(items)})}


GOOD = {"name": "conv.weight", "shared": "conv.weight", "index": [[0, 4], None]}


@pytest.mark.parametrize("metadata, message", [
    ({}, "nefl_zoo.slices: missing or not the slice map's JSON (KeyError)"),
    ({SLICES_KEY: "[1]"}, "nefl_zoo.slices: missing or not the slice map's JSON (TypeError)"),
    ({SLICES_KEY: "{"}, "nefl_zoo.slices: missing or not the slice map's JSON (JSONDecodeError)"),
    ({SLICES_KEY: json.dumps({"literals": "head.bias", "slices": []})}, "nefl_zoo.slices: expected {literals: [names], slices: [...]}"),
    (slices({"name": "a", "shared": "a"}), "nefl_zoo.slices: slices[0]: expected name, shared, index and optionally scale, dtype, pad"),
    (slices(GOOD, {**GOOD, "name": "b", "colour": 1}),
     "nefl_zoo.slices: slices[1]: expected name, shared, index and optionally scale, dtype, pad"),
    (slices({**GOOD, "index": "all"}), "nefl_zoo.slices: slices[0].index: expected a list"),
    (slices({**GOOD, "index": [[3, 1]]}), "nefl_zoo.slices: slices[0].index[0]: expected [start, stop], an index tensor's name or null"),
    (slices({**GOOD, "index": [None, [0.5, 2]]}), "nefl_zoo.slices: slices[0].index[1]: expected [start, stop], an index tensor's name or null"),
    (slices({**GOOD, "index": [[False, True]]}), "nefl_zoo.slices: slices[0].index[0]: expected [start, stop], an index tensor's name or null"),
    (slices({**GOOD, "pad": [4, -1]}), "nefl_zoo.slices: slices[0].pad: expected a shape"),
    (slices({**GOOD, "dtype": "int8"}), "nefl_zoo.slices: slices[0].dtype: expected float32 or float16"),
    (slices({**GOOD, "name": 3}), "nefl_zoo.slices: slices[0]: name, shared and scale must be strings"),
    (slices({**GOOD, "scale": 2.0}), "nefl_zoo.slices: slices[0]: name, shared and scale must be strings"),
    (slices(GOOD, literals=["head.bias", "nope"]), "nefl_zoo.slices: literal nope is not a tensor of the file"),
    (slices(GOOD, {**GOOD, "shared": "other"}), "nefl_zoo.slices: an initializer is named twice"),
])
def test_a_malformed_slice_map_is_one_line_naming_the_file_and_field(metadata, message):
    with pytest.raises(ManifestError) as refused:
        parse_tier_file(tier_file(metadata), "t.tensors.safetensors")
    assert str(refused.value) == f"t.tensors.safetensors: {message}"


def test_bytes_that_are_no_tensors_file_are_refused():
    with pytest.raises(ManifestError, match=r"^t\.tensors\.safetensors: not a valid tensors file \(.+\)$"):
        parse_tier_file(b"\x08\x00\x00\x00\x00\x00\x00\x00{}", "t.tensors.safetensors")


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

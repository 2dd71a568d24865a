"""A nested package's per-tier file (nefl_zoo/runtime/nested.py): its slice map written and read
back in every form, and each malformed map refused in one line naming the file and the field."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save

from nefl_zoo.manifest import ManifestError
from nefl_zoo.runtime.nested import SLICES_KEY, Slice, parse_tier_file, tier_metadata

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

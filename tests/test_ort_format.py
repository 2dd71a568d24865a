"""The nested model converts to onnxruntime's own ORT format (``.ort``, what onnxruntime's
minimal and mobile builds load) with onnxruntime's converter, and the ``.ort`` file serves every
tier with the ``.onnx`` file's logits.

``python -m onnxruntime.tools.convert_onnx_models_to_ort --optimization_style Fixed`` (the
style onnxruntime recommends for the CPU provider) runs the session's graph optimizations before
saving, so it folds each tier's slices of the shared weights into constants: the ``.ort`` file
holds every tier's weights (for the test export's FP32 model about 1.8x the ``.onnx`` file's
bytes), the tier input, the ``If`` branches, the out-of-range guard and the tier table in the
metadata all survive.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from nefl_zoo.runtime.nested import METADATA_KEY, TIER_INPUT


TOLERANCE = 1e-5  # max |logit difference|; measured: 0 for FP32 and INT8 on x86-64 (Fixed style)


def _target_platform() -> str:
    return "arm" if platform.machine().lower() in ("arm64", "aarch64") else "amd64"


@pytest.fixture(scope="module")
def converted(tmp_path_factory, nested_export_dir) -> tuple[Path, Path]:
    """The test export (FP32, INT8) and its nested models converted to ``.ort`` in one run."""
    folder = nested_export_dir
    out = tmp_path_factory.mktemp("ort")
    done = subprocess.run(
        [sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", "--optimization_style", "Fixed",
         "--target_platform", _target_platform(), "--output_dir", str(out), str(folder)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return folder, out


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_every_tier_of_the_ort_file_gives_the_onnx_files_logits(converted):
    folder, out = converted
    manifest = json.loads((folder / "manifest.json").read_text())
    spec = manifest["input"]
    images = np.random.default_rng(1).standard_normal((5, *spec["shape"])).astype(np.float32)
    files = sorted({entry["file"] for entry in manifest["tiers"]})
    assert files == ["nested.fp32.onnx", "nested.int8.onnx"]
    for file in files:
        ort_file = out / Path(file).with_suffix(".ort").name
        assert ort_file.is_file(), sorted(p.name for p in out.iterdir())
        onnx_session, ort_session = _session(folder / file), _session(ort_file)
        assert [(i.name, i.type) for i in ort_session.get_inputs()] == [(i.name, i.type) for i in onnx_session.get_inputs()]
        assert ort_session.get_modelmeta().custom_metadata_map[METADATA_KEY] == \
            onnx_session.get_modelmeta().custom_metadata_map[METADATA_KEY]  # the tier table travels
        entries = [entry for entry in manifest["tiers"] if entry["file"] == file]
        assert sorted(entry["index"] for entry in entries) == list(range(3))
        logits = {}
        for entry in entries:
            feed = {spec["name"]: images, TIER_INPUT: np.array(entry["index"], np.int64)}
            expected = onnx_session.run(None, feed)[0]
            got = ort_session.run(None, feed)[0]
            assert got.shape == (len(images), manifest["output"]["num_classes"])
            diff = float(np.abs(got - expected).max())
            assert diff <= TOLERANCE, f"{file} tier {entry['name']}: max |logit difference| {diff:.3g}"
            logits[entry["index"]] = got
        assert not np.allclose(logits[0], logits[2])  # the tier input really picks another branch


def test_the_ort_file_refuses_a_tier_outside_the_table(converted):
    folder, out = converted
    session = _session(out / "nested.fp32.ort")
    images = np.zeros((1, 1, 16, 16), np.float32)
    with pytest.raises(Exception, match="tier_out_of_range"):
        session.run(None, {"input": images, TIER_INPUT: np.array(3, np.int64)})
    # negative values count from the end, as in the .onnx file
    last = session.run(None, {"input": images, TIER_INPUT: np.array(-1, np.int64)})[0]
    np.testing.assert_array_equal(last, session.run(None, {"input": images, TIER_INPUT: np.array(2, np.int64)})[0])

"""The nested models in onnxruntime's ORT format (``nefl-zoo convert-ort``, :mod:`nefl_zoo.
export.mobile`): every tier of each ``.ort`` file gives its ``.onnx`` file's logits, the compact
style stores the shared weights once (onnxruntime's own converter folds every tier's cuts into
constants: 1.8x the ``.onnx`` file here, 3.5x on the demo), and bad input is one line.

These tests fail on a tree without the command: there was no way to write a nested ``.ort``
file but onnxruntime's converter, whose file holds every tier's weights.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from nefl_zoo.export.mobile import CONFIG_NAME, SOURCE_KEY, convert_to_ort, unfolded
from nefl_zoo.manifest import file_sha256, load_manifest
from nefl_zoo.runtime.nested import METADATA_KEY, TIER_INPUT
from nefl_zoo_cli.app import app

FILES = ["nested.fp32.ort", "nested.int8.ort"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, nested_export_dir):
    """The shared test export (FP32, INT8) converted in both styles, through the CLI."""
    out = {}
    for style in ("compact", "folded"):
        out[style] = tmp_path_factory.mktemp(style)
        result = CliRunner().invoke(app, ["convert-ort", str(nested_export_dir), "--out", str(out[style]), "--style", style,
                                          "--threads", "1", "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert [f["file"] for f in report["files"]] == FILES and report["config"] == CONFIG_NAME
    return nested_export_dir, out


def session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("style", ["compact", "folded"])
def test_every_tier_of_the_ort_file_gives_the_onnx_files_logits(converted, style):
    folder, out = converted
    manifest = load_manifest(folder)
    images = np.random.default_rng(1).standard_normal((5, *manifest.input.shape)).astype(np.float32)
    for file in FILES:
        onnx_session, ort_session = session(folder / file.replace(".ort", ".onnx")), session(out[style] / file)
        assert [(i.name, i.type) for i in ort_session.get_inputs()] == [(i.name, i.type) for i in onnx_session.get_inputs()]
        metadata = ort_session.get_modelmeta().custom_metadata_map
        assert metadata[METADATA_KEY] == onnx_session.get_modelmeta().custom_metadata_map[METADATA_KEY]  # the tier table travels
        assert metadata[SOURCE_KEY] == file_sha256(folder / file.replace(".ort", ".onnx"))
        logits = []
        for entry in (e for e in manifest.tiers if e.file == file.replace(".ort", ".onnx")):
            feed = {manifest.input.name: images, TIER_INPUT: np.array(entry.index, np.int64)}
            expected, got = onnx_session.run(None, feed)[0], ort_session.run(None, feed)[0]
            if entry.precision == "int8":
                np.testing.assert_array_equal(got, expected, err_msg=entry.label)
            else:  # other kernels (no NCHWc layout for ARM): the same logits up to float rounding
                np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0, err_msg=entry.label)
            logits.append(got)
        assert not np.allclose(logits[0], logits[-1])  # the tier input really picks another branch


def test_the_compact_file_keeps_one_copy_of_the_shared_weights(converted):
    """Compact: about the ``.onnx`` file's bytes (the tiers' graphs are stored once per tier, the
    ORT format has no functions); folded, as onnxruntime's converter writes it: every tier's
    weights. A session of the compact file runs its cuts (no constant folding at load: what
    keeps it small in memory too)."""
    folder, out = converted
    for file in FILES:
        source = (folder / file.replace(".ort", ".onnx")).stat().st_size
        compact, folded = (out["compact"] / file).stat().st_size, (out["folded"] / file).stat().st_size
        assert compact <= (1.15 if "fp32" in file else 1.7) * source < folded, (file, compact, folded, source)
    config = (out["compact"] / CONFIG_NAME).read_text()
    assert config.startswith("# Generated from model/s:\n# - nested.fp32.ort\n# - nested.int8.ort\n")
    ops = {op for line in config.splitlines() if not line.startswith("#") for op in line.split(";")[2].split(",")}
    assert {"If", "Less", "Gather", "Slice", "QLinearConv"} <= ops


def test_unfolded_drops_the_concats_that_make_a_whole_tensor_a_constant(nested_export_dir):
    import onnx

    from .support.exports import graphs

    model = onnx.load(nested_export_dir / "nested.fp32.onnx")
    concats = lambda m: [n for g in graphs(m) for n in g.node if n.op_type == "Concat" and len(n.input) == 1]  # noqa: E731
    assert concats(model) and not concats(unfolded(model))
    x = {"input": np.random.default_rng(0).standard_normal((2, 1, 16, 16), dtype=np.float32)}
    a, b = session(nested_export_dir / "nested.fp32.onnx"), ort.InferenceSession(unfolded(model).SerializeToString())
    for tier in range(3):
        feed = {**x, "tier": np.array(tier, np.int64)}
        np.testing.assert_array_equal(a.run(None, feed)[0], b.run(None, feed)[0])


def test_the_ort_file_refuses_a_tier_outside_the_table(converted):
    folder, out = converted
    s = session(out["compact"] / "nested.fp32.ort")
    images = np.zeros((1, 1, 16, 16), np.float32)
    with pytest.raises(Exception, match="tier_out_of_range"):
        s.run(None, {"input": images, TIER_INPUT: np.array(3, np.int64)})
    last = s.run(None, {"input": images, TIER_INPUT: np.array(-1, np.int64)})[0]  # from the end, as in the .onnx file
    np.testing.assert_array_equal(last, s.run(None, {"input": images, TIER_INPUT: np.array(2, np.int64)})[0])


def test_bad_input_is_one_line(nested_export_dir, tmp_path):
    runner = CliRunner()
    copy = shutil.copytree(nested_export_dir, tmp_path / "export")
    manifest = json.loads((copy / "manifest.json").read_text())
    files = tmp_path / "files"
    files.mkdir()
    (files / "manifest.json").write_text(json.dumps({**manifest, "format": "files",
                                                     "tiers": [{**t, "index": None} for t in manifest["tiers"]][:1]}))
    data = bytearray((copy / "nested.int8.onnx").read_bytes())
    data[len(data) // 2] ^= 1
    (copy / "nested.int8.onnx").write_bytes(bytes(data))
    (tmp_path / "a-file").write_text("")
    for args, message in [
        ([str(files)], "format: files; convert-ort converts nested models (export --format nested)"),
        ([str(copy)], "nested.int8.onnx: sha256"),
        ([str(nested_export_dir), "--out", str(tmp_path / "a-file")], "a-file is a file; convert-ort writes a folder"),
        ([str(nested_export_dir), "--style", "tiny"], "--style: expected compact or folded, got 'tiny'"),
    ]:
        result = runner.invoke(app, ["convert-ort", *args, "--out", str(tmp_path / "out")] if "--out" not in args else ["convert-ort", *args])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert not (tmp_path / "out" / "nested.fp32.ort").exists()  # nothing written when a file fails

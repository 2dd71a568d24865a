"""`nefl-zoo export / select / predict / bench-tiers`: outputs and exit codes."""

import json
import re
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from nefl_zoo.manifest import load_manifest
from nefl_zoo_cli.app import app

runner = CliRunner()

SPEC = {
    "model": "resnet20",
    "tiers": [
        {"name": "g0.25", "gamma_w": 0.25, "steps": [[1, 0, 1], [0, 1, 1], [1, 1, 0]]},
        {"name": "g0.5", "gamma_w": 0.5},
        {"name": "g1", "gamma": 1.0},
    ],
}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, code, message):
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "resnet20.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    return path


@pytest.fixture(scope="module")
def export_dir(spec_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports") / "resnet20"
    result = invoke("export", spec_file, "--out", out, "--tiers", "g0.25,g1", "--dataset", "cifar10", "--latency-runs", "2")
    assert result.exit_code == 0, result.output
    assert f"wrote {out / 'manifest.json'}" in result.stdout
    return out


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
    return path


def test_export_writes_only_the_requested_tiers(export_dir):
    manifest = load_manifest(export_dir)
    assert [t.name for t in manifest.tiers] == ["g0.25", "g1"]
    assert manifest.format == "nested"  # the default
    assert sorted(p.name for p in export_dir.iterdir() if not p.name.startswith(".")) == ["manifest.json", "nested.fp32.onnx"]
    assert [t.index for t in manifest.tiers] == [0, 1]
    assert manifest.class_names[0] == "airplane"


def test_export_with_a_fixed_batch(spec_file, tmp_path, image):
    out = tmp_path / "fixed"
    (out / ".export-killed").mkdir(parents=True)  # what an export killed mid-way leaves behind
    (out / ".export-killed" / ".lock").write_text("")
    result = invoke("export", spec_file, "--out", out, "--tiers", "g0.25", "--no-batch-dynamic", "--batch", "2", "--latency-runs", "1",
                    "--format", "files")
    assert result.exit_code == 0, result.output
    manifest = load_manifest(out)
    assert manifest.input.batch == 2 and manifest.tiers[0].latency.batch == 2
    assert sorted(p.name for p in out.iterdir()) == ["g0.25.onnx", "manifest.json"]  # the stale staging folder is gone
    session = ort.InferenceSession(str(out / "g0.25.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [2, 3, 32, 32]
    result = invoke("predict", out, image, image, image, "--top-k", "1")  # 3 images: padded to 2 + 2
    assert result.exit_code == 0, result.output
    assert result.stdout.count("(tier g0.25):") == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tiers", "g0.25,huge"], "unknown tier 'huge'; tiers: g0.25, g0.5, g1"),
        (["--dataset", "digits"], "--dataset: expected cifar10, cifar100, svhn, cinic10, imagefolder, mnist, fashionmnist, kmnist or emnist, got 'digits'"),
        (["--batch", "0"], "--batch: must be >= 1"),
        (["--opset", "17"], "opset: the torch.export-based exporter writes opset 18 or later, got 17"),
    ],
)
def test_export_bad_options(spec_file, tmp_path, args, message):
    assert_one_line_error(invoke("export", spec_file, "--out", tmp_path / "x", *args), 2, message)
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_export_bad_sources(tmp_path):
    assert_one_line_error(invoke("export", tmp_path / "nope.yaml", "--out", tmp_path / "x"), 2, "no such spec file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: resnet20\ntiers: [{name: a, gamma_w: 2}]\n")
    assert_one_line_error(invoke("export", bad, "--out", tmp_path / "x"), 2, "tiers[0].gamma_w: must be in (0, 1]")
    assert_one_line_error(invoke("export", tmp_path, "--out", tmp_path / "x"), 2, "spec.yaml: missing")


def test_select_prints_the_tier_and_why(export_dir):
    small_macs = load_manifest(export_dir).tier("g0.25").macs
    result = invoke("select", export_dir / "manifest.json", "--max-macs", small_macs, "--json")
    assert result.exit_code == 0, result.output
    choice = json.loads(result.stdout)
    assert choice["tier"] == "g0.25" and choice["fitting"] == ["g0.25"]
    result = invoke("select", export_dir, "--max-params", 1e9)
    assert result.exit_code == 0 and result.stdout.startswith("g1: largest")


def test_select_exit_codes(export_dir, tmp_path):
    assert_one_line_error(invoke("select", export_dir, "--latency-ms", 1e-9), 1, "no tier fits latency <= 1e-09 ms")
    assert_one_line_error(invoke("select", tmp_path / "missing.json"), 2, "cannot read the manifest")
    future = tmp_path / "manifest.json"
    future.write_text(json.dumps(json.loads((export_dir / "manifest.json").read_text()) | {"schema_version": 9}))
    assert_one_line_error(invoke("select", future), 2, "schema_version: unsupported version 9")


def test_predict_prints_top_k_classes(export_dir, image):
    result = invoke("predict", export_dir, image, "--tier", "g0.25", "--top-k", "3")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"{image} (tier g0.25):" and len(lines) == 4
    probs = [float(line.split()[0]) for line in lines[1:]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    classes = load_manifest(export_dir).class_names
    assert all(line.split()[1] in classes for line in lines[1:])
    auto = invoke("predict", export_dir, image)
    assert auto.exit_code == 0 and auto.stdout.startswith(f"{image} (tier g1):")
    assert len(auto.stdout.splitlines()) == 6


@pytest.mark.parametrize(
    "size, mode, message",
    [
        ((28, 32), "RGB", "image is 28x32 RGB; the model takes 32x32 RGB"),
        ((32, 32), "RGBA", "image is 32x32 RGBA; the model takes 32x32 RGB"),
        ((32, 32), "L", "image is 32x32 L"),
    ],
)
def test_predict_refuses_wrong_size_or_mode(export_dir, tmp_path, size, mode, message):
    path = tmp_path / "wrong.png"
    Image.new(mode, size).save(path)
    assert_one_line_error(invoke("predict", export_dir, path), 2, message)


def test_predict_refuses_unreadable_images_and_unknown_tiers(export_dir, tmp_path, image):
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    assert_one_line_error(invoke("predict", export_dir, text), 2, "notes.png: not a readable image")
    assert_one_line_error(invoke("predict", export_dir, image, "--tier", "g0.5"), 2, "unknown tier 'g0.5'; tiers: g0.25, g1")


@pytest.mark.parametrize("tamper, message", [
    (lambda data: data[:100] + bytes([data[100] ^ 1]) + data[101:], r"nested.fp32.onnx: sha256 \w+\.\.\. does not match"),
    (lambda data: data + b"\0", r"nested.fp32.onnx: (\d+) bytes, but the manifest declares (\d+) "),
])
def test_predict_refuses_a_tampered_tier(export_dir, tmp_path, image, tamper, message):
    copy = shutil.copytree(export_dir, tmp_path / "copy")
    (copy / "nested.fp32.onnx").write_bytes(tamper((copy / "nested.fp32.onnx").read_bytes()))
    result = invoke("predict", copy, image, "--tier", "g1")
    assert_one_line_error(result, 2, "nested.fp32.onnx: ")
    assert re.search(message, result.stderr), result.stderr
    assert invoke("predict", export_dir, image, "--tier", "g0.25").exit_code == 0


def test_bench_tiers_measures_every_tier(export_dir):
    result = invoke("bench-tiers", export_dir, "--batch", "2", "--runs", "2")
    assert result.exit_code == 0, result.output
    assert "g0.25" in result.stdout and "g1" in result.stdout and "batch 2: median of 2 runs" in result.stdout
    assert_one_line_error(invoke("bench-tiers", export_dir, "--batch", "0"), 2, "must be >= 1")


# ---- one line, exit 2, before any work (issue 12) ----------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["--latency-ms", "-1"], "--latency-ms: must be a finite number >= 0, got -1"),
        (["--max-macs", "nan"], "--max-macs: must be a finite number >= 0, got nan"),
        (["--max-memory-mb", "-0.5"], "--max-memory-mb: must be a finite number >= 0"),
        (["--max-memory-mb", "8", "--batch", "-3"], "--batch: must be >= 1, got -3"),
    ],
)
def test_select_refuses_negative_or_nan_budgets(export_dir, args, message):
    assert_one_line_error(invoke("select", export_dir, *args), 2, message)


def test_impossible_batches_are_refused_before_any_work(export_dir, spec_file, tmp_path):
    huge = ["--batch", "1000000000"]
    result = invoke("bench-tiers", export_dir, *huge, "--runs", "1")
    assert_one_line_error(result, 2, "batch 1000000000: needs about")
    assert "use a batch of at most" in result.stderr
    assert_one_line_error(invoke("export", spec_file, "--out", tmp_path / "x", *huge), 2, "batch 1000000000: needs about")
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_export_out_must_be_a_folder(spec_file, tmp_path):
    (tmp_path / "file").write_text("keep me")
    assert_one_line_error(invoke("export", spec_file, "--out", tmp_path / "file"), 2, "is a file; export writes a folder")
    assert (tmp_path / "file").read_text() == "keep me"


def png_declaring(width, height):
    """A small PNG file whose header declares ``width`` x ``height`` pixels (data truncated)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    "size, message",
    [
        ((100_000, 100_000), "image declares more pixels than PIL decodes safely"),  # PIL's DecompressionBombError
        ((10_000, 10_000), "image declares more pixels than PIL decodes safely"),  # PIL's DecompressionBombWarning
        ((4_000, 4_000), "image is 4000x4000 RGB; the model takes 32x32 RGB"),  # refused before decoding
    ],
)
def test_predict_refuses_decompression_bombs_from_the_header(export_dir, tmp_path, size, message):
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_declaring(*size))
    assert bomb.stat().st_size < 200
    assert_one_line_error(invoke("predict", export_dir, bomb), 2, message)


def test_stale_staging_folders_of_killed_exports_are_removed(tmp_path):
    import fcntl

    from nefl_zoo.export.staging import remove_stale_staging

    dead, live = tmp_path / ".export-dead", tmp_path / ".export-live"
    for folder in (dead, live):
        folder.mkdir()
        (folder / ".lock").write_text("")
        (folder / "g1.onnx").write_bytes(b"partial")
    with open(live / ".lock") as held:  # a running export holds its lock; a killed one's was released
        fcntl.flock(held, fcntl.LOCK_EX)
        assert remove_stale_staging(tmp_path) == [dead]
    assert not dead.exists() and (live / "g1.onnx").exists()

"""The torch-free tier runtime: sessions, integrity checks, manifest errors and selection."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from nefl_zoo.export import ExportSource, export_tiers
from nefl_zoo.manifest import ManifestError, file_sha256, load_manifest
from nefl_zoo.runtime import NoTierFits, TierRuntime
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec

SPEC = {
    "model": "resnet20",
    "tiers": [
        {"name": "small", "gamma_w": 0.25, "steps": [[1, 0, 1], [0, 1, 1], [1, 1, 0]]},
        {"name": "full"},
    ],
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    compiled = compile_spec(parse_spec(SPEC))
    state = compiled.init_global_state()
    out = tmp_path_factory.mktemp("export")
    source = ExportSource(compiled, state, "test", accuracy={"small": 0.7, "full": 0.8})
    export_tiers(source, out, latency_runs=2)
    return compiled, state, out


@pytest.fixture
def export_copy(exported, tmp_path):
    """A private copy of the export that a test may tamper with."""
    shutil.copytree(exported[2], tmp_path / "export")
    return tmp_path / "export"


def write_manifest(directory, tiers):
    """A copy of the exported manifest whose tiers have the given costs and accuracies."""
    manifest = load_manifest(directory)
    template = manifest.tiers[0]
    entries = []
    for name, macs, params, accuracy, latency_ms, weights_mb, act_mb in tiers:
        latency = template.latency.model_copy(update={"median_ms": latency_ms})
        entries.append(
            template.model_copy(
                update=dict(
                    name=name, macs=macs, params=params, accuracy=accuracy, latency=latency,
                    weights_mb=weights_mb, activation_mb_per_sample=act_mb,
                )
            )
        )
    path = directory / "costs.json"
    path.write_text(manifest.model_copy(update={"tiers": entries}).model_dump_json())
    return path


def test_runtime_imports_without_torch():
    code = "import sys, nefl_zoo.runtime, nefl_zoo.manifest; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_run_matches_pytorch_and_keeps_sessions_cached(exported):
    compiled, state, out = exported
    runtime = TierRuntime(out / "manifest.json")
    x = torch.randn(3, 3, 32, 32)
    for tier in ("small", "full", "small"):
        with torch.no_grad():
            expected = compiled[tier].load(state).eval()(x).numpy()
        assert np.abs(runtime.run(x.numpy(), tier) - expected).max() <= 1e-4
    sessions = {tier: runtime.session(tier) for tier in ("small", "full")}
    assert all(runtime.session(tier) is session for tier, session in sessions.items())


def test_auto_follows_the_latest_selection(exported):
    _, _, out = exported
    runtime = TierRuntime(out)
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)
    assert runtime.selection.tier == "full"  # most accurate without a budget
    np.testing.assert_array_equal(runtime.run(x), runtime.run(x, "full"))
    small_macs = runtime.manifest.tier("small").macs
    assert runtime.select(max_macs=small_macs).tier == "small"
    np.testing.assert_array_equal(runtime.run(x), runtime.run(x, "small"))


def test_tampered_file_is_refused_before_loading(export_copy):
    data = bytearray((export_copy / "small.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (export_copy / "small.onnx").write_bytes(bytes(data))
    runtime = TierRuntime(export_copy)
    x = np.zeros((1, 3, 32, 32), np.float32)
    with pytest.raises(ManifestError, match=r"small.onnx: sha256 [0-9a-f]{12}\.\.\. does not match the manifest's"):
        runtime.run(x, "small")
    assert runtime.run(x, "full").shape == (1, 10)  # the other tier is intact


def test_corrupt_file_with_a_matching_hash_is_a_clear_error(export_copy):
    (export_copy / "small.onnx").write_bytes(b"not an onnx model")
    manifest = json.loads((export_copy / "manifest.json").read_text())
    manifest["tiers"][0]["sha256"] = file_sha256(export_copy / "small.onnx")
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="small.onnx: onnxruntime cannot load the model"):
        TierRuntime(export_copy).session("small")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("schema_version"), "schema_version: required key is missing"),
        (lambda m: m.update(schema_version=2), "schema_version: unsupported version 2"),
        (lambda m: m["tiers"][1].pop("sha256"), r"tiers\[1\].sha256: required key is missing"),
        (lambda m: m["input"].update(shape="32x32"), r"input.shape: Input should be a valid list"),
        (lambda m: m.update(tiers=[]), "tiers: List should have at least 1 item"),
    ],
)
def test_bad_manifest_names_the_field(export_copy, edit, message):
    manifest = json.loads((export_copy / "manifest.json").read_text())
    edit(manifest)
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=message) as info:
        TierRuntime(export_copy / "manifest.json")
    assert "\n" not in str(info.value) and str(info.value).startswith(str(export_copy / "manifest.json"))


def test_manifest_that_is_not_json(export_copy):
    (export_copy / "manifest.json").write_text("{\n  'tiers': }")
    with pytest.raises(ManifestError, match=r"manifest.json: not valid JSON \(line 2"):
        TierRuntime(export_copy)


def test_unknown_tier_and_bad_batches_are_refused(exported):
    runtime = TierRuntime(exported[2])
    with pytest.raises(KeyError, match="unknown tier 'medium'; tiers: small, full"):
        runtime.run(np.zeros((1, 3, 32, 32), np.float32), "medium")
    with pytest.raises(ValueError, match=r"input shape \(1, 3, 28, 28\) != \(batch, 3, 32, 32\)"):
        runtime.run(np.zeros((1, 3, 28, 28), np.float32))
    with pytest.raises(ValueError, match="floating point"):
        runtime.run(np.zeros((1, 3, 32, 32), np.uint8))
    assert runtime.run(np.zeros((2, 3, 32, 32), np.float64)).dtype == np.float32


# name, macs, params, accuracy, latency_ms, weights_mb, activation_mb_per_sample
COSTS = [
    ("a", 10, 100, 0.70, 1.0, 1.0, 0.5),
    ("b", 20, 200, 0.90, 2.0, 2.0, 1.0),
    ("c", 40, 400, 0.85, 4.0, 4.0, 2.0),
]


@pytest.mark.parametrize(
    "budget, tier",
    [
        ({}, "b"),  # most accurate, although c is larger
        ({"latency_ms": 1.5}, "a"),
        ({"latency_ms": 3.0}, "b"),
        ({"max_macs": 39}, "b"),
        ({"max_params": 150}, "a"),
        ({"max_memory_mb": 3.0}, "b"),  # b: 2 + 1 x 1
        ({"max_memory_mb": 3.0, "batch": 2}, "a"),  # b: 2 + 1 x 2 = 4 > 3
        ({"latency_ms": 10, "max_params": 199}, "a"),
    ],
)
def test_select_most_accurate_within_budget(export_copy, budget, tier):
    runtime = TierRuntime(write_manifest(export_copy, COSTS))
    assert runtime.select(**budget).tier == tier


def test_select_without_accuracy_takes_the_largest_and_explains(export_copy):
    costs = [c[:3] + (None,) + c[4:] for c in COSTS]
    choice = TierRuntime(write_manifest(export_copy, costs)).select(latency_ms=3.0)
    assert choice.tier == "b" and choice.fitting == ("a", "b")
    assert choice.reason.startswith("b: largest (20 MACs; accuracy not measured for every tier) of 2/3 tiers")
    assert "within latency <= 3 ms" in choice.reason


def test_select_reports_when_nothing_fits(export_copy):
    runtime = TierRuntime(write_manifest(export_copy, COSTS))
    with pytest.raises(NoTierFits, match="no tier fits latency <= 0.5 ms and MACs <= 5; the smallest, a, needs latency 1, MACs 10"):
        runtime.select(latency_ms=0.5, max_macs=5)
    assert runtime.selection.tier == "b"  # a failed select leaves the previous choice


def test_memory_estimate_is_weights_plus_activations_per_sample(exported):
    tier = load_manifest(exported[2]).tier("full")
    assert tier.memory_mb(4) == pytest.approx(tier.weights_mb + 4 * tier.activation_mb_per_sample)


# ---- what is verified is what runs (issue 12, class 5) --------------------------------------
def small_logits(exported, x):
    compiled, state, _ = exported
    with torch.no_grad():
        return compiled["small"].load(state).eval()(torch.from_numpy(x)).numpy()


def test_a_tier_swapped_after_its_hash_check_is_not_run(exported, export_copy, monkeypatch):
    """The file is replaced between the sha256 check and onnxruntime's load: the session
    still runs the verified bytes (onnxruntime gets bytes, never the path)."""
    import onnxruntime as ort

    import nefl_zoo.runtime as runtime_module

    real = ort.InferenceSession

    def swap_then_load(model, *args, **kwargs):
        (export_copy / "small.onnx").write_bytes((export_copy / "full.onnx").read_bytes())
        return real(model, *args, **kwargs)

    monkeypatch.setattr(runtime_module.ort, "InferenceSession", swap_then_load)
    runtime = TierRuntime(export_copy)
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)
    np.testing.assert_allclose(runtime.run(x, "small"), small_logits(exported, x), atol=1e-4)


def test_a_symlink_out_of_the_export_folder_is_refused(export_copy, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (export_copy / "small.onnx").rename(outside / "small.onnx")  # same bytes: the hash matches
    (export_copy / "small.onnx").symlink_to(outside / "small.onnx")
    runtime = TierRuntime(export_copy)
    with pytest.raises(ManifestError, match=r"small.onnx: resolves to .*elsewhere/small.onnx, outside the manifest's folder") as info:
        runtime.session("small")
    assert "\n" not in str(info.value)
    assert runtime.run(np.zeros((1, 3, 32, 32), np.float32), "full").shape == (1, 10)


def test_a_symlink_inside_the_export_folder_is_followed(exported, export_copy):
    (export_copy / "store").mkdir()
    (export_copy / "small.onnx").rename(export_copy / "store" / "small.onnx")
    (export_copy / "small.onnx").symlink_to(export_copy / "store" / "small.onnx")
    x = np.zeros((1, 3, 32, 32), np.float32)
    np.testing.assert_allclose(TierRuntime(export_copy).run(x, "small"), small_logits(exported, x), atol=1e-4)


def edit_manifest(directory, edit):
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(class_names=["a", "b"]), r"class_names: 2 names for 10 classes \(output.num_classes\)"),
        (lambda m: m["input"].update(normalization={"mean": [0.5] * 3, "std": [0.2, 0.0, 0.2]}), r"input.normalization.std\[1\]: Input should be greater than 0"),
        (lambda m: m["input"].update(normalization={"mean": [0.5], "std": [0.2]}), r"input.normalization.mean: 1 values for 3 input channels"),
        (lambda m: m["tiers"][0].update(macs=-1), r"tiers\[0\].macs: Input should be greater than or equal to 0"),
        (lambda m: m["tiers"][0]["latency"].update(median_ms=float("nan")), r"tiers\[0\].latency.median_ms: Input should be a finite number"),
        (lambda m: m["tiers"][1].update(name="small"), r"tiers\[1\].name: duplicate tier name 'small'"),
        (lambda m: m["input"].update(shape=[3, 32]), r"input.shape: List should have at least 3 items"),
        (lambda m: m.update(model_args={"num_classes": 100}), r"output.num_classes: 10 contradicts model_args.num_classes = 100"),
    ],
)
def test_inconsistent_manifest_is_refused_when_read(export_copy, edit, message):
    edit_manifest(export_copy, edit)
    with pytest.raises(ManifestError, match=message) as info:
        TierRuntime(export_copy)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["input"].update(shape=[1, 32, 32]), r"input.shape: \[1, 32, 32\], but small.onnx takes \['batch', 3, 32, 32\]"),
        (lambda m: m["output"].update(num_classes=5), r"output.num_classes: 5, but small.onnx gives 10 logits"),
        (lambda m: m["input"].update(name="pixels"), r"input.name: 'pixels', but small.onnx takes input"),
    ],
)
def test_manifest_that_contradicts_the_model_is_refused_at_load(export_copy, edit, message):
    edit_manifest(export_copy, edit)
    runtime = TierRuntime(export_copy)
    with pytest.raises(ManifestError, match=message):
        runtime.session("small")


@pytest.mark.parametrize("budget", [{"latency_ms": -1.0}, {"max_macs": float("nan")}, {"max_memory_mb": float("inf")}, {"batch": 0}])
def test_select_refuses_negative_or_non_finite_budgets(exported, budget):
    with pytest.raises(ValueError, match="must be"):
        TierRuntime(exported[2]).select(**budget)


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_running(exported):
    runtime = TierRuntime(exported[2])
    with pytest.raises(ValueError, match=r"batch 1000000000: needs about .* more than the .* of memory available; use a batch of at most"):
        runtime.benchmark("full", 10**9)
    assert not runtime._sessions  # refused before any session was created

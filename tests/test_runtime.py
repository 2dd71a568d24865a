"""The torch-free tier runtime: sessions, integrity checks, manifest errors and selection."""

import hashlib
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from nefl_zoo.export import ExportOptions, ExportSource, export_tiers
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
    export_tiers(source, out, ExportOptions(latency_runs=2))
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
    actual = hashlib.sha256(bytes(data)).hexdigest()[:12]
    expected = load_manifest(export_copy).tier("small").sha256[:12]
    message = f"small.onnx: sha256 {actual}... does not match the manifest's {expected}... (the file was modified or corrupted; re-export it)"
    with pytest.raises(ManifestError, match=f"{re.escape(message)}$"):
        runtime.run(x, "small")
    assert runtime.run(x, "full").shape == (1, 10)  # the other tier is intact


@pytest.mark.parametrize("cut", ["truncated", "appended"])
def test_a_file_of_another_size_than_declared_is_refused_in_one_line(export_copy, cut):
    path = export_copy / "small.onnx"
    declared = load_manifest(export_copy).tier("small").bytes
    assert declared == path.stat().st_size
    data = path.read_bytes()
    path.write_bytes(data[:-1] if cut == "truncated" else data + b"\0")
    with pytest.raises(ManifestError) as info:
        TierRuntime(export_copy).session("small")
    size = declared - 1 if cut == "truncated" else declared + 1
    assert str(info.value) == f"{path}: {size} bytes, but the manifest declares {declared} (truncated, replaced or appended to; re-export it)"


def test_a_file_past_two_gib_is_refused_without_reading_it(export_copy):
    """A sparse 3 GiB file whose size the manifest declares: refused from its size alone."""
    path = export_copy / "small.onnx"
    with path.open("r+b") as f:
        f.truncate(3 * 2**30)
    manifest = json.loads((export_copy / "manifest.json").read_text())
    manifest["tiers"][0]["bytes"] = 3 * 2**30
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"small.onnx: larger than 2 GiB, which no self-contained .onnx file is$"):
        TierRuntime(export_copy).session("small")


def test_entries_of_one_file_declare_one_size(export_copy):
    manifest = json.loads((export_copy / "manifest.json").read_text())
    manifest["tiers"][1].update(file="small.onnx", sha256=manifest["tiers"][0]["sha256"], bytes=7)
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"tiers\[1\].bytes: 7, but another entry declares \d+ for small.onnx$"):
        TierRuntime(export_copy)


def test_corrupt_file_with_a_matching_hash_is_a_clear_error(export_copy):
    (export_copy / "small.onnx").write_bytes(b"not an onnx model")
    manifest = json.loads((export_copy / "manifest.json").read_text())
    manifest["tiers"][0]["sha256"] = file_sha256(export_copy / "small.onnx")
    manifest["tiers"][0]["bytes"] = len(b"not an onnx model")
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="small.onnx: onnxruntime cannot load the model"):
        TierRuntime(export_copy).session("small")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("schema_version"), "schema_version: required key is missing"),
        (lambda m: m.update(schema_version=6), r"schema_version: unsupported version 6 \(this nefl-zoo reads 1, 2, 3, 4 and 5; re-export or upgrade nefl-zoo\)"),
        (lambda m: m["tiers"][1].pop("bytes"), r"tiers\[1\].bytes: required from schema version 5 \(the size of full.onnx\)"),
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


# ---- what is verified is what runs (issue 12, class 5) --------------------------------------
def small_logits(exported, x):
    compiled, state, _ = exported
    with torch.no_grad():
        return compiled["small"].load(state).eval()(torch.from_numpy(x)).numpy()


def test_a_tier_swapped_after_its_hash_check_is_not_run(exported, export_copy, monkeypatch):
    """The file is replaced between the sha256 check and onnxruntime's load: the session
    still runs the verified bytes (onnxruntime gets bytes, never the path)."""
    import onnxruntime as ort

    real = ort.InferenceSession

    def swap_then_load(model, *args, **kwargs):
        (export_copy / "small.onnx").write_bytes((export_copy / "full.onnx").read_bytes())
        return real(model, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", swap_then_load)
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


def described(path):
    """What a manifest entry declares of the file at ``path``: its sha256 and size."""
    return {"sha256": file_sha256(path), "bytes": path.stat().st_size}


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
    with pytest.raises(ManifestError, match=f"^{re.escape(str(export_copy / 'manifest.json'))}: {message}$"):
        runtime.session("small")


@pytest.mark.parametrize("inputs, takes", [(["input", "extra"], "input, extra"), ([], "nothing")])
def test_a_tier_with_other_inputs_than_the_manifests_is_refused(export_copy, inputs, takes):
    """A tier file (with its hash in the manifest) whose model takes two inputs, or none."""
    import onnx
    from onnx import TensorProto, helper

    values = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, 32, 32]) for n in inputs]
    nodes = [helper.make_node("Constant", [], ["logits"], value=helper.make_tensor("c", TensorProto.FLOAT, [1, 10], [0.0] * 10))]
    graph = helper.make_graph(nodes, "g", values, [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, export_copy / "small.onnx")
    edit_manifest(export_copy, lambda m: m["tiers"][0].update(**described(export_copy / "small.onnx")))
    with pytest.raises(ManifestError, match=f"^{re.escape(str(export_copy / 'manifest.json'))}: input.name: 'input', but small.onnx takes {takes}$"):
        TierRuntime(export_copy).session("small")


@pytest.mark.parametrize(
    "budget, message",
    [
        ({"latency_ms": -1.0}, "latency_ms: must be a finite number >= 0, got -1.0"),
        ({"max_macs": float("nan")}, "max_macs: must be a finite number >= 0, got nan"),
        ({"max_params": "9"}, "max_params: must be a finite number >= 0, got 9"),
        ({"max_memory_mb": float("inf")}, "max_memory_mb: must be a finite number >= 0, got inf"),
        ({"batch": 0}, "batch: must be an integer >= 1, got 0"),
        ({"batch": True}, "batch: must be an integer >= 1, got True"),
        ({"batch": 2.0}, "batch: must be an integer >= 1, got 2.0"),
    ],
)
def test_select_refuses_negative_or_non_finite_budgets(exported, budget, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TierRuntime(exported[2]).select(**budget)


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_running(exported):
    runtime = TierRuntime(exported[2])
    with pytest.raises(ValueError, match=r"batch 1000000000: needs about .* more than the .* of memory available; use a batch of at most"):
        runtime.benchmark("full", 10**9)
    assert not runtime._sessions  # refused before any session was created


# ---- select's rules, predict's normalisation, memory from the arrays themselves (issue 13) ----
@pytest.mark.parametrize(
    "accuracies, budget, tier, why",
    [
        # one fitting tier without an accuracy: the largest by MACs, not the most accurate
        ((None, 0.90, 0.85), {}, "c", "largest (40 MACs; accuracy not measured for every tier) of 3/3"),
        ((0.70, 0.90, None), {}, "c", "largest (40 MACs; accuracy not measured for every tier) of 3/3"),
        # ... unless the budget leaves out the tier without one
        ((0.70, 0.90, None), {"max_macs": 39}, "b", "most accurate (accuracy 0.9) of 2/3"),
        # equal accuracies: the cheaper tier
        ((0.90, 0.90, 0.85), {}, "a", "most accurate (accuracy 0.9) of 3/3"),
        ((0.70, 0.90, 0.90), {}, "b", "most accurate (accuracy 0.9) of 3/3"),
    ],
)
def test_select_rules_with_partial_accuracies_and_ties(export_copy, accuracies, budget, tier, why):
    for order in (COSTS, COSTS[::-1]):  # the manifest's order does not matter
        costs = [c[:3] + (accuracies["abc".index(c[0])],) + c[4:] for c in order]
        choice = TierRuntime(write_manifest(export_copy, costs)).select(**budget)
        assert choice.tier == tier
        assert choice.reason.startswith(f"{tier}: {why} tiers within {'MACs <= 39' if budget else 'no budget'}; ")
        assert sorted(choice.fitting) == sorted(c[0] for c in COSTS if c[1] <= budget.get("max_macs", 40))


def test_select_ties_without_accuracy_go_to_more_params(export_copy):
    costs = [("p", 40, 300, None, 1.0, 1.0, 0.5), ("q", 40, 400, None, 1.0, 1.0, 0.5), ("r", 10, 900, 0.9, 1.0, 1.0, 0.5)]
    for order in (costs, costs[::-1]):
        assert TierRuntime(write_manifest(export_copy, order)).select().tier == "q"


@pytest.mark.parametrize(
    "budget, fitting",
    [  # a cost equal to its budget fits; a hair below it does not
        ({"max_macs": 20}, ("a", "b")), ({"max_macs": 19.999}, ("a",)),
        ({"max_params": 200}, ("a", "b")), ({"max_params": 199.999}, ("a",)),
        ({"latency_ms": 2.0}, ("a", "b")), ({"latency_ms": 1.999}, ("a",)),
        ({"max_memory_mb": 3.0}, ("a", "b")), ({"max_memory_mb": 2.999}, ("a",)),  # b: 2 + 1 x 1
        ({"max_memory_mb": 6.0, "batch": 4}, ("a", "b")), ({"max_memory_mb": 5.999, "batch": 4}, ("a",)),  # b: 2 + 1 x 4
        ({"max_macs": 0}, ()),
    ],
)
def test_select_budgets_are_inclusive(export_copy, budget, fitting):
    runtime = TierRuntime(write_manifest(export_copy, COSTS))
    if not fitting:
        with pytest.raises(NoTierFits, match=r"^no tier fits MACs <= 0; the smallest, a, needs MACs 10$"):
            runtime.select(**budget)
        return
    choice = runtime.select(**budget)
    assert choice.fitting == fitting and choice.tier == fitting[-1]


def test_select_reason_states_the_budget_and_export_latency(export_copy):
    runtime = TierRuntime(write_manifest(export_copy, COSTS))
    batch = runtime.manifest.tier("a").latency.batch
    choice = runtime.select(latency_ms=3, max_macs=1e6, max_params=1e6, max_memory_mb=100, batch=2)
    assert choice.reason == (
        "b: most accurate (accuracy 0.9) of 2/3 tiers within latency <= 3 ms and MACs <= 1,000,000 and "
        f"params <= 1,000,000 and memory <= 100 MB at batch 2; 2 ms at batch {batch} on export"
    )
    assert runtime.selection is choice and runtime.resolve("auto") == "b" and runtime.resolve("c") == "c"
    with pytest.raises(NoTierFits, match=r"^no tier fits params <= 50 and memory <= 1 MB at batch 3; the smallest, a, needs params 100, memory 2.5$"):
        runtime.select(max_params=50, max_memory_mb=1, batch=3)


def test_predict_applies_the_manifests_normalisation(exported, export_copy, tmp_path):
    """The printed probabilities are PyTorch's softmax of the tier on (pixels / 255 - mean) / std."""
    from PIL import Image
    from typer.testing import CliRunner

    from nefl_zoo_cli.app import app

    compiled, state, _ = exported
    mean, std = [0.9, 0.1, 0.5], [0.05, 0.2, 0.1]
    names = [f"n{i}" for i in range(10)]
    edit_manifest(export_copy, lambda m: (m["input"].update(normalization={"mean": mean, "std": std}), m.update(class_names=names)))
    pixels = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(tmp_path / "x.png")
    result = CliRunner().invoke(app, ["predict", str(export_copy), str(tmp_path / "x.png"), "--tier", "small", "--top-k", "10"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"{tmp_path / 'x.png'} (tier small):"
    printed = [(float(p), label) for p, label in (line.split(None, 1) for line in lines[1:])]

    def probabilities(x):
        with torch.no_grad():
            return torch.softmax(compiled["small"].load(state).eval()(x).double(), dim=1)[0]

    raw = torch.from_numpy(pixels.astype(np.float64) / 255).permute(2, 0, 1)[None]
    normalised = (raw - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    expected = probabilities(normalised.float())
    order = torch.argsort(expected, descending=True, stable=True).tolist()
    assert [label for _, label in printed] == [f"n{i} ({i})" for i in order]
    assert [p for p, _ in printed] == pytest.approx([float(expected[i]) for i in order], abs=1e-4)
    assert float((probabilities(raw.float()) - expected).abs().max()) > 1e-2  # skipping it would show


def test_memory_estimate_matches_the_bytes_of_the_arrays_it_describes(exported):
    """``weights_mb`` is the file's size; ``activation_mb_per_sample`` the largest sum of one node's
    activation inputs and outputs, measured here on onnxruntime's actual arrays for one sample."""
    import onnx
    import onnxruntime as ort

    out = exported[2]
    for entry in load_manifest(out).tiers:
        path = out / entry.file
        assert entry.weights_mb * 2**20 == path.stat().st_size
        model = onnx.load(str(path))
        weights = {t.name for t in model.graph.initializer}
        graph_outputs = {o.name for o in model.graph.output}
        inner = [v for v in onnx.shape_inference.infer_shapes(model).graph.value_info if v.name not in graph_outputs]
        model.graph.output.extend(inner)  # every intermediate value becomes an output
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).standard_normal((1, 3, 32, 32), dtype=np.float32)
        arrays = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"input": x})))
        arrays["input"] = x
        assert len(arrays) > len(model.graph.node) // 2
        largest = max(
            sum(arrays[n].nbytes for n in [*node.input, *node.output] if n and n not in weights and n in arrays)
            for node in model.graph.node
        )
        assert entry.activation_mb_per_sample * 2**20 == largest
        assert entry.memory_mb(3) == pytest.approx((path.stat().st_size + 3 * largest) / 2**20, rel=1e-12)


def test_a_fixed_batch_manifest_is_enforced(export_copy):
    edit_manifest(export_copy, lambda m: m["input"].update(batch=2))
    runtime = TierRuntime(export_copy)
    assert runtime.run(np.zeros((2, 3, 32, 32), np.float32), "small").shape == (2, 10)
    with pytest.raises(ValueError, match=r"^this export has a fixed batch of 2, got 4$"):
        runtime.run(np.zeros((4, 3, 32, 32), np.float32), "small")
    with pytest.raises(ValueError, match=r"^this export has a fixed batch of 2, got --batch 1$"):
        runtime.benchmark("small", 1)
    assert runtime.benchmark("small", 2, runs=1, warmup=0) > 0
    with pytest.raises(ValueError, match=r"^input shape \(2, 3, 32\) != \(batch, 3, 32, 32\)$"):
        runtime.check_batch(np.zeros((2, 3, 32), np.float32))


def test_check_memory_uses_four_working_sets_plus_the_input_per_sample(exported, monkeypatch):
    """With the memory available fixed 100 bytes above or below the documented estimate of a
    batch of 10 (weights + batch x (4 x activations + the float32 input)), it fits or not."""
    import nefl_zoo.memory as memory

    runtime = TierRuntime(exported[2])
    entry = runtime.manifest.tier("small")
    per_sample = 4 * entry.activation_mb_per_sample * 2**20 + 4 * 3 * 32 * 32
    need = entry.weights_mb * 2**20 + 10 * per_sample
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: need + 100)
    runtime.check_memory(10, ["small"])
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: need - 100)
    with pytest.raises(ValueError, match=rf"^batch 10: needs about .* \(tier small: {per_sample / 2**20:,.2f} MiB per input\), more than the .* use a batch of at most 9$"):
        runtime.check_memory(10, ["small"])
    assert runtime.manifest.tier("full").activation_mb_per_sample > entry.activation_mb_per_sample
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: need + 100)
    with pytest.raises(ValueError, match=r"\(tier full: "):  # default: every tier, and the full one needs more
        runtime.check_memory(10)
    with pytest.raises(ValueError, match=r"\(tier full: "):
        runtime.benchmark("full", 10)
    assert runtime.benchmark("small", 10, runs=1, warmup=0) > 0  # only the tier measured is checked


def test_benchmark_runs_the_session_warmup_plus_runs_times(exported):
    runtime = TierRuntime(exported[2])
    session = runtime.session("small")
    feeds = []

    class Counting:
        def run(self, names, feed):
            feeds.append(feed)
            return session.run(names, feed)

    runtime._sessions[runtime.manifest.tier("small").file] = Counting()  # sessions are cached by file
    assert runtime.benchmark("small", 3, runs=4, warmup=1) > 0
    assert len(feeds) == 5 and all(f["input"].shape == (3, 3, 32, 32) and f["input"].dtype == np.float32 for f in feeds)
    feeds.clear()
    runtime.benchmark("small", 1)
    assert len(feeds) == 12  # defaults: 10 timed runs after 2 warm-up runs


def test_read_tier_refuses_what_is_not_a_tier_file(export_copy, monkeypatch):
    import os

    import nefl_zoo.runtime.session as runtime_session
    from nefl_zoo.runtime import read_tier

    entry = load_manifest(export_copy).tier("small")
    path = export_copy / "small.onnx"
    assert read_tier(path, entry.sha256, export_copy) == path.read_bytes()
    assert read_tier(path, entry.sha256) == path.read_bytes()  # no root: no containment check
    monkeypatch.setattr(runtime_session, "MAX_TIER_BYTES", path.stat().st_size - 1)
    with pytest.raises(ManifestError, match=r"small.onnx: larger than 2 GiB, which no self-contained .onnx file is$"):
        read_tier(path, entry.sha256)
    monkeypatch.setattr(runtime_session, "MAX_TIER_BYTES", path.stat().st_size)
    assert read_tier(path, entry.sha256) == path.read_bytes()
    (export_copy / "dir.onnx").mkdir()
    os.mkfifo(export_copy / "fifo.onnx")  # refused at once, not a read that waits for a writer
    for name in ("dir.onnx", "fifo.onnx"):
        with pytest.raises(ManifestError, match=rf"{name}: not a regular file$"):
            read_tier(export_copy / name, entry.sha256, export_copy)
    with pytest.raises(ManifestError, match=r"gone.onnx: tier file is missing \(re-export the model\)$"):
        read_tier(export_copy / "gone.onnx", entry.sha256, export_copy)
    (export_copy / "link.onnx").symlink_to(path)  # without a root to resolve in, a symlink is not followed
    with pytest.raises(ManifestError, match=r"link.onnx: cannot read the tier file \(Too many levels of symbolic links\)$"):
        read_tier(export_copy / "link.onnx", entry.sha256)
    assert read_tier(export_copy / "link.onnx", entry.sha256, export_copy) == path.read_bytes()


def test_sessions_take_the_thread_count(exported):
    runtime = TierRuntime(exported[2] / "manifest.json", threads=1)
    assert runtime.manifest_path == exported[2] / "manifest.json" and runtime.root == exported[2]
    assert runtime.session("small").get_session_options().intra_op_num_threads == 1
    assert runtime.session("small").get_providers() == ["CPUExecutionProvider"]


def hand_tier(directory, input_shape, output_shape, batch=None):
    """Replace small.onnx by a hand-made model (a constant output) and fix up the manifest."""
    import onnx
    from onnx import TensorProto, helper

    numel = int(np.prod(output_shape))
    node = helper.make_node("Constant", [], ["logits"], value=helper.make_tensor("c", TensorProto.FLOAT, output_shape, [0.0] * numel))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, input_shape)],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, output_shape)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), directory / "small.onnx")
    edit_manifest(directory, lambda m: (m["tiers"][0].update(**described(directory / "small.onnx")), m["input"].update(batch=batch)))


def test_a_fixed_batch_tier_must_match_the_manifests_batch(export_copy):
    hand_tier(export_copy, [1, 3, 32, 32], [1, 10], batch=1)
    assert TierRuntime(export_copy).run(np.zeros((1, 3, 32, 32), np.float32), "small").shape == (1, 10)
    for batch in (None, 2):
        hand_tier(export_copy, [1, 3, 32, 32], [1, 10], batch=batch)
        message = f"{export_copy / 'manifest.json'}: input.batch: {batch}, but small.onnx takes a batch of 1"
        with pytest.raises(ManifestError, match=f"^{re.escape(message)}$"):
            TierRuntime(export_copy).session("small")


def test_a_tier_whose_output_has_no_class_dimension_is_not_checked_for_it(export_copy):
    hand_tier(export_copy, [1, 3, 32, 32], [], batch=1)
    assert TierRuntime(export_copy).session("small").get_outputs()[0].shape == []


def test_onnxruntime_load_errors_keep_their_first_line(export_copy, monkeypatch):
    import onnxruntime as ort

    from nefl_zoo.runtime import session_from_bytes

    with pytest.raises(ManifestError, match=r"^x.onnx: onnxruntime cannot load the model \(\[ONNXRuntimeError\] : 7 : INVALID_PROTOBUF : [^\n]+\)$"):
        session_from_bytes(b"not an onnx model", "x.onnx")

    class Silent(RuntimeError):
        pass

    def fails(*args, **kwargs):
        raise Silent("  \n")

    monkeypatch.setattr(ort, "InferenceSession", fails)
    with pytest.raises(ManifestError, match=r"^x.onnx: onnxruntime cannot load the model \(Silent\)$"):
        session_from_bytes(b"", "x.onnx")

    def two_lines(*args, **kwargs):
        raise RuntimeError("  first line\nsecond line")

    monkeypatch.setattr(ort, "InferenceSession", two_lines)
    with pytest.raises(ManifestError, match=r"^x.onnx: onnxruntime cannot load the model \(first line\)$"):
        session_from_bytes(b"", "x.onnx")
    assert ort.InferenceSession is two_lines


def test_a_tier_whose_last_output_dimension_is_not_the_class_count_is_refused(export_copy):
    hand_tier(export_copy, [1, 3, 32, 32], [1, 10, 3], batch=1)
    message = f"{export_copy / 'manifest.json'}: output.num_classes: 10, but small.onnx gives 3 logits"
    with pytest.raises(ManifestError, match=f"^{re.escape(message)}$"):
        TierRuntime(export_copy).session("small")


def test_a_load_reads_its_tier_file_once_and_runs_those_bytes(exported, export_copy, monkeypatch):
    """Every open of ``small.onnx`` (``os.open``, ``open``, ``io.open``, so ``Path.read_bytes``
    too) is counted, and right after each one the file is replaced by ``full.onnx``'s bytes (same
    input and classes, other logits). A load opens the file once and runs the bytes it checked;
    a cached session reads nothing; a new load reads the file once more and refuses the swapped
    bytes. Catches the one-line change in ``create_session``
    ``return session_from_bytes(read_tier(path, sha256, root) and Path(path).read_bytes(), ...)``
    (a read after the check), and ``... and str(path), ...`` (the path handed to onnxruntime)."""
    import builtins
    import io
    import os

    small = export_copy / "small.onnx"
    swapped_in = (export_copy / "full.onnx").read_bytes()
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)
    expected = small_logits(exported, x)
    opens = []

    def swapping(real):
        def opener(file, *args, **kwargs):
            result = real(file, *args, **kwargs)
            if isinstance(file, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(file)) == os.path.realpath(small):
                opens.append(file)
                replacement = export_copy / "replacement.tmp"
                with io.FileIO(replacement, "w") as f:  # not through the counted openers
                    f.write(swapped_in)
                os.replace(replacement, small)  # a new file: what was opened keeps its bytes
            return result
        return opener

    monkeypatch.setattr(os, "open", swapping(os.open))
    monkeypatch.setattr(io, "open", swapping(io.open))
    monkeypatch.setattr(builtins, "open", swapping(builtins.open))
    runtime = TierRuntime(export_copy)
    np.testing.assert_allclose(runtime.run(x, "small"), expected, atol=1e-4)
    assert len(opens) == 1
    np.testing.assert_allclose(runtime.run(x, "small"), expected, atol=1e-4)  # the cached session
    assert len(opens) == 1
    with pytest.raises(ManifestError, match=r"small.onnx: \d+ bytes, but the manifest declares \d+"):  # sizes differ
        TierRuntime(export_copy).session("small")
    assert len(opens) == 2


def test_a_tier_with_external_data_is_refused_by_every_command_whatever_the_working_directory(exported, export_copy, monkeypatch, tmp_path):
    """``small.onnx`` rewritten with one initializer in ``weights.bin`` (the manifest's hash
    updated to match): onnxruntime would read ``weights.bin`` relative to the working directory,
    bytes no hash covers. ``predict``, ``select`` and ``bench-tiers`` refuse it in one line,
    from the export folder (where ``weights.bin`` lies) as from anywhere else."""
    import onnx
    from PIL import Image
    from typer.testing import CliRunner

    from nefl_zoo_cli.app import app

    model = onnx.load(str(export_copy / "small.onnx"))
    name = model.graph.initializer[0].name
    onnx.external_data_helper.convert_model_to_external_data(model, location="weights.bin", size_threshold=0)
    onnx.save_model(model, str(export_copy / "small.onnx"))
    assert (export_copy / "weights.bin").exists()
    edit_manifest(export_copy, lambda m: m["tiers"][0].update(**described(export_copy / "small.onnx")))
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "x.png")
    commands = [
        ["predict", str(export_copy), str(tmp_path / "x.png"), "--tier", "small"],
        ["select", str(export_copy), "--max-params", str(load_manifest(export_copy).tier("small").params)],
        ["bench-tiers", str(export_copy), "--runs", "1"],
    ]
    for cwd in (export_copy, tmp_path):
        monkeypatch.chdir(cwd)
        for command in commands:
            result = CliRunner().invoke(app, command)
            assert result.exit_code == 2, (command, result.output)
            assert result.stderr.count("\n") == 1 and re.search(
                rf"^error: \S*small.onnx: tensor {re.escape(name)}( \(and \d+ more\))? is stored as external data", result.stderr
            ), result.stderr

"""INT8 and FP16 tiers (issue 21): calibration on a run's own data, the check against FP32,
the manifest's entries per (tier, precision), selection with precisions, hostile files.

One tiny run directory (ResNet20 on 8x8 digits, trained for two epochs) has its full tier
exported once through the CLI with every precision; the tests read that export.
"""

import json
import re
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml
from safetensors.torch import save_file
from typer.testing import CliRunner

from nefl_zoo.export import verify
from nefl_zoo.export.quantize import compact
from nefl_zoo.manifest import PRECISIONS, ManifestError, file_sha256, load_manifest
from nefl_zoo.runtime import NoTierFits, TierRuntime
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec
from nefl_zoo_cli.app import app
from nefl_zoo_cli.export import Precision

SPEC = {
    "model": "resnet20",
    "model_args": {"num_classes": 10, "in_chans": 1, "img_size": 8},
    "tiers": [{"name": "narrow", "gamma_w": 0.25}, {"name": "full"}],
}
DATA = {"dataset": "digits", "test_fraction": 0.25}


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def digits():
    """Training and test images as training loads them (no augmentation): the reference the
    export's own loading is checked against."""
    from nefl_zoo.data.loading import load_data
    from nefl_zoo.data.config import DataConfig

    data = load_data(DataConfig(augment=False, **DATA), "data", (1, 8, 8), 1, 0)
    test = [data.test[i] for i in range(len(data.test))]
    train = torch.stack([data.train_eval[i][0] for i in range(len(data.train_eval))])
    return train, data.targets, torch.stack([x for x, _ in test]), np.array([y for _, y in test])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory (plain layout) whose full tier was trained for two epochs on digits, so
    that its logits mean something; that tier exported with every precision through the CLI."""
    compiled = compile_spec(parse_spec(SPEC))
    torch.manual_seed(0)
    state = compiled.init_global_state()
    train, targets, test, labels = digits()
    model = compiled["full"].load(state).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    for batch in [*torch.randperm(len(train)).split(64), *torch.randperm(len(train)).split(64)]:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(train[batch]), torch.as_tensor(targets[batch])).backward()
        optimizer.step()
    compiled["full"].scatter_(state, model.state_dict())
    path = tmp_path_factory.mktemp("run")
    (path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "global.safetensors"))
    (path / "metrics.jsonl").write_text(json.dumps({"acc": {"narrow": 0.2, "full": 0.2}}) + "\n")
    (path / "config.yaml").write_text(yaml.safe_dump({"data": DATA}))
    out = tmp_path_factory.mktemp("export")
    result = invoke("export", path, "-o", out, "--tiers", "full", "--precision", "fp32,int8,fp16", "--calibration-images", "64",
                    "--latency-runs", "2", "--threads", "1", "--pad-channels", "1", "--format", "files", "--json")
    assert result.exit_code == 0, result.output
    return compiled, state, out, json.loads(result.stdout), (test, labels), path


def test_every_tier_ships_one_checked_file_per_precision(run):
    _, _, out, printed, _, _ = run
    manifest = load_manifest(out)
    assert printed["manifest"] == json.loads((out / "manifest.json").read_text()) and printed["warnings"] == []
    assert manifest.schema_version == 5
    assert [(t.name, t.precision, t.file) for t in manifest.tiers] == [
        ("full", p, f"full.onnx" if p == "fp32" else f"full.{p}.onnx") for p in ("fp32", "int8", "fp16")
    ]
    assert sorted(p.name for p in out.iterdir()) == sorted(["manifest.json", *(t.file for t in manifest.tiers)])
    for entry in manifest.tiers:
        assert entry.sha256 == file_sha256(out / entry.file) and entry.weights_mb * 2**20 == (out / entry.file).stat().st_size
        fp32 = manifest.tier(entry.name)
        assert (entry.params, entry.macs, entry.blocks_per_stage) == (fp32.params, fp32.macs, fp32.blocks_per_stage)
        assert entry.latency.runs == 2 and entry.latency.threads == 1 and entry.latency.median_ms > 0
        assert (entry.vs_fp32 is None) == (entry.precision == "fp32")
        assert (entry.calibration is None) == (entry.precision != "int8")
    int8 = manifest.tier("full", "int8")
    assert int8.calibration.images == 64 and "digits training images" in int8.calibration.source
    assert "QDQ" in int8.calibration.method


def test_int8_is_qdq_with_int8_weights_per_channel_and_fp16_is_half(run):
    _, _, out, _, _, _ = run
    model = onnx.load(str(out / "full.int8.onnx"))
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= ops and "BatchNormalization" not in ops
    weights = {t.name: t for t in model.graph.initializer}
    conv_weights = [weights[n.input[0]] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights
                    and len(weights[n.input[0]].dims) == 4]
    assert conv_weights and all(t.data_type == onnx.TensorProto.INT8 for t in conv_weights)
    per_channel = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights
                   and len(weights[n.input[0]].dims) == 4 and len(weights[n.input[1]].dims) == 1]
    assert len(per_channel) == len(conv_weights)  # one scale per output channel
    half = onnx.load(str(out / "full.fp16.onnx"))
    kinds = {t.data_type for t in half.graph.initializer if len(t.dims) == 4}
    assert kinds == {onnx.TensorProto.FLOAT16}
    assert half.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # same input as FP32
    assert (out / "full.int8.onnx").stat().st_size <= 0.3 * (out / "full.onnx").stat().st_size


def test_accuracy_and_agreement_are_what_the_files_give_on_the_test_split(run):
    """Recomputed here from the shipped files on the digits test split as training loads it;
    the FP32 accuracy also equals the PyTorch module's."""
    compiled, state, out, _, (test, labels), _ = run
    manifest = load_manifest(out)
    for name in ("full",):
        with torch.no_grad():
            torch_logits = compiled[name].load(state).eval()(test).numpy()
        logits = {}
        for entry in [t for t in manifest.tiers if t.name == name]:
            session = ort.InferenceSession(str(out / entry.file), providers=["CPUExecutionProvider"])
            logits[entry.precision] = session.run(None, {"input": test.numpy()})[0]
            assert entry.accuracy == pytest.approx(float((logits[entry.precision].argmax(1) == labels).mean()))
            assert entry.accuracy_on == f"digits test split ({len(labels)} images)"
        assert manifest.tier(name).accuracy == pytest.approx(float((torch_logits.argmax(1) == labels).mean()))
        for precision in ("int8", "fp16"):
            found = manifest.tier(name, precision).vs_fp32
            diff = np.abs(logits[precision].astype(np.float64) - logits["fp32"]).max()
            assert found.images == len(labels)
            assert found.top1_agreement == pytest.approx(float((logits[precision].argmax(1) == logits["fp32"].argmax(1)).mean()))
            assert found.max_abs_diff == pytest.approx(diff, rel=1e-6)
            assert found.relative_error == pytest.approx(diff / max(1.0, np.abs(logits["fp32"]).max()), rel=1e-6)
            assert found.top1_agreement >= verify.MIN_TOP1_AGREEMENT[precision]
    assert manifest.tier("full").accuracy > 0.5  # trained (chance: 0.1): the agreement above is between real outputs


@pytest.mark.parametrize(
    "found, passes",
    [  # (top-1 agreement, relative logit error) for INT8: bounds 0.95 and 0.25, both inclusive
        ((0.95, 0.25), True), ((0.949, 0.1), False), ((1.0, 0.2501), False), ((1.0, float("nan")), False),
    ],
)
def test_the_check_against_fp32_at_its_bounds(found, passes):
    agree, error = found
    reference = np.zeros((1000, 3))
    reference[:, 0], reference[:, 1] = 4.0, 3.9  # top-1 class 0 everywhere; max |logit| 4
    logits = reference.copy()
    logits[: round((1 - agree) * 1000), 1] = 4.1  # these images now pick class 1 (a difference of 0.2)
    logits[-1, 2] = error * 4.0 if error == error else np.nan
    if passes:
        got = verify.check_agreement("t", "int8", reference, logits)
        assert (got.top1_agreement, got.relative_error, got.images) == pytest.approx((agree, error, 1000))
    else:
        with pytest.raises(verify.ExportError, match=r"^tier t int8: (top-1 agreement with FP32|logit error) "):
            verify.check_agreement("t", "int8", reference, logits)


def test_a_file_that_fails_the_check_is_dropped_with_a_warning(tmp_path, monkeypatch):
    """FP16 from a spec (random weights, checked on seeded random inputs), with a bound
    nothing meets: the FP32 file ships, the FP16 one does not, and the export says so."""
    monkeypatch.setitem(verify.MAX_RELATIVE_ERROR, "fp16", -1.0)
    spec = tmp_path / "narrow.yaml"
    spec.write_text(yaml.safe_dump(SPEC | {"tiers": SPEC["tiers"][:1]}))
    result = invoke("export", spec, "-o", tmp_path / "out", "--precision", "fp32,fp16", "--pad-channels", "1",
                    "--latency-runs", "1", "--format", "files", "--json")
    assert result.exit_code == 0, result.output
    (warning,) = json.loads(result.stdout)["warnings"]
    assert re.fullmatch(r"tier narrow fp16: logit error \S+ x max\(1, max \|FP32 logit\|\) > -1.0 on 64 random normal "
                        r"inputs \(seed 0\); not shipped", warning), warning
    assert f"warning: {warning}" in result.stderr
    assert [t.label for t in load_manifest(tmp_path / "out").tiers] == ["narrow"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["manifest.json", "narrow.onnx"]


def test_compact_renames_tensors_and_keeps_the_outputs(run):
    _, _, out, _, (test, _), _ = run
    data = (out / "full.onnx").read_bytes()
    small = compact(onnx.load_model_from_string(data))
    names = {t.name for t in small.graph.initializer} | {o for n in small.graph.node for o in n.output}
    assert all(re.fullmatch(r"t\d+", n) for n in names - {"logits"}) and not small.graph.value_info
    x = test[:7].numpy()
    run_ = lambda model: ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]  # noqa: E731
    np.testing.assert_array_equal(run_(small.SerializeToString()), run_(data))
    assert small.ByteSize() < len(data)


# ---- the runtime and the CLI with precisions ---------------------------------------------------
def test_select_picks_the_most_accurate_entry_within_file_and_latency_budgets(run, tmp_path):
    """Hand-set accuracies, latencies and sizes on a copy of the export's manifest, its
    entries copied to a second tier."""
    _, _, out, _, _, _ = run
    shutil.copytree(out, tmp_path / "e")
    data = json.loads((tmp_path / "e" / "manifest.json").read_text())
    data["tiers"] = [json.loads(json.dumps(entry)) | {"name": "narrow"} for entry in data["tiers"]] + data["tiers"]
    costs = {  # (accuracy, ms, file MB)
        "narrow": (0.80, 1.0, 0.40), "narrow:int8": (0.79, 0.5, 0.10), "narrow:fp16": (0.80, 1.2, 0.20),
        "full": (0.95, 4.0, 1.60), "full:int8": (0.94, 2.0, 0.40), "full:fp16": (0.95, 4.5, 0.80),
    }
    for entry in data["tiers"]:
        label = entry["name"] if entry["precision"] == "fp32" else f"{entry['name']}:{entry['precision']}"
        entry["accuracy"], entry["latency"]["median_ms"], entry["weights_mb"] = costs[label]
    (tmp_path / "e" / "manifest.json").write_text(json.dumps(data))
    runtime = TierRuntime(tmp_path / "e")
    assert runtime.select().label == "full:fp16"  # full and full:fp16 tie at 0.95: the smaller file
    assert runtime.select(latency_ms=4.0).label == "full"
    assert runtime.select(latency_ms=3.0).label == "full:int8"
    assert runtime.select(max_file_mb=0.5).label == "full:int8"  # wider INT8 beats narrower FP32
    assert runtime.select(max_file_mb=0.3).label == "narrow:fp16"
    assert runtime.select(max_file_mb=0.5, precisions=["fp32", "fp16"]).label == "narrow:fp16"
    assert runtime.select(precisions=["fp32"]).label == "full"
    choice = runtime.select(latency_ms=1.0, precisions=["int8", "fp32"])
    assert (choice.tier, choice.precision, choice.fitting) == ("narrow", "fp32", ("narrow", "narrow:int8"))
    assert choice.reason.startswith("narrow: most accurate (accuracy 0.8) of 2/4 tiers within latency <= 1 ms; ")
    with pytest.raises(NoTierFits, match=r"^no tier fits file <= 0.05 MB; the smallest, narrow:int8, needs file 0.1$"):
        runtime.select(max_file_mb=0.05)
    result = invoke("select", tmp_path / "e", "--max-ms", "3", "--max-mb", "0.5", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) | {"reason": ""} == {
        "tier": "full", "precision": "int8", "label": "full:int8", "file": "full.int8.onnx", "reason": "",
        "fitting": ["narrow", "narrow:int8", "narrow:fp16", "full:int8"],
    }
    result = invoke("select", tmp_path / "e", "--max-mb", "0.5", "--precision", "fp32,fp16")
    assert result.exit_code == 0 and result.stdout.startswith("narrow:fp16: most accurate")


def test_entries_are_found_by_label_or_by_name_and_precision(run):
    _, _, out, _, _, _ = run
    manifest = load_manifest(out)
    assert manifest.tier("full:int8") is manifest.tier("full", "int8")
    assert manifest.tier("full").precision == "fp32"
    with pytest.raises(KeyError, match=r"unknown tier 'wide'; tiers: full\W$"):
        manifest.tier("wide")
    runtime = TierRuntime(out)
    with pytest.raises(ValueError, match=r"^precision int4: the manifest has no such files \(precisions are fp32, int8, fp16\); "):
        runtime.select(precisions=["int4"])
    assert [p.value for p in Precision] == list(PRECISIONS)  # the CLI's choices are the manifest's


def test_predict_and_bench_tiers_run_each_precision(run, tmp_path):
    from PIL import Image

    _, _, out, _, _, _ = run
    image = tmp_path / "digit.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8), dtype=np.uint8), "L").save(image)
    result = invoke("predict", out, image, "--tier", "full", "--precision", "int8", "--top-k", "2", "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    pixels = np.asarray(Image.open(image), np.float32)[None, None] / 255  # no normalisation in a digits manifest
    logits = ort.InferenceSession(str(out / "full.int8.onnx"), providers=["CPUExecutionProvider"]).run(None, {"input": pixels})[0][0]
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert (printed["tier"], printed["precision"], printed["label"]) == ("full", "int8", "full:int8")
    assert [t["class"] for t in printed["predictions"][0]["top"]] == list(np.argsort(-probs)[:2])
    assert [t["probability"] for t in printed["predictions"][0]["top"]] == pytest.approx(sorted(probs)[::-1][:2], abs=1e-5)
    auto = invoke("predict", out, image, "--precision", "fp16")
    assert auto.exit_code == 0 and auto.stdout.splitlines()[0] == f"{image} (tier full:fp16):"
    bench = invoke("bench-tiers", out, "--runs", "2", "--precision", "int8,fp32", "--json")
    assert bench.exit_code == 0, bench.output
    rows = {r["label"]: r for r in json.loads(bench.stdout)["tiers"]}
    assert sorted(rows) == ["full", "full:int8"]
    assert rows["full:int8"]["vs_fp32"] == pytest.approx(rows["full:int8"]["latency_ms"] / rows["full"]["latency_ms"])
    assert rows["full"]["vs_fp32"] == 1.0 and rows["full"]["latency_ratio"] == 1.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--precision", "int4"], "--precision: expected fp32, int8 or fp16, got 'int4'"),
        (["--precision", "int8"], "int8: needs calibration images; export a run directory, or give a folder of images (--calibration)"),
        (["--precision", "int8", "--calibration", "nowhere"], "--calibration: {tmp}/nowhere: not a folder"),
    ],
)
def test_export_refuses_what_cannot_be_quantized_before_any_work(tmp_path, args, message):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    result = invoke("export", spec, "-o", tmp_path / "x", *[str(tmp_path / a) if a == "nowhere" else a for a in args])
    assert result.exit_code == 2 and message.format(tmp=tmp_path) in result.stderr, result.output
    assert result.stderr.count("\n") == 1 and not (tmp_path / "x").exists()


# ---- hostile or stale quantized files, old manifests ----------------------------------------
def test_tampered_stale_or_escaping_quantized_files_are_refused(run, tmp_path):
    _, _, out, _, _, _ = run
    copy = shutil.copytree(out, tmp_path / "e")
    (copy / "full.int8.onnx").write_bytes((copy / "full.fp16.onnx").read_bytes())  # stale: another entry's file
    with pytest.raises(ManifestError, match=r"full.int8.onnx: \d+ bytes, but the manifest declares \d+ \(truncated, replaced"):  # another size
        TierRuntime(copy).session("full:int8")
    outside = tmp_path / "outside.onnx"
    outside.write_bytes((out / "full.fp16.onnx").read_bytes())  # the right bytes, outside the folder
    (copy / "full.fp16.onnx").unlink()
    (copy / "full.fp16.onnx").symlink_to(outside)
    with pytest.raises(ManifestError, match=r"full.fp16.onnx: resolves to .*outside.onnx, outside the manifest's folder"):
        TierRuntime(copy).session("full", "fp16")
    data = json.loads((copy / "manifest.json").read_text())
    data["tiers"][1]["file"] = "../full.int8.onnx"
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"tiers\[1\].file: String should match pattern"):
        TierRuntime(copy)
    assert TierRuntime(out).run(np.zeros((1, 1, 8, 8), np.float32), "full:int8").shape == (1, 10)


def test_version_1_manifests_are_read_as_fp32_and_cannot_hold_other_precisions(run, tmp_path):
    _, _, out, _, _, _ = run
    copy = shutil.copytree(out, tmp_path / "e")
    data = json.loads((copy / "manifest.json").read_text())
    new = ("precision", "accuracy_on", "vs_fp32", "calibration")
    old = data | {"schema_version": 1, "tiers": [{k: v for k, v in t.items() if k not in new} for t in data["tiers"] if t["precision"] == "fp32"]}
    (copy / "manifest.json").write_text(json.dumps(old))
    runtime = TierRuntime(copy)
    assert [(t.label, t.precision) for t in runtime.manifest.tiers] == [("full", "fp32")]
    assert runtime.run(np.zeros((1, 1, 8, 8), np.float32), "full").shape == (1, 10)
    (copy / "manifest.json").write_text(json.dumps(data | {"schema_version": 1}))
    with pytest.raises(ManifestError, match=r"tiers\[1\].precision: schema version 1 has FP32 entries only"):
        TierRuntime(copy)
    twice = data | {"tiers": [data["tiers"][0], data["tiers"][1] | {"precision": "fp32", "file": "x.onnx"}]}
    (copy / "manifest.json").write_text(json.dumps(twice))
    with pytest.raises(ManifestError, match=r"tiers\[1\].name: duplicate tier name 'full' at precision fp32"):
        TierRuntime(copy)

"""The nested model: one standard ONNX file per precision holding every tier, checked against
the per-tier files.

One source (a ResNet20 with trained-looking BatchNorm statistics and step sizes, three tiers:
a narrow one with skipped blocks, a middle one and the full model) is exported twice, as
per-tier files and as nested models, at FP32, INT8 and FP16. The per-tier files are the
reference the nested models are held to.
"""

import collections
import json
import re
import shutil

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper
from typer.testing import CliRunner

from nefl_zoo.export import ExportError, ExportSource, export_tiers
from nefl_zoo.export.nested import Slice, quantize_per_channel
from nefl_zoo.export.nested_model import FUNCTION_DOMAIN
from nefl_zoo.manifest import ManifestError, file_sha256, load_manifest, parse_manifest
from nefl_zoo.profile import profile_tiers
from nefl_zoo.runtime import Deadline, TierRuntime
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec
from nefl_zoo_cli.app import app

from .support.device import bench
from .support.exports import SPEC, calibration_images, graphs, trained_looking_state

PRECISIONS = ["fp32", "int8", "fp16"]
SPEC = {**SPEC, "model_args": {"num_classes": 10, "img_size": 16}}  # three input channels


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    torch.manual_seed(0)  # the global state's initialisation: the same weights whatever ran before
    compiled = compile_spec(parse_spec(SPEC))
    state = trained_looking_state(compiled)
    calibration = calibration_images(compiled.input_size)
    out = {}
    for layout in ("files", "nested"):
        source = ExportSource(compiled, state, "test", accuracy={"small": 0.6, "mid": 0.7, "full": 0.8})
        out[layout] = tmp_path_factory.mktemp(layout)
        export_tiers(source, out[layout], precisions=PRECISIONS, calibration=calibration, latency_runs=1, threads=1,
                     format=layout, warn=pytest.fail)
    return compiled, state, out["files"], out["nested"]


@pytest.fixture
def nested_copy(exports, tmp_path):
    return shutil.copytree(exports[3], tmp_path / "nested")


def images(compiled, n=16, seed=1):
    return np.random.default_rng(seed).standard_normal((n, *compiled.input_size)).astype(np.float32)


def branch(model: onnx.ModelProto, index: int) -> onnx.GraphProto:
    """The ``If`` branch of tier ``index`` (the nested model's subgraph ``tiers[i:i+1]``)."""
    (found,) = [graph for graph in graphs(model) if graph.name == f"tiers[{index}:{index + 1}]"]
    return found


def rehash(folder, file):
    """Record ``file``'s new sha256 and size in the manifest, as an attacker or a buggy exporter would."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["tiers"]:
        if entry["file"] == file:
            entry.update(sha256=file_sha256(folder / file), bytes=(folder / file).stat().st_size)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_one_standard_file_per_precision_holds_each_shared_tensor_once(exports):
    compiled, state, files, nested = exports
    manifest = load_manifest(nested)
    assert manifest.format == "nested" and manifest.schema_version == 5
    assert sorted(p.name for p in nested.iterdir()) == ["manifest.json", *(f"nested.{p}.onnx" for p in sorted(PRECISIONS))]
    model = onnx.load(nested / "nested.fp32.onnx")
    onnx.checker.check_model(model, full_check=True)
    top = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for key in ("conv1.weight", "layer3.2.conv2.weight", "fc.weight"):  # the global tensors, bit for bit
        np.testing.assert_array_equal(top[key], state[key].numpy())
    assert not any(key.startswith("t0/") for key in top)  # a tier's own tensors stay in its branch
    file_manifest = load_manifest(files)
    for precision, limit in (("fp32", 1.10), ("int8", 1.25), ("fp16", 1.10)):
        size = (nested / f"nested.{precision}.onnx").stat().st_size
        own = [(files / t.file).stat().st_size for t in file_manifest.tiers if t.precision == precision]
        assert size <= limit * max(own) < sum(own), precision


def test_int8_tiers_add_to_the_nested_file_less_than_their_own_files_hold_beside_their_weights(exports):
    """Beyond the shared int8 weights, the nested file holds the tiers' graphs (once per structure,
    see below), scales and biases more compactly than their own files do (no node names, no
    ``Identity`` after a cut, one constant per distinct value): at most 0.90x those bytes of the
    per-tier files together (0.80x here; 1.04x when each branch held its own copy of its graph)."""
    _, _, files, nested = exports
    model = onnx.load(nested / "nested.int8.onnx")
    beyond_shared = model.ByteSize() - sum(t.ByteSize() for t in model.graph.initializer)
    beside_weights = 0
    for entry in load_manifest(files).tiers:
        if entry.precision == "int8":
            own = onnx.load(files / entry.file)
            weights = [t for t in own.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) > 1]
            beside_weights += own.ByteSize() - sum(t.ByteSize() for t in weights)
    assert beyond_shared <= 0.90 * beside_weights
    for index in range(3):  # unnamed nodes, as in a tier's own file; no Identity but the one giving the branch's output
        nodes = branch(model, index).node
        assert not [n.name for n in nodes if n.name] and [n.op_type for n in nodes].count("Identity") == 1, index
    for index in range(3):  # one initializer per distinct value (slice bounds, zero points, scales, ...), whatever names they had
        values = [(t.data_type, tuple(t.dims), numpy_helper.to_array(t).tobytes()) for t in branch(model, index).initializer]
        assert len(values) == len(set(values)), index


@pytest.mark.parametrize("precision", PRECISIONS)
def test_tiers_of_one_structure_share_one_function_holding_their_graph(exports, precision):
    """Each branch is its cuts and one call of a model-local function running the tier's graph:
    the two tiers of the same depth (mid, full) call one function, stored once; the narrow tier,
    whose skipped blocks make another graph, calls its own. Inlined, the file is the same model."""
    nested = exports[3]
    model = onnx.load(nested / f"nested.{precision}.onnx")
    assert [(f.domain, f.name) for f in model.functions] == [(FUNCTION_DOMAIN, "tier_graph0"), (FUNCTION_DOMAIN, "tier_graph1")]
    calls = [[n.op_type for n in branch(model, index).node if n.domain == FUNCTION_DOMAIN] for index in range(3)]
    assert calls == [["tier_graph0"], ["tier_graph1"], ["tier_graph1"]]
    session = ort.InferenceSession(model.SerializeToString())
    inlined = ort.InferenceSession(onnx.inliner.inline_local_functions(model).SerializeToString())
    x = images(exports[0], n=3)
    for tier in range(3):
        feed = {"input": x, "tier": np.array(tier, np.int64)}
        np.testing.assert_array_equal(session.run(None, feed)[0], inlined.run(None, feed)[0])


def test_plain_onnxruntime_runs_every_tier_through_the_documented_inputs(exports):
    """What an app with only onnxruntime does: open the file with default options, read the tier
    table from its metadata, feed the images and the tier's index; FP32 gives the per-tier
    files' logits within 1e-5, INT8 exactly theirs: one quantization in both formats (the
    per-tier INT8 files were quantized on their own before, 0.1-0.4 apart from the nested tiers)."""
    compiled, _, files, nested = exports
    x = images(compiled)
    manifest = load_manifest(nested)
    for precision in PRECISIONS:
        session = ort.InferenceSession(str(nested / f"nested.{precision}.onnx"))
        table = json.loads(session.get_modelmeta().custom_metadata_map["nefl_zoo.nested"])
        assert table["precision"] == precision and table["tier_input"] == "tier" and table["version"] == 1
        assert session.get_modelmeta().description.startswith("The model takes the images (``input``) and an int64 scalar ``tier``")
        assert [t["name"] for t in table["tiers"]] == ["small", "mid", "full"]
        assert table["input"]["shape"] == list(compiled.input_size) and table["output"]["num_classes"] == 10
        for tier in table["tiers"]:
            entry = manifest.tier(tier["name"], precision)
            assert entry.index == tier["index"] and entry.macs == tier["macs"] and entry.accuracy == tier["accuracy"]
            logits = session.run(None, {"input": x, "tier": np.array(tier["index"], np.int64)})[0]
            own = ort.InferenceSession(str(files / load_manifest(files).tier(entry.label).file))
            reference = own.run(None, {"input": x})[0]
            if precision == "fp32":
                np.testing.assert_allclose(logits, reference, atol=1e-5, rtol=0)
            elif precision == "int8":  # weights shared over the full tensor, the tier's own activation ranges
                np.testing.assert_array_equal(logits, reference, err_msg=entry.label)
            else:  # FP16: the per-tier file computes in half precision between layers
                assert (logits.argmax(1) == reference.argmax(1)).mean() >= 0.9, entry.label
                assert np.abs(logits - reference).max() <= 0.01 * max(1, np.abs(reference).max())


def test_a_tier_counts_from_the_end_when_negative_and_fails_in_a_named_node_outside_the_table(exports):
    compiled, nested = exports[0], exports[3]
    session = ort.InferenceSession(str(nested / "nested.fp32.onnx"))
    x = images(compiled, n=2)
    run = lambda tier: session.run(None, {"input": x, "tier": np.array(tier, np.int64)})[0]  # noqa: E731
    np.testing.assert_array_equal(run(-1), run(2))
    np.testing.assert_array_equal(run(-3), run(0))
    for bad in (3, -4, 2**40):
        with pytest.raises(Exception, match="tier_out_of_range"):
            run(bad)


def optimized_ops(model: bytes, tmp_path, name: str) -> collections.Counter:
    """The compute operators onnxruntime runs for ``model`` after its graph optimizations, in
    the main graph and every subgraph (the plumbing that chooses a branch left out)."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    ops = collections.Counter()
    for graph in graphs(onnx.load(options.optimized_model_filepath)):
        for node in graph.node:
            if node.op_type not in ("If", "Less", "Identity") and node.name != "tier_out_of_range":
                ops[node.op_type] += 1
    return ops


def test_onnxruntime_runs_the_same_kernels_for_the_tiers_as_for_their_files(exports, tmp_path):
    """Every branch is optimised as its per-tier file is (fused, re-laid convolutions;
    QLinearConv, QLinearAdd, ... for INT8): what makes a tier of the nested model as fast as
    its own file. With the tiers' biases outside their branches, none of it happened."""
    _, _, files, nested = exports
    file_manifest = load_manifest(files)
    ops = {}
    for precision in PRECISIONS:
        ops[precision] = optimized_ops((nested / f"nested.{precision}.onnx").read_bytes(), tmp_path, "nested")
        reference = collections.Counter()
        for entry in file_manifest.tiers:
            if entry.precision == precision:
                reference += optimized_ops((files / entry.file).read_bytes(), tmp_path, "file")
        if precision != "fp16":
            assert ops[precision] == reference, precision
    assert ops["int8"]["QLinearConv"] > 0
    # FP16: half-precision weights cast to float32 once, at session creation: the FP32 kernels,
    # none of the casts an FP16 file runs between its layers
    assert ops["fp16"] == ops["fp32"] and reference["Cast"] > 0


def test_every_layer_reads_constants_of_its_own_branch(exports, tmp_path):
    """After onnxruntime's optimizations no node of a branch reads a top-level initializer: a
    weight read from the outer graph is not pre-packed (an INT8 QLinearConv repacked its weight
    on every run, up to 1.9x slower). The full tier takes its weights whole: the case to watch."""
    nested = exports[3]
    for precision in PRECISIONS:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / f"{precision}.onnx")
        ort.InferenceSession(str(nested / f"nested.{precision}.onnx"), options)
        model = onnx.load(options.optimized_model_filepath)
        top = {t.name for t in model.graph.initializer}
        full = branch(model, 2)
        assert full.initializer and not [i for n in full.node for i in n.input if i in top], precision


def test_int8_weights_are_quantized_once_over_the_full_tensor(exports):
    """The narrow tier's int8 conv weight is a slice of the full tensor's int8 weight, and its
    scales are the full tensor's per-channel scales times the tier's BatchNorm factor."""
    compiled, state, _, nested = exports
    model = onnx.inliner.inline_local_functions(onnx.load(nested / "nested.int8.onnx"))  # the tier graph's nodes in the branch
    q, scale = quantize_per_channel(state["layer1.0.conv1.weight"].numpy())
    top = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(top["layer1.0.conv1.weight"], q)
    small = branch(model, 0)
    local = {t.name: numpy_helper.to_array(t) for t in small.initializer}
    (cut,) = [n for n in small.node if n.op_type == "Slice" and n.input[0] == "layer1.0.conv1.weight"]
    region = compiled["small"].slice_map["layer1.0.conv1.weight"].index
    rows, cols = region[0].stop, region[1].stop
    assert list(local[cut.input[2]]) == [rows, cols] and list(local[cut.input[3]]) == [0, 1]
    (dequantize,) = [n for n in small.node if n.op_type == "DequantizeLinear" and n.input[0] == cut.output[0]]
    bn = compiled["small"].extract(state)
    factor = bn["layer1.0.bn1.weight"] * torch.rsqrt(bn["layer1.0.bn1.running_var"] + 1e-5)
    np.testing.assert_allclose(local[dequantize.input[1]], scale[:rows] * factor.numpy(), rtol=1e-6)
    assert (factor < 0).any()  # a negative BatchNorm scale is carried by the dequantization scale


def int8_conv(weight_dtype=np.int8):
    """A Conv whose input and per-output-channel weight are dequantized, as onnxruntime's
    quantizer writes it, and its tier arrays (the weight quantized over the whole tensor)."""
    nodes = [
        helper.make_node("DequantizeLinear", ["x_quantized", "x_scale"], ["x"]),
        helper.make_node("DequantizeLinear", ["w_quantized", "w_scale", "w_zero"], ["w"], axis=0),
        helper.make_node("Conv", ["x", "w"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x_quantized", onnx.TensorProto.INT8, None)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    weight = torch.randn(4, 2, 1, 1, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_per_channel(weight.numpy())
    arrays = {"w_quantized": q.astype(weight_dtype), "w_scale": scale * 2, "w_zero": np.zeros(4, np.int8), "x_scale": np.float32(0.1)}
    return helper.make_model(graph), arrays, weight


@pytest.mark.parametrize("change", ["uint8 weight", "scale not an initializer", "weight not an initializer"])
def test_only_an_int8_weight_with_its_scale_in_the_tier_becomes_a_shared_slice(change):
    from nefl_zoo.export.nested import SharedTensors, _int8_slices

    fp32 = {"w": (Slice("w", "conv.weight", (None,) * 4), {})}
    model, arrays, weight = int8_conv()
    (cut, tier), = _int8_slices(model, arrays, fp32, {"w": weight.numpy()}, SharedTensors("int8", {"conv.weight": weight})).values()
    assert (cut, tier) == (Slice("w_quantized", "conv.weight", (None,) * 4), {})
    np.testing.assert_array_equal(arrays["w_scale"], quantize_per_channel(weight.numpy())[1])  # the shared scale
    model, arrays, weight = int8_conv(np.uint8 if change == "uint8 weight" else np.int8)
    computed = {"scale not an initializer": "w_scale", "weight not an initializer": "w_quantized"}
    if change in computed:  # an output of some node, not a stored tensor
        del arrays[computed[change]]
    before = dict(arrays)
    assert _int8_slices(model, arrays, fp32, {"w": weight.numpy()}, SharedTensors("int8", {"conv.weight": weight})) == {}
    assert arrays.keys() == before.keys() and all(arrays[k] is v for k, v in before.items())  # kept as the tier's literals


def test_an_export_whose_branch_reads_another_tiers_slice_fails(exports, tmp_path, monkeypatch):
    """The small tier's branch cutting its first weight one channel further along (a region of
    the same shape, as a slice map mixed up between tiers would give): the export's check of
    every branch against its tier fails, and nothing is published."""
    from nefl_zoo.export import package as package_module

    compiled, state = exports[0], exports[1]
    real = package_module.nested_model

    def shifted(entries, shared, metadata):
        if len(entries) > 1:
            first = entries[0].slices[0]
            moved = Slice(first.name, first.shared, ((1, first.index[0][1] + 1), *first.index[1:]), first.scale, first.dtype, first.pad)
            entries = [type(entries[0])(entries[0].name, entries[0].graph, entries[0].arrays, entries[0].literals,
                                        (moved, *entries[0].slices[1:])), *entries[1:]]
        return real(entries, shared, metadata)

    monkeypatch.setattr(package_module, "nested_model", shifted)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"entry small: the nested model's logits differ from the tier's alone by"):
        export_tiers(ExportSource(compiled, state, "test"), out, tiers=["small", "full"], latency_runs=1, threads=1, format="nested")
    assert not (out / "manifest.json").exists()


def test_a_rehashed_file_whose_branch_reads_another_region_gives_other_outputs(exports, nested_copy):
    """The branch's slice bounds are what place the weights: shifting one region by a channel
    (same shape, file re-hashed) gives other logits than the tier's own file."""
    compiled, _, files, _ = exports
    path = nested_copy / "nested.fp32.onnx"
    model = onnx.load(path)
    small = branch(model, 0)
    cut = next(n for n in small.node if n.op_type == "Slice" and n.input[0] == "layer1.0.conv1.weight")
    local = {t.name: numpy_helper.to_array(t) for t in small.initializer}
    for k in (1, 2):  # the cut's own bounds, one channel further (other cuts may read the same constants)
        small.initializer.append(numpy_helper.from_array(local[cut.input[k]] + np.array([0, 1]), f"{cut.input[k]}+1"))
        cut.input[k] = f"{cut.input[k]}+1"
    path.write_bytes(model.SerializeToString())
    rehash(nested_copy, path.name)
    x = images(compiled)
    assert np.abs(TierRuntime(nested_copy).run(x, "small") - TierRuntime(files).run(x, "small")).max() > 1e-5
    np.testing.assert_allclose(TierRuntime(nested_copy).run(x, "mid"), TierRuntime(files).run(x, "mid"), atol=1e-5)


def test_a_tampered_nested_file_is_refused_in_one_line(nested_copy):
    data = bytearray((nested_copy / "nested.fp32.onnx").read_bytes())
    data[len(data) // 2] ^= 1
    (nested_copy / "nested.fp32.onnx").write_bytes(bytes(data))
    runtime = TierRuntime(nested_copy)
    with pytest.raises(ManifestError, match=r"nested.fp32.onnx: sha256 \w+\.\.\. does not match the manifest's") as info:
        runtime.session("small")
    assert "\n" not in str(info.value)
    assert runtime.session("small:int8") is not None  # the other precisions still load


def test_nested_files_must_stay_in_the_folder(nested_copy, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (nested_copy / "nested.fp32.onnx").rename(outside / "nested.fp32.onnx")
    (nested_copy / "nested.fp32.onnx").symlink_to(outside / "nested.fp32.onnx")
    with pytest.raises(ManifestError, match=r"nested.fp32.onnx: resolves to .*, outside the manifest's folder"):
        TierRuntime(nested_copy).session("full")
    manifest = json.loads((nested_copy / "manifest.json").read_text())
    manifest["tiers"][0]["file"] = "../nested.fp32.onnx"
    with pytest.raises(ManifestError, match=r"tiers\[0\].file: String should match pattern"):
        parse_manifest(manifest)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["tiers"][0].pop("index"), r"tiers\[0\].index: required for format nested"),
        (lambda m: m.update(format="files"), r"tiers\[0\].index: only for format nested"),
        (lambda m: m.update(schema_version=2), "format: nested models need schema version 4, got 2"),
        (lambda m: m["tiers"][0].update(index=7), "the fp32 entries' indices are"),
        (lambda m: m["tiers"][3].update(file="nested.int8.onnx"), r"tiers\[3\].file: nested.int8.onnx, but the fp32 entries"),
        (lambda m: [t.update(file="nested.fp32.onnx") for t in m["tiers"]], "each precision needs a nested file of its own"),
        (lambda m: m.update(schema_version=3), "a schema 3 nested package .* re-export it"),
    ],
)
def test_an_inconsistent_nested_manifest_is_refused_when_read(exports, edit, message):
    manifest = json.loads((exports[3] / "manifest.json").read_text())
    edit(manifest)
    with pytest.raises(ManifestError, match=message):
        parse_manifest(manifest)


def test_a_model_without_the_tier_input_is_refused_naming_it(exports, nested_copy):
    """A per-tier file put in the nested file's place (re-hashed) has no ``tier`` input."""
    shutil.copy(exports[2] / "small.onnx", nested_copy / "nested.fp32.onnx")
    rehash(nested_copy, "nested.fp32.onnx")
    with pytest.raises(ManifestError, match="format: nested, but nested.fp32.onnx has no int64 scalar input 'tier'"):
        TierRuntime(nested_copy).session("small")


def test_a_model_that_refers_to_external_data_is_refused_before_onnxruntime_sees_it(nested_copy, tmp_path, monkeypatch):
    """An initializer whose data lies in ``weights.bin`` (which no hash covers), even inside a
    branch, is refused in one line naming the file and the tensor, whatever the working directory."""
    path = nested_copy / "nested.fp32.onnx"
    model = onnx.load(path)
    tensor = numpy_helper.from_array(np.zeros(2, np.float32), "planted")
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="weights.bin")
    branch(model, 1).initializer.append(tensor)
    path.write_bytes(model.SerializeToString())
    rehash(nested_copy, path.name)
    (nested_copy / "weights.bin").write_bytes(np.zeros(2, np.float32).tobytes())
    monkeypatch.chdir(nested_copy)
    with pytest.raises(ManifestError, match=r"nested.fp32.onnx: tensor planted is stored as external data, which no hash covers") as info:
        TierRuntime(nested_copy).session("small")
    assert "\n" not in str(info.value)


def test_cli_select_predict_and_bench_tiers_work_on_a_nested_export(exports, tmp_path):
    from PIL import Image

    nested = exports[3]
    runner = CliRunner()
    chosen = runner.invoke(app, ["select", str(nested), "--max-params", "50000", "--json"])
    assert chosen.exit_code == 0, chosen.output
    assert json.loads(chosen.stdout)["tier"] == "small"
    image = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(image)
    predicted = runner.invoke(app, ["predict", str(nested), str(image), "--tier", "mid:int8", "--top-k", "1"])
    assert predicted.exit_code == 0 and "(tier mid:int8)" in predicted.stdout, predicted.output
    timed = runner.invoke(app, ["bench-tiers", str(nested), "--batch", "2", "--runs", "1", "--low-memory", "--json"])
    assert timed.exit_code == 0, timed.output
    assert {r["label"] for r in json.loads(timed.stdout)["tiers"]} == {t.label for t in load_manifest(nested).tiers}
    assert json.loads(timed.stdout)["low_memory"] is True


def test_the_device_bench_runs_a_nested_export_without_torch(exports, tmp_path):
    done = bench(exports[3], "--batch", "1", "--runs", "1", "--warmup", "0", "--threads", "1", "--out", tmp_path / "d.json")
    assert done.returncode == 0 and "BLOCKED" not in done.stderr, done.stderr
    table = json.loads((tmp_path / "d.json").read_text())
    manifest = load_manifest(exports[3])
    assert {(e["label"], e["sha256"]) for e in table["entries"]} == {(t.label, t.sha256) for t in manifest.tiers}


def test_the_adaptive_runtime_steps_down_when_its_entry_slows_and_meets_the_deadline(exports, monkeypatch):
    """A fake clock makes every entry take its given latency times a load: under a 4x load the
    runtime leaves the most accurate entry on the second slow request and then keeps within the
    deadline."""
    from nefl_zoo.runtime import nested as nested_module

    nested = exports[3]
    manifest = load_manifest(nested)
    base = {t.label: 0.5 + t.macs_ratio * 4 for t in manifest.tiers}  # ms, growing with the MACs
    now, load = [0.0], [1.0]
    runtime = TierRuntime(nested, policy=Deadline(ms=6.0, probe_after_s=1.0), latencies=base, precisions=["fp32"],
                          clock=lambda: now[0])

    def timed_run(self, *args):
        label = runtime.adaptive.current
        now[0] += base[label] * load[0] / 1e3
        return [np.zeros((1, 10), np.float32)]

    monkeypatch.setattr(nested_module.TierSession, "run", timed_run)  # the clock advances as if the entry had run
    x = images(exports[0], n=1)
    served = []
    for request in range(60):
        load[0] = 4.0 if request >= 20 else 1.0
        runtime.run(x, "adaptive")
        served.append((runtime.last_label, base[runtime.last_label] * load[0]))
    assert {label for label, _ in served[:20]} == {"full"}  # the most accurate fitting entry, idle
    assert [ms > 6.0 for _, ms in served[20:]] == [True, True] + [False] * 38  # two misses (what p95 allows), then none
    assert runtime.adaptive.switches[0].from_label == "full"
    with pytest.raises(ValueError, match="tier adaptive: this runtime has no policy"):
        TierRuntime(nested).run(x, "adaptive")


def test_an_export_that_reads_back_other_than_it_was_made_is_not_published(exports, tmp_path, monkeypatch):
    """The staged export is read back through the runtime before it is published: a nested file
    written with one weight changed (as a bad disk or a writer bug would) fails the export, and
    nothing is published."""
    from nefl_zoo.export import package as package_module

    compiled, state = exports[0], exports[1]
    real = package_module.PackageWriter.finish

    def one_weight_changed(self, folder, metadata):
        written = real(self, folder, metadata)
        model = onnx.load(folder / "nested.fp32.onnx")
        weight = next(t for t in model.graph.initializer if t.name == "conv1.weight")
        weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 2, weight.name))
        (folder / "nested.fp32.onnx").write_bytes(model.SerializeToString())
        return written

    monkeypatch.setattr(package_module.PackageWriter, "finish", one_weight_changed)
    out = tmp_path / "out"
    with pytest.raises((ExportError, ManifestError), match="sha256|read back gives other logits"):
        export_tiers(ExportSource(compiled, state, "test"), out, tiers=["small"], latency_runs=1, threads=1, format="nested")
    assert not (out / "manifest.json").exists()


def test_padded_tiers_share_their_weights_too(exports, tmp_path, capfd, monkeypatch):
    """With inner channels zero-padded (``channel_align``), every FP32 and INT8 conv weight of
    the tier is still a (zero-padded) slice of a shared tensor, FP32 gives the padded tier
    file's logits and INT8 exactly its file's. FP16 pads its weights after casting them to
    float32, so that onnxruntime folds the pads (it has no half-precision Pad on the CPU: it
    warned on every load, and ran the pad at every request)."""
    compiled, state = exports[0], exports[1]
    x = images(compiled)
    out = {}
    for layout in ("files", "nested"):
        out[layout] = tmp_path / layout
        export_tiers(ExportSource(compiled, state, "test"), out[layout], tiers=["small"], latency_runs=1, threads=1,
                     channel_align=16, precisions=["fp32", "int8", "fp16"], calibration=images(compiled, 32, seed=2),
                     format=layout, warn=pytest.fail)
    manifest = load_manifest(out["nested"])
    assert all(t.channel_align == 16 for t in manifest.tiers)
    nested, files = TierRuntime(out["nested"]), TierRuntime(out["files"])
    np.testing.assert_allclose(nested.run(x, "small"), files.run(x, "small"), atol=1e-5)
    np.testing.assert_array_equal(nested.run(x, "small:int8"), files.run(x, "small:int8"))
    monkeypatch.setenv("NEFL_ZOO_ORT_LOG", "2")  # onnxruntime's warnings shown
    capfd.readouterr()
    TierRuntime(out["nested"]).session("small:fp16")
    assert "onnxruntime" not in capfd.readouterr().err
    for precision in ("fp32", "int8"):
        graph = onnx.load(out["nested"] / f"nested.{precision}.onnx").graph  # one tier: its branch is the main graph
        literal_weights = [t.name for t in graph.initializer if len(t.dims) == 4 and t.name.startswith("t0/") and "~" not in t.name]
        assert [n for n in graph.node if n.op_type == "Pad"] and not literal_weights, precision


def test_the_adaptive_runtime_runs_each_ladder_tier_once_before_serving(exports, monkeypatch):
    """A first run allocates and is slow; the runtime runs every tier of the ladder once when it
    starts, so the policy never takes that for a slowdown."""
    from nefl_zoo.runtime import nested as nested_module

    runs = collections.Counter()
    real = nested_module.TierSession.run

    def counting(self, *args, **kwargs):
        runs.update([self.index])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(nested_module.TierSession, "run", counting)
    runtime = TierRuntime(exports[3], policy=Deadline(ms=1000.0), precisions=["fp32"])
    manifest = load_manifest(exports[3])
    assert set(runs) == {manifest.tier(label).index for label in runtime.adaptive.ladder}
    assert set(runs.values()) == {1}
    assert len(runtime._sessions) == 1  # one session serves every tier


def test_a_model_past_the_protobuf_limit_is_refused_in_one_line(exports, tmp_path, monkeypatch):
    from nefl_zoo.export import package as package_module

    monkeypatch.setattr(package_module, "MAX_TIER_BYTES", 1000)
    compiled, state = exports[0], exports[1]
    with pytest.raises(ExportError, match=r"the fp32 nested model is .* GiB, past ONNX's 2 GiB protobuf limit .*--format files"):
        export_tiers(ExportSource(compiled, state, "test"), tmp_path / "out", tiers=["small"], latency_runs=1, threads=1, format="nested")


def test_re_exporting_changes_nothing_but_the_timings(exports, tmp_path):
    """Same source, same files: the nested model is deterministic, byte for byte."""
    compiled, state = exports[0], exports[1]
    source = ExportSource(compiled, state, "test", accuracy={"small": 0.6, "mid": 0.7, "full": 0.8})
    export_tiers(source, tmp_path, precisions=["fp32"], calibration=calibration_images(compiled.input_size), latency_runs=1, threads=1, format="nested")
    assert file_sha256(tmp_path / "nested.fp32.onnx") == file_sha256(exports[3] / "nested.fp32.onnx")
    assert re.fullmatch(r"[0-9a-f]{64}", load_manifest(tmp_path).tiers[0].sha256)


def test_a_precision_exports_without_fp32(exports, tmp_path):
    """Any subset of the precisions exports: ``int8`` alone failed with ``KeyError: 'fp32'`` (the
    nested writer assumed an FP32 entry; ``fp16`` alone took the same path); the tier is the one
    the export of every precision holds, to the logit."""
    compiled, state, _, nested = exports
    manifest = export_tiers(ExportSource(compiled, state, "test"), tmp_path, tiers=["small"], precisions=["int8"],
                            calibration=calibration_images(compiled.input_size), latency_runs=1, threads=1, format="nested",
                            warn=pytest.fail)
    assert [t.label for t in manifest.tiers] == ["small:int8"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "nested.int8.onnx"]
    x = images(compiled)
    np.testing.assert_array_equal(TierRuntime(tmp_path).run(x, "small:int8"), TierRuntime(nested).run(x, "small:int8"))


def test_the_channel_padding_auto_chose_is_recorded_and_reused(exports, tmp_path, monkeypatch):
    """``channel_align="auto"`` times the plain and the padded tier and keeps the faster, and
    records the choice and its timings in the manifest; an export into a folder holding that
    record reuses it instead of timing again (it timed again, and a near tie flipped the choice:
    the same run exported twice gave 1,138,820 and 1,138,720 bytes). With the alignment fixed,
    an export is byte for byte the same (the test below), so the same source exported twice now
    gives the same files. A record of another tier (other params) is not reused."""
    from nefl_zoo.export import tiers as tiers_module
    from nefl_zoo.export.onnx_file import cpu_channel_block

    compiled, state, _, nested = exports
    block = cpu_channel_block()
    manifest = json.loads((nested / "manifest.json").read_text())
    recorded = {str(block): 1.0, "1": 2.0}  # as if padding had won by 2x when the folder was first exported
    for entry in manifest["tiers"]:
        entry.update(channel_align=block, channel_align_ms=recorded)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    real, timed = tiers_module.interleaved_median_ms, []

    def counting(calls, runs, **kwargs):
        timed.append(sorted(map(str, calls)))
        return real(calls, runs, **kwargs)

    monkeypatch.setattr(tiers_module, "interleaved_median_ms", counting)
    again = export_tiers(ExportSource(compiled, state, "test"), tmp_path, tiers=["small"], latency_runs=1, threads=1,
                         channel_align="auto", format="nested")
    assert [str(block)] in timed and ["1", str(block)] not in timed  # the kept file's latency only: no choice timed
    assert again.tiers[0].channel_align == block and again.tiers[0].channel_align_ms == recorded
    profiles = {p.name: p for p in profile_tiers(compiled)}
    assert tiers_module.recorded_alignments(tmp_path, compiled, profiles) == {"small": (block, recorded)}
    other = compile_spec(parse_spec({**SPEC, "tiers": [{"name": "small", "gamma_w": 0.5}]}))  # another tier of that name
    assert tiers_module.recorded_alignments(tmp_path / "manifest.json", other, {p.name: p for p in profile_tiers(other)}) == {}


def quiet_failure(capfd, call, message):
    """``call()`` raises a ManifestError of one line matching ``message``, and onnxruntime printed
    nothing of its own (its log lines went to stderr before the one-line error)."""
    capfd.readouterr()
    with pytest.raises(ManifestError, match=message) as info:
        call()
    assert "\n" not in str(info.value)
    printed = capfd.readouterr()
    assert "onnxruntime" not in printed.err + printed.out, printed.err


def test_a_manifest_entry_past_the_files_tiers_is_refused_in_one_line(exports, nested_copy, capfd):
    """An entry whose index is past the nested file's tier table (the manifest edited, a tier
    added) is refused when the file is opened, naming the field; it ran, and onnxruntime's log
    line came before an "unexpected" error."""
    manifest = json.loads((nested_copy / "manifest.json").read_text())
    full = next(t for t in manifest["tiers"] if t["name"] == "full" and t["precision"] == "fp32")
    manifest["tiers"].append({**full, "name": "extra", "index": 3})
    (nested_copy / "manifest.json").write_text(json.dumps(manifest))
    quiet_failure(capfd, lambda: TierRuntime(nested_copy).session("extra"),
                  r"manifest.json: tiers\[9\].index: 3, but nested.fp32.onnx holds 3 tiers \(0..2\); re-export$")
    manifest["tiers"].pop()
    next(t for t in manifest["tiers"] if t["name"] == "mid" and t["precision"] == "fp32")["name"] = "wide"
    (nested_copy / "manifest.json").write_text(json.dumps(manifest))
    quiet_failure(capfd, lambda: TierRuntime(nested_copy).session("small"), r"tiers\[3\].index: 1 is tier 'mid' in nested.fp32.onnx, not 'wide'")


def huge_kernel(model):
    """Tier 0's first cut weight padded to a 1000 x 1000 kernel before its graph reads it."""
    small = branch(model, 0)
    (call,) = [n for n in small.node if n.domain == FUNCTION_DOMAIN]
    weight = call.input[1]
    small.initializer.append(numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 0, 997, 997], np.int64), "huge_pads"))
    small.node.insert(list(small.node).index(call), helper.make_node("Pad", [weight, "huge_pads"], ["huge_weight"]))
    call.input[1] = "huge_weight"


def huge_initializer(model):
    """A shared weight declaring 2**40 x 2**40 elements (its data unchanged)."""
    del model.graph.initializer[0].dims[:]
    model.graph.initializer[0].dims.extend([2**40, 2**40])


@pytest.mark.parametrize("tamper", [huge_kernel, huge_initializer])
def test_a_model_onnxruntime_cannot_load_is_one_line_and_nothing_else(nested_copy, capfd, tamper):
    """Re-hashed files onnxruntime refuses: one line naming the file, and none of onnxruntime's
    own log lines (up to three came first) unless ``NEFL_ZOO_ORT_LOG`` asks for them."""
    path = nested_copy / "nested.fp32.onnx"
    model = onnx.load(path)
    tamper(model)
    path.write_bytes(model.SerializeToString())
    rehash(nested_copy, path.name)
    quiet_failure(capfd, lambda: TierRuntime(nested_copy).session("small"), r"nested.fp32.onnx: onnxruntime cannot load the model for tier small \(")


def test_a_failure_while_running_names_the_file_and_the_tier(exports, capfd, monkeypatch):
    from nefl_zoo.runtime.session import ORT_LOG_ENV

    session = TierRuntime(exports[3]).session("mid:int8")
    bad = {"input": np.zeros((1, 5, 16, 16), np.float32)}  # 5 channels: onnxruntime fails in the first convolution
    quiet_failure(capfd, lambda: session.run(None, bad),
                  r"nested.int8.onnx: tier mid:int8 \(index 1\): onnxruntime failed running it \(\[ONNXRuntimeError\]")
    monkeypatch.setenv(ORT_LOG_ENV, "1")  # asked for: onnxruntime's own lines are printed
    TierRuntime(exports[3]).session("mid:int8")
    assert "[I:onnxruntime" in capfd.readouterr().err
    monkeypatch.setenv(ORT_LOG_ENV, "loud")
    with pytest.raises(ValueError, match=r"NEFL_ZOO_ORT_LOG: must be an onnxruntime log severity 0 \(verbose\) .. 4 \(fatal\), got 'loud'"):
        TierRuntime(exports[3]).session("small")


def test_the_cli_and_the_device_bench_say_one_line_when_a_tier_cannot_be_served(exports, nested_copy, tmp_path, capfd):
    """``predict`` and ``python -m nefl_zoo.runtime bench`` on an export with an entry past its
    file's tiers: exit 2 and one ``error:`` line, nothing of onnxruntime's own (``predict``
    printed onnxruntime's log line, then an "unexpected" error; the bench a traceback, exit 1)."""
    from PIL import Image

    from nefl_zoo.runtime.__main__ import main

    manifest = json.loads((nested_copy / "manifest.json").read_text())
    full = next(t for t in manifest["tiers"] if t["name"] == "full" and t["precision"] == "int8")
    manifest["tiers"].append({**full, "name": "extra", "index": 3})
    (nested_copy / "manifest.json").write_text(json.dumps(manifest))
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(image)
    capfd.readouterr()
    predicted = CliRunner().invoke(app, ["predict", str(nested_copy), str(image), "--tier", "extra:int8"])
    with pytest.raises(SystemExit) as exited:
        main(["bench", str(nested_copy), "--runs", "1", "--warmup", "0", "--labels", "extra:int8"])
    printed = capfd.readouterr()
    assert predicted.exit_code == 2 and exited.value.code == 2
    assert "onnxruntime" not in printed.out + printed.err
    for stderr in (predicted.stderr, printed.err):
        (line,) = stderr.splitlines()
        assert re.fullmatch(r"error: \S+manifest.json: tiers\[9\].index: 3, but nested.int8.onnx holds 3 tiers \(0..2\); re-export", line), line


def test_the_low_memory_mode_keeps_one_copy_of_the_shared_weights(exports, tmp_path):
    """``TierRuntime(low_memory=True)``: onnxruntime's constant folding off, so a session holds
    the shared weights once (the optimized graph's initializers about the file's bytes; by
    default every tier's folded cuts too) and gives the same logits (INT8 exactly)."""
    from nefl_zoo.runtime.session import session_options

    compiled, nested = exports[0], exports[3]
    x = images(compiled, n=4)
    default, low = TierRuntime(nested, threads=1), TierRuntime(nested, threads=1, low_memory=True)
    for entry in load_manifest(nested).tiers:
        expected, got = default.run(x, entry.label), low.run(x, entry.label)
        if entry.precision == "int8":
            np.testing.assert_array_equal(got, expected, err_msg=entry.label)
        else:
            np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0, err_msg=entry.label)
    held = {}
    for mode in (False, True):
        options = session_options(1, low_memory=mode)
        options.optimized_model_filepath = str(tmp_path / f"{mode}.onnx")
        ort.InferenceSession(str(nested / "nested.fp32.onnx"), options, providers=["CPUExecutionProvider"])
        held[mode] = sum(numpy_helper.to_array(t).nbytes for g in graphs(onnx.load(options.optimized_model_filepath)) for t in g.initializer)
    size = (nested / "nested.fp32.onnx").stat().st_size
    assert held[True] <= 1.02 * size and held[False] >= 1.5 * size, (held, size)

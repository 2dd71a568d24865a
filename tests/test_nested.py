"""Nested packages: every tier from one copy of the shared tensors, checked like tier files.

One source (a ResNet20 with trained-looking BatchNorm statistics and step sizes, three tiers:
a narrow one with skipped blocks, a middle one and the full model) is exported twice, as
per-tier files and as a nested package, at FP32, INT8 and FP16. The per-tier files are the
reference the package is held to.
"""

import collections
import json
import re
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper
from typer.testing import CliRunner

from nefl_zoo.export import ExportSource, export_tiers
from nefl_zoo.export.nested import quantize_per_channel
from nefl_zoo.manifest import ManifestError, file_sha256, load_manifest, parse_manifest
from nefl_zoo.runtime import Deadline, TierRuntime
from nefl_zoo.runtime.arrays import parse_safetensors
from nefl_zoo.runtime.nested import SLICES_KEY, materialize, parse_tier_file
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec
from nefl_zoo_cli.app import app

from .support.device import bench

SPEC = {
    "model": "resnet20",
    "model_args": {"num_classes": 10, "img_size": 16},
    "inconsistent": ["steps", "norm"],
    "tiers": [
        {"name": "small", "gamma_w": 0.25, "steps": [[1, 0, 0.5], [1, 0.7, 0], [1, 0, 1]]},
        {"name": "mid", "gamma_w": 0.5},
        {"name": "full"},
    ],
}
PRECISIONS = ["fp32", "int8", "fp16"]


def trained_looking_state(compiled):
    """Global state whose norms are not the identity and whose step sizes are not 1, so that
    folding, per-tier tensors and slices all matter (negative BN scales included)."""
    generator = torch.Generator().manual_seed(0)
    state = compiled.init_global_state()
    for key, value in state.items():
        if value.dtype != torch.float32:
            continue
        if "running_var" in key:
            value.copy_(torch.rand(value.shape, generator=generator) + 0.5)
        elif ".bn" in key or "downsample.1" in key:
            value.copy_(torch.randn(value.shape, generator=generator) * 0.5 + (1.0 if key.endswith("weight") else 0.0))
        elif "step" in key:
            value.mul_(0.8)
    return state


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    compiled = compile_spec(parse_spec(SPEC))
    state = trained_looking_state(compiled)
    calibration = np.random.default_rng(0).standard_normal((64, *compiled.input_size)).astype(np.float32)
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


def test_the_package_holds_each_shared_tensor_once_per_precision(exports):
    compiled, state, files, nested = exports
    manifest = load_manifest(nested)
    assert manifest.format == "nested" and manifest.schema_version == 3 and set(manifest.shared) == set(PRECISIONS)
    shared = parse_safetensors((nested / manifest.shared["fp32"].file).read_bytes())[0]
    # every shared (consistent) weight of the global model, at full size, bit for bit
    for key, array in shared.items():
        np.testing.assert_array_equal(array, state[key].numpy())
    assert {"conv1.weight", "layer3.2.conv2.weight", "fc.weight"} <= set(shared)
    assert not any("@" in key for key in shared)  # per-tier tensors are never shared
    package_bytes = sum(f.stat().st_size for f in nested.iterdir() if ".fp32." in f.name)  # shared, graphs, tensors
    files_bytes = sum((files / t.file).stat().st_size for t in load_manifest(files).tiers if t.precision == "fp32")
    full_file = (files / "full.onnx").stat().st_size
    assert package_bytes <= 1.15 * full_file < files_bytes
    int8 = parse_safetensors((nested / manifest.shared["int8"].file).read_bytes())[0]
    assert all(a.dtype == np.int8 for a in int8.values())


def test_every_entry_gives_its_tier_files_outputs(exports):
    compiled, _, files, nested = exports
    x = images(compiled)
    by_file, by_package = TierRuntime(files, threads=1), TierRuntime(nested, threads=1)
    assert [t.label for t in by_file.manifest.tiers] == [t.label for t in by_package.manifest.tiers]
    for entry in by_package.manifest.tiers:
        reference, logits = by_file.run(x, entry.label), by_package.run(x, entry.label)
        if entry.precision == "fp32":  # the same graph and the same floats: PyTorch's fold, redone in numpy
            np.testing.assert_array_equal(logits, reference)
        else:  # INT8: shared int8 weights, the tier's own activation ranges; FP16: scaled in float32
            fp32 = by_file.run(x, entry.name)
            assert (logits.argmax(1) == fp32.argmax(1)).mean() >= 0.9, entry.label
            assert np.abs(logits - fp32).max() <= 0.25 * max(1, np.abs(fp32).max())


def optimized_ops(model: bytes, tmp_path, name: str) -> collections.Counter:
    """The operators onnxruntime runs for ``model`` after its graph optimizations."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)


def test_onnxruntime_runs_the_same_kernels_for_an_entry_as_for_its_tier_file(exports, tmp_path):
    """The same fused operators (QLinearConv, QLinearAdd, ... for INT8): what makes a package
    entry as fast as its per-tier file. A scalar stored as a 1-element tensor, for one, keeps
    onnxruntime from fusing an INT8 residual add."""
    from nefl_zoo.runtime.nested import NestedPackage

    _, _, files, nested = exports
    manifest = load_manifest(nested)
    package = NestedPackage(manifest, nested)
    for entry in manifest.tiers:
        own = optimized_ops(package.model_bytes(entry), tmp_path, "nested")
        reference = optimized_ops((files / load_manifest(files).tier(entry.label).file).read_bytes(), tmp_path, "file")
        assert own == reference, entry.label
    assert own["QLinearConv"] > 0 or manifest.tiers[-1].precision != "int8"


def test_int8_weights_are_quantized_once_over_the_full_tensor(exports):
    """The narrow tier's int8 conv weight is the prefix of the full tensor's int8 weight, and its
    scales are the full tensor's per-channel scales times the tier's BatchNorm factor."""
    compiled, state, _, nested = exports
    manifest = load_manifest(nested)
    entry = manifest.tier("small", "int8")
    graph = onnx.load_model_from_string((nested / entry.file).read_bytes())
    assert not graph.graph.initializer  # weights-free
    tier = parse_tier_file((nested / entry.tensors.file).read_bytes(), "t")
    cut = next(c for c in tier.slices if c.shared == "layer1.0.conv1.weight")
    (dequantize,) = [n for n in graph.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == cut.name]
    q, scale = quantize_per_channel(state["layer1.0.conv1.weight"].numpy())
    small = compiled["small"].slice_map["layer1.0.conv1.weight"]
    assert cut.shared == "layer1.0.conv1.weight" and cut.index == tuple((s.start or 0, s.stop) for s in small.index)
    rows, cols = small.index[0].stop, small.index[1].stop
    shared = parse_safetensors((nested / manifest.shared["int8"].file).read_bytes())[0]
    np.testing.assert_array_equal(materialize(cut, shared, tier.arrays), q[:rows, :cols])
    bn = compiled["small"].extract(state)
    factor = bn["layer1.0.bn1.weight"] * torch.rsqrt(bn["layer1.0.bn1.running_var"] + 1e-5)
    np.testing.assert_allclose(tier.arrays[dequantize.input[1]], scale[:rows] * factor.numpy(), rtol=1e-6)
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
    from nefl_zoo.runtime.nested import Slice

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


def edit_tier_file(folder, entry_label, edit):
    """Rewrite an entry's per-tier file with ``edit(arrays, metadata)`` and re-hash it, as an
    attacker or a buggy exporter that also fixes the manifest would."""
    from safetensors.numpy import save

    manifest = json.loads((folder / "manifest.json").read_text())
    entry = next(t for t in manifest["tiers"] if (t["name"] if t["precision"] == "fp32" else f"{t['name']}:{t['precision']}") == entry_label)
    path = folder / entry["tensors"]["file"]
    arrays, metadata = parse_safetensors(path.read_bytes())
    arrays = {k: np.array(v) for k, v in arrays.items()}
    metadata = dict(metadata)
    edit(arrays, metadata)
    path.write_bytes(save(arrays, metadata=metadata))
    entry["tensors"].update(sha256=file_sha256(path), bytes=path.stat().st_size)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_shared_tensor_sliced_with_another_tiers_map_is_caught(exports, nested_copy):
    """The small tier's slice map with the mid tier's regions: its weights no longer fit its
    graph (a one-line error) or no longer give its outputs."""
    compiled = exports[0]
    mid = {c.shared: c for c in parse_tier_file((nested_copy / "mid.fp32.tensors.safetensors").read_bytes(), "m").slices}

    def other_tiers_regions(arrays, metadata):
        content = json.loads(metadata[SLICES_KEY])
        for item in content["slices"]:
            if item["shared"] in mid:
                item["index"] = [list(i) if isinstance(i, tuple) else i for i in mid[item["shared"]].index]
        metadata[SLICES_KEY] = json.dumps(content)

    edit_tier_file(nested_copy, "small", other_tiers_regions)
    with pytest.raises(ManifestError, match=r"small.fp32.graph.onnx: onnxruntime cannot load the model|scale .* is not a tier tensor"):
        TierRuntime(nested_copy).run(images(compiled), "small")


def test_a_region_moved_by_one_channel_changes_the_outputs(exports, nested_copy):
    """The slice map is what places the weights: shifting one region by a channel (same shape,
    re-hashed) gives other logits, so a test comparing with the tier file would catch it."""
    compiled, _, files, _ = exports

    def shift(arrays, metadata):
        content = json.loads(metadata[SLICES_KEY])
        item = next(i for i in content["slices"] if i["shared"] == "layer1.0.conv1.weight")
        item["index"][1] = [1, item["index"][1][1] + 1]
        metadata[SLICES_KEY] = json.dumps(content)

    edit_tier_file(nested_copy, "small", shift)
    x = images(compiled)
    assert np.abs(TierRuntime(nested_copy).run(x, "small") - TierRuntime(files).run(x, "small")).max() > 1e-5


def test_a_rehashed_file_that_does_not_fit_is_refused_naming_it(nested_copy):
    """A slice of a tensor the shared file lacks names the per-tier file; a shared file that is
    no tensors file names the shared file (both re-hashed, as a buggy exporter would)."""
    first = {}

    def unknown_shared(arrays, metadata):
        content = json.loads(metadata[SLICES_KEY])
        first["name"] = content["slices"][0]["name"]
        content["slices"][0]["shared"] = "nope"
        metadata[SLICES_KEY] = json.dumps(content)

    edit_tier_file(nested_copy, "small", unknown_shared)
    with pytest.raises(ManifestError) as refused:
        TierRuntime(nested_copy).session("small")
    assert str(refused.value) == (f"{nested_copy / 'small.fp32.tensors.safetensors'}: {SLICES_KEY}: {first['name']}: "
                                  "shared tensor nope is not in the shared file")
    shared = nested_copy / "shared.fp32.safetensors"
    shared.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    manifest = json.loads((nested_copy / "manifest.json").read_text())
    manifest["shared"]["fp32"].update(sha256=file_sha256(shared), bytes=shared.stat().st_size)
    (nested_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError) as refused:
        TierRuntime(nested_copy).session("mid")
    assert str(refused.value).startswith(f"{shared}: not a valid tensors file (") and "\n" not in str(refused.value)


@pytest.mark.parametrize("file", ["shared.fp32.safetensors", "small.fp32.graph.onnx", "small.fp32.tensors.safetensors"])
def test_a_tampered_package_file_is_refused_in_one_line(nested_copy, file):
    data = bytearray((nested_copy / file).read_bytes())
    data[len(data) // 2] ^= 1
    (nested_copy / file).write_bytes(bytes(data))
    runtime = TierRuntime(nested_copy)
    with pytest.raises(ManifestError, match=rf"{re.escape(file)}: sha256 \w+\.\.\. does not match the manifest's") as info:
        runtime.session("small")
    assert "\n" not in str(info.value)


def test_a_swapped_tier_file_is_refused(nested_copy):
    shutil.copy(nested_copy / "mid.fp32.tensors.safetensors", nested_copy / "small.fp32.tensors.safetensors")
    with pytest.raises(ManifestError, match=r"small.fp32.tensors.safetensors: sha256"):
        TierRuntime(nested_copy).session("small")
    assert TierRuntime(nested_copy).session("mid") is not None  # the others still load


def test_package_files_must_stay_in_the_folder(nested_copy, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (nested_copy / "shared.fp32.safetensors").rename(outside / "shared.fp32.safetensors")
    (nested_copy / "shared.fp32.safetensors").symlink_to(outside / "shared.fp32.safetensors")
    with pytest.raises(ManifestError, match=r"shared.fp32.safetensors: resolves to .*, outside the manifest's folder"):
        TierRuntime(nested_copy).session("full")
    manifest = json.loads((nested_copy / "manifest.json").read_text())
    manifest["shared"]["fp32"]["file"] = "../shared.fp32.safetensors"
    with pytest.raises(ManifestError, match=r"shared.fp32.file: String should match pattern"):
        parse_manifest(manifest)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("shared"), "shared: required for format nested"),
        (lambda m: m.update(format="files"), "shared: only for format nested"),
        (lambda m: m.update(schema_version=2), "format: nested packages need schema version 3, got 2"),
        (lambda m: m["tiers"][0].pop("tensors"), r"tiers\[0\].tensors: required for format nested"),
        (lambda m: m["shared"].pop("int8"), r"tiers\[\d+\].precision: int8: no shared tensors for it"),
        (lambda m: m["tiers"][1]["tensors"].update(file=m["tiers"][0]["tensors"]["file"]), "is named twice"),
    ],
)
def test_an_inconsistent_nested_manifest_is_refused_when_read(exports, edit, message):
    manifest = json.loads((exports[3] / "manifest.json").read_text())
    edit(manifest)
    with pytest.raises(ManifestError, match=message):
        parse_manifest(manifest)


def test_a_graph_that_refers_to_external_data_is_refused_before_onnxruntime_sees_it(nested_copy, tmp_path, monkeypatch):
    """An initializer whose data lies in ``weights.bin`` (which no hash covers) is refused in
    one line naming the file and the tensor, whatever the working directory."""
    path = nested_copy / "small.fp32.graph.onnx"
    model = onnx.load_model_from_string(path.read_bytes())
    tensor = numpy_helper.from_array(np.zeros(2, np.float32), "planted")
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="weights.bin")
    model.graph.node.append(helper.make_node("Constant", [], ["unused"], value=tensor))
    path.write_bytes(model.SerializeToString())
    manifest = json.loads((nested_copy / "manifest.json").read_text())
    next(t for t in manifest["tiers"] if t["file"] == path.name)["sha256"] = file_sha256(path)
    (nested_copy / "manifest.json").write_text(json.dumps(manifest))
    (nested_copy / "weights.bin").write_bytes(np.zeros(2, np.float32).tobytes())
    monkeypatch.chdir(nested_copy)
    with pytest.raises(ManifestError, match=r"small.fp32.graph.onnx: tensor planted is stored as external data, which no hash covers") as info:
        TierRuntime(nested_copy).session("small")
    assert "\n" not in str(info.value)


def test_cli_select_predict_and_bench_tiers_work_on_a_package(exports, tmp_path):
    from PIL import Image

    compiled, _, _, nested = exports
    runner = CliRunner()
    chosen = runner.invoke(app, ["select", str(nested), "--max-params", "50000", "--json"])
    assert chosen.exit_code == 0, chosen.output
    assert json.loads(chosen.stdout)["tier"] == "small"
    image = tmp_path / "x.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(image)
    predicted = runner.invoke(app, ["predict", str(nested), str(image), "--tier", "mid:int8", "--top-k", "1"])
    assert predicted.exit_code == 0 and "(tier mid:int8)" in predicted.stdout, predicted.output
    timed = runner.invoke(app, ["bench-tiers", str(nested), "--batch", "2", "--runs", "1", "--json"])
    assert timed.exit_code == 0, timed.output
    assert {r["label"] for r in json.loads(timed.stdout)["tiers"]} == {t.label for t in load_manifest(nested).tiers}


def test_the_device_bench_runs_a_package_without_torch(exports, tmp_path):
    done = bench(exports[3], "--batch", "1", "--runs", "1", "--warmup", "0", "--threads", "1", "--out", tmp_path / "d.json")
    assert done.returncode == 0 and "BLOCKED" not in done.stderr, done.stderr
    table = json.loads((tmp_path / "d.json").read_text())
    assert {e["label"] for e in table["entries"]} == {t.label for t in load_manifest(exports[3]).tiers}


def test_the_adaptive_runtime_steps_down_when_its_entry_slows_and_meets_the_deadline(exports):
    """A fake clock makes every entry take its given latency times a load: under a 4x load the
    runtime leaves the most accurate entry on the second slow request and then keeps within the
    deadline."""
    nested = exports[3]
    manifest = load_manifest(nested)
    base = {t.label: 0.5 + t.macs_ratio * 4 for t in manifest.tiers}  # ms, growing with the MACs
    now, load = [0.0], [1.0]
    runtime = TierRuntime(nested, policy=Deadline(ms=6.0, probe_after_s=1.0), latencies=base, precisions=["fp32"],
                          clock=lambda: now[0])

    def timed_run(*args):
        label = runtime.adaptive.current
        now[0] += base[label] * load[0] / 1e3
        return [np.zeros((1, 10), np.float32)]

    for session in runtime._sessions.values():
        session.run = timed_run  # the clock advances as if the entry had run
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


def test_a_package_that_reads_back_other_than_it_was_made_is_not_published(exports, tmp_path, monkeypatch):
    """The staged package is read back through the runtime before it is published: a shared
    file written with one weight changed (as a bad disk or a writer bug would) fails the
    export, and nothing is published."""
    from nefl_zoo.export import ExportError
    from nefl_zoo.export import package as package_module

    compiled, state = exports[0], exports[1]
    real = package_module.shared_file

    def one_weight_changed(shared):
        data = bytearray(real(shared))
        data[8 + int.from_bytes(data[:8], "little") + 3] ^= 0x40  # the first weight of the first tensor, in every tier
        return bytes(data)

    monkeypatch.setattr(package_module, "shared_file", one_weight_changed)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="the package read back gives other logits than when it was made"):
        export_tiers(ExportSource(compiled, state, "test"), out, tiers=["small"], latency_runs=1, threads=1, format="nested")
    assert not (out / "manifest.json").exists()


def test_padded_tiers_share_their_weights_too(exports, tmp_path):
    """With inner channels zero-padded (``channel_align``), every FP32 and INT8 weight of the
    tier is still a (zero-padded) slice of a shared tensor, and FP32 gives the padded tier
    file's logits bit for bit."""
    compiled, state = exports[0], exports[1]
    x = images(compiled)
    out = {}
    for layout in ("files", "nested"):
        out[layout] = tmp_path / layout
        export_tiers(ExportSource(compiled, state, "test"), out[layout], tiers=["small"], latency_runs=1, threads=1,
                     channel_align=16, precisions=["fp32", "int8"], calibration=images(compiled, 32, seed=2),
                     format=layout, warn=pytest.fail)
    manifest = load_manifest(out["nested"])
    assert all(t.channel_align == 16 for t in manifest.tiers)
    np.testing.assert_array_equal(TierRuntime(out["nested"]).run(x, "small"), TierRuntime(out["files"]).run(x, "small"))
    for entry in manifest.tiers:
        tier = parse_tier_file((out["nested"] / entry.tensors.file).read_bytes(), entry.label)
        padded = [cut for cut in tier.slices if cut.pad is not None]
        literal_weights = [n for n in tier.literals if tier.arrays[n].ndim == 4]
        assert padded and not literal_weights, entry.label


def test_the_adaptive_runtime_runs_each_ladder_session_once_before_serving(exports, monkeypatch):
    """A first run allocates and is slow; the runtime runs every session of the ladder once
    when it starts, so the policy never takes that for a slowdown."""
    import nefl_zoo.runtime.tiers as tiers_module

    runs = collections.Counter()
    real = tiers_module.session_from_bytes

    def counting(model, source, *args, **kwargs):
        session = real(model, source, *args, **kwargs)
        run = session.run
        session.run = lambda *a, **k: (runs.update([source.rsplit("/", 1)[-1]]), run(*a, **k))[1]
        return session

    monkeypatch.setattr(tiers_module, "session_from_bytes", counting)
    runtime = TierRuntime(exports[3], policy=Deadline(ms=1000.0), precisions=["fp32"])
    assert set(runs) == {load_manifest(exports[3]).tier(label).file for label in runtime.adaptive.ladder}
    assert set(runs.values()) == {1}

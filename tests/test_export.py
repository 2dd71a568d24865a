"""ONNX export of every tier: parity with PyTorch, the manifest, run directories, atomicity."""

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml
from safetensors.torch import save_file

from nefl_zoo.export import verify
from nefl_zoo.export import (
    ExportError,
    ExportOptions,
    ExportSource,
    export_tiers,
    fold_batchnorm,
    load_run_dir,
    load_source,
    pad_channels,
)
from nefl_zoo.manifest import file_sha256, load_manifest
from nefl_zoo.profile import profile_tiers
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec

RESNET_SPEC = {
    "model": "resnet20",
    "tiers": [
        # narrower, with skipped blocks (the first of stage 2 keeps its projection) and a step of 2
        {"name": "small", "gamma_w": 0.25, "gamma": 0.2, "steps": [[1, 0, 1], [0, 1, 1], [2, 1, 0]]},
        {"name": "full", "gamma": 1.0},
    ],
}
VIT_SPEC = {
    "model": "vit_tiny_16",
    "model_args": dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10),
    "inconsistent": ["steps"],
    "tiers": [{"name": "half", "gamma_w": 0.5, "steps": [[1, 0]]}, {"name": "full"}],
}


def trained_like_state(compiled):
    """A global state whose per-tier tensors (steps, BN affine and statistics) differ from the
    shared defaults, so an export that ignored them would not match."""
    gen = torch.Generator().manual_seed(1)
    state = compiled.init_global_state()
    for key, value in state.items():
        if "@" not in key:
            continue
        if key.split("@")[0].endswith("running_var"):
            state[key] = 0.5 + torch.rand(value.shape, generator=gen)
        elif value.is_floating_point():
            state[key] = value + 0.1 * torch.randn(value.shape, generator=gen)
    return state


def write_run_dir(path, spec_dict, state, metrics_lines, config=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "spec.yaml").write_text(yaml.safe_dump(spec_dict))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "global.safetensors"))
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics_lines))
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory):
    """A run directory written the way training writes it, and its export."""
    compiled = compile_spec(parse_spec(RESNET_SPEC))
    state = trained_like_state(compiled)
    run = write_run_dir(
        tmp_path_factory.mktemp("run"),
        RESNET_SPEC,
        state,
        [
            {"round": 5, "acc": {"small": 0.5, "full": 0.6}},
            {"round": 5, "loss": 1.2},
            {"round": 10, "acc": {"small": 0.71, "full": 0.83}},
        ],
        config={"data": {"dataset": "cifar10"}},
    )
    out = tmp_path_factory.mktemp("export")
    manifest = export_tiers(load_source(run), out, ExportOptions(latency_runs=2))
    return compiled, state, out, manifest


def test_export_writes_one_self_contained_file_per_tier_and_a_valid_manifest(resnet_run):
    _, _, out, manifest = resnet_run
    assert sorted(p.name for p in out.iterdir()) == ["full.onnx", "manifest.json", "small.onnx"]
    assert load_manifest(out / "manifest.json") == manifest
    for tier in manifest.tiers:
        model = onnx.load(str(out / tier.file))
        assert not any(onnx.external_data_helper.uses_external_data(t) for t in model.graph.initializer)
        assert tier.sha256 == file_sha256(out / tier.file)
        assert tier.weights_mb == pytest.approx((out / tier.file).stat().st_size / 2**20)


@pytest.mark.parametrize("tier", ["small", "full"])
def test_onnxruntime_matches_the_tier_module_at_another_batch_size(resnet_run, tier):
    compiled, state, out, manifest = resnet_run
    module = compiled[tier].load(state).eval()
    session = ort.InferenceSession(str(out / manifest.tier(tier).file), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[0] == "batch"
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        expected = module(x).numpy()
    got = session.run(None, {"input": x.numpy()})[0]
    assert got.shape == (5, 10)
    assert np.abs(got - expected).max() <= 1e-4
    assert manifest.tier(tier).max_abs_diff <= 1e-4


def test_each_tier_uses_its_own_inconsistent_parameters(resnet_run):
    """Swapping in another tier's step sizes and norms changes the output: they were exported."""
    compiled, state, out, manifest = resnet_run
    default_state = compiled.init_global_state()
    for key in state:
        if "@" not in key:
            default_state[key] = state[key]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        without = compiled["small"].load(default_state).eval()(x).numpy()
    session = ort.InferenceSession(str(out / "small.onnx"), providers=["CPUExecutionProvider"])
    assert np.abs(session.run(None, {"input": x.numpy()})[0] - without).max() > 1e-2


def test_manifest_records_costs_accuracy_dataset_and_latency(resnet_run):
    compiled, _, _, manifest = resnet_run
    profiles = {p.name: p for p in profile_tiers(compiled)}
    assert manifest.schema_version == 5 and manifest.model == "resnet20"
    assert manifest.input.shape == [3, 32, 32] and manifest.input.batch is None
    assert manifest.input.dataset == "cifar10"
    assert manifest.input.normalization.mean == pytest.approx([0.4914, 0.4822, 0.4465])
    assert manifest.class_names[3] == "cat" and manifest.output.num_classes == 10
    small = manifest.tier("small")
    assert small.blocks_per_stage == [2, 2, 2]
    assert (small.params, small.macs) == (profiles["small"].params, profiles["small"].macs)
    assert small.gamma == 0.2 and small.gamma_w == 0.25
    assert small.macs < manifest.tier("full").macs
    assert small.accuracy == 0.71 and manifest.tier("full").accuracy == 0.83  # last "acc" line: cifar10 is not here
    assert small.accuracy_on is None and small.precision == "fp32" and small.vs_fp32 is None
    assert small.batchnorm_folded
    assert small.latency.batch == 1 and small.latency.runs == 2 and small.latency.median_ms > 0
    assert small.latency.threads is None
    assert small.latency.machine.cpu_count >= 1 and small.latency.machine.onnxruntime == ort.__version__
    assert 0 < small.activation_mb_per_sample < manifest.tier("full").activation_mb_per_sample


def test_batchnorm_is_folded_out_of_the_graph(resnet_run):
    _, _, out, _ = resnet_run
    ops = {node.op_type for node in onnx.load(str(out / "full.onnx")).graph.node}
    assert "Conv" in ops and "BatchNormalization" not in ops


def test_fold_batchnorm_keeps_the_output():
    compiled = compile_spec(parse_spec(RESNET_SPEC))
    module = compiled["small"].load(trained_like_state(compiled)).eval()
    folded = fold_batchnorm(module)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert (folded(x) - module(x)).abs().max() <= 1e-5


def test_padded_channels_export_keeps_outputs_and_aligns_widths(tmp_path):
    # gamma_w 0.3: 9 / 18 / 36 channels, padded to 16 / 24 / 40
    spec = {"model": "resnet20", "tiers": [{"name": "odd", "gamma_w": 0.3, "steps": [[1, 0, 1], [0, 1, 1], [1, 1, 1]]}]}
    compiled = compile_spec(parse_spec(spec))
    state = trained_like_state(compiled)
    manifest = export_tiers(ExportSource(compiled, state, "t"), tmp_path, ExportOptions(channel_align=8, latency_runs=1))
    tier = manifest.tier("odd")
    assert tier.channel_align == 8 and tier.max_abs_diff <= 1e-4 and tier.batchnorm_folded
    model = onnx.load(str(tmp_path / "odd.onnx"))
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    conv_shapes = [weights[n.input[1]] for n in model.graph.node if n.op_type == "Conv"]
    assert conv_shapes[0][:2] == [16, 3]  # the stem reads the 3-channel image
    assert {s[0] for s in conv_shapes} == {16, 24, 40} and all(s[1] % 8 == 0 for s in conv_shapes[1:])
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        expected = compiled["odd"].load(state).eval()(x).numpy()
    session = ort.InferenceSession(str(tmp_path / "odd.onnx"), providers=["CPUExecutionProvider"])
    assert np.abs(session.run(None, {"input": x.numpy()})[0] - expected).max() <= 1e-4


def test_pad_channels_refuses_what_padding_would_change():
    compiled = compile_spec(parse_spec(VIT_SPEC))
    vit = compiled["full"].load(compiled.init_global_state()).eval()
    with pytest.raises(ValueError, match=r"cannot pad channels of cls_token \(VisionTransformer\)"):
        pad_channels(vit, 8)
    with pytest.raises(ValueError, match=r"cannot pad channels of 0.norm1.weight \(LayerNorm\)"):
        pad_channels(vit.blocks, 8)


def odd_network() -> torch.nn.Sequential:
    """Every layer kind :func:`pad_channels` pads, with the options it must carry over: a
    dilated reflect-padded convolution without bias, a BatchNorm with its own eps and
    statistics, a linear layer without bias."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 5, 3, padding=2, dilation=2, bias=False, padding_mode="reflect"),
        torch.nn.BatchNorm2d(5, eps=0.5), torch.nn.ReLU(), torch.nn.Conv2d(5, 6, 1), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(6, 4, bias=False))
    net[1].running_mean.uniform_(-1, 1)
    net[1].running_var.uniform_(0.1, 0.3)
    net[1].weight.data.uniform_(0.5, 2)
    return net.eval()


def test_pad_channels_pads_every_layer_kind_and_keeps_the_output():
    net, x = odd_network(), torch.randn(2, 3, 6, 6)
    traced = torch.fx.symbolic_trace(net)
    before = {k: v.clone() for k, v in traced.state_dict().items()}
    for module in (net, traced):  # a plain module is traced; a traced one is copied, not changed
        padded = pad_channels(module, 8)
        assert {k: tuple(v.shape) for k, v in padded.state_dict().items()} == {
            "0.weight": (8, 3, 3, 3), "1.weight": (8,), "1.bias": (8,), "1.running_mean": (8,), "1.running_var": (8,),
            "1.num_batches_tracked": (), "3.weight": (8, 8, 1, 1), "3.bias": (8,), "6.weight": (4, 8)}
        with torch.no_grad():
            assert (padded(x) - net(x)).abs().max() <= 1e-5
    assert traced.state_dict().keys() == before.keys()
    assert all(torch.equal(traced.state_dict()[k], v) for k, v in before.items())


def test_pad_channels_refuses_a_layer_it_cannot_pad_after_one_it_can():
    with pytest.raises(ValueError, match=r"^cannot pad channels of 1\.weight \(GroupNorm\)"):
        pad_channels(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.GroupNorm(2, 4)), 8)


def test_onnx_latency_ms_times_the_file_export_writes_after_two_warmups(monkeypatch):
    from nefl_zoo.export import onnx_file

    real, made, timed = onnx_file.session_from_bytes, {}, {}

    def session(data, source, threads=None):
        made.update(data=data, source=source, threads=threads, session=real(data, source, threads=threads))
        return made["session"]

    def median(fn, runs, warmup):
        timed.update(runs=runs, warmup=warmup, out=fn())
        return 1.25

    monkeypatch.setattr(onnx_file, "session_from_bytes", session)
    monkeypatch.setattr(onnx_file, "median_ms", median)
    net = odd_network()
    assert onnx_file.onnx_latency_ms(net, (3, 6, 6), 3, 2, 7) == 1.25
    assert made["source"].endswith("candidate.onnx") and made["threads"] == 2
    assert (timed["runs"], timed["warmup"]) == (7, 2) and timed["out"][0].shape == (3, 4)
    assert made["session"].get_inputs()[0].shape == [3, 3, 6, 6]  # the batch is fixed
    assert "BatchNormalization" not in {n.op_type for n in onnx.load_model_from_string(made["data"]).graph.node}
    x = torch.randn(3, 3, 6, 6)
    with torch.no_grad():
        assert np.abs(made["session"].run(None, {"input": x.numpy()})[0] - net(x).numpy()).max() <= 1e-5


@pytest.mark.parametrize("cpuinfo, block", [("flags\t: fpu sse avx2 avx512f avx512bw\n", 16),
                                            ("flags\t: fpu sse avx2 avx512fp16\n", 8), ("flags\t: fpu sse\n", 8), (None, 8)])
def test_the_cpu_channel_block_is_16_with_avx512f_else_8(monkeypatch, cpuinfo, block):
    from nefl_zoo.export import onnx_file

    class FakePath:
        def __init__(self, path):
            assert path == "/proc/cpuinfo"

        def read_text(self):
            if cpuinfo is None:
                raise PermissionError("no /proc here")
            return cpuinfo

    monkeypatch.setattr(onnx_file, "Path", FakePath)
    assert onnx_file.cpu_channel_block() == block


def test_vit_export_from_a_spec_file(tmp_path):
    spec_path = tmp_path / "vit.yaml"
    spec_path.write_text(yaml.safe_dump(VIT_SPEC))
    source = load_source(spec_path, seed=3)
    manifest = export_tiers(source, tmp_path / "out", ExportOptions(batch_dynamic=False, batch=2, latency_runs=1, threads=1))
    assert manifest.tiers[0].latency.threads == 1
    assert manifest.input.batch == 2 and manifest.input.normalization is None and manifest.class_names is None
    assert [t.blocks_per_stage for t in manifest.tiers] == [[1], [2]]
    for tier in manifest.tiers:
        assert not tier.batchnorm_folded
        session = ort.InferenceSession(str(tmp_path / "out" / tier.file), providers=["CPUExecutionProvider"])
        assert session.get_inputs()[0].shape == [2, 3, 32, 32]
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            expected = source.compiled[tier.name].load(source.global_state).eval()(x).numpy()
        assert np.abs(session.run(None, {"input": x.numpy()})[0] - expected).max() <= 1e-4


def test_failed_export_keeps_the_previous_manifest_and_leaves_no_staging(resnet_run, tmp_path, monkeypatch):
    compiled, state, out, manifest = resnet_run
    for path in out.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(verify, "ATOL", -1.0)  # no difference can pass
    source = ExportSource(compiled, trained_like_state(compiled), "test")
    with pytest.raises(ExportError, match=r"tier small: onnxruntime vs PyTorch max abs diff"):
        export_tiers(source, tmp_path, ExportOptions(tiers=["small"], latency_runs=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.onnx", "manifest.json", "small.onnx"]
    assert load_manifest(tmp_path) == manifest
    assert all(t.sha256 == file_sha256(tmp_path / t.file) for t in manifest.tiers)


def test_unknown_tier_is_refused_before_exporting(tmp_path):
    compiled = compile_spec(parse_spec(RESNET_SPEC))
    with pytest.raises(KeyError, match="unknown tier 'tiny'; tiers: small, full"):
        export_tiers(ExportSource(compiled, compiled.init_global_state(), "t"), tmp_path, ExportOptions(tiers=["tiny"]))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("settings, message", [
    ({"precisions": []}, "precisions: expected some of fp32, int8, fp16, got none"),
    ({"precisions": ["fp32", "bf16"]}, "precisions: expected some of fp32, int8, fp16, got fp32, bf16"),
    ({"precisions": "fp32"}, "precisions: expected a list of names, got the string 'fp32'"),
    ({"tiers": "small"}, "tiers: expected a list of names, got the string 'small'"),
    ({"batch": 0}, "batch must be >= 1 and channel_align >= 1 or 'auto', got 0 and 1"),
    ({"channel_align": "fast"}, "batch must be >= 1 and channel_align >= 1 or 'auto', got 1 and 'fast'"),
    ({"opset": 12}, "opset: the torch.export-based exporter writes opset 18 or later, got 12"),
    ({"format": "zip"}, "format: expected one of files, nested, got 'zip'"),
    ({"latency_runs": 0}, "latency_runs: must be an integer >= 1, got 0"),
    ({"threads": 0}, "threads: must be an integer >= 1, got 0"),
    ({"calibration_images": True}, "calibration_images: must be an integer >= 1, got True"),
])
def test_export_options_are_checked_when_made(settings, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ExportOptions(**settings)


def test_export_options_keep_tiers_and_precisions_as_tuples_without_repeats():
    images = np.zeros((2, 3, 32, 32), np.float32)
    options = ExportOptions(tiers=["small", "full", "small"], precisions=["int8", "fp32", "int8"], calibration=images)
    assert options.tiers == ("small", "full") and options.precisions == ("int8", "fp32")
    assert ExportOptions(tiers=[]).tiers is None and ExportOptions(batch=np.int64(2)).batch == 2
    assert options == ExportOptions(tiers=("small", "full"), precisions=("int8", "fp32"))  # images are data, not compared
    assert hash(options) == hash(ExportOptions(tiers=("small", "full"), precisions=("int8", "fp32")))


def test_the_old_keyword_arguments_still_work_and_warn(resnet_run, tmp_path):
    """``export_tiers(source, out, tiers=..., ...)`` (the settings before ExportOptions): the
    same files as ``ExportOptions``, with a DeprecationWarning naming the replacement; applied
    over ``options`` when both are given; an unknown keyword is a TypeError."""
    compiled, state, _, manifest = resnet_run
    source = ExportSource(compiled, state, "t")
    replacement = r"pass options=ExportOptions\(tiers=\.\.\., latency_runs=\.\.\.\)"
    with pytest.warns(DeprecationWarning, match=r"^export_tiers\(\.\.\., tiers=\.\.\., latency_runs=\.\.\.\) is deprecated .*" + replacement):
        old = export_tiers(source, tmp_path / "old", tiers=["small"], latency_runs=1)
    assert [t.name for t in old.tiers] == ["small"] and old.tiers[0].latency.runs == 1
    assert old.tiers[0].sha256 == manifest.tier("small").sha256  # the file the ExportOptions export wrote
    with pytest.warns(DeprecationWarning, match="tiers=..."), pytest.raises(KeyError, match="unknown tier 'tiny'"):
        export_tiers(source, tmp_path / "over", ExportOptions(tiers=["small"]), tiers=["tiny"])
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="^format: expected one of files, nested, got 'zip'$"):
        export_tiers(source, tmp_path / "bad", format="zip")
    with pytest.raises(TypeError, match=r"^export_tiers\(\) got an unexpected keyword argument 'tier'$"):
        export_tiers(source, tmp_path / "typo", tier=["small"])
    assert not (tmp_path / "over").exists() and not (tmp_path / "bad").exists() and not (tmp_path / "typo").exists()


def test_run_dir_with_a_wrong_shape_names_the_key(tmp_path):
    compiled = compile_spec(parse_spec(RESNET_SPEC))
    state = compiled.init_global_state()
    state["fc.weight"] = torch.zeros(10, 7)
    write_run_dir(tmp_path, RESNET_SPEC, state, [])
    with pytest.raises(ValueError, match=r"global.safetensors: fc.weight: shape \(10, 7\), the spec needs \(10, 64\)"):
        load_run_dir(tmp_path)


def test_a_committed_training_run_is_read_through_its_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from nefl_zoo.export import read_dataset
    from nefl_zoo.fl.engine import Engine

    from .conftest import records, tiny

    run = tmp_path / "run"
    Engine(tiny(rounds=2, clients__num_clients=2, train__local_epochs=1), run).run()
    source = load_run_dir(run)
    published = load_file(str(run / "global.safetensors"))
    assert source.global_state.keys() == published.keys() and all(torch.equal(source.global_state[k], published[k]) for k in published)
    assert source.accuracy == records(run)[-1]["acc"] and set(source.accuracy) == {"g0.25", "g0.5", "g1"}
    assert source.dataset == "digits" and source.data["dataset"] == "digits" and source.description == str(run)
    assert [t.name for t in source.compiled.spec.tiers] == ["g0.25", "g0.5", "g1"]
    assert read_dataset(run / "config.yaml") == "digits" and read_dataset(tmp_path / "none.yaml") is None
    (tmp_path / "other.yaml").write_text("data: {dataset: 3}\n")
    (tmp_path / "no-data.yaml").write_text("rounds: 3\n")
    assert read_dataset(tmp_path / "other.yaml") is None and read_dataset(tmp_path / "no-data.yaml") is None


def test_run_dir_problems_are_one_line_errors(tmp_path):
    compiled = compile_spec(parse_spec(RESNET_SPEC))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(RESNET_SPEC))
    with pytest.raises(FileNotFoundError, match="global.safetensors: missing"):
        load_run_dir(tmp_path)
    state = compiled.init_global_state()
    del state["layer1.0.step@small"]
    write_run_dir(tmp_path, RESNET_SPEC, state, [])
    with pytest.raises(ValueError, match=r"layer1.0.step@small: missing \(1 keys missing"):
        load_run_dir(tmp_path)
    write_run_dir(tmp_path, RESNET_SPEC, compiled.init_global_state(), [])
    (tmp_path / "metrics.jsonl").write_text('{"acc": {"full": 0.5}}\n{oops\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2: not valid JSON"):
        load_run_dir(tmp_path)


# ---- the parity threshold, just above and just below (issue 13) ------------------------------
class FixedOutput:
    """Stands in for an onnxruntime session whose output is a given array."""

    def __init__(self, output):
        self.output = output
        self.feeds = []

    def run(self, names, feed):
        self.feeds.append(feed)
        return [self.output]


@pytest.mark.parametrize(
    "largest, off, passes",
    [
        (0.5, 0.99e-4, True), (0.5, 1.01e-4, False),  # |logits| <= 1: an absolute 1e-4
        (1.0, 0.99e-4, True), (1.0, 1.01e-4, False),
        (-2000.0, 0.199, True), (-2000.0, 0.201, False),  # else 1e-4 x max |logit|
        (3.0, 2.99e-4, True), (3.0, 3.01e-4, False),
    ],
)
def test_parity_threshold_is_1e_4_times_the_largest_logit(largest, off, passes):
    reference = torch.tensor([[0.25, largest, -0.5], [0.0, 0.1, 0.2]], dtype=torch.float64)
    deviating = reference.clone()
    deviating[1, 2] += off
    x = torch.zeros(2, 3, 4, 4)
    session = FixedOutput(deviating.numpy())
    assert verify.max_abs_diff(deviating, reference) == pytest.approx(off, rel=1e-9)
    assert verify.same_output(lambda _: deviating, x, reference) is passes
    if passes:
        assert verify.check_parity("t", session, x, reference) == pytest.approx(off, rel=1e-9)
    else:
        tolerance = 1e-4 * max(1.0, abs(largest))
        import re

        message = f"tier t: onnxruntime vs PyTorch max abs diff {off:.3g} > {tolerance:.3g} (1e-4 x max(1, max |logit| = {abs(largest):.3g}))"
        with pytest.raises(ExportError, match=f"^{re.escape(message)}$"):
            verify.check_parity("t", session, x, reference)
    assert list(session.feeds[0]) == ["input"] and session.feeds[0]["input"].shape == (2, 3, 4, 4)


def test_parity_refuses_nan_outputs():
    reference = torch.zeros(1, 3, dtype=torch.float64)
    with pytest.raises(ExportError, match="max abs diff nan"):
        verify.check_parity("t", FixedOutput(np.full((1, 3), np.nan)), torch.zeros(1, 3, 4, 4), reference)


def tiny_onnx(opset=17, external=False):
    """A one-node ONNX model (input + a 2-element initializer), by hand."""
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "w")
    if external:
        weight.data_location = TensorProto.EXTERNAL
        weight.external_data.add(key="location", value="w.bin")
    graph = helper.make_graph(
        [helper.make_node("Add", ["input", "w"], ["logits"])], "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, 2])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 2])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.example", 1)],
                             ir_version=8)


def test_check_single_file_reads_the_opset_and_refuses_external_data():
    assert verify.check_single_file("t", tiny_onnx(17), None) == 17
    assert verify.check_single_file("t", tiny_onnx(18), 18) == 18
    with pytest.raises(ExportError, match=r"^tier t: asked for opset 18, the exporter wrote 17$"):
        verify.check_single_file("t", tiny_onnx(17), 18)
    with pytest.raises(ExportError, match=r"^tier t: the exporter wrote tensor w as external data; expected one file$"):
        verify.check_single_file("t", tiny_onnx(17, external=True), None)


def test_hashed_session_hashes_and_runs_the_same_bytes():
    import hashlib

    data = tiny_onnx(17).SerializeToString()
    digest, session = verify.hashed_session(data, "tiny.onnx", threads=1)
    assert digest == hashlib.sha256(data).hexdigest()
    assert session.get_session_options().intra_op_num_threads == 1
    out = session.run(None, {"input": np.array([[1.0, -1.0]], np.float32)})[0]
    assert out.tolist() == [[2.0, 1.0]]
    assert verify.tolerance_for(torch.tensor([[-3.0, 2.0]])) == pytest.approx(3e-4)
    assert verify.tolerance_for(torch.tensor([[0.5, -0.25]])) == pytest.approx(1e-4)


def test_parity_at_exactly_the_tolerance_passes():
    reference = torch.tensor([[0.5, 0.0]], dtype=torch.float64)
    at_bound = np.array([[0.5, 1e-4]])  # max abs diff == 1e-4 x max(1, 0.5), exactly
    assert verify.check_parity("t", FixedOutput(at_bound), torch.zeros(1, 3, 4, 4), reference) == 1e-4


def test_the_opset_may_be_declared_as_ai_onnx_and_bad_bytes_name_their_source():
    from nefl_zoo.manifest import ManifestError

    model = tiny_onnx(17)
    model.opset_import[0].domain = "ai.onnx"  # the default domain's other name
    assert verify.check_single_file("t", model, 17) == 17
    with pytest.raises(ManifestError, match=r"^tiny.onnx: onnxruntime cannot load the model"):
        verify.hashed_session(b"not a model", "tiny.onnx", threads=1)


def test_exports_reuse_one_torchlib_registry_and_write_the_same_bytes(tmp_path, monkeypatch):
    """write_onnx builds torch's operator registry once per opset, not once per export, and its
    file is byte-for-byte the one of a plain ``torch.onnx.export`` with the same arguments."""
    from torch.onnx._internal.exporter import _registration

    from nefl_zoo.export import onnx_file

    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    built = []
    monkeypatch.setattr(onnx_file, "_REGISTRIES", {})
    monkeypatch.setattr(_registration.ONNXRegistry, "from_torchlib", classmethod(
        lambda cls, opset_version=18: built.append(opset_version) or original.__func__(cls, opset_version=opset_version)))
    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 5)).eval()
    for name in ("a", "b"):
        torch.manual_seed(2)
        onnx_file.write_onnx(module, tmp_path / f"{name}.onnx", (3, 6, 6), 2, True, None)
    assert len(built) == 1  # the second export reused the first one's registry
    torch.manual_seed(2)
    torch.onnx.export(module, (torch.randn(2, 3, 6, 6),), str(tmp_path / "plain.onnx"), input_names=["input"],
                      output_names=["logits"], dynamo=True, external_data=False,
                      dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False)
    assert built == built[:1] * 2  # outside write_onnx the exporter builds its own again
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes() == (tmp_path / "plain.onnx").read_bytes()


def test_the_registry_is_left_alone_where_torchs_exporter_has_no_from_torchlib(monkeypatch):
    """Other torch internals than the ones the reuse was written for: the block runs, nothing is patched."""
    from torch.onnx._internal.exporter import _registration

    from nefl_zoo.export import onnx_file

    class Other:  # an exporter whose registry is built some other way
        pass

    monkeypatch.setattr(_registration, "ONNXRegistry", Other)
    ran = []
    with onnx_file.reused_torchlib_registry():
        ran.append("from_torchlib" in vars(Other))
    assert ran == [False] and "from_torchlib" not in vars(Other)

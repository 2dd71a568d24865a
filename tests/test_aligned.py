"""Hardware-aligned widths (``channel_multiple``): the rounding rule, the paper specs unchanged,
nesting of aligned tiers, auto-tier with aligned widths, and bad input."""

import hashlib
import math

import pytest
import torch
import yaml
from typer.testing import CliRunner

from nefl_zoo.auto import auto_tier
from nefl_zoo.models import count_params, create_model
from nefl_zoo.models.base import scale_width
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import SpecError, load_spec, parse_spec, shipped_specs_dir
from nefl_zoo_cli.app import app

ALIGNED_SPECS = ["resnet56/nefl-wd-aligned", "resnet110/nefl-wd-aligned", "resnet18/nefl-wd-aligned"]

# Recorded before channel_multiple existed: per shipped paper spec and tier, the parameter ratio
# (6 decimals) and the first 12 hex digits of sha256(repr([(key, shape), ...])) of the slim
# state dict (the slice maps were checked equal as well when these were recorded).
PAPER_SPECS = {
    "resnet110/nefl-d-g004": {"g0.04": (0.045093, "b40efcfe7cd1"), "g0.16": (0.162835, "cd84fbb2a9bc"), "g0.36": (0.368695, "dcebc410bd3b"), "g0.64": (0.64955, "6af9ebb16576"), "g1": (1.0, "6af2d7f4db74")},
    "resnet110/nefl-d": {"g0.2": (0.203258, "af55a42a9689"), "g0.4": (0.401019, "da27cfc97241"), "g0.6": (0.601704, "c6e0ef791619"), "g0.8": (0.802164, "d257fb45ea5c"), "g1": (1.0, "6af2d7f4db74")},
    "resnet110/nefl-w": {"g0.2": (0.211752, "0e766537bf98"), "g0.4": (0.418731, "7e614ba695e8"), "g0.6": (0.613778, "74ac1a8d6f3d"), "g0.8": (0.824629, "972615fe2db9"), "g1": (1.0, "6af2d7f4db74")},
    "resnet110/nefl-wd-g004": {"g0.04": (0.0433, "c29822fbeddd"), "g0.16": (0.166012, "c35129763d17"), "g0.36": (0.372539, "f3b897bab220"), "g0.64": (0.66815, "fd99cff7c591"), "g1": (1.0, "6af2d7f4db74")},
    "resnet110/nefl-wd": {"g0.2": (0.207777, "b401e7df7cf4"), "g0.4": (0.407002, "b9b3a149598b"), "g0.6": (0.623038, "b2ba9daf975d"), "g0.8": (0.815883, "1ade1e5f4c6b"), "g1": (1.0, "6af2d7f4db74")},
    "resnet18/nefl-d": {"g0.2": (0.214357, "f6aa67ac7f29"), "g0.4": (0.418969, "e29c73e5457f"), "g0.6": (0.577532, "f9ec7f35342a"), "g0.8": (0.808446, "11a4373291a5"), "g1": (1.0, "058a71e49cbb")},
    "resnet18/nefl-w": {"g0.2": (0.201214, "c1ba5b1f37eb"), "g0.4": (0.400964, "75c370a53185"), "g0.6": (0.602874, "66eb739cc780"), "g0.8": (0.801089, "78c9b9fa0181"), "g1": (1.0, "058a71e49cbb")},
    "resnet18/nefl-wd": {"g0.2": (0.198132, "87df7c16e9b5"), "g0.4": (0.400964, "75c370a53185"), "g0.6": (0.602874, "66eb739cc780"), "g0.8": (0.801089, "78c9b9fa0181"), "g1": (1.0, "058a71e49cbb")},
    "resnet34/nefl-d": {"g0.2": (0.230393, "1482f5d8dfca"), "g0.4": (0.389944, "43737fdfb433"), "g0.6": (0.611756, "17e80bffc1d8"), "g0.8": (0.805806, "a48f78e24a8b"), "g1": (1.0, "b2e61d5031b9")},
    "resnet34/nefl-w": {"g0.2": (0.201299, "4c208e2cb63e"), "g0.4": (0.400836, "2ca08fc136c1"), "g0.6": (0.603112, "9ea7d5ab2209"), "g0.8": (0.800961, "9baab9447c1e"), "g1": (1.0, "b2e61d5031b9")},
    "resnet34/nefl-wd": {"g0.2": (0.201629, "362327fd26ba"), "g0.4": (0.405082, "db6d23aeb497"), "g0.6": (0.559038, "b28e3479006e"), "g0.8": (0.801618, "39f3d3e2e715"), "g1": (1.0, "b2e61d5031b9")},
    "resnet56/nefl-d": {"g0.2": (0.204796, "d1e154fa1612"), "g0.4": (0.404848, "f4c8283dc5f9"), "g0.6": (0.6049, "56e571b1c6e6"), "g0.8": (0.805408, "2a555dc5047b"), "g1": (1.0, "692a70b5a06f")},
    "resnet56/nefl-d_o": {"g0.2": (0.204796, "d1e154fa1612"), "g0.4": (0.404848, "f4c8283dc5f9"), "g0.6": (0.6049, "56e571b1c6e6"), "g0.8": (0.805408, "2a555dc5047b"), "g1": (1.0, "692a70b5a06f")},
    "resnet56/nefl-w": {"g0.2": (0.212124, "2a8b5ff3b628"), "g0.4": (0.419148, "664726058305"), "g0.6": (0.61403, "cc328cbb7241"), "g0.8": (0.824825, "a85b1447a6cd"), "g1": (1.0, "692a70b5a06f")},
    "resnet56/nefl-wd": {"g0.2": (0.204975, "a40f2a1f7ac2"), "g0.4": (0.404937, "225ee302926b"), "g0.6": (0.621404, "044718e0ba10"), "g0.8": (0.81509, "98e74864d811"), "g1": (1.0, "692a70b5a06f")},
    "vit_b_16/nefl-d": {"g0.5": (0.504381, "1880d82c5cc1"), "g0.75": (0.752191, "3156a45a8fe7"), "g1": (1.0, "5e7a3cb5efc7")},
    "vit_b_16/nefl-w": {"g0.5": (0.505816, "146ac5732177"), "g0.75": (0.754863, "edeee1edc6aa"), "g1": (1.0, "5e7a3cb5efc7")},
    "wide_resnet101_2/nefl-d": {"g0.5": (0.508184, "80c339df2de3"), "g0.75": (0.754059, "8158d0991b98"), "g1": (1.0, "2fb1a149fa33")},
    "wide_resnet101_2/nefl-w": {"g0.2": (0.200445, "27199516c184"), "g0.4": (0.400766, "1f65cfde6d50"), "g0.6": (0.60154, "02f28f05cbd3"), "g0.8": (0.800346, "7ee81ebd4841"), "g1": (1.0, "2fb1a149fa33")},
}


def _shapes_digest(model) -> str:
    shapes = repr([(k, tuple(v.shape)) for k, v in model.state_dict().items()])
    return hashlib.sha256(shapes.encode()).hexdigest()[:12]


@pytest.mark.parametrize(
    "channels, gamma_w, multiple, expected",
    [
        (64, 0.6, 1, 50),  # the paper's rule: ceil(64 * 0.7746) = ceil(49.57)
        (16, 0.2, 1, 8),  # ceil(7.155)
        (64, 0.6, 8, 48),  # 49.57 -> nearest multiple of 8 is 48 (>= 90% of 49.57)
        (64, 0.4, 8, 40),  # 40.48 -> 40
        (32, 0.4, 8, 24),  # 20.24 -> 24
        (16, 0.4, 8, 16),  # 10.12 -> 8 is below 90% (9.1), so one more multiple: 16
        (64, 0.8, 16, 64),  # 57.24 -> 64
        (64, 0.2, 16, 32),  # 28.62 -> 32
        (16, 0.04, 8, 8),  # 3.2 -> at least one multiple
        (4, 0.2, 8, 4),  # never above the full width
        (100, 1.0, 8, 100),  # the full width stays the full width
    ],
)
def test_scale_width_rule(channels, gamma_w, multiple, expected):
    assert scale_width(channels, gamma_w, multiple) == expected


@pytest.mark.parametrize("multiple", [1, 8, 16])
def test_scale_width_grows_with_gamma_w(multiple):
    for channels in (16, 32, 64, 100, 512):
        widths = [scale_width(channels, k / 1000, multiple) for k in range(1, 1001)]
        assert widths == sorted(widths) and widths[-1] == channels
        if multiple > 1:
            assert all(w % multiple == 0 or w == channels for w in widths)


@pytest.mark.parametrize("name", sorted(PAPER_SPECS))
def test_channel_multiple_1_reproduces_the_shipped_paper_specs(name):
    path = shipped_specs_dir() / f"{name}.yaml"
    data = yaml.safe_load(path.read_text())
    assert "channel_multiple" not in data
    for spec in (load_spec(path), parse_spec(data | {"channel_multiple": 1}, str(path))):
        with torch.device("meta"):
            full = count_params(create_model(spec.model, **spec.model_args))
            for tier in spec.tiers:
                model = create_model(spec.model, **spec.model_args, **spec.tier_args(tier))
                ratio, digest = PAPER_SPECS[name][tier.name]
                assert round(count_params(model) / full, 6) == ratio, tier.name
                assert _shapes_digest(model) == digest, tier.name


def _widths_in_order(compiled):
    """Tiers sorted by parameter count, with every consistent tensor's shape."""
    tiers = sorted(compiled.tiers.values(), key=lambda ct: sum(math.prod(e.shape) for e in ct.slice_map.values()))
    return [{e.global_key: e for e in ct.slice_map.values() if e.consistent} for ct in tiers]


@pytest.mark.parametrize("name", ALIGNED_SPECS + ["train:digits-aligned"])
def test_aligned_tiers_are_nested_and_aligned(name):
    if name.startswith("train:"):
        spec = parse_spec(yaml.safe_load((shipped_specs_dir() / "train" / f"{name[6:]}.yaml").read_text())["spec"])
    else:
        spec = load_spec(shipped_specs_dir() / f"{name}.yaml")
    multiple = spec.channel_multiple
    assert multiple in (8, 16)
    compiled = compile_spec(spec)
    full = compiled.full_shapes
    ordered = _widths_in_order(compiled)
    for narrow, wide in zip(ordered, ordered[1:]):
        for key, entry in narrow.items():
            if key in wide:  # a narrower tier's region is a prefix of the wider tier's
                assert all(a.stop <= b.stop for a, b in zip(entry.index, wide[key].index)), key
    for regions in ordered:
        for key, entry in regions.items():
            for d, (n, f) in enumerate(zip(entry.shape, full[key])):
                # every channel count is a multiple, except the input image and classes
                assert n % multiple == 0 or n == f, (key, d, n)


def test_aligned_extract_scatter_round_trip():
    compiled = compile_spec(load_spec(shipped_specs_dir() / "resnet56/nefl-wd-aligned.yaml"))
    state = compiled.init_global_state()
    before = {k: v.clone() for k, v in state.items()}
    ct = compiled["g0.4"]
    sub = {k: v + 1 for k, v in ct.extract(state).items()}
    ct.scatter_(state, sub)
    assert all(torch.equal(ct.extract(state)[k], sub[k]) for k in sub)
    changed = sum(int((state[k] != before[k]).sum()) for k in state)
    assert changed == sum(v.numel() for v in sub.values())  # nothing outside the tier's regions
    module = ct.load(state)
    assert [info["num_chs"] for info in module.feature_info] == [16, 32, 48]


def test_a_tier_overrides_the_specs_channel_multiple():
    spec = parse_spec({
        "model": "resnet20", "channel_multiple": 8,
        "tiers": [{"name": "a", "gamma_w": 0.4}, {"name": "b", "gamma_w": 0.4, "channel_multiple": 1}, {"name": "c"}],
    })
    widths = {n: [i["num_chs"] for i in ct.build().feature_info] for n, ct in compile_spec(spec).tiers.items()}
    assert widths == {"a": [16, 24, 40], "b": [11, 21, 41], "c": [16, 32, 64]}


@pytest.mark.parametrize("model, gamma, mode, multiple", [
    ("resnet56", 0.4, "balanced", 16), ("resnet110", 0.2, "balanced", 8), ("resnet18", 0.6, "width", 16),
    ("resnet18", 0.6, "balanced", 8),
])
def test_auto_tier_with_aligned_widths_lands_within_two_percent(model, gamma, mode, multiple):
    found = auto_tier(model, gamma, mode, channel_multiple=multiple)
    assert found.within_tolerance and not found.note
    assert found.tier.channel_multiple == multiple
    with torch.device("meta"):
        full = create_model(model)
        slim = create_model(model, gamma_w=found.tier.gamma_w, steps=found.tier.steps, channel_multiple=multiple)
    assert all(v.shape[0] % multiple == 0 for k, v in slim.state_dict().items() if v.ndim == 4)
    assert abs(count_params(slim) / count_params(full) - gamma) <= 0.02 * gamma


def test_auto_tier_says_when_aligned_widths_cannot_reach_the_target():
    found = auto_tier("resnet20", 0.8, "balanced", channel_multiple=16)
    assert not found.within_tolerance
    assert found.note.startswith(
        "resnet20 cannot reach parameter ratio 0.8 within 2% in balanced mode with channels a multiple of 16; closest is"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: resnet20\nchannel_multiple: 0\ntiers: [{name: a}]", "channel_multiple: Input should be greater than or equal to 1"),
        ("model: resnet20\ntiers: [{name: a, channel_multiple: 2.5}]", "tiers[0].channel_multiple:"),
        ("model: resnet20\nmodel_args: {channel_multiple: 8}\ntiers: [{name: a}]",
         "model_args.channel_multiple: set per tier (tiers[].channel_multiple), not in model_args"),
    ],
)
def test_bad_channel_multiple_is_a_one_line_error(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: {message}") and "\n" not in str(info.value)


def test_cli_build_with_channel_multiple(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["build", "resnet56", "--gamma", "0.4", "--channel-multiple", "16", "--json"])
    assert ok.exit_code == 0, ok.output
    import json

    report = json.loads(ok.stdout)
    assert abs(report["params_ratio"] - 0.4) <= 0.008 and report["channel_multiple"] == 16
    bad = runner.invoke(app, ["build", "resnet56", "--gamma", "0.4", "--channel-multiple", "0"])
    assert bad.exit_code == 2 and bad.stderr.strip() == "error: --channel-multiple: must be >= 1, got 0"


# ---- latency-targeted tiers ----
import nefl_zoo.export.onnx_file as onnx_file  # noqa: E402
from nefl_zoo.auto import latency_tier  # noqa: E402


def _fake_latency(module, input_size, batch, threads, runs):
    return count_params(module) / 1e4 * batch  # ms: resnet20 in full (272,483 parameters) is 27.2483 ms


def test_latency_tier_finds_the_largest_gamma_within_the_budget(monkeypatch):
    monkeypatch.setattr(onnx_file, "onnx_latency_ms", _fake_latency)
    found = latency_tier("resnet20", 10.0, mode="width")
    assert found.latency_ms <= 10.0 and found.latency_ms == pytest.approx(found.params_ratio * 27.2483)
    k = round(found.tier.gamma * 100)
    following = auto_tier("resnet20", (k + 1) / 100, "width")
    assert following.params_ratio * 27.2483 > 10.0  # the next grid point misses the budget
    assert found.candidates[0][0] == 0.02 and found.candidates[-1][0] == 1.0 and len(found.candidates) <= 9
    assert latency_tier("resnet20", 30.0).tier.gamma == 1  # the full model fits
    with pytest.raises(ValueError, match=r"no tier of resnet20 meets 0.01 ms at batch 2: the smallest tried \(g0.02"):
        latency_tier("resnet20", 0.01, batch=2)


def test_cli_build_latency_ms_measures_onnxruntime():
    runner = CliRunner()
    ok = runner.invoke(app, ["build", "resnet20", "--latency-ms", "10000", "--json"])
    assert ok.exit_code == 0, ok.output
    import json

    report = json.loads(ok.stdout)
    assert report["tier"] == "g1" and 0 < report["latency_ms"] <= report["budget_ms"] == 10000
    for args, message in [
        (["--latency-ms", "0"], "--latency-ms: must be a finite number > 0, got 0"),
        (["--latency-ms", "2", "--gamma", "0.5"], "--latency-ms: give --gamma or --latency-ms, not both"),
        (["--latency-ms", "2", "--batch", "0"], "--batch: must be >= 1, got 0"),
    ]:
        bad = runner.invoke(app, ["build", "resnet20", *args])
        assert bad.exit_code == 2 and bad.stderr.strip() == f"error: {message}"


# ---- export --pad-channels auto ----
import onnx  # noqa: E402

import nefl_zoo.export.fp32 as export_fp32_module  # noqa: E402
from nefl_zoo.export import ExportOptions, ExportSource, export_tiers  # noqa: E402
from nefl_zoo.export.onnx_file import cpu_channel_block  # noqa: E402

# 9/18/36 channels and 16/32/64; one block per stage (every width still in the graph) keeps the exports quick
ONE_BLOCK = [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
ODD = {"model": "resnet20", "tiers": [{"name": "odd", "gamma_w": 0.3, "steps": ONE_BLOCK}, {"name": "full", "steps": ONE_BLOCK}]}


def _conv_outputs(path):
    model = onnx.load(str(path))
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    return {weights[n.input[1]][0] for n in model.graph.node if n.op_type == "Conv"}


def test_pad_channels_auto_keeps_the_faster_file_and_records_both(tmp_path, monkeypatch):
    block = cpu_channel_block()
    timed = []

    def fake_interleaved(fns, rounds, warmup_rounds):  # the padded variant is faster, the plain one 2 ms
        timed.append(sorted(fns))
        return {a: 1.0 if a > 1 else 2.0 for a in fns}

    monkeypatch.setattr(export_fp32_module, "interleaved_median_ms", fake_interleaved)
    compiled = compile_spec(parse_spec(ODD))
    manifest = export_tiers(ExportSource(compiled, compiled.init_global_state(), "t"), tmp_path, ExportOptions(channel_align="auto"))
    assert timed == [[1, block], [1]]  # the full tier's widths are aligned already: nothing to pad
    odd, full = manifest.tier("odd"), manifest.tier("full")
    assert odd.channel_align == block and odd.channel_align_ms == {"1": 2.0, str(block): 1.0}
    assert odd.latency.median_ms == 1.0 and odd.max_abs_diff <= 1e-4
    assert full.channel_align == 1 and full.channel_align_ms == {"1": 2.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.onnx", "manifest.json", "odd.onnx"]
    padded = {16, 32, 48} if block == 16 else {16, 24, 40}  # 9/18/36 rounded up to the block
    assert _conv_outputs(tmp_path / "odd.onnx") == padded and _conv_outputs(tmp_path / "full.onnx") == {16, 32, 64}


def test_cli_export_pad_channels_values(tmp_path):
    runner = CliRunner()
    bad = runner.invoke(app, ["export", "resnet20/none", "--out", str(tmp_path / "x"), "--pad-channels", "x8"])
    assert bad.exit_code == 2 and bad.stderr.strip() == "error: --pad-channels: expected auto, 1, 4, 8, 16, 32 or 64, got 'x8'"
    zero = runner.invoke(app, ["export", "resnet20/none", "--out", str(tmp_path / "x"), "--pad-channels", "0"])
    assert zero.exit_code == 2 and "expected auto, 1, 4, 8, 16, 32 or 64, got '0'" in zero.stderr


def test_interleaved_timing_runs_every_function_in_turn_and_skips_warmup_rounds(monkeypatch):
    from nefl_zoo import timing

    calls = []
    clock = iter(range(1000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock) / 2)  # each timed call: 500 ms
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    assert timing.interleaved_median_ms(fns, rounds=3, runs=2, warmup=1, warmup_rounds=1) == {"a": 500.0, "b": 500.0}
    # 1 untimed round + 3 timed ones, each: per function 1 warm-up call and 2 timed calls, a then b
    assert calls == (["a"] * 3 + ["b"] * 3) * 4

"""Fuzzing of the files people write: any spec, training config or manifest, as data or as file
text, gives either a valid object or a one-line SpecError/ConfigError/ManifestError naming its
source. No other exception (pydantic's ValidationError, KeyError, TypeError, RecursionError, ...)
escapes."""

import json
import string

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nefl_zoo.fl.config import ConfigError, load_config, parse_config
from nefl_zoo.manifest import Manifest, ManifestError, load_manifest, parse_manifest
from nefl_zoo.spec import SpecError, SubmodelSpec, load_spec, parse_spec

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

VALID_SPEC = {"model": "resnet20", "tiers": [{"name": "small", "gamma_w": 0.25}, {"name": "full"}]}

# ---- building blocks: what YAML can give ---------------------------------------------------
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)  # includes newlines and other control characters
)
keys = st.text(max_size=10) | st.integers(-3, 3) | st.none()
anything = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=16,
)


odd_keys = st.text(string.ascii_lowercase, min_size=1, max_size=8) | st.sampled_from(["a\nb", "tiers\u2028", "\r"])


def some_of(mapping: dict, extra_keys=odd_keys):
    """Dicts with any subset of ``mapping``'s keys (values from its strategies, sometimes
    arbitrary ones), in one of four with an unknown key."""
    known = st.fixed_dictionaries({}, optional={k: v | anything for k, v in mapping.items()})
    unknown = st.dictionaries(extra_keys, anything, min_size=1, max_size=1)
    extra = st.one_of(st.just({}), st.just({}), st.just({}), unknown)
    return st.builds(lambda d, e: {**d, **e}, known, extra)


small_ints = st.integers(-2, 40)
steps = st.lists(st.lists(st.sampled_from([0, 1, 2, 0.5, -1]) | st.floats(), max_size=4), max_size=4)
tier = st.builds(
    lambda name, rest: {"name": name, **rest},
    st.sampled_from(["a", "b", "full", ""]) | st.text(max_size=4),
    some_of({
        "gamma_w": st.floats(-1, 2) | st.sampled_from([0.25, 0.5, 1]),
        "steps": steps | st.just([[1, 1, 1], [1, 0, 1], [1, 1, 0]]),
        "learnable_steps": st.booleans(),
        "gamma": st.floats(-1, 2),
    }),
)
model_names = st.sampled_from(["resnet20", "resnet18", "vit_tiny_16"])
model_args = st.dictionaries(
    st.sampled_from(["num_classes", "in_chans", "img_size", "patch_size", "embed_dim", "depth", "num_heads",
                     "stem", "planes", "layers", "block", "gamma_w", "steps"]) | odd_keys,
    small_ints | st.sampled_from(["cifar", "nefl", "imagenet", "basic"]) | st.lists(small_ints, max_size=4) | anything,
    max_size=3,
)
spec_like = st.builds(
    lambda model, tiers, rest: {"model": model, "tiers": tiers, **rest},
    model_names,
    st.lists(tier, min_size=1, max_size=3),
    some_of({
        "model_args": model_args,
        "tiers": st.lists(tier, max_size=3),
        "inconsistent": st.lists(st.sampled_from(["steps", "norm", "bias"]), max_size=3),
    }),
)
spec_data = spec_like | anything | st.just(VALID_SPEC)


def yaml_text(data_strategy):
    """File text: YAML of structured data, sometimes cut or with a character inserted,
    arbitrary text, or brackets nested deeper than a parser recurses."""
    dumped = data_strategy.map(lambda d: yaml.safe_dump(d, allow_unicode=True))
    mutated = st.builds(
        lambda text, at, insert: text[:at] + insert + text[at:] if text else insert,
        dumped, st.integers(0, 200), st.text(max_size=3),
    )
    deep = st.integers(100, 800).map(lambda n: "a: " + "[" * n + "]" * n)
    tagged = st.sampled_from([
        "a: !!int abc", "a: !!int", "a: !!float", "a: !!bool x", "a: !!timestamp x", "a: 2001-02-30", "a: 0000-00-00",
        "a: \x00", "a: !!python/name:os.system", "? [1]\n: 2", "model: resnet20\n\ttiers: []", "a: &x [*x]",
    ])
    return dumped | mutated | st.text(max_size=80) | deep | tagged


def assert_one_line(exc: Exception, source: str) -> None:
    text = str(exc)
    assert len(text.splitlines()) == 1 and "\n" not in text, text
    assert text.startswith(f"{source}: "), text


# ---- specs ------------------------------------------------------------------------------------
@FUZZ
@given(data=spec_data)
def test_parse_spec_gives_a_spec_or_a_one_line_error(data):
    try:
        spec = parse_spec(data, "fuzz.yaml")
    except SpecError as exc:
        assert_one_line(exc, "fuzz.yaml")
    else:
        assert isinstance(spec, SubmodelSpec)


sizes = st.integers(-1, 12) | st.sampled_from([16, 32, 64])
resnet_args = st.fixed_dictionaries({}, optional={
    "num_classes": sizes, "in_chans": sizes, "img_size": sizes, "width_multiplier": sizes, "gamma_w": st.floats(-1, 2),
    "stem": st.sampled_from(["cifar", "nefl", "imagenet", "x"]), "block": st.sampled_from(["basic", "bottleneck", "x"]),
    "planes": st.lists(sizes, max_size=5), "layers": st.lists(st.integers(-1, 3), max_size=5),
})
vit_args = st.fixed_dictionaries({}, optional={
    "num_classes": sizes, "in_chans": sizes, "img_size": sizes, "patch_size": sizes, "embed_dim": sizes,
    "depth": st.integers(-1, 4), "num_heads": sizes, "mlp_ratio": st.floats(-1, 4), "gamma_w": st.floats(-1, 2),
})
model_with_args = (
    st.tuples(st.sampled_from(["resnet20", "resnet18"]), resnet_args)
    | st.tuples(st.just("vit_tiny_16"), vit_args)
    | st.tuples(model_names, model_args)
)


@FUZZ
@given(model_and_args=model_with_args)
def test_any_model_args_give_a_spec_or_a_one_line_error(model_and_args):
    """Whatever a model's constructor makes of the arguments (a list, a zero, a negative size)."""
    model, args = model_and_args
    try:
        spec = parse_spec({"model": model, "model_args": args, "tiers": [{"name": "a"}]}, "fuzz.yaml")
    except SpecError as exc:
        assert_one_line(exc, "fuzz.yaml")
    else:
        assert spec.model_args == args


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz")
    (path / "spec.yaml").write_text(yaml.safe_dump(VALID_SPEC))
    return path


@FUZZ
@given(text=yaml_text(spec_data) | st.binary(max_size=40))
def test_load_spec_gives_a_spec_or_a_one_line_error(fuzz_dir, text):
    path = fuzz_dir / "fuzzed-spec.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    try:
        spec = load_spec(path)
    except SpecError as exc:
        assert_one_line(exc, str(path))
    else:
        assert isinstance(spec, SubmodelSpec)


# ---- training configs ---------------------------------------------------------------------------
positive = st.integers(-2, 5) | st.floats(-1, 2)
config_like = st.builds(lambda spec, rest: {"spec": spec, **rest}, st.sampled_from(["spec.yaml", VALID_SPEC]), some_of({
    "name": st.text(max_size=6),
    "method": st.sampled_from(["nefl", "heterofl", "fjord", "depthfl", "fedavg", "nefl_w"]) | st.text(max_size=6),
    "method_args": st.dictionaries(st.sampled_from(["kd", "mu", "bn_recompute_batches"]) | st.text(max_size=4),
                                   positive | st.booleans() | anything, max_size=2),
    "seed": st.integers(),
    "rounds": positive,
    "spec": st.sampled_from(["spec.yaml", "missing.yaml", "", ".", "a\x00b", "/"]) | spec_like | st.just(VALID_SPEC),
    "data": some_of({
        "dataset": st.sampled_from(["digits", "cifar10", "mnist"]),
        "partition": st.sampled_from(["iid", "dirichlet", "shards", "x"]),
        "alpha": positive, "shards_per_client": positive, "test_fraction": positive, "max_test_samples": positive,
        "root": st.text(max_size=5), "download": st.booleans(), "augment": st.booleans(),
    }),
    "clients": some_of({
        "num_clients": positive, "fraction": positive, "environment": st.sampled_from(["dynamic", "fixed", "x"]),
        "groups": st.lists(st.lists(st.sampled_from(["small", "full", "x"]), max_size=2), max_size=3),
    }),
    "train": some_of({"local_epochs": positive, "lr": positive, "momentum": positive, "kd": st.booleans(),
                      "schedule": st.sampled_from(["step", "cosine", "x"]), "grad_clip": positive}),
    "eval": some_of({"every": positive, "batch_size": positive, "bn_recompute_batches": positive}),
    "checkpoint_every": positive,
}))
config_data = config_like | anything | st.just({"spec": "spec.yaml"})
override_values = st.sampled_from(["3", "[1, 2]", "!!int abc", "!!int", "2001-02-30", "{", "[" * 1000])
overrides = st.lists(
    st.builds(
        "{}={}".format,
        st.sampled_from(["rounds", "train.lr", "spec", "spec.model", "a.b.c", "", "data"]),
        override_values | st.text(max_size=6),
    )
    | st.text(max_size=8),
    max_size=2,
)


@FUZZ
@given(data=config_data)
def test_parse_config_gives_a_config_or_a_one_line_error(fuzz_dir, data):
    try:
        config = parse_config(data, "<config>", fuzz_dir)
    except ConfigError as exc:
        assert_one_line(exc, "<config>")
    else:
        assert config is not None


@FUZZ
@given(text=yaml_text(config_data) | st.binary(max_size=40), sets=overrides)
def test_load_config_gives_a_config_or_a_one_line_error(fuzz_dir, text, sets):
    path = fuzz_dir / "fuzzed-config.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    try:
        config = load_config(path, sets)
    except ConfigError as exc:
        assert_one_line(exc, str(path))
    else:
        assert config is not None


# ---- manifests (JSON, read by the torch-free runtime) ---------------------------------------------

MACHINE = {"processor": "x86_64", "platform": "Linux", "cpu_count": 2, "onnxruntime": "1.0", "provider": "CPUExecutionProvider"}
LATENCY = {"median_ms": 1.0, "batch": 1, "runs": 2, "threads": None, "machine": MACHINE}
TIER = {
    "name": "g1", "file": "g1.onnx", "sha256": "0" * 64, "params": 100, "params_ratio": 1.0, "macs": 1000, "macs_ratio": 1.0,
    "gamma": 1.0, "gamma_w": 1.0, "blocks_per_stage": [3, 3, 3], "accuracy": 0.9, "batchnorm_folded": True, "channel_align": 1,
    "max_abs_diff": 0.0, "weights_mb": 0.5, "activation_mb_per_sample": 0.1, "latency": LATENCY,
}
VALID_MANIFEST = {
    "schema_version": 1, "model": "resnet20", "model_args": {"num_classes": 10}, "source": "x", "created_by": "nefl-zoo", "opset": 18,
    "input": {"name": "input", "shape": [3, 32, 32], "dtype": "float32", "layout": "NCHW", "batch": None,
              "normalization": {"mean": [0.5] * 3, "std": [0.25] * 3}, "dataset": "cifar10"},
    "output": {"name": "logits", "num_classes": 10},
    "class_names": [str(i) for i in range(10)],
    "tiers": [TIER],
}
numbers = st.integers(-2, 40) | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0, -1, 2**63, 1e308])
manifest_like = st.builds(lambda rest: {**VALID_MANIFEST, **rest}, some_of({
    "schema_version": st.sampled_from([1, 2, "1", None]),
    "model_args": st.dictionaries(st.sampled_from(["num_classes", "in_chans", "img_size"]), numbers | anything, max_size=2),
    "input": st.builds(lambda rest: {**VALID_MANIFEST["input"], **rest}, some_of({
        "shape": st.lists(numbers, max_size=4), "batch": numbers | st.none(),
        "normalization": st.none() | st.fixed_dictionaries({"mean": st.lists(numbers, max_size=4), "std": st.lists(numbers, max_size=4)}),
    })),
    "output": st.builds(lambda rest: {**VALID_MANIFEST["output"], **rest}, some_of({"num_classes": numbers})),
    "class_names": st.none() | st.lists(st.text(max_size=3), max_size=12),
    "tiers": st.lists(st.builds(lambda rest: {**TIER, **rest}, some_of({
        "name": st.sampled_from(["g1", "g0.5", ""]), "file": st.sampled_from(["g1.onnx", "../x.onnx", "a/b.onnx", "x"]),
        "macs": numbers, "params_ratio": numbers, "gamma_w": numbers, "accuracy": numbers | st.none(), "weights_mb": numbers,
        "latency": st.builds(lambda rest: {**LATENCY, **rest}, some_of({"median_ms": numbers, "batch": numbers, "threads": numbers})),
    })), max_size=3),
}))
manifest_data = manifest_like | anything | st.just(VALID_MANIFEST)


@FUZZ
@given(data=manifest_data)
def test_parse_manifest_gives_a_manifest_or_a_one_line_error(data):
    try:
        manifest = parse_manifest(data, "fuzz.json")
    except ManifestError as exc:
        assert_one_line(exc, "fuzz.json")
    else:
        assert isinstance(manifest, Manifest)
        assert manifest.class_names is None or len(manifest.class_names) == manifest.output.num_classes


@FUZZ
@given(text=manifest_data.map(json.dumps) | st.text(max_size=80) | st.binary(max_size=40)
       | st.integers(100, 3000).map(lambda n: "[" * n + "]" * n))
def test_load_manifest_gives_a_manifest_or_a_one_line_error(fuzz_dir, text):
    path = fuzz_dir / "manifest.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        manifest = load_manifest(path)
    except ManifestError as exc:
        assert_one_line(exc, str(path))
    else:
        assert isinstance(manifest, Manifest)

"""Bad input of every kind gets one line, ``error: ...``, and exit code 2, before any work
(issue 12): model arguments out of their declared range, absurd batches, ``--out`` of the
wrong kind, non-finite numbers and out-of-range seeds, YAML that expands enormously, and
whatever goes wrong inside a command."""

import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nefl_zoo.fl.config import ConfigError, load_config
from nefl_zoo.spec import SpecError, load_spec
from nefl_zoo_cli.app import app

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "specs/train/digits-quick.yaml")
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_exit_2(result, message=""):
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0], lines[0]


@pytest.fixture
def write(tmp_path):
    def write(name, text):
        path = tmp_path / name
        path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
        return path

    return write


# ---- model_args against each model's declared constraints -------------------------------------
@pytest.mark.parametrize(
    "model, args, message",
    [
        ("resnet20", {"num_classes": -1}, "model_args.num_classes: Input should be greater than or equal to 1"),
        ("vit_tiny_16", {"num_heads": 0}, "model_args.num_heads: Input should be greater than or equal to 1"),
        ("vit_tiny_16", {"img_size": -4}, "model_args.img_size: Input should be greater than or equal to 1"),
        ("resnet20", {"img_size": -4}, "model_args.img_size: Input should be greater than or equal to 1"),
        ("vit_b_16", {"embed_dim": 100}, "model_args.num_heads: embed_dim 100 is not divisible by num_heads 12"),
        ("vit_tiny_16", {"mlp_ratio": float("inf")}, "model_args.mlp_ratio: Input should be a finite number"),
        ("resnet18", {"stem": "vgg"}, "model_args.stem: Input should be 'cifar', 'nefl' or 'imagenet'"),
    ],
)
def test_bad_model_args_are_one_line_before_construction(write, model, args, message):
    spec = write("spec.yaml", yaml.safe_dump({"model": model, "model_args": args, "tiers": [{"name": "a"}]}))
    assert_one_line_exit_2(invoke("profile", spec), f"{spec}: {message}")


# ---- impossible allocations, --out of the wrong kind, small ones -------------------------------
def test_profile_latency_with_an_impossible_batch_is_refused(write):
    spec = write("spec.yaml", "model: resnet20\ntiers: [{name: a}]\n")
    assert_one_line_exit_2(invoke("profile", spec, "--latency", "--batch", 1_000_000_000), "batch 1000000000: needs about")


def test_build_out_must_name_a_weights_file(tmp_path):
    weights = tmp_path / "w.yaml"
    assert_one_line_exit_2(invoke("build", "resnet20", "--out", weights), "--out: ")
    assert not weights.exists()  # the one-tier spec was not written over the weights
    (tmp_path / "folder").mkdir()
    assert_one_line_exit_2(invoke("build", "resnet20", "--out", tmp_path / "folder"), "is a folder")
    (tmp_path / "file").write_text("")
    assert_one_line_exit_2(invoke("build", "resnet20", "--out", tmp_path / "file" / "w.safetensors"), "is a file, not a folder")


def test_build_with_a_tiny_gamma_names_the_option():
    assert_one_line_exit_2(invoke("build", "resnet20", "--gamma", "1e-9"), "--gamma: 1e-09 is too small for balanced mode")
    assert_one_line_exit_2(invoke("build", "resnet20", "--gamma", "nan"), "--gamma: must be in (0, 1]")


def test_non_utf8_spec_names_the_file(write):
    spec = write("latin1.yaml", "model: r\xe9snet20\n".encode("latin-1"))
    assert_one_line_exit_2(invoke("profile", spec), f"{spec}: not UTF-8 text (byte 8)")


# ---- training configs: finite numbers, seeds, folders, errors inside compare ----------------------
@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=.inf", "train.lr: Input should be a finite number"),
        ("train.lr=.nan", "train.lr: Input should be a finite number"),
        ("data.alpha=.nan", "data.alpha: Input should be a finite number"),
        ("seed=100000000000000000000000", "seed: Input should be less than or equal to 4294967295"),
        ("seed=-1", "seed: Input should be greater than or equal to 0"),
    ],
)
def test_non_finite_numbers_and_bad_seeds_are_refused_before_the_run_dir(tmp_path, override, message):
    out = tmp_path / "run"
    assert_one_line_exit_2(invoke("train", QUICK, "--out", out, "--set", override, "--quiet"), message)
    assert not out.exists()


def test_method_args_must_be_finite():
    with pytest.raises(ConfigError, match=r"method_args.mu: fedprox: (must be a finite number|Input should be a finite number)"):
        load_config(QUICK, ["method=fedprox", "method_args.mu=.inf"])


def test_train_and_compare_out_must_be_folders(tmp_path):
    (tmp_path / "file").write_text("")
    assert_one_line_exit_2(invoke("train", QUICK, "--out", tmp_path / "file", "--quiet"), "--out: ")
    assert_one_line_exit_2(invoke("compare", QUICK, "--methods", "nefl", "--out", tmp_path / "file" / "x", "--quiet"), "is a file")


def test_errors_inside_compare_are_one_line(tmp_path):
    args = ["--set", "data.dataset=cifar10", "--set", f"data.root={tmp_path}", "--quiet", "--seeds", "1"]
    assert_one_line_exit_2(invoke("compare", QUICK, "--methods", "nefl", "--out", tmp_path / "cmp", *args))


# ---- resources before validation: billion laughs, depth, size --------------------------------------
def billion_laughs(levels=9, fan_out=10):
    lines = ["l0: &l0 [" + ", ".join(["1"] * fan_out) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * fan_out) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nmodel: resnet20\ntiers: [{{name: a, steps: *l{levels}}}]\n"


def test_billion_laughs_is_refused_quickly(write):
    path = write("laughs.yaml", billion_laughs())  # 10**10 values once expanded, under 1 KB of text
    start = time.perf_counter()
    with pytest.raises(SpecError, match="expands to more than 1,000,000 values"):
        load_spec(path)
    assert time.perf_counter() - start < 2
    start = time.perf_counter()
    assert_one_line_exit_2(invoke("profile", path), "expands to more than")
    assert time.perf_counter() - start < 2


def test_billion_laughs_in_a_training_config_is_refused(write):
    text = billion_laughs().replace("model: resnet20\ntiers:", "spec: {model: resnet20, tiers:").rstrip() + "}\n"
    path = write("cfg.yaml", text)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="expands to more than"):
        load_config(path)
    assert time.perf_counter() - start < 2


def test_aliases_within_the_limit_still_work(write):
    spec = "model: resnet20\ntiers: [{name: a, steps: [&s [1, 1, 1], *s, *s]}]\n"
    assert load_spec(write("ok.yaml", spec)).tiers[0].steps == [[1, 1, 1]] * 3


@pytest.mark.parametrize(
    "text, message",
    [
        ("a: &x [1, *x]\n", "refers to a collection that contains it"),
        ("a: " + "[" * 70 + "]" * 70 + "\n", "nested deeper than 64 levels"),
        ("a: " + "x" * (3 * 2**20) + "\n", "larger than 2 MiB"),
    ],
)
def test_recursive_deep_or_huge_files_are_refused(write, text, message):
    with pytest.raises(SpecError, match=message) as info:
        load_spec(write("x.yaml", text))
    assert "\n" not in str(info.value)


# ---- nothing but one line reaches the user ----------------------------------------------------------
@pytest.mark.parametrize(
    "raised, message",
    [
        (RuntimeError("boom\nsecond line"), "error: RuntimeError: boom (unexpected; NEFL_ZOO_TRACEBACK=1 shows the traceback)"),
        (MemoryError(), "error: not enough memory; use a smaller --batch or model"),
        (PermissionError(13, "Permission denied", "x.yaml"), "error: x.yaml: Permission denied"),
        (RecursionError(), "error: input nested too deeply to process"),
    ],
)
def test_an_unexpected_exception_is_one_line(monkeypatch, raised, message):
    import nefl_zoo.spec

    def explode(*args, **kwargs):
        raise raised

    monkeypatch.delenv("NEFL_ZOO_TRACEBACK", raising=False)
    monkeypatch.setattr(nefl_zoo.spec, "resolve_spec_path", explode)
    result = invoke("profile", "anything")
    assert_one_line_exit_2(result)
    assert result.output.strip() == message


def test_every_command_is_guarded():
    """A command registered without :func:`cli.errors.guarded` could print a traceback."""
    commands = {c.name or c.callback.__name__: c.callback for c in app.registered_commands}
    assert {"build", "profile", "export", "select", "predict", "bench-tiers", "train", "compare"} <= set(commands)
    assert [name for name, callback in commands.items() if not hasattr(callback, "__wrapped__")] == []

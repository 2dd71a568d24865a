"""What every ``nefl-zoo`` command promises: ``--json`` prints one JSON document on stdout and
nothing else, choice options list their choices and refuse others in one line (exit 2), an
output path is ``-o/--out``, and help text is plain (no reST markup).

``train --json`` and ``compare --json`` are checked in ``test_cli_train.py``, where those runs
happen anyway (each trains; the suite runs them once)."""

import json
import re

import click
import numpy as np
import pytest
import typer.main
from PIL import Image
from typer.testing import CliRunner

from nefl_zoo.models import list_models
from nefl_zoo_cli.app import app

SPEC = """
model: resnet20
tiers:
  - {name: small, gamma_w: 0.25, steps: [[1, 0, 1], [0, 1, 1], [1, 1, 0]]}
  - {name: full}
"""
COMMANDS = typer.main.get_command(app).commands
runner = CliRunner()


def invoke_json(*args):
    """Run a command with ``--json``: exit 0, and stdout is exactly one JSON document."""
    result = runner.invoke(app, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "tiny.yaml"
    path.write_text(SPEC)
    return path


@pytest.fixture(scope="module")
def exported(spec_file, tmp_path_factory):
    """One export of one small tier (the input of select, predict and bench-tiers), and what
    ``export --json`` printed."""
    out = tmp_path_factory.mktemp("export") / "tiny"
    printed = invoke_json("export", spec_file, "-o", out, "--tiers", "small", "--latency-runs", "1", "--pad-channels", "1",
                          "--dataset", "cifar10")
    return out, printed


@pytest.fixture(scope="module")
def export_dir(exported):
    return exported[0]


# --- --json on every command that prints results -------------------------------------------


NO_RESULTS = {"clientapp", "serve"}  # long-running processes (a ClientApp, the local page's server): they log, they print no results


def test_every_command_has_json():
    assert sorted(name for name, cmd in COMMANDS.items() if "--json" not in _options(cmd)) == sorted(NO_RESULTS)


def test_models_json_lists_the_registry():
    rows = invoke_json("models")
    assert [r["model"] for r in rows] == list_models()
    resnet20 = next(r for r in rows if r["model"] == "resnet20")
    assert resnet20["blocks_per_stage"] == [3, 3, 3] and resnet20["input_size"] == [3, 32, 32]
    assert resnet20["params"] == 272_474 + 9  # He et al.'s ResNet-20 (0.27M) plus one step size per block


def test_specs_json_lists_the_shipped_specs_and_their_tiers():
    rows = {r["spec"]: r for r in invoke_json("specs")}
    wd = rows["resnet110/nefl-wd"]
    assert wd["model"] == "resnet110" and [t["gamma"] for t in wd["tiers"]] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert not [name for name, r in rows.items() if "error" in r]


def test_schema_json():
    assert "tiers" in invoke_json("schema")["properties"]


def test_build_json(spec_file):
    data = invoke_json("build", "--spec", spec_file, "--tier", "small")
    assert data["tier"] == "small" and data["gamma_w"] == 0.25 and data["blocks_per_stage"] == [2, 2, 2]


def test_profile_json_and_the_deprecated_format_json(spec_file):
    data = invoke_json("profile", spec_file)
    assert [t["name"] for t in data["tiers"]] == ["small", "full"]
    old = runner.invoke(app, ["profile", str(spec_file), "--format", "json"])
    assert old.exit_code == 0 and json.loads(old.stdout) == data
    assert old.stderr == "note: --format json is deprecated and will be removed; use --json (the same output)\n"
    modules = invoke_json("profile", spec_file, "--by-module")
    assert {r["tier"] for r in modules if r["module"] == "(total)"} == {"small", "full"}
    both = runner.invoke(app, ["profile", str(spec_file), "--json", "--format", "csv"])
    assert both.exit_code == 2 and both.stderr == "error: --json: prints JSON; leave out --format csv\n"


def test_methods_json_is_the_registry_with_its_settings():
    from nefl_zoo.fl import registered_methods

    rows = invoke_json("methods")
    methods = registered_methods()
    assert [r["method"] for r in rows] == list(methods)
    for r in rows:
        assert r["label"] == methods[r["method"]].label
        assert r["method_args"] == methods[r["method"]].Settings().model_dump(mode="json")


def test_export_json(exported):
    out, printed = exported
    assert "small" in json.dumps(printed) and str(out / "manifest.json") in json.dumps(printed)


def test_select_json(export_dir):
    assert invoke_json("select", export_dir)["tier"] == "small"


def test_predict_json(export_dir, tmp_path):
    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(image)
    data = invoke_json("predict", export_dir, image, "--top-k", "2")
    assert str(image) in json.dumps(data) and "small" in json.dumps(data)


def test_bench_tiers_json(export_dir):
    data = invoke_json("bench-tiers", export_dir, "--runs", "1")
    assert "small" in json.dumps(data)


# --- options and help -------------------------------------------------------------------------


def _options(command: click.Command) -> set[str]:
    return {opt for p in command.params for opt in p.opts + p.secondary_opts}


def _choices():
    return [(name, p) for name, cmd in COMMANDS.items() for p in cmd.params if isinstance(p.type, click.Choice)]


@pytest.mark.parametrize("name, param", _choices(), ids=lambda x: x if isinstance(x, str) else x.opts[0])
def test_choice_options_show_their_choices_and_refuse_others_in_one_line(name, param):
    choices = [param.type.normalize_choice(c, None) for c in param.type.choices]
    help_text = runner.invoke(app, [name, "--help"], env={"COLUMNS": "240"}).stdout
    assert f"[{'|'.join(choices)}]" in help_text
    result = runner.invoke(app, [name, param.opts[0], "bogus"])
    expected = " or ".join(choices) if len(choices) < 3 else f"{', '.join(choices[:-1])} or {choices[-1]}"
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == f"error: {param.opts[0]}: expected {expected}, got 'bogus'\n"


def test_the_engine_is_a_choice():
    assert [name for name, p in _choices() if p.opts[0] == "--engine"] == ["train"]


def test_every_output_path_is_dash_o():
    assert sorted(name for name, cmd in COMMANDS.items() if "--out" in _options(cmd) and "-o" not in _options(cmd)) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["build", "--zzz"], "error: No such option '--zzz'. (`nefl-zoo build --help` lists the options)"),
        (["bogus"], "error: No such command 'bogus'. (`nefl-zoo --help` lists the options)"),
        (["profile", "x", "--batch", "x"], "error: --batch: 'x' is not a valid integer."),
        (["profile"], "error: Missing argument 'SPEC'. (`nefl-zoo profile --help` lists the options)"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and result.stdout == "" and result.stderr == message + "\n"


REST = re.compile(r"``|:(class|func|meth|mod|attr|data|exc|obj|ref|doc):`")


@pytest.mark.parametrize("name", [None, *COMMANDS])
def test_help_is_plain_text(name):
    result = runner.invoke(app, [*([name] if name else []), "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert not REST.search(result.stdout), f"reST markup in `nefl-zoo {name or ''} --help`:\n{result.stdout}"


def test_the_cli_imports_nothing_heavy():
    """``nefl-zoo --help`` stays quick: importing the app loads no torch, numpy, onnx or rich."""
    import subprocess
    import sys

    heavy = ("torch", "numpy", "onnx", "onnxruntime", "rich", "nefl_zoo.fl", "pydantic")
    code = f"import sys, nefl_zoo_cli.app; print([m for m in {heavy!r} if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"

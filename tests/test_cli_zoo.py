import json

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from nefl_zoo.spec import load_spec
from nefl_zoo.slim import compile_spec
from nefl_zoo_cli.app import app

runner = CliRunner()

SPEC = """
model: resnet20
tiers:
  - {name: small, gamma_w: 0.25, steps: [[1, 0, 1], [0, 1, 1], [1, 1, 0]]}
  - {name: full}
"""


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(SPEC)
    return path


def test_build_json_reports_what_was_built():
    result = invoke("build", "resnet20", "--gamma", "0.4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {"model", "tier", "params", "params_ratio", "macs", "macs_ratio", "gamma_w", "blocks_per_stage"} <= set(data)
    assert data["model"] == "resnet20" and abs(data["params_ratio"] - 0.4) <= 0.004
    assert 0 < data["macs_ratio"] < 1 and len(data["blocks_per_stage"]) == 3


def test_build_line_for_a_user():
    result = invoke("build", "resnet20", "--gamma", "0.5", "--mode", "width")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("resnet20 tier g0.5: ") and "params" in result.stdout and "MACs" in result.stdout


def test_build_out_writes_weights_and_a_rebuildable_tier_spec(spec_file, tmp_path):
    out = tmp_path / "out" / "small.safetensors"
    result = invoke("build", "--spec", spec_file, "--tier", "small", "-o", out)
    assert result.exit_code == 0, result.output
    weights = load_file(str(out))
    tier_spec = load_spec(out.with_suffix(".yaml"))
    assert [t.name for t in tier_spec.tiers] == ["small"]
    model = compile_spec(tier_spec)["small"].build()
    model.load_state_dict(weights)  # strict: every tensor present with the slim shape
    assert weights["conv1.weight"].shape == (8, 3, 3, 3)
    again = invoke("build", "--spec", out.with_suffix(".yaml"), "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["tier"] == "small"


@pytest.mark.parametrize(
    "args, message",
    [
        (("build", "resnet9"), "error: model: unknown model 'resnet9'"),
        (("build", "resnet20", "--gamma", "0"), "error: --gamma: must be in (0, 1], got 0"),
        (("build",), "error: give a MODEL or --spec FILE"),
        (("build", "--spec", "nope.yaml"), "error: nope.yaml: no such spec file"),
        (("profile", "nope.yaml"), "error: nope.yaml: no such spec file"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.stderr.strip().startswith(message) and len(result.stderr.strip().splitlines()) == 1


def test_bad_spec_names_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: resnet20\ntiers: [{name: a, gamma_w: 2}]\n")
    result = invoke("profile", bad)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {bad}: tiers[0].gamma_w: must be in (0, 1], got 2.0"


def test_build_spec_needs_a_tier_when_there_are_several(spec_file):
    result = invoke("build", "--spec", spec_file)
    assert result.exit_code == 2 and "give --tier, one of small, full" in result.stderr


@pytest.mark.parametrize("fmt", ["table", "markdown", "csv", "json"])
def test_profile_formats(spec_file, fmt):
    result = invoke("profile", spec_file, *(["--json"] if fmt == "json" else ["--format", fmt]))
    assert result.exit_code == 0, result.output
    if fmt == "json":
        assert [t["name"] for t in json.loads(result.stdout)["tiers"]] == ["small", "full"]
    elif fmt == "csv":
        assert result.stdout.splitlines()[2].startswith("full,,1.0,")
    else:
        assert "small" in result.stdout and "full" in result.stdout


def test_profile_by_module_and_shipped_spec_names():
    result = invoke("profile", "resnet20/nefl-wd", "--by-module", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    totals = {r["tier"]: r for r in rows if r["module"] == "(total)"}
    assert list(totals) == ["g0.2", "g0.4", "g0.6", "g0.8", "g1"]
    layer3 = [r for r in rows if r["tier"] == "g1" and r["module"] == "layer3"][0]
    assert 0 < layer3["macs"] < totals["g1"]["macs"]


def test_models_specs_and_schema():
    assert "resnet110" in invoke("models").stdout
    specs = invoke("specs")
    assert specs.exit_code == 0 and "resnet34/nefl-wd" in specs.stdout
    schema = json.loads(invoke("schema").stdout)
    assert "tiers" in schema["properties"]


def test_readme_build_example_prints_exactly_what_the_readme_shows():
    """README's "Build a tier" ``$ nefl-zoo build resnet110 --gamma 0.2`` line and its output
    line, read from README.md so that the two cannot drift apart."""
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text().splitlines()
    command = "$ nefl-zoo build resnet110 --gamma 0.2"
    assert readme.count(command) == 1, f"README.md: 'Build a tier' shows `{command}` once"
    shown = readme[readme.index(command) + 1]
    assert shown.startswith("resnet110 tier g0.2: ")
    result = invoke(*shlex.split(command)[2:])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [shown]


def test_profile_by_module_in_every_format(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("model: resnet20\nmodel_args: {img_size: 8}\ntiers: [{name: g1}]\n")
    csv = invoke("profile", str(spec), "--by-module", "--format", "csv").stdout.splitlines()
    assert csv[0] == "tier,module,params,macs" and csv[1].startswith("g1,(total),")
    markdown = invoke("profile", str(spec), "--by-module", "--format", "markdown").stdout.splitlines()
    assert markdown[:2] == ["| tier | module | params | MACs |", "|---|---|---|---|"] and markdown[2].startswith("| g1 | (total) | ")
    table = invoke("profile", str(spec), "--by-module").stdout
    assert [c.strip() for c in table.splitlines()[1].split("┃")[1:5]] == ["tier", "module", "params", "MACs"]


def test_specs_lists_an_invalid_spec_by_name(tmp_path, monkeypatch):
    (tmp_path / "resnet20").mkdir()
    (tmp_path / "resnet20" / "broken.yaml").write_text("model: resnet20\ntiers: []\n")
    monkeypatch.setenv("NEFL_ZOO_SPECS", str(tmp_path))
    rows = [line for line in invoke("specs").stdout.splitlines() if "broken" in line]
    assert len(rows) == 1 and [cell.strip() for cell in rows[0].split("│")[1:3]] == ["resnet20/broken", "invalid"]


def test_build_latency_ms_rounds_channels_as_asked(monkeypatch):
    import nefl_zoo.auto

    def refuse(model, budget_ms, batch, threads, mode, channel_multiple):  # what the search was asked
        raise ValueError(f"{model} {budget_ms:g} ms, batch {batch}, {threads} thread, {mode}, multiple {channel_multiple}")

    monkeypatch.setattr(nefl_zoo.auto, "latency_tier", refuse)
    result = invoke("build", "resnet20", "--latency-ms", 5, "--channel-multiple", 8, "--batch", 2)
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: --latency-ms: resnet20 5 ms, batch 2, 1 thread, balanced, multiple 8"


def test_build_says_when_the_ratio_cannot_be_reached():
    result = invoke("build", "resnet18", "--gamma", "0.2", "--mode", "depth")
    assert result.exit_code == 0
    assert result.stderr.startswith("note: resnet18 cannot reach parameter ratio 0.2 within 1% in depth mode")

import json

import pytest
import torch

from nefl_zoo.models import create_model
from nefl_zoo.spec import SpecError, json_schema, load_spec, parse_spec, shipped_specs_dir


def write(tmp_path, text, name="x.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message.removeprefix(f"{path}: ")


GOOD_110 = "[" + ", ".join(["1"] * 18) + "]"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("model: resnet9\ntiers: [{name: a}]", "model: unknown model 'resnet9'"),
        ("model: resnet20\ntiers: [{name: a, gamma_w: 1.5}]", "tiers[0].gamma_w: must be in (0, 1], got 1.5"),
        ("model: resnet20\ntiers: [{name: a, gamma_w: 0}]", "tiers[0].gamma_w: must be in (0, 1], got 0"),
        ("model: resnet20\ntiers: [{name: a, steps: [[1,1,1],[1,1,1]]}]", "tiers[0].steps: resnet20 has 3 stages, got 2"),
        (
            "model: resnet110\ntiers: [{name: a}, {name: b}, {name: c, steps: [" + GOOD_110 + ", [" + ", ".join(["1"] * 17) + "], " + GOOD_110 + "]}]",
            "tiers[2].steps[1]: resnet110 stage 2 has 18 blocks, got 17",
        ),
        ("model: resnet20\ntiers: [{name: a, steps: [[1,1,1],[1,-1,1],[1,1,1]]}]", "tiers[0].steps[1][1]: step must be >= 0, got -1.0"),
        ("model: resnet20\ntiers: [{name: a, steps: [[0,0,0],[0,0,0],[0,0,0]]}]", "tiers[0].steps: every block is skipped"),
        ("model: resnet20\ntiers: [{name: a}, {name: a, gamma_w: 0.5}]", "tiers[1].name: duplicate tier name 'a'"),
        ("model: resnet20\ntiers: [{name: a, widht: 0.5}]", "tiers[0].widht: unknown key"),
        ("model: resnet20\nfoo: 1\ntiers: [{name: a}]", "foo: unknown key"),
        ("model: resnet20\ntiers: []", "tiers: List should have at least 1 item"),
        ("tiers: [{name: a}]", "model: required key is missing"),
        ("model: resnet20\ninconsistent: [bias]\ntiers: [{name: a}]", "inconsistent[0]: Input should be 'steps' or 'norm'"),
        ("model: resnet20\nmodel_args: {stem: cifar}\ntiers: [{name: a}]", "model_args.stem: unknown argument (this model takes"),
        ("model: resnet20\nmodel_args: {num_classes: -1}\ntiers: [{name: a}]", "model_args.num_classes: Input should be greater than or equal to 1"),
        ("model: vit_tiny_16\nmodel_args: {num_heads: 0}\ntiers: [{name: a}]", "model_args.num_heads: Input should be greater than or equal to 1"),
        ("model: vit_tiny_16\nmodel_args: {img_size: -4}\ntiers: [{name: a}]", "model_args.img_size: Input should be greater than or equal to 1"),
        ("model: vit_tiny_16\nmodel_args: {embed_dim: 100}\ntiers: [{name: a}]", "model_args.num_heads: embed_dim 100 is not divisible by num_heads 3"),
        ("model: vit_tiny_16\nmodel_args: {img_size: 4096, patch_size: 2}\ntiers: [{name: a}]", "model_args.patch_size: img_size 4096 / patch_size 2 gives 4,194,304 patches"),
        ("model: resnet18\nmodel_args: {planes: [8, 16]}\ntiers: [{name: a}]", "model_args.planes: Value should have at least 4 items"),
        ("model: resnet18\nmodel_args: {planes: [8192, 8192, 8192, 8192], width_multiplier: 64}\ntiers: [{name: a}]", "model_args: resnet18 with these arguments has"),
        ("model: resnet20\nmodel_args: {gamma_w: 0.5}\ntiers: [{name: a}]", "model_args.gamma_w: set per tier (tiers[].gamma_w)"),
        ("model: resnet20\ninconsistent: [steps]\ntiers: [{name: a, steps: [[1,.nan,1],[1,1,1],[1,1,1]]}]", "tiers[0].steps[0][1]: Input should be a finite number"),
        ("model: resnet20\ninconsistent: [steps]\ntiers: [{name: a, steps: [[1,.inf,1],[1,1,1],[1,1,1]]}]", "tiers[0].steps[0][1]: Input should be a finite number"),
        ("model: resnet20\ninconsistent: [norm]\ntiers: [{name: a, steps: [[2,1,1],[1,1,1],[1,1,1]]}]", "tiers[0].steps[0][0]: shared step sizes start at 1"),
        ("model: [resnet20\n", "not valid YAML at line"),
        ("- just\n- a list\n", "expected a mapping with model and tiers, got list"),
    ],
)
def test_errors_name_file_field_and_expectation(tmp_path, text, expected):
    assert error_of(tmp_path, text).startswith(expected)


def test_missing_file_is_a_one_line_error(tmp_path):
    with pytest.raises(SpecError, match="cannot read the file"):
        load_spec(tmp_path / "nope.yaml")


def test_yaml_is_loaded_safely(tmp_path):
    text = "model: !!python/object/apply:os.system ['echo hacked']\ntiers: [{name: a}]"
    assert "not valid YAML" in error_of(tmp_path, text)


def test_depth_need_not_be_nested_across_tiers():
    spec = parse_spec({"model": "resnet20", "tiers": [
        {"name": "a", "steps": [[1, 1, 1], [0, 0, 0], [1, 1, 1]]},
        {"name": "b", "steps": [[1, 1, 1], [1, 1, 1], [1, 0, 0]]},
    ]})
    assert [t.name for t in spec.tiers] == ["a", "b"]


def test_json_schema_describes_tiers():
    schema = json_schema()
    json.dumps(schema)
    assert set(schema["properties"]) == {"model", "model_args", "channel_multiple", "tiers", "inconsistent"}
    assert "gamma_w" in schema["$defs"]["TierSpec"]["properties"]


SHIPPED = sorted(p for p in shipped_specs_dir().glob("*/*.yaml") if p.parent.name != "train")


def test_every_paper_table_is_shipped():
    names = {str(p.relative_to(shipped_specs_dir()).with_suffix("")) for p in SHIPPED}
    assert names >= {
        "resnet18/nefl-d", "resnet18/nefl-wd", "resnet34/nefl-d", "resnet34/nefl-wd",
        "resnet56/nefl-d", "resnet56/nefl-d_o", "resnet56/nefl-wd",
        "resnet110/nefl-d", "resnet110/nefl-wd", "resnet110/nefl-d-g004", "resnet110/nefl-wd-g004",
        "wide_resnet101_2/nefl-d", "vit_b_16/nefl-d", "vit_b_16/nefl-w",
        "resnet18/nefl-w", "resnet34/nefl-w", "resnet56/nefl-w", "resnet110/nefl-w",
    }


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_specs_load(path):
    spec = load_spec(path)
    assert spec.full_tier.gamma_w == 1.0


def measured_ratios(spec):
    def count(**kw):
        with torch.device("meta"):
            return sum(p.numel() for p in create_model(spec.model, **spec.model_args, **kw).parameters())

    full = count()
    return [round(count(gamma_w=t.gamma_w, steps=t.steps) / full, 3) for t in spec.tiers]


def test_measured_ratios_match_the_reference_figures():
    root = shipped_specs_dir()
    assert measured_ratios(load_spec(root / "resnet56/nefl-wd.yaml")) == [0.205, 0.405, 0.621, 0.815, 1.0]
    assert measured_ratios(load_spec(root / "resnet34/nefl-wd.yaml"))[2] == 0.559
    assert "off its nominal gamma (0.559 vs 0.6)" in (root / "resnet34/nefl-wd.yaml").read_text()


def test_a_spec_is_a_file_path_or_a_shipped_name(tmp_path, monkeypatch):
    from nefl_zoo.spec import resolve_spec_path

    own = write(tmp_path, "model: resnet20\ntiers: [{name: g1}]\n")
    assert resolve_spec_path(own) == own and resolve_spec_path(str(own)) == own
    assert resolve_spec_path("resnet56/nefl-w") == shipped_specs_dir() / "resnet56" / "nefl-w.yaml"
    with pytest.raises(SpecError) as unknown:
        resolve_spec_path("resnet56/nefl-x")
    assert str(unknown.value) == "resnet56/nefl-x: no such spec file or shipped spec (see `nefl-zoo specs`)"
    monkeypatch.setenv("NEFL_ZOO_SPECS", str(tmp_path))  # another folder of shipped specs
    assert shipped_specs_dir() == tmp_path and resolve_spec_path("x") == tmp_path / "x.yaml"


def test_load_spec_takes_a_shipped_name_as_the_cli_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: the name is found in the installed specs
    by_name = load_spec("resnet110/nefl-wd")
    assert by_name == load_spec(shipped_specs_dir() / "resnet110" / "nefl-wd.yaml") and by_name.model == "resnet110"
    with pytest.raises(SpecError) as unknown:
        load_spec("resnet110/nefl-x")
    assert str(unknown.value) == "resnet110/nefl-x: no such spec file or shipped spec (see `nefl-zoo specs`)"
    with pytest.raises(SpecError, match="cannot read"):  # a file name stays a file name
        load_spec("resnet110/nefl-wd.yaml")


def test_stage_depths_and_parameters_of_a_zoo_model():
    from nefl_zoo.spec import model_shape, stage_depths

    assert stage_depths("resnet20", ()) == (3, 3, 3) and stage_depths("resnet56", ()) == (9, 9, 9)
    depths, params = model_shape("resnet20", (("num_classes", 10),))
    assert depths == (3, 3, 3) and params == sum(p.numel() for p in create_model("resnet20", num_classes=10).parameters())
    assert model_shape("resnet18", (("planes", [8, 16, 32, 64]),))[0] == (2, 2, 2, 2)  # a list: not cached, still built


def test_spec_data_that_is_no_mapping_is_one_line():
    with pytest.raises(SpecError) as refused:
        parse_spec(["resnet20"])
    assert str(refused.value) == "<spec>: expected a mapping with model and tiers, got list"

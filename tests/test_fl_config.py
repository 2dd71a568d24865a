"""Training configs: the shipped files load, overrides apply, bad input gives one-line errors."""

from pathlib import Path

import pytest

from nefl_zoo.fl.config import ConfigError, load_config, parse_config
from nefl_zoo.fl.training.client import learning_rate
from nefl_zoo.fl.strategy.registry import registered_methods

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"model": "resnet20", "tiers": [{"name": "a", "gamma_w": 0.5}, {"name": "b"}]}


@pytest.mark.parametrize("name", ["digits-quick", "digits-compare", "digits-fedgh", "digits-fedlps", "cifar10-iid-resnet18", "cifar10-noniid-resnet18",
                                  "mnist-quick"])
def test_shipped_configs_load(name):
    config = load_config(ROOT / "specs" / "train" / f"{name}.yaml")
    assert len(config.submodel_spec().tiers) == 5
    if name.startswith("cifar10"):
        assert (config.rounds, config.clients.num_clients, config.clients.fraction) == (500, 100, 0.1)
        assert (config.train.local_epochs, config.train.batch_size, config.train.lr) == (5, 32, 0.1)
        assert config.train.schedule == "step" and config.train.momentum == 0 and config.train.weight_decay == 0
        assert config.data.partition == ("dirichlet" if "noniid" in name else "iid")
    if name == "digits-fedgh":  # the FedGH paper's setting: 2 label shards, 8:1:1 local splits
        assert (config.data.partition, config.data.shards_per_client, config.data.local_split) == ("shards", 2, (0.8, 0.1, 0.1))
        assert config.build_strategy().settings.rep_dim == 500 and config.eval.per_client
    if name == "mnist-quick":  # MNIST's own images: one channel, 28x28
        assert config.data.dataset == "mnist" and config.submodel_spec().model_args["img_size"] == 28
    if name == "digits-fedlps":  # the paper's levels: the largest tier unpruned, the smallest at 0.8
        assert config.build_strategy().rho == {"g1": 0.0, "g0.8": 0.2, "g0.6": 0.4, "g0.4": 0.6, "g0.2": 0.8}


def test_overrides_are_typed_and_nested():
    config = load_config(ROOT / "specs/train/digits-quick.yaml",
                         ["rounds=3", "data.alpha=0.25", "data.partition=dirichlet", "train.grad_clip=5", "method=fjord"])
    assert config.rounds == 3 and config.data.alpha == 0.25 and config.train.grad_clip == 5.0
    assert config.method == "fjord" and config.data.partition == "dirichlet"


@pytest.mark.parametrize(
    "data, field, words",
    [
        ({"spec": SPEC, "roundz": 3}, "roundz", "unknown key"),
        ({"spec": SPEC, "method": "fedproxx"}, "method", "one of " + ", ".join(registered_methods())),
        ({"spec": SPEC, "method": "fedlps", "method_args": {"bn_recompute_batches": 5}}, "method_args.bn_recompute_batches",
         "moved to eval.bn: recompute and eval.bn_batches"),
        ({"spec": SPEC, "method": "fedprox", "method_args": {"mu": -1}}, "method_args.mu", "fedprox: Input should be greater than or equal to 0"),
        ({"spec": SPEC, "method": "nefl", "method_args": {"kd": True}}, "method_args.kd", "nefl: unknown key"),
        ({"spec": SPEC, "method": "fjord", "method_args": {"kd": "maybe"}}, "method_args.kd", "fjord: Input should be a valid boolean"),
        ({"spec": SPEC, "method": "fjord", "train": {"kd": True}}, "train.kd", "moved to method_args.kd (method: fjord)"),
        ({"spec": SPEC, "eval": {"bn_recompute_batches": 5}}, "eval.bn_recompute_batches", "moved to eval.bn_batches"),
        ({"spec": SPEC, "eval": {"bn": "batch"}}, "eval.bn", "'running' or 'recompute'"),
        ({"spec": SPEC, "rounds": 0}, "rounds", "greater than"),
        ({"spec": SPEC, "train": {"schedule": "linear"}}, "train.schedule", "step"),
        ({"spec": SPEC, "data": {"alpha": -1}}, "data.alpha", "greater than"),
        ({}, "spec", "missing"),
        ({"spec": {"model": "resnet20", "tiers": [{"name": "a", "gamma_w": 2}]}}, "spec.tiers[0].gamma_w", "(0, 1]"),
        ({"spec": SPEC, "clients": {"groups": [["a"], ["zz"]]}}, "clients.groups[1]", "unknown tier 'zz'"),
    ],
)
def test_config_errors_name_the_field(data, field, words):
    with pytest.raises(ConfigError) as info:
        parse_config(data, "cfg.yaml")
    message = str(info.value)
    assert message.startswith(f"cfg.yaml: {field}: ") and words in message and "\n" not in message


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    ref = tmp_path / "ref.yaml"
    ref.write_text("spec: missing-spec.yaml\n")
    with pytest.raises(ConfigError, match=r"ref.yaml: spec: .*missing-spec.yaml: cannot read"):
        load_config(ref)
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(ROOT / "specs/train/digits-quick.yaml", ["rounds"])


def test_relative_spec_path_is_resolved_against_the_config(tmp_path):
    (tmp_path / "s.yaml").write_text("model: resnet20\ntiers: [{name: only}]\n")
    (tmp_path / "c.yaml").write_text("spec: s.yaml\nrounds: 2\n")
    config = load_config(tmp_path / "c.yaml")
    assert config.submodel_spec().tiers[0].name == "only"
    assert config.to_dict()["spec"]["model"] == "resnet20"


def test_method_args_are_the_methods_own_settings_and_saved_with_their_defaults():
    config = parse_config({"spec": SPEC, "method": "fjord", "method_args": {"kd": True}})
    assert config.build_strategy().settings.kd is True
    assert config.to_dict()["method_args"] == {"variant": "original", "kd": True, "kd_alpha": 1.0, "kd_temperature": 1.0}
    defaults = {"variant": "original", "kd": None, "kd_alpha": 1.0, "kd_temperature": 1.0}  # kd none: the variant's own (on)
    assert parse_config({"spec": SPEC, "method": "fjord"}).to_dict()["method_args"] == defaults
    other = config.with_method("fedprox", seed=3)  # another method starts from its own defaults
    assert (other.method, other.seed, other.build_strategy().settings.mu) == ("fedprox", 3, 0.01)


def test_learning_rate_schedules():
    step = parse_config({"spec": SPEC}).train
    assert [learning_rate(step, r, 8) for r in (0, 3, 4, 5, 6, 7)] == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001, 0.001])
    cosine = parse_config({"spec": SPEC, "train": {"schedule": "cosine", "warmup_rounds": 2}}).train
    lrs = [learning_rate(cosine, r, 10) for r in range(10)]
    assert lrs[0] == pytest.approx(0.05) and lrs[1] == pytest.approx(0.1) and lrs[2] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] < 0.01


def test_a_relative_trace_is_resolved_against_the_config_and_a_bad_one_named(tmp_path):
    (tmp_path / "s.yaml").write_text("model: resnet20\ntiers: [{name: only}]\n")
    (tmp_path / "trace.csv").write_text("client,start_s,end_s\n0,0,100\n1,5,50\n")
    devices = ("devices: {classes: [{name: d, share: 1, macs_per_s: 1.0e9, memory_mb: 64, uplink_mbps: 10, "
               "downlink_mbps: 10}], deadline_s: 5, trace: trace.csv}\n")
    (tmp_path / "c.yaml").write_text(f"spec: s.yaml\nclients: {{num_clients: 2}}\n{devices}")
    config = load_config(tmp_path / "c.yaml")
    assert config.devices.trace == str((tmp_path / "trace.csv").resolve())  # resumes from any working directory
    assert parse_config(config.to_dict()).devices.trace == config.devices.trace
    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path / "c.yaml", ["clients.num_clients=1"])
    assert str(refused.value) == (f"{tmp_path / 'c.yaml'}: devices.trace: {tmp_path / 'trace.csv'}: line 3: client 1 is not "
                                  "one of the 1 clients (0..0)")


def test_a_missing_device_is_named_with_the_config_file(tmp_path):
    (tmp_path / "c.yaml").write_text("spec: {model: resnet20, tiers: [{name: only}]}\ntrain: {device: 'cuda:7'}\n")
    config = load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError) as refused:
        config.placement()
    assert str(refused.value).startswith(f"{tmp_path / 'c.yaml'}: train.device: ")


def test_the_strategy_is_built_from_the_configs_sections():
    config = parse_config({"spec": SPEC, "seed": 3, "rounds": 7, "clients": {"fraction": 0.25}, "train": {"lr": 0.05}})
    run = config.build_strategy().run
    assert run.train == config.train and run.train.lr == 0.05 and run.eval == config.eval
    assert (run.seed, run.rounds, run.fraction) == (3, 7, 0.25) and run.spec == config.submodel_spec()
    assert run.data.root == str(config.data_root()) and run.aggregation == config.aggregation


def test_a_shipped_config_is_taken_by_name_from_any_folder(tmp_path, monkeypatch):
    """``digits-quick`` names the shipped file; in a shipped config, ``spec:`` may name a shipped
    spec and a relative ``data.root`` is the working directory's, never the installed package's."""
    from nefl_zoo.fl.config import shipped_configs, shipped_configs_dir
    from nefl_zoo.spec import shipped_specs_dir

    monkeypatch.chdir(tmp_path)
    assert "digits-quick" in shipped_configs() and "mnist-devices" in shipped_configs()
    assert load_config("digits-quick").name == "digits-quick"
    by_name = load_config("mnist-devices")  # spec: resnet20/nefl-w, data.root: data
    assert by_name.submodel_spec() == load_config(shipped_specs_dir() / "train" / "mnist-devices.yaml").submodel_spec()
    assert by_name.data_root() == tmp_path / "data"
    assert by_name.to_dict()["data"]["root"] == str(tmp_path / "data")
    assert shipped_configs_dir() not in by_name.data_root().parents


@pytest.mark.parametrize("given, words", [
    ("digits-quik", "digits-quik: no such config file or shipped config (shipped: cifar10-iid-resnet18, "),
    ("missing.yaml", "missing.yaml: cannot read"),
    ("folder/digits-quick", "folder/digits-quick: cannot read"),
    ("a" * 300, "a" * 300 + ": no such config file or shipped config"),  # a name the OS refuses (too long)
])
def test_an_unknown_config_name_lists_the_shipped_ones(tmp_path, monkeypatch, given, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_config(given)
    assert str(error.value).startswith(words) and len(str(error.value).splitlines()) == 1


def test_a_config_file_beside_the_users_own_spec_still_wins_over_a_shipped_name(tmp_path):
    (tmp_path / "resnet20").mkdir()
    (tmp_path / "resnet20" / "nefl-w").write_text("model: resnet20\ntiers: [{name: only, gamma_w: 0.5}, {name: all}]\n")
    (tmp_path / "run.yaml").write_text("spec: resnet20/nefl-w\n")
    assert [t.name for t in load_config(tmp_path / "run.yaml").submodel_spec().tiers] == ["only", "all"]
    (tmp_path / "resnet20" / "nefl-w").unlink()
    assert [t.name for t in load_config(tmp_path / "run.yaml").submodel_spec().tiers] == ["g0.2", "g0.4", "g0.6", "g0.8", "g1"]


def test_a_spec_name_the_os_refuses_is_a_one_line_error(tmp_path):
    """A name longer than the file system allows is no file: the one-line error of an unknown spec."""
    (tmp_path / "run.yaml").write_text("name: long\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "run.yaml", ["spec=" + "a" * 300])
    assert "spec: " + "a" * 300 in str(error.value) and len(str(error.value).splitlines()) == 1

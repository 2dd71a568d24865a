"""The method contract, checked for every registered method (as tests/test_model_contract.py is
for every model): two rounds on digits, a bit-identical resume (global, client and server state
and the metrics records), settings that survive the saved configuration, what the engine reads
(``info``), the method in ``nefl-zoo methods``, and the documentation's tables that list every
method.
A new method file is covered here without an edit."""

import hashlib
import json
import math
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nefl_zoo.fl.engine import Engine, resume_config
from nefl_zoo.fl.strategy.registry import parse_settings, registered_methods
from nefl_zoo.fl.strategy.base import MethodInfo
from nefl_zoo.fl.methods.common import level_sizes
from nefl_zoo.slim import compile_spec

from .conftest import CONTRACT_LEVELS as LEVELS, contract_config, contract_run, crash_in_round, records, same_tensors

torch.set_num_threads(1)
METHODS = list(registered_methods())
DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("method", METHODS)
def test_two_rounds_then_a_resume_are_bit_identical(tmp_path_factory, tmp_path, monkeypatch, method):
    config = contract_config(method)
    shutil.copytree(contract_run(tmp_path_factory, method), tmp_path / "straight")  # Engine(config, ...).run(), made once
    straight = records(tmp_path / "straight")
    crash_in_round(config, tmp_path / "resumed", monkeypatch, 1)
    engine = Engine(config, tmp_path / "resumed")
    result = engine.run(resume=True)
    for name in ("global.safetensors", "clients.safetensors", "server.safetensors"):
        assert (tmp_path / "straight" / name).exists() == (tmp_path / "resumed" / name).exists(), name
        if (tmp_path / "straight" / name).exists():
            assert same_tensors(tmp_path / "straight", tmp_path / "resumed", name), name
    assert records(tmp_path / "resumed") == straight
    assert json.dumps(asdict(result)) == json.dumps(json.loads((tmp_path / "straight" / "summary.json").read_text()))

    info = engine.strategy.info
    assert isinstance(info, MethodInfo) and info.input_size == (1, 8, 8) and info.num_classes == 10
    assert set(info.levels) <= set(LEVELS) and info.eval_names
    assert result.acc and set(result.acc) <= set(info.eval_names) and all(0 <= a <= 1 for a in result.acc.values())
    assert all("/" in k for k in result.extra)
    # the worst case is the smallest submodel's accuracy (the NeFL paper's "Worst"), not the minimum
    if method == "fedlps":  # per-task accuracies: no submodel is the smallest
        assert info.worst_case is None and result.worst == result.min
    else:
        sizes = level_sizes(compile_spec(info.spec))
        assert info.worst_case == min(info.eval_names, key=sizes.__getitem__), (info.worst_case, sizes)
        assert result.worst_case == info.worst_case
        # NaN where no client of the smallest submodel evaluated (per-client evaluation, FedGH)
        assert result.worst == result.acc[info.worst_case] if info.worst_case in result.acc else math.isnan(result.worst)
    assert result.min == min(result.acc.values())
    assert all(engine.strategy.submodel_numel(name) > 0 for name in (*info.levels, *info.eval_names))
    assert [r["round"] for r in straight] == [1, 2] and all(r["clients"] >= 1 and r["rejected"] == 0 for r in straight)
    assert all(set(r["tiers"]) <= set(info.levels) for r in straight)

    # the settings round-trip through the saved configuration
    saved = resume_config(tmp_path / "straight")
    assert saved.method == method and saved.build_strategy().settings == engine.strategy.settings
    assert parse_settings(method, saved.method_args) == engine.strategy.settings


@pytest.mark.parametrize("method", METHODS)
def test_every_setting_is_described_and_its_default_validates(method):
    cls = registered_methods()[method]
    assert cls.name == method and cls.label and (cls.__doc__ or "").strip()
    assert all(field.description for field in cls.Settings.model_fields.values()), method
    defaults = cls.Settings()
    assert cls.Settings.model_validate(defaults.model_dump(mode="json")) == defaults


def test_every_method_is_listed_by_the_cli():
    from nefl_zoo_cli.app import app

    out = CliRunner().invoke(app, ["methods"], env={"COLUMNS": "400"})
    assert out.exit_code == 0, out.output
    listed = {line.split()[1] for line in out.output.splitlines() if len(line.split()) > 1 and line.split()[0] in "│┃|"}
    assert set(METHODS) <= listed, set(METHODS) - listed


def _documented_methods(page: Path, header: str) -> list[str]:
    """The method names in the first column of the table of ``page`` whose header row is ``header``."""
    text = page.read_text()
    table = re.search(re.escape(header) + r"\n(\|.*\|\n)+", text)
    assert table, f"{page}: no table {header!r}"
    names = []
    for row in table.group(0).strip().splitlines()[2:]:
        names += re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])
    return names


def test_the_documented_method_tables_list_every_registered_method():
    explained = _documented_methods(DOCS / "explanations/nefl-and-baselines.md",
                                    "| method | what a client trains | BN at evaluation | departs from its paper |")
    assert sorted(explained) == sorted(METHODS)
    with_args = {m for m in METHODS if registered_methods()[m].Settings.model_fields}
    assert sorted(_documented_methods(DOCS / "reference/run-config.md", "| method | `method_args` |")) == sorted(with_args)


def test_the_registry_lists_the_built_in_methods_in_sorted_module_order():
    modules = [registered_methods()[m].__module__ for m in METHODS]
    assert modules == sorted(modules) and len(set(METHODS)) == len(METHODS)


# sha256 over every tensor (sorted names: name, dtype, shape, bytes) of each method's contract run
# (one torch thread), recorded on this project's CI machine type before the training package was
# reorganised: a refactor of training must leave them as they are. Floating-point results depend on
# the CPU's vector instructions, so other CPUs are not compared.
RECORDED_CPU = "AVX512"
RECORDED_STATES = {
    "depthfl": "dc2c4f31b24cc6f5db73d0551567129a6cb1849868a276d5f7d348a66f1ed6a3",
    "fedavg": "6f085dfa9250982e4ea90d69560cd74b7eecb719877cf9b4353b1975c3f41910",
    "fedavg_min": "fd73113984d86b1650ab097b216f6dd54e7426d94d81f247d27e474a7afcb604",
    "fedavg_full": "6c7ac59dd61b7a8f37fab8ee2e1da0bb62d88c8664319c8dc9ef9aaeb9a4adfb",
    "fedavgm": "71f4eab8246d6215a1509d0845066739bccedd0f32d754cec05012e2f3bef4cc",
    "fedgh": "32902800791c10923fd303b9ba36d2cff69257a0b2de8b9e76bfec82fc17ffb8",
    "fedlps": "47fd6b954fdd8d6ca1f32a7dade88f7dd0c4a3a28cca778bf94ff7d795e602bb",
    "fedprox": "150612f2c7d9444e756e72cfba8b90d24bd1a9855a207c4c35e1055e9856924e",
    "fjord": "5541feedd6599df82084fd719e0c0990ebfb86c01235766f172b945d504e02cc",
    "heterofl": "465d6a6b0ebeb2fe0834e2f1e1923db892725fd385e2ed1fbb24a80d4075de4e",
    "nefl": "8bc2b4daf4425d44a52e0fd140f431ca8715861bc1b7461bbb9dd462f8514283",
}


def state_digest(run_dir: Path) -> str:
    """One sha256 over a run directory's global and per-client tensors."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name in ("global.safetensors", "clients.safetensors"):
        if (run_dir / name).exists():
            tensors = load_file(str(run_dir / name))
            for key in sorted(tensors):
                tensor = tensors[key].contiguous().reshape(-1)
                digest.update(f"{name}:{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


@pytest.mark.parametrize("method", METHODS)
def test_each_methods_results_are_the_recorded_ones(tmp_path_factory, method):
    if torch.backends.cpu.get_cpu_capability() != RECORDED_CPU:
        pytest.skip(f"recorded on a {RECORDED_CPU} CPU; this one is {torch.backends.cpu.get_cpu_capability()}")
    if method not in RECORDED_STATES:
        pytest.skip(f"no recorded result for {method}: a method added after the recording")
    assert state_digest(contract_run(tmp_path_factory, method)) == RECORDED_STATES[method]

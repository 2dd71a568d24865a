"""A full disk during a checkpoint, a round's metrics or an export (issue 33) is one line
naming the file being written and the fix, and breaks no promise: the last checkpoint stays
committed and the run resumes bit for bit; an export leaves the previous one in place, or no
manifest rather than one that does not match its files.

A full disk is simulated where the bytes go: ``open`` of the module that writes a file gives,
for that file, one that takes half the bytes and then fails with ``ENOSPC``, as ``write(2)``
does; ``Path.write_text`` likewise for the manifest."""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml
from typer.testing import CliRunner

from nefl_zoo import files
from nefl_zoo.export import ExportOptions, ExportSource, export_tiers
from nefl_zoo.export import fp32 as export_fp32_module
from nefl_zoo.files import WriteError
from nefl_zoo.runs import store
from nefl_zoo.fl.engine import Engine
from nefl_zoo.runs.store import read_pointer
from nefl_zoo.manifest import file_sha256, load_manifest
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec
from nefl_zoo_cli.app import app
from tests.conftest import records, same_tensors, tiny

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "specs/train/digits-quick.yaml")
FULL = os.strerror(errno.ENOSPC)  # "No space left on device"
EXPORT_FIX = "free space or choose another --out, then export again"
SPEC = {"model": "resnet20", "model_args": {"img_size": 8}, "tiers": [{"name": "g0.25", "gamma_w": 0.25}, {"name": "g1"}]}
runner = CliRunner()


class _FullFile:
    """A file on a full disk: a write stores half its bytes, then fails with ``ENOSPC``."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        self._file.write(data[: len(data) // 2])
        self._file.flush()
        raise OSError(errno.ENOSPC, FULL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def __getattr__(self, name):
        return getattr(self._file, name)


def full_disk(monkeypatch, module: ModuleType, pattern: str) -> list[Path]:
    """Make ``module``'s writes to files whose name matches ``pattern`` fail as on a full disk;
    returns the paths hit."""
    hit: list[Path] = []

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        if set(mode) & set("wax") and fnmatch.fnmatch(Path(path).name, pattern):
            hit.append(Path(path))
            return _FullFile(file)
        return file

    monkeypatch.setattr(module, "open", open_on_a_full_disk, raising=False)
    return hit


def assert_one_line_exit_2(result, line: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [line]


# ---- checkpoints and metrics ---------------------------------------------------------------------
def run_config(**overrides):
    """4 rounds of 2 of 16 clients, a checkpoint every 2: a fraction of a second a round."""
    return tiny(clients__num_clients=16, clients__fraction=0.125, train__local_epochs=1, data__max_test_samples=64,
                **overrides)


def test_a_full_disk_at_a_checkpoint_names_the_file_and_the_run_resumes_bit_for_bit(tmp_path, monkeypatch):
    reference, run = tmp_path / "reference", tmp_path / "run"
    Engine(run_config(), reference).run()
    hit = full_disk(monkeypatch, files, "ckpt-000004-*.global.safetensors")
    with pytest.raises(WriteError) as failed:
        Engine(run_config(), run).run()
    (path,) = hit
    assert str(failed.value) == (f"{path}: cannot write ({FULL}); free space, then continue with --resume {run} "
                                 "(the last checkpoint, round 2, is intact)")
    assert failed.value.errno == errno.ENOSPC and re.fullmatch(r"ckpt-000004-[0-9a-f]{8}\.global\.safetensors", path.name)
    assert read_pointer(run).round == 2  # the half-written generation was never committed
    monkeypatch.undo()  # space freed
    Engine(run_config(), run).run(resume=True)
    assert same_tensors(reference, run) and records(run) == records(reference)


TRAIN = ["--set", "rounds=1", "--set", "clients.num_clients=8", "--set", "clients.fraction=0.25",
         "--set", "train.local_epochs=1", "--set", "spec.model_args.img_size=8", "--set", "data.max_test_samples=50",
         "--set", "eval.bn_batches=1", "--quiet"]


@pytest.mark.parametrize("module, pattern", [(files, "ckpt-000001-*.global.safetensors"), (store, "metrics.jsonl")],
                         ids=["checkpoint", "metrics"])
def test_train_on_a_full_disk_prints_the_file_and_the_fix(tmp_path, monkeypatch, module, pattern):
    run = tmp_path / "run"
    hit = full_disk(monkeypatch, module, pattern)
    result = runner.invoke(app, ["train", QUICK, "--out", str(run), *TRAIN])
    assert_one_line_exit_2(result, f"error: {hit[0]}: cannot write ({FULL}); free space, then start the run again with "
                                   "--overwrite (no checkpoint was committed yet)")
    monkeypatch.undo()
    result = runner.invoke(app, ["train", QUICK, "--out", str(run), "--overwrite", *TRAIN])
    assert result.exit_code == 0, result.output  # the fix it named works


# ---- exports -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def previous_export(tmp_path_factory) -> Path:
    """An export of the tiny spec, copied into each test's output folder."""
    compiled = compile_spec(parse_spec(SPEC))
    out = tmp_path_factory.mktemp("previous") / "out"
    export_tiers(ExportSource(compiled, compiled.init_global_state(), "previous"), out, ExportOptions(latency_runs=1, threads=1))
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_full_disk_while_staging_a_tier_leaves_the_previous_export(previous_export, tmp_path, monkeypatch):
    out = shutil.copytree(previous_export, tmp_path / "out")
    before = snapshot(out)

    def write_onnx_on_a_full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, FULL)

    monkeypatch.setattr(export_fp32_module, "write_onnx", write_onnx_on_a_full_disk)
    compiled = compile_spec(parse_spec(SPEC))
    with pytest.raises(WriteError) as failed:
        export_tiers(ExportSource(compiled, compiled.init_global_state(), "new"), out, ExportOptions(latency_runs=1, threads=1))
    assert str(failed.value) == f"{out}: cannot write ({FULL}); {EXPORT_FIX}"
    assert snapshot(out) == before  # no staging folder, no lock file, the previous manifest and files


def test_a_full_disk_while_publishing_leaves_no_mismatched_manifest(previous_export, tmp_path, monkeypatch):
    out = shutil.copytree(previous_export, tmp_path / "out")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    write_text = Path.write_text

    def write_text_on_a_full_disk(self, data, *args, **kwargs):
        if self.name == ".manifest.json.tmp":
            write_text(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, FULL)
        return write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text_on_a_full_disk)
    export = ["export", str(spec), "--out", str(out), "--seed", "1", "--latency-runs", "1", "--pad-channels", "1"]
    assert_one_line_exit_2(runner.invoke(app, export), f"error: {out / 'manifest.json'}: cannot write ({FULL}); {EXPORT_FIX}")
    left = sorted(snapshot(out))
    assert "manifest.json" not in left and "g1.onnx" in left  # no manifest rather than a mismatched one
    assert [name for name in left if name.startswith(".")] == []  # no staging folder, no lock file
    monkeypatch.undo()
    assert runner.invoke(app, export).exit_code == 0  # exporting again, as the line says, works
    manifest = load_manifest(out)
    assert all(file_sha256(out / t.file) == t.sha256 for t in manifest.tiers)

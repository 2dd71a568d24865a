"""``nefl-zoo train`` and ``nefl-zoo compare`` end to end on a tiny digits setup."""

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from nefl_zoo_cli.app import app

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "specs/train/digits-quick.yaml")
TINY = [
    "--set", "rounds=2", "--set", "clients.num_clients=4", "--set", "clients.fraction=0.5",
    "--set", "train.local_epochs=1", "--set", "eval.every=1", "--set", "checkpoint_every=1",
    "--set", "spec.model_args.img_size=8", "--set", "data.max_test_samples=100", "--quiet",
]
runner = CliRunner()


def test_train_writes_an_exportable_run_dir_and_resumes(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", QUICK, "--out", str(out), *TINY])
    assert result.exit_code == 0, result.output
    for name in ("spec.yaml", "global.safetensors", "metrics.jsonl", "metrics.csv", "config.yaml", "checkpoint.json"):
        assert (out / name).exists(), name
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert set(last["acc"]) == {"g0.2", "g0.4", "g0.6", "g0.8", "g1"}

    result = runner.invoke(app, ["train", "--resume", str(out), "--set", "rounds=3", "--quiet"])
    assert result.exit_code == 0, result.output
    rounds = [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]


def test_train_refuses_to_replace_an_existing_run(tmp_path):
    out = tmp_path / "run"
    assert runner.invoke(app, ["train", QUICK, "--out", str(out), *TINY]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = runner.invoke(app, ["train", QUICK, "--out", str(out), *TINY])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {out}: already holds a run; continue it with --resume {out}, or choose another --out (--overwrite replaces it)"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # saved state untouched
    assert runner.invoke(app, ["train", QUICK, "--out", str(out), "--overwrite", *TINY]).exit_code == 0


def test_train_bad_input_is_one_line_exit_2(tmp_path):
    cases = [
        ["train", str(tmp_path / "missing.yaml")],
        ["train", QUICK, "--set", "method=bogus"],
        ["train", QUICK, "--set", "method=fedprox", "--set", "method_args.mu=-1"],
        ["train", QUICK, "--set", "roundz=1"],
        ["train", QUICK, "--set", "data.dataset=cifar10", "--set", "data.root=" + str(tmp_path)],
        ["train", "--resume", str(tmp_path)],
        ["train"],
        ["compare", QUICK, "--methods", "nefl,bogus"],
        ["train", QUICK, "--threads", "0"],
        ["compare", QUICK, "--seeds", "0"],
    ]
    for args in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.output)


def test_compare_writes_table_and_plot(tmp_path):
    result = runner.invoke(app, ["compare", QUICK, "--methods", "nefl,fedprox,fedlps", "--seeds", "2", "--out", str(tmp_path), *TINY,
                                 "--set", "rounds=1"])
    assert result.exit_code == 0, result.output
    table = (tmp_path / "results.md").read_text()
    assert "| Model | Method | Worst | Avg |" in table
    assert "| resnet20 | NeFL |" in table and "| resnet20 | FedProx |" in table and "| resnet20 | FedLPS |" in table and "±" in table
    assert "BN statistics at evaluation: **running**" in table and "BN statistics at evaluation: **recompute**" in table
    png = (tmp_path / "comparison.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert sorted(p.name for p in (tmp_path / "nefl").iterdir()) == ["seed0", "seed1"]


def test_methods_lists_every_registered_method_with_its_settings():
    result = runner.invoke(app, ["methods"])
    assert result.exit_code == 0, result.output
    cells = [line.split("│") for line in result.output.splitlines() if line.startswith("│")]
    rows = {c[1].strip(): "│".join(c) for c in cells if c[1].strip()}  # wrapped descriptions continue on rows without a name
    assert list(rows) == ["nefl", "heterofl", "fjord", "depthfl", "fedavg", "fedavg_min", "fedavg_full", "fedprox", "fedgh", "fedlps"]
    assert "mu: 0.01" in rows["fedprox"] and "kd: True" in rows["fjord"] and "kd: True" in rows["depthfl"]

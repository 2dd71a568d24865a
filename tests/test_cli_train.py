"""``nefl-zoo train``, ``compare``, ``methods`` (and ``clientapp``'s bad input) end to end on a tiny digits setup (their
``--json`` output included: each run happens once, here)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nefl_zoo_cli.app import app

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "specs/train/digits-quick.yaml")
# 2 of 8 clients per round (about 170 digits each), one local epoch, 8x8 inputs, 50 test
# images, BN statistics recomputed from one batch: seconds per run, every code path kept
TINY = [
    "--set", "rounds=2", "--set", "clients.num_clients=8", "--set", "clients.fraction=0.25",
    "--set", "train.local_epochs=1", "--set", "eval.every=1", "--set", "checkpoint_every=1",
    "--set", "spec.model_args.img_size=8", "--set", "data.max_test_samples=50", "--set", "eval.bn_batches=1",
    "--quiet",
]
runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One finished 1-round run: its directory and what ``train --json`` printed."""
    out = tmp_path_factory.mktemp("train") / "run"
    result = runner.invoke(app, ["train", QUICK, "-o", str(out), *TINY, "--set", "rounds=1", "--json"])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_train_writes_an_exportable_run_dir_prints_its_summary_and_resumes(run):
    out, printed = run
    for name in ("spec.yaml", "global.safetensors", "metrics.jsonl", "metrics.csv", "config.yaml", "checkpoint.json"):
        assert (out / name).exists(), name
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert set(last["acc"]) == {"g0.2", "g0.4", "g0.6", "g0.8", "g1"}
    summary = json.loads((out / "summary.json").read_text())
    assert printed == {"method": "nefl", "name": "digits-quick", "run_dir": str(out), **summary}
    assert printed["acc"] == last["acc"] and printed["rounds"] == 1

    result = runner.invoke(app, ["train", "--resume", str(out), "--set", "rounds=2", "--quiet"])
    assert result.exit_code == 0, result.output
    rounds = [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2]


def test_train_refuses_to_replace_an_existing_run(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = runner.invoke(app, ["train", QUICK, "--out", str(out), *TINY])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {out}: already holds a run; continue it with --resume {out}, or choose another --out (--overwrite replaces it)"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # saved state untouched
    assert runner.invoke(app, ["train", QUICK, "--out", str(out), "--overwrite", *TINY, "--set", "rounds=1"]).exit_code == 0
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def test_train_bad_input_is_one_line_exit_2(tmp_path):
    cases = [
        ["train", str(tmp_path / "missing.yaml")],
        ["train", QUICK, "--set", "method=bogus"],
        ["train", QUICK, "--set", "method=fedprox", "--set", "method_args.mu=-1"],
        ["train", QUICK, "--set", "roundz=1"],
        ["train", QUICK, "--set", "data.dataset=cifar10", "--set", "data.root=" + str(tmp_path)],
        ["train", "--resume", str(tmp_path)],
        ["train"],
        ["train", QUICK, "--engine", "ray"],
        ["compare", QUICK, "--methods", "nefl,bogus"],
        ["train", QUICK, "--threads", "0"],
        ["compare", QUICK, "--seeds", "0"],
        ["train", QUICK, "--set", "train.batch_size=1"],  # min_batch 2 would drop every batch
        ["clientapp"],  # neither --insecure nor --root-certificates
        ["clientapp", "--insecure", "--poll", "0"],
        ["clientapp", "--root-certificates", str(tmp_path / "missing.crt")],
    ]
    for args in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.output)


def test_compare_writes_table_and_plot_and_prints_every_runs_summary(tmp_path):
    result = runner.invoke(app, ["compare", QUICK, "--methods", "nefl,fedprox,fedlps", "--seeds", "2", "-o", str(tmp_path), *TINY,
                                 "--set", "rounds=1", "--set", "data.public_fraction=0.2", "--set", "method=fedlps", "--set", "method_args.pretrain_epochs=2", "--json"])  # FedLPS pre-trains its encoder on it, briefly (the config's method gets its method_args)
    assert result.exit_code == 0, result.output
    table = (tmp_path / "results.md").read_text()
    assert "| Model | Method | Worst | Avg |" in table
    assert "| resnet20 | NeFL |" in table and "| resnet20 | FedProx |" in table and "| resnet20 | FedLPS |" in table and "±" in table
    assert "BN statistics at evaluation: **running**" in table and "BN statistics at evaluation: **recompute**" in table
    png = (tmp_path / "comparison.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert sorted(p.name for p in (tmp_path / "nefl").iterdir()) == ["seed0", "seed1"]
    printed = json.loads(result.stdout)
    assert printed == {"out": str(tmp_path), "results_md": str(tmp_path / "results.md"), "plot": str(tmp_path / "comparison.png"),
                       "runs": json.loads((tmp_path / "results.json").read_text())}
    assert list(printed["runs"]) == ["nefl", "fedprox", "fedlps"]
    for key, runs in printed["runs"].items():
        assert runs == [json.loads((tmp_path / key / f"seed{s}" / "summary.json").read_text()) for s in (0, 1)]


def test_methods_lists_every_registered_method_with_its_settings():
    from nefl_zoo.fl import registered_methods

    result = runner.invoke(app, ["methods"])
    assert result.exit_code == 0, result.output
    cells = [line.split("│") for line in result.output.splitlines() if line.startswith("│")]
    rows = {c[1].strip(): "│".join(c) for c in cells if c[1].strip()}  # wrapped descriptions continue on rows without a name
    methods = registered_methods()
    assert list(rows) == list(methods)
    for name, cls in methods.items():
        assert cls.label.split(" (")[0] in rows[name]
    assert "mu: 0.01" in rows["fedprox"] and "variant: original" in rows["fjord"] and "variant: original" in rows["depthfl"]


def test_methods_lists_every_registered_method():
    from nefl_zoo.fl.strategy.registry import registered_methods

    result = runner.invoke(app, ["methods", "--json"])
    assert result.exit_code == 0, result.output
    assert [m["method"] for m in json.loads(result.stdout)] == list(registered_methods())


def test_the_progress_bar_and_the_summary_table(capsys):
    from types import SimpleNamespace as NS

    from nefl_zoo_cli.progress import RichProgress

    dp = NS(delta=1e-5, noise_multiplier=1.1)
    config = NS(method="nefl", name="tiny", rounds=2, aggregation=NS(dp=dp), clients=NS(fraction=0.5))
    engine = NS(config=config, round=0, strategy=NS(submodel_numel={"g0.5": 1234, "g1": 56789}.__getitem__), out="runs/x")
    result = NS(rounds=2, acc={"g0.5": 0.5, "g1": 0.75}, worst_case="g0.5", worst=0.5, avg=0.625, min=0.5,
                bytes_down=2.5e6, bytes_up=1.25e6)
    with RichProgress() as progress:
        progress.start(engine)
        task = progress.bar.tasks[0]
        assert (task.description, task.total, task.completed) == ("nefl tiny", 2, 0)
        progress.round({"round": 1, "train_loss": 2.25}, {})
        assert (task.description, task.completed) == ("nefl tiny round 1 loss 2.250", 1)
        progress.round({"round": 2, "train_loss": 1.5, "epsilon": 0.5}, {"worst": 0.5, "avg": 0.625})
        assert task.description == "nefl tiny round 2 loss 1.500 worst 0.500 avg 0.625 epsilon 0.5"
        progress.end(engine, result)
    assert progress.bar is None
    out = capsys.readouterr().out
    rows = [" ".join(line.replace("│", " ").split()) for line in out.splitlines()]
    assert "nefl: tiny after 2 rounds" in out and "submodel ┃ elements sent ┃ accuracy" in " ".join(out.split())
    assert "g0.5 1,234 50.00%" in rows and "g1 56,789 75.00%" in rows
    assert "worst (g0.5) / avg / min 50.00% / 62.50% / 50.00%" in rows
    assert "communication: 2.5 MB down, 1.2 MB up; run dir runs/x" in rows
    assert "privacy: (0.5, 1e-05)-DP for each client after 2 rounds (noise multiplier 1.1, sampling rate 0.5)" in rows
    plain = NS(**{**vars(config), "aggregation": NS(dp=None)})
    with RichProgress() as progress:  # a run without DP, no evaluation, no smallest submodel; stopped by __exit__
        progress.start(NS(**{**vars(engine), "config": plain, "round": 1}))
        assert progress.bar.tasks[0].completed == 1  # a resumed run starts where it stopped
        progress.end(NS(**{**vars(engine), "config": plain}), NS(**{**vars(result), "worst_case": None}))
    out = capsys.readouterr().out
    assert "worst (minimum) / avg / min" in out and "privacy" not in out
    with pytest.raises(KeyboardInterrupt):
        with RichProgress() as interrupted:
            interrupted.start(engine)
            raise KeyboardInterrupt
    assert not interrupted.bar.live.is_started  # the bar is closed on the way out

"""The CLI's one-line errors (``cli/errors.py``) word for word: what an escaped exception says,
and the checks of numeric options."""

import math

import pytest
import typer

from nefl_zoo_cli.errors import describe, require_budget, require_positive


@pytest.mark.parametrize("exc, line", [
    (MemoryError("cannot allocate 8 GiB"), "not enough memory (cannot allocate 8 GiB); use a smaller --batch or model"),
    (MemoryError(), "not enough memory; use a smaller --batch or model"),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory"),
     "not enough memory (DefaultCPUAllocator: can't allocate memory); use a smaller --batch or model"),
    (RecursionError("deep"), "input nested too deeply to process"),
    (OSError(2, "No such file or directory", "runs/x"), "runs/x: No such file or directory"),
    (OSError("the disk said no"), "the disk said no"),
    (OSError(), "OSError"),
    (KeyError("unknown tier 'g9'; tiers: g1", "second"), "unknown tier 'g9'; tiers: g1"),
    (ValueError("x.yaml: rounds: expected an integer\nmore"), "x.yaml: rounds: expected an integer"),
    (ValueError(), "ValueError"),
    (TypeError("bad"), "TypeError: bad (unexpected; NEFL_ZOO_TRACEBACK=1 shows the traceback)"),
])
def test_an_escaped_exception_is_described_in_one_line(exc, line):
    assert describe(exc) == line


def refusal(check, capsys, **options) -> str:
    with pytest.raises(typer.Exit) as exited:
        check(**options)
    assert exited.value.exit_code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value, shown", [(math.inf, "inf"), (-math.inf, "-inf"), (math.nan, "nan"), (-0.5, "-0.5")])
def test_a_budget_is_a_finite_number_from_zero(capsys, value, shown):
    assert refusal(require_budget, capsys, max_ms=value) == f"error: --max-ms: must be a finite number >= 0, got {shown}\n"
    require_budget(max_ms=0.0, max_params=0.5, max_macs=None)  # 0 and fractions are budgets; None is unset


def test_a_count_is_at_least_one(capsys):
    assert refusal(require_positive, capsys, latency_runs=3, max_batch=0) == "error: --max-batch: must be >= 1, got 0\n"
    assert refusal(require_positive, capsys, runs=0.5) == "error: --runs: must be >= 1, got 0.5\n"
    require_positive(latency_runs=1, max_batch=None)


def test_a_bad_choice_or_option_is_one_line_with_exit_2():
    from typer.testing import CliRunner

    from nefl_zoo_cli.app import app

    runner = CliRunner()
    for value in ("xml", "JSON"):  # choices are case-sensitive
        bad = runner.invoke(app, ["profile", "resnet20/nefl-wd", "--format", value])
        assert (bad.exit_code, bad.stderr) == (2, f"error: --format: expected table, markdown, csv or json, got {value!r}\n")
    unknown = runner.invoke(app, ["profile", "resnet20/nefl-wd", "--bogus"])
    assert (unknown.exit_code, unknown.stderr) == (2, "error: No such option '--bogus'. (`nefl-zoo profile --help` lists the options)\n")

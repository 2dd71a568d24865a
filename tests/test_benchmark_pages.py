"""The benchmark pages: every ``benchmarks/bench_*.py`` has its results JSON, a figure drawn from
it and a page under ``docs/benchmarks/`` that shows both; the figure comes from the JSON alone
(``benchmarks/publish.py``, ``benchmarks/figures.py``), and a run records what it printed."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
PAGES = ROOT / "docs" / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import publish  # noqa: E402

NAMES = sorted(p.stem.removeprefix("bench_") for p in BENCHMARKS.glob("bench_*.py"))
PNG = b"\x89PNG\r\n\x1a\n"


def test_there_are_benchmarks():
    assert len(NAMES) >= 19 and "slim" in NAMES and "nested" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_benchmark_has_its_json_figure_and_page(name):
    """Results JSON, a small PNG figure, the page that shows it, and the script's entry point."""
    data = publish.load(name)
    assert isinstance(data, dict) and data, name
    figure = publish.figure_path(name)
    assert figure.read_bytes()[:8] == PNG
    assert figure.stat().st_size < publish.MAX_FIGURE_BYTES
    page = (PAGES / f"{name}.md").read_text(encoding="utf-8")
    assert f"](img/{name}.png)" in page, f"docs/benchmarks/{name}.md does not show its figure"
    assert f"benchmarks/bench_{name}.py" in page
    source = (BENCHMARKS / f"bench_{name}.py").read_text(encoding="utf-8")
    assert f'publish.run("{name}", main' in source, f"bench_{name}.py: no publish.run entry point (--plot-only)"


def test_every_benchmark_has_a_figure_function_and_a_row_in_the_index():
    from figures import FIGURES

    assert sorted(FIGURES) == NAMES
    index = (PAGES / "index.md").read_text(encoding="utf-8")
    for name in NAMES:
        assert f"]({name}.md)" in index, f"docs/benchmarks/index.md does not link {name}.md"


def test_every_figure_under_docs_benchmarks_is_shown_by_a_page():
    shown = "".join(p.read_text(encoding="utf-8") for p in PAGES.glob("*.md"))
    for image in (PAGES / "img").glob("*"):
        assert f"](img/{image.name})" in shown, f"docs/benchmarks/img/{image.name} is on no page"


@pytest.mark.parametrize("name", NAMES)
def test_the_page_shows_every_table_of_the_json(name):
    """Each row of each recorded table is a row of a table on the page (transcribed or printed: the same cells)."""
    page_rows = {tuple(row) for table in publish.parse_tables((PAGES / f"{name}.md").read_text(encoding="utf-8"))
                 for row in table["rows"]}
    for table in publish.tables(publish.load(name)):
        missing = [row for row in table["rows"] if tuple(row) not in page_rows]
        assert not missing, f"{name}: {table['title']!r}: {len(missing)} rows not on the page, first {missing[0]}"


def test_transcribed_runs_name_the_commit_machine_and_load():
    for name in NAMES:
        for run in publish.load(name).get("runs", []):
            p = run["provenance"]
            assert re.fullmatch(r"[0-9a-f]{7}", p["commit"]), (name, p)
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", p["date"]), (name, p)
            assert p["machine"] and ("load" in p or "load_before" in p), (name, p)


def test_markdown_tables_and_numbers_are_read_as_written():
    text = "## part a\n\nIID, 3 seeds:\n\n| Method | Worst | g0.2 |\n|---|---:|---|\n| NeFL-W | 85.48 ± 4.94 | 96.51 \\| 96.15 |\n| x |  | – |\nafter\n"
    (table,) = publish.parse_tables(text)
    assert table == {"title": "IID, 3 seeds:", "section": "part a", "columns": ["Method", "Worst", "g0.2"],
                     "rows": [["NeFL-W", "85.48 ± 4.94", "96.51 \\| 96.15"], ["x", "", "–"]]}
    assert [publish.number(c) for c in ("85.48 ± 4.94", "1,169,849", "27.1M", "**96.85 ± 0.05**", "−1.5", "4e-07", "–")] == \
        [85.48, 1169849.0, 27.1, 96.85, -1.5, 4e-07, None]


SLIM = {"benchmark": "slim", "runs": [{"command": "python benchmarks/bench_slim.py", "provenance": {}, "tables": [{
    "title": "t", "section": "", "rows": [["resnet56/nefl-d", "g0.5", "0.500", "0.550", "1.10", "1.000", "1", "2", "yes"],
                                          ["resnet56/nefl-d", "g1", "1.000", "1.000", "1.00", "1.000", "2", "2", "yes"]],
    "columns": ["spec", "tier", "MACs ratio", "slim latency ratio", "slim / MACs", "masked latency ratio", "slim ms", "masked ms",
                "slim <= 1.3 x MACs"]}]}]}


def test_the_figure_is_drawn_from_a_results_file_alone(tmp_path):
    path = tmp_path / "slim.json"
    path.write_text(json.dumps(SLIM))
    out = publish.figure("slim", publish.load("slim", path), out=tmp_path / "slim.png")
    assert out.read_bytes()[:8] == PNG and 5_000 < out.stat().st_size < publish.MAX_FIGURE_BYTES


def test_a_run_records_its_printed_tables_and_plot_only_redraws_from_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(publish, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(publish, "FIGURES_DIR", tmp_path / "img")
    publish.save("slim", {"benchmark": "slim", "runs": [{**SLIM["runs"][0], "command": "an earlier run"}]})
    table = SLIM["runs"][0]["tables"][0]

    def main():
        print("progress line\n\nslim vs masked:\n")
        print(publish.render_row(table["columns"]) + "\n|" + "---|" * len(table["columns"]))
        for row in table["rows"]:
            print(publish.render_row(row))

    for _ in range(2):  # the same command twice: one run
        monkeypatch.setattr(sys, "argv", ["benchmarks/bench_slim.py", "--reps", "1"])
        publish.run("slim", main)
    data = json.loads((tmp_path / "results" / "slim.json").read_text())
    assert [r["command"] for r in data["runs"]] == ["an earlier run", "python benchmarks/bench_slim.py --reps 1"]
    run = data["runs"][-1]
    assert run["tables"][0]["rows"] == table["rows"] and run["tables"][0]["title"] == "slim vs masked:"
    assert {"commit", "date", "machine", "load_before", "load_after"} <= set(run["provenance"])
    figure = tmp_path / "img" / "slim.png"
    first = figure.read_bytes()
    figure.unlink()
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_slim.py", "--plot-only"])
    publish.run("slim", lambda: pytest.fail("--plot-only must not run the benchmark"))
    assert figure.read_bytes() == first
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_slim.py"])
    publish.run("slim", lambda: print("no table printed"))  # a worker subprocess: nothing recorded
    assert len(json.loads((tmp_path / "results" / "slim.json").read_text())["runs"]) == 2

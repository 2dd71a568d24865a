"""The markdown tables a benchmark prints, as its results JSON stores them: read from text,
written back, found by words of their titles and read cell by cell. :mod:`publish` records them
and :mod:`figures` draws from them; this module imports neither."""

from __future__ import annotations

import re
from typing import Callable


def split_row(line: str) -> list[str]:
    """The cells of one markdown table row (``\\|`` inside a cell is not a separator; kept as written)."""
    cells = re.split(r"(?<!\\)\|", line.strip())
    return [c.strip() for c in cells[1:-1]]


def render_row(cells: list[str]) -> str:
    """The markdown row of ``cells`` (empty cells as two spaces, as the tables are written)."""
    return "| " + " | ".join(cells) + " |"


def parse_tables(text: str) -> list[dict]:
    """Every markdown table of ``text``: ``{"title", "section", "columns", "rows"}``, the title
    being the last non-empty line before the table and the section the last heading (``#`` marks
    and bold stripped)."""
    tables, title, section = [], "", ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            rows, j = [], i + 2
            while j < len(lines) and lines[j].strip().startswith("|"):
                rows.append(split_row(lines[j]))
                j += 1
            tables.append({"title": title, "section": section, "columns": split_row(line), "rows": rows})
            i = j
            continue
        if line:
            title = re.sub(r"^#+\s*", "", line).replace("**", "").strip()
            if line.startswith("#"):
                section = title
        i += 1
    return tables


def number(cell: str) -> float | None:
    """The first number of a table cell (``"85.48 ± 4.94"`` → 85.48, ``"1,169,849"`` → 1169849,
    ``"27.1M"`` → 27.1, ``"–"`` → None)."""
    match = re.search(r"[-+−]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", cell.replace("**", ""))
    if not match:
        return None
    return float(match.group().replace(",", "").replace("−", "-"))


def tables(data: dict) -> list[dict]:
    """Every table of every run of ``data``, oldest run first."""
    return [t for run in data.get("runs", []) for t in run.get("tables", [])]


def find_table(data: dict, *words: str, where: Callable[[dict], bool] = lambda t: True) -> dict:
    """The latest table whose section, title or columns contain every one of ``words`` (and ``where`` holds)."""
    for table in reversed(tables(data)):
        text = " ".join([table.get("section", ""), table["title"], *table["columns"]])
        if all(w in text for w in words) and where(table):
            return table
    raise KeyError(f"no table with {words!r}")


def column(table: dict, name: str) -> list[str]:
    """The cells of the first column whose header contains ``name``."""
    index = next(i for i, c in enumerate(table["columns"]) if name in c)
    return [row[index] for row in table["rows"]]

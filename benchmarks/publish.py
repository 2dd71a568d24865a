"""One place for every benchmark's results: its JSON (``benchmarks/results/NAME.json``) and the
figure drawn from that JSON (``docs/benchmarks/img/NAME.png``, shown by ``docs/benchmarks/NAME.md``).

A benchmark script ends with ``publish.run(NAME, main)``:

* ``python benchmarks/bench_NAME.py ARGS`` runs ``main()``; every markdown table it prints is
  recorded, with the command, the commit, the machine and the load average before and after, as
  one *run* of ``results/NAME.json`` (a later run of the same command replaces it, other runs
  stay, so a benchmark run in parts keeps every part), then the figure is drawn from the JSON;
* ``python benchmarks/bench_NAME.py --plot-only`` draws the figure again from the JSON alone.

Scripts that write their own structured JSON (clock, robust, secagg, nested) pass
``capture=False`` and call :func:`figure` after writing it. ``python benchmarks/publish.py
[NAME ...]`` redraws figures from their JSON (all of them by default). The figure of each
benchmark is one function of :mod:`figures` (``FIGURES[NAME]``: results dict in, matplotlib
figure out).

Results published before the scripts wrote JSON were transcribed from the tables of
``benchmarks/README.md`` into runs whose ``provenance`` names the commit that published them.
"""

from __future__ import annotations

import io
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from markdown_tables import column, find_table, number, parse_tables, render_row, split_row, tables  # noqa: E402,F401 (publish's API)

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
FIGURES_DIR = ROOT / "docs" / "benchmarks" / "img"
MAX_FIGURE_BYTES = 150_000
DPI = 80


def results_path(name: str) -> Path:
    return RESULTS_DIR / f"{name}.json"


def figure_path(name: str) -> Path:
    return FIGURES_DIR / f"{name}.png"


def load(name: str, path: Path | None = None) -> dict:
    """The results of benchmark ``name`` (from ``path`` when given)."""
    return json.loads((path or results_path(name)).read_text(encoding="utf-8"))


def save(name: str, data: dict, path: Path | None = None) -> Path:
    """Write ``data`` as the results of ``name`` (written to a temporary file, then renamed over the old one)."""
    path = path or results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def figure(name: str, data: dict | None = None, out: Path | None = None) -> Path:
    """Draw the figure of ``name`` from its results (``data``, else its JSON) into ``out``
    (default :func:`figure_path`); refuses a PNG over :data:`MAX_FIGURE_BYTES`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        from figures import FIGURES
    finally:
        sys.path.pop(0)
    data = load(name) if data is None else data
    out = out or figure_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = FIGURES[name](data)
    fig.savefig(out, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    size = out.stat().st_size
    if size > MAX_FIGURE_BYTES:
        raise ValueError(f"{out}: {size:,} bytes, over {MAX_FIGURE_BYTES:,}: draw a smaller figure")
    return out


# ---- runs ----------------------------------------------------------------------------------------

def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def provenance() -> dict:
    """Where and when a run happens: commit (``+changes`` when the tree differs from it), date, machine, load."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += " +changes"
    return {"source": "measured by the script", "commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": f"{_cpu()}, {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}",
            "load_before": _load()}


def record(name: str, run: dict, path: Path | None = None) -> dict:
    """Add ``run`` to the results of ``name``, replacing an earlier run of the same command; returns the results."""
    path = path or results_path(name)
    data = load(name, path) if path.exists() else {"benchmark": name, "runs": []}
    data.setdefault("runs", [])
    data["runs"] = [r for r in data["runs"] if r.get("command") != run["command"]] + [run]
    save(name, data, path)
    return data


class _Tee(io.TextIOBase):
    def __init__(self, stream):
        self.stream, self.buffer_ = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.buffer_.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def run(name: str, main: Callable[[], object], capture: bool = True) -> None:
    """A benchmark script's entry point (module docstring): ``--plot-only`` redraws the figure
    from the JSON; otherwise ``main()`` runs and (``capture``) its printed tables become a run."""
    if "--plot-only" in sys.argv[1:]:
        print(f"wrote {_shown(figure(name))}")
        return
    if not capture:
        main()
        return
    command = " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    info = provenance()
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        main()
    finally:
        sys.stdout = tee.stream
    text = tee.buffer_.getvalue()
    found = parse_tables(text)
    if not found:  # e.g. a worker subprocess of the benchmark: nothing measured to publish
        return
    info["load_after"] = _load()
    data = record(name, {"command": command, "provenance": info, "tables": found, "text": text})
    print(f"wrote {_shown(results_path(name))} and {_shown(figure(name, data))}")


def main(argv: list[str] | None = None) -> None:
    """``python benchmarks/publish.py [NAME ...]``: redraw figures from their JSON (every one by default)."""
    names = (argv if argv is not None else sys.argv[1:]) or sorted(p.stem for p in RESULTS_DIR.glob("*.json"))
    for name in names:
        print(f"wrote {_shown(figure(name))}")


if __name__ == "__main__":
    main()

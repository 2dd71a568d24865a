"""The documentation's code works as written: every ```python, ```console and ```bash snippet
of README.md, examples/*/README.md and every page of the site (docs/**/*.md) runs here, one
test per snippet or chain of snippets (``continue``, below; id ``FILE:LINE``, the line of its
opening fence), so the documentation and the code cannot drift apart.

* ``python``: executed in a fresh namespace (one per chain), in a temporary working directory
  holding copies of ``specs/`` and ``examples/`` and an empty ``exports/`` (what a fresh clone
  has); models the snippet registers are unregistered afterwards. A comment line ``#> TEXT``
  shows output: every such line must appear in what the snippet printed, in order, as for
  ``console`` (``...`` stands for any text).
* ``console``: each line starting with ``$ `` is a command; the lines after it, up to the next
  command, are its output as shown: every shown line must appear in the real output, in order,
  exactly (``...`` in a shown line stands for any text). ``bash``: every line is a command
  (``\\`` continues it), no output shown. ``nefl-zoo ...`` commands run in process
  (``typer.testing.CliRunner``); the others in ``bash``. Each must exit 0.

Markers: HTML comments on the lines just before a snippet's opening fence (invisible once
rendered), one per line:

* ``<!-- snippet: skip (REASON) -->``: not run, reported as skipped with REASON. For snippets
  that need a network, downloaded weights or data sets, a GPU or a long run (training for
  minutes, ``make ...``), and for templates and synopses that are not code.
* ``<!-- snippet: files NAME ... -->``: before the snippet runs, a stand-in for each NAME is
  written into its working directory (the ``FILES`` table below, e.g. a random-weight
  torchvision ResNet18 state dict for ``resnet18-imagenet.pth``).
* ``<!-- snippet: continue -->``: the snippet goes on from the one before it on the same page
  (a tutorial's next step): it runs after it, in the same test (id: the first snippet's), in
  the same working directory and, for ``python``, the same namespace. A skip marker on any
  snippet of such a chain skips the whole chain.

Snippets that train use tiny settings (``--set rounds=1 ...``): each test takes seconds.

An unknown marker fails its snippet's test. New snippets are picked up as they are written.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from typer.testing import CliRunner

torch.set_num_threads(1)  # as the other test files: two threads on two shared cores only spin
ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted(ROOT.glob("examples/*/README.md")), *sorted(ROOT.glob("docs/**/*.md"))]
LANGUAGES = {"python": "python", "console": "console", "bash": "bash", "sh": "bash", "shell": "bash"}
COPIED = ("specs", "examples")  # copied into each snippet's working directory; exports/ is made empty
MARKER = re.compile(r"^<!--\s*snippet:\s*(?P<kind>\w+)\s*(?P<args>.*?)\s*-->$")
SHELL_SYNTAX = set("|&;<>$`*?")  # a command with any of these runs in bash, even a nefl-zoo one


def _torchvision_resnet18(path: Path) -> None:
    import torch
    import torchvision

    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), path)


FILES: dict[str, Callable[[Path], None]] = {
    "resnet18-imagenet.pth": _torchvision_resnet18,  # torchvision's resnet18 layout, random weights
}


@dataclass(frozen=True)
class Snippet:
    """One fenced code block of a document, with the markers written before it."""

    document: Path
    line: int  # 1-based line of the opening fence
    language: str  # python, console or bash
    code: str
    markers: tuple[tuple[str, str], ...]  # (kind, arguments)

    @property
    def id(self) -> str:
        document = self.document.relative_to(ROOT) if self.document.is_relative_to(ROOT) else self.document.name
        return f"{document}:{self.line}"


def collect(document: Path) -> list[Snippet]:
    """The runnable snippets of a Markdown ``document`` (fences of :data:`LANGUAGES`)."""
    lines = document.read_text(encoding="utf-8").splitlines()
    snippets, index = [], 0
    while index < len(lines):
        opening = re.match(r"^( *)(`{3,}|~{3,})\s*([\w+-]*)", lines[index])  # indented: in a list item
        if not opening:
            index += 1
            continue
        indent, fence, language = opening.group(1), opening.group(2), opening.group(3).lower()
        end = next((j for j in range(index + 1, len(lines)) if lines[j].lstrip().startswith(fence)), len(lines))
        if language in LANGUAGES:
            code = "".join(line.removeprefix(indent) + "\n" for line in lines[index + 1:end])
            snippets.append(Snippet(document, index + 1, LANGUAGES[language], code, _markers(lines, index)))
        index = end + 1
    return snippets


def _markers(lines: list[str], fence: int) -> tuple[tuple[str, str], ...]:
    """The marker comments on the lines just before line index ``fence`` (blank lines between allowed)."""
    found = []
    index = fence - 1
    while index >= 0 and (not lines[index].strip() or MARKER.match(lines[index].strip())):
        match = MARKER.match(lines[index].strip())
        if match:
            found.append((match["kind"], match["args"]))
        index -= 1
    return tuple(reversed(found))


def chains(snippets: list[Snippet]) -> list[list[Snippet]]:
    """``snippets`` grouped into the tests that run them: a ``continue`` snippet joins the chain
    of the snippet before it on its page (a ``continue`` with nothing before it starts a chain,
    and its test fails)."""
    grouped: list[list[Snippet]] = []
    for snippet in snippets:
        joins = ("continue", "") in snippet.markers and grouped and grouped[-1][0].document == snippet.document
        if joins:
            grouped[-1].append(snippet)
        else:
            grouped.append([snippet])
    return grouped


SNIPPETS = [snippet for document in DOCUMENTS for snippet in collect(document)]
CHAINS = chains(SNIPPETS)


def test_the_readme_has_snippets_of_each_kind():
    """The collector finds the README's code (an empty collection would pass every test)."""
    kinds = {(s.language, any(kind == "skip" for kind, _ in s.markers)) for s in SNIPPETS}
    assert {("python", False), ("console", False), ("bash", True)} <= kinds


def test_markers_commands_and_shown_output_are_told_apart(tmp_path):
    document = tmp_path / "DOC.md"
    document.write_text("<!-- snippet: skip (why) -->\n\n```console\n$ nefl-zoo a \\\n    --b\nout 1\n\n"
                        "$ nefl-zoo c  # note\n```\n  ```python\n  x = 1\n  ```\n```yaml\na: 1\n```\n")
    console, python = collect(document)
    assert (console.line, console.markers, python.line, python.code, python.markers) == (3, (("skip", "(why)"),), 10, "x = 1\n", ())
    assert [(shlex.split(c, comments=True), shown) for c, shown in commands(console)] == [
        (["nefl-zoo", "a", "--b"], ["out 1"]), (["nefl-zoo", "c"], [])]


def test_shown_python_output_must_be_printed(tmp_path):
    document = tmp_path / "DOC.md"
    document.write_text("```python\nprint('a', 1)\n#> a 1\nprint('b: 2.50 s')\n#> b: ... s\n```\n"
                        "```python\nprint('a')\n#> b\n```\n")
    good, bad = collect(document)
    run_python(good, {})
    with pytest.raises(AssertionError, match="did not print the line the page shows"):
        run_python(bad, {})


def test_continue_joins_the_snippet_before_it_on_the_same_page(tmp_path):
    first, second = tmp_path / "A.md", tmp_path / "B.md"
    first.write_text("```python\na = 1\n```\n<!-- snippet: continue -->\n```bash\nls\n```\n```python\nb = 2\n```\n")
    second.write_text("<!-- snippet: continue -->\n```python\nc = 3\n```\n")
    grouped = chains(collect(first) + collect(second))
    assert [[(s.document.name, s.line) for s in chain] for chain in grouped] == [
        [("A.md", 1), ("A.md", 5)], [("A.md", 8)], [("B.md", 2)]]


def test_every_page_of_the_site_is_collected():
    """docs/**/*.md is read (an empty or missing docs/ would pass every snippet test)."""
    pages = {d.relative_to(ROOT).as_posix() for d in DOCUMENTS}
    assert {"docs/index.md", "docs/explanations/slice-map.md"} <= pages
    assert any(s.document.is_relative_to(ROOT / "docs") and not any(k == "skip" for k, _ in s.markers) for s in SNIPPETS)


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A working directory like a fresh clone's root: copies of :data:`COPIED`, empty exports/."""
    for name in COPIED:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "exports").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("chain", CHAINS, ids=[chain[0].id for chain in CHAINS])
def test_snippet(chain: list[Snippet], workdir: Path):
    for snippet in chain:
        for kind, args in snippet.markers:
            if kind == "skip":
                reason = args[1:-1] if args.startswith("(") and args.endswith(")") else args
                pytest.skip(f"{snippet.id}: {reason or 'marked skip'}")
            elif kind == "continue" and not args:
                assert snippet is not chain[0], f"{snippet.id}: 'snippet: continue' with no snippet before it on its page"
            elif kind != "files":
                pytest.fail(f"{snippet.id}: unknown marker 'snippet: {kind} {args}' (expected skip, files or continue)")
    namespace = {"__name__": "__readme__"}
    for snippet in chain:
        for kind, args in snippet.markers:
            for name in args.split() if kind == "files" else ():
                assert name in FILES, f"{snippet.id}: no stand-in for {name!r}; add one to FILES in {Path(__file__).name}"
                FILES[name](workdir / name)
        if snippet.language == "python":
            run_python(snippet, namespace)
        else:
            for command, shown in commands(snippet):
                check_output(snippet, command, run_command(snippet, command, workdir), shown)


def run_python(snippet: Snippet, namespace: dict) -> None:
    """Execute ``snippet`` in ``namespace`` (its chain's; tracebacks give the page's line
    numbers), then check its ``#>`` output lines against what it printed; models it registers
    are unregistered after the test (conftest's ``_model_registry``)."""
    code = compile("\n" * snippet.line + snippet.code, str(snippet.document), "exec")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, namespace)
    shown = [line.strip()[2:] for line in snippet.code.splitlines() if line.strip().startswith("#>")]
    check_output(snippet, "the snippet", printed.getvalue(), shown)


def commands(snippet: Snippet) -> list[tuple[str, list[str]]]:
    """(command, output lines shown after it) for each command of a console or bash snippet."""
    found: list[tuple[str, list[str]]] = []
    lines = iter(snippet.code.splitlines())
    for line in lines:
        if snippet.language == "console":
            if not line.startswith("$ "):
                if found and line.strip():
                    found[-1][1].append(line.rstrip())
                continue
            line = line[2:]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.rstrip().endswith("\\"):
            line = line.rstrip()[:-1] + " " + next(lines, "").strip()
        found.append((line.strip(), []))
    return found


def run_command(snippet: Snippet, command: str, workdir: Path) -> str:
    """Run one command (``nefl-zoo`` in process, else in bash); its output, after checking that
    it exited 0."""
    words = shlex.split(command, comments=True)
    if words and words[0] == "nefl-zoo" and not SHELL_SYNTAX & set(command.split("#", 1)[0]):
        from nefl_zoo_cli.app import app

        result = CliRunner().invoke(app, words[1:])
        assert result.exit_code == 0, f"{snippet.id}: `{command}` exited {result.exit_code}:\n{result.output}"
        return result.output
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{snippet.id}: `{command}` exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def check_output(snippet: Snippet, command: str, output: str, shown: list[str]) -> None:
    """Every line ``shown`` after ``command`` appears in ``output``, in order (``...``: any text)."""
    actual = iter(line.rstrip() for line in output.splitlines())
    for line in shown:
        pattern = re.compile(".*".join(re.escape(part) for part in line.strip().split("...")))
        assert any(pattern.fullmatch(candidate.strip()) for candidate in actual), (
            f"{snippet.id}: `{command}` did not print the line the page shows:\n  {line}\nit printed:\n{output}"
        )


# ---- the names the README gives -----------------------------------------------------------------
def test_nz_nest_is_the_function_the_readme_names():
    """``import nefl_zoo as nz; nz.nest(module, example_input)``, also once the nesting
    subpackage is imported."""
    import torch
    from torch import nn

    import nefl_zoo as nz
    import nefl_zoo.nesting.sources  # noqa: F401  (sets nz.nesting, never nz.nest)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(self.conv(x).mean((2, 3)))

    from nefl_zoo.nesting import NestError, nest

    assert nz.nest is nest and nz.NestError is NestError and "nest" in nz.__all__
    name = nz.nest(Tiny(), (1, 3, 8, 8), name="readme_tiny")
    assert nz.create_model(name, gamma_w=0.25)(torch.zeros(2, 3, 8, 8)).shape == (2, 4)

"""The documentation site builds and shows what it should.

* ``mkdocs build --strict`` of ``mkdocs.yml`` passes (no broken link or anchor, no missing
  page, no failing generator, and none of the page checks of ``tools/docs_hooks.py`` warns:
  no code line over 88 columns, no issue number, commit hash or test path on a user page)
  once per module, into a temporary folder, and the generated reference is there: the CLI
  from the typer app, the schemas from the pydantic models, the Python API from the
  docstrings; so are the version, the changelog, the glossary and the bibliography.
* The page checks themselves find what they look for (made-up pages).
* In headless Chromium (one launch for the module), the home page, a tutorial and an
  explanation at 1280 and 390 px wide: each shows its title (the page's level-1 heading, as
  its Markdown writes it) and a figure that loaded (``naturalWidth > 0``), scrolls no wider
  than the window, requests nothing outside the site, and at 1280 px no code block scrolls
  sideways. A screenshot of each goes to the module's temporary folder (or to
  ``$NEFL_ZOO_SCREENSHOTS`` when set). Debian's chromium is driven by Playwright
  (``executable_path``, never ``playwright install``), as in ``tests/test_browser.py``.

Skipped with the reason when mkdocs (the ``docs`` extra), playwright or chromium is missing,
unless the CI environment variable is set: then it fails.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/lib/chromium/chromium")
PAGES = {
    "": ROOT / "docs/index.md",
    "tutorials/train-nested-fl/": ROOT / "docs/tutorials/train-nested-fl.md",
    "explanations/slice-map/": ROOT / "docs/explanations/slice-map.md",
}
WIDTHS = (1280, 390)


def _require(reason: str | None) -> None:
    """Skip with ``reason`` (fail on CI); nothing when ``reason`` is None."""
    if reason and os.environ.get("CI"):
        pytest.fail(f"the documentation site test cannot run on CI: {reason}")
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built strictly from this checkout's mkdocs.yml."""
    _require(None if importlib.util.find_spec("mkdocs") else "mkdocs is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    assert "Formatting signatures requires" not in done.stderr, "ruff (the docs extra) formats the API signatures"
    return out


def test_the_site_builds_strictly_with_its_generated_reference(site):
    cli = (site / "reference/cli/index.html").read_text()
    assert "nefl-zoo export" in cli and "--pad-channels" in cli and "<!-- generate" not in cli
    config = (site / "reference/run-config/index.html").read_text()
    assert "TrainConfig" in config and "local_epochs" in config
    assert "TierEntry" in (site / "reference/manifest/index.html").read_text()
    api = (site / "reference/api/specs/index.html").read_text()
    assert 'id="nefl_zoo.slim.compile_spec"' in api and "Returns:" in api and "Examples:" in api
    assert 'id="nefl_zoo.auto.auto_tier"' in (site / "reference/api/models/index.html").read_text()
    assert (site / "search/search_index.json").is_file()


def test_the_site_shows_the_version_changelog_glossary_and_bibliography(site):
    from nefl_zoo import __version__ as version  # the one place the version is written

    home = (site / "index.html").read_text()
    assert f'md-source__fact--version">{version}<' in home  # beside the repository link
    assert "https://github.com/nefl-zoo/nefl-zoo" in home and "api.github.com" not in home
    changelog = (site / "changelog/index.html").read_text()
    first = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert first.removeprefix("## ").strip() in changelog and "--8<--" not in changelog  # included, not copied
    glossary = (site / "reference/glossary/index.html").read_text()
    assert all(f'id="{term}"' in glossary for term in ("tier", "gamma-w", "slice-map", "nefedavg", "worst-case"))
    bibliography = (site / "reference/bibliography/index.html").read_text()
    assert "arxiv.org/abs/2308.07761" in bibliography and 'id="secagg-plus"' in bibliography


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "tools" / "docs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_the_page_checks_find_wide_code_and_history_on_user_pages_only():
    hooks = _hooks()
    wide = "<pre><code>" + "x" * 88 + "\n" + "&lt;" + "y" * 88 + "</code></pre>"
    assert hooks.page_problems("how-to/a.md", "<pre><code>" + "x" * 88 + "</code></pre>") == []
    (problem,) = hooks.page_problems("how-to/a.md", wide)
    assert "89 columns" in problem
    history = "<p>Fixed in issue 52 at 8317077a; see <code>tests/test_store.py</code>.</p>"
    found = hooks.page_problems("explanations/b.md", history)
    assert [p.split(" on a user page")[0] for p in found] == [
        "explanations/b.md: an issue number", "explanations/b.md: a commit hash", "explanations/b.md: a test file's path"]
    assert hooks.page_problems("develop/c.md", history) == []  # the developer section may
    assert hooks.page_problems("a.md", "<p>a 1e5 tensor, 1.0e-5, deadbeef, sha256 " + "ab12" * 16 + "</p>") == []


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def browser():
    missing = (None if importlib.util.find_spec("playwright") else "playwright is not installed (pip install playwright==1.63.0)")
    _require(missing or (None if CHROMIUM.is_file() else f"{CHROMIUM} is missing (apt-get install chromium)"))
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("NEFL_ZOO_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


MEASURE = """() => ({
    figures: Array.from(document.querySelectorAll('.md-content img'))
        .filter((img) => img.complete && img.naturalWidth > 0).map((img) => img.getAttribute('src')),
    page: [document.documentElement.scrollWidth, window.innerWidth],
    code: Array.from(document.querySelectorAll('.md-content pre > code'))
        .filter((code) => code.scrollWidth > code.clientWidth)
        .map((code) => code.innerText.split('\\n').reduce((a, b) => (b.length > a.length ? b : a), '')),
})"""


@pytest.mark.parametrize("path", list(PAGES), ids=["home", "tutorial", "explanation"])
def test_the_page_fits_the_window_and_shows_its_title_and_a_figure(server, browser, screenshots, path):
    title = PAGES[path].read_text(encoding="utf-8").splitlines()[0].removeprefix("# ").strip()
    page = browser.new_page(viewport={"width": WIDTHS[0], "height": 900})
    outside: list[str] = []

    def local_only(route) -> None:
        if route.request.url.startswith(server):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", local_only)
    page.goto(server + path, wait_until="load")
    heading = page.locator(".md-content h1").first.inner_text().replace("¶", "").strip()
    tab = page.title()
    assert heading == title and title in tab, f"{path or 'home'}: the page shows {heading!r} ({tab!r}), its Markdown {title!r}"
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        measured = page.evaluate(MEASURE)
        shot = screenshots / f"{path.strip('/').replace('/', '-') or 'home'}-{width}.png"
        page.screenshot(path=str(shot), full_page=True)
        where = f"{path or 'home'} at {width} px"
        assert measured["figures"], f"{where}: no figure loaded"
        scroll_width, window_width = measured["page"]
        assert scroll_width <= window_width, f"{where}: the page is {scroll_width} px wide, the window {window_width}"
        if width >= 1280:
            assert not measured["code"], f"{where}: code blocks scroll sideways; their widest lines: {measured['code']}"
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page.close()
    assert not outside, f"{path or 'home'} requested outside the site: {outside}"

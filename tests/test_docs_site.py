"""The documentation site builds and shows what it should.

* ``mkdocs build --strict`` of ``mkdocs.yml`` passes (no broken link or anchor, no missing
  page, no failing generator) once per module, into a temporary folder, and the generated
  reference is there: the CLI from the typer app, the schemas from the pydantic models, the
  Python API from the docstrings.
* In headless Chromium, the home page and the first tutorial show their title (the page's
  level-1 heading, as its Markdown writes it) and a figure that loaded (``naturalWidth > 0``),
  and request nothing outside the site. Debian's chromium is driven by Playwright
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
PAGES = {"": ROOT / "docs/index.md", "tutorials/train-nested-fl/": ROOT / "docs/tutorials/train-nested-fl.md"}


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
    return out


def test_the_site_builds_strictly_with_its_generated_reference(site):
    cli = (site / "reference/cli/index.html").read_text()
    assert "nefl-zoo export" in cli and "--pad-channels" in cli and "<!-- generate" not in cli
    config = (site / "reference/run-config/index.html").read_text()
    assert "TrainConfig" in config and "local_epochs" in config
    assert "TierEntry" in (site / "reference/manifest/index.html").read_text()
    assert "compile_spec" in (site / "reference/api/specs/index.html").read_text()
    assert (site / "search/search_index.json").is_file()


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


@pytest.mark.parametrize("path", list(PAGES), ids=["home", "tutorial"])
def test_the_page_shows_its_title_and_a_figure(server, browser, path):
    title = PAGES[path].read_text(encoding="utf-8").splitlines()[0].removeprefix("# ").strip()
    page = browser.new_page()
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
    figures = page.evaluate("""() => Array.from(document.querySelectorAll('.md-content img'))
        .filter((img) => img.complete && img.naturalWidth > 0).map((img) => img.getAttribute('src'))""")
    tab = page.title()
    page.close()
    assert heading == title and title in tab, f"{path or 'home'}: the page shows {heading!r} ({tab!r}), its Markdown {title!r}"
    assert figures, f"{path or 'home'}: no figure loaded"
    assert not outside, f"{path or 'home'} requested outside the site: {outside}"


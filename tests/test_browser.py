"""`nefl-zoo serve`'s page in headless Chromium: a nested export run with onnxruntime-web (WASM).

Debian's chromium is driven by Playwright (`executable_path`, never `playwright install`), every
request that is not to the local server is blocked (and must not happen), and the page's
results are read from its `window.nefl` hook:

* every tier of every precision predicts on the bundled digits samples what onnxruntime in
  Python predicts on the same file and images (argmax equal, logits within 1e-4; INT8 within
  one step of its quantized logits);
* policy.mjs, loaded by the page, makes every decision of tests/data/policy_traces.json, and the
  adaptive mode serves requests with the policy's ladder;
* the latency table the page downloads is a valid table of the export that
  `nefl-zoo select --latency-table` uses;
* a model file that is not the manifest's (one byte changed on the wire) is refused;
* a phone on the local network: the page opened by a host name that is not this machine's
  (``phone.test``, mapped onto loopback by Chromium's host resolver rules, so the origin is
  not a secure context and has no Web Crypto) at 390 px wide checks the file, predicts what
  Python predicts on one thread, fits the screen, and says which tier its status is about; over
  ``serve --tls`` the same page gets a secure context, cross-origin isolation and threads;
* screenshots of the page (desktop and phone-sized) are saved (their paths are printed).

Skipped with the reason when playwright, chromium or web/node_modules are missing, unless the
CI environment variable is set: then it fails.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import threading
from pathlib import Path
from urllib.request import urlopen

import numpy as np
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from nefl_zoo.manifest import load_manifest
from nefl_zoo.runtime.latency import parse_latency_table
from nefl_zoo_cli.app import app
from nefl_zoo_cli.serve import NPM_FIX, ORT_DIST, WEB, make_server, url_of
from nefl_zoo_cli.tls import self_signed, server_context


CHROMIUM = Path("/usr/lib/chromium/chromium")
PHONE_HOST = "phone.test"  # resolved onto loopback by the browser: a name, so not a secure context
PHONE = {"width": 390, "height": 844}
TRACES = Path(__file__).parent / "data" / "policy_traces.json"
TOLERANCE = 1e-4


def _missing() -> str | None:
    """Why the browser test cannot run here (None: it can)."""
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install playwright==1.63.0)"
    if not CHROMIUM.is_file():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    if not (WEB / ORT_DIST / "ort.wasm.min.mjs").is_file():
        return f"onnxruntime-web is not installed in web/node_modules ({NPM_FIX})"
    return None


@pytest.fixture(scope="module")
def requirements():
    reason = _missing()
    if reason and os.environ.get("CI"):
        pytest.fail(f"browser test cannot run on CI: {reason}")
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def export_dir(requirements, nested_export_dir):
    return nested_export_dir


def serving(export_dir, **options):
    """A started server of ``export_dir``; yields its URL."""
    httpd = make_server(export_dir, port=0, **options)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield url_of(httpd)
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(export_dir):
    yield from serving(export_dir)


@pytest.fixture(scope="module")
def browser(requirements):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                              args=[f"--host-resolver-rules=MAP {PHONE_HOST} 127.0.0.1"])
        yield chromium
        chromium.close()


class Page:
    """A page of the server with every other request blocked and recorded, and the page's
    uncaught errors recorded."""

    def __init__(self, browser, url: str, query: str = "", viewport: dict | None = None, **options):
        self.url, self.query = url, query
        self.context = browser.new_context(accept_downloads=True, viewport=viewport or {"width": 1100, "height": 900}, **options)
        self.page = self.context.new_page()
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.page.route("**/*", self._local_only)
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))

    def _local_only(self, route) -> None:
        if route.request.url.startswith(self.url):
            route.continue_()
        else:
            self.outside.append(route.request.url)
            route.abort()

    def open(self) -> dict:
        self.page.goto(self.url + self.query)
        return self.page.evaluate("window.nefl.ready")

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="module")
def page(browser, server):
    session = Page(browser, server)
    ready = session.open()
    assert ready == {"ok": True, "error": None}, ready
    yield session.page
    session.close()
    assert session.outside == [], f"the page asked for something outside the server: {session.outside}"
    assert session.errors == [], session.errors


def samples_of(server: str) -> tuple[np.ndarray, list[int] | None]:
    with urlopen(server + "samples.json") as response:
        data = json.load(response)
    images = np.frombuffer(base64.b64decode(data["data"]), dtype="<f4").reshape(data["shape"])
    return images, data["labels"]


def test_the_page_is_cross_origin_isolated_and_lists_the_tiers(page, export_dir):
    assert page.evaluate("crossOriginIsolated") is True
    manifest = load_manifest(export_dir)
    fp32 = sorted((t for t in manifest.tiers if t.precision == "fp32"), key=lambda t: t.index)
    assert page.locator("#tiers tbody tr td:nth-child(2)").all_inner_texts() == [t.name for t in fp32]
    assert "verified" in page.locator("#file-status").inner_text()
    assert sorted(page.locator("#precision option").all_inner_texts()) == sorted({t.precision for t in manifest.tiers})


def test_every_tier_and_precision_predicts_what_python_predicts(page, server, export_dir):
    manifest = load_manifest(export_dir)
    predictions = page.evaluate("nefl.predictAll()")
    assert sorted(predictions) == sorted(t.label for t in manifest.tiers)
    assert_like_python(predictions, server, export_dir)


def assert_like_python(predictions: dict, server: str, export_dir: Path) -> None:
    """Every entry the page predicted (label -> result) gives Python's onnxruntime's logits on
    the same file and images."""
    manifest = load_manifest(export_dir)
    images, labels = samples_of(server)
    assert labels is not None and len(labels) == len(images) == 64  # digits: real test images
    sessions: dict[str, ort.InferenceSession] = {}
    for entry in (t for t in manifest.tiers if t.label in predictions):
        if entry.file not in sessions:
            sessions[entry.file] = ort.InferenceSession(str(export_dir / entry.file), providers=["CPUExecutionProvider"])
        feed = {manifest.input.name: images, "tier": np.array(entry.index, dtype=np.int64)}
        expected = sessions[entry.file].run(None, feed)[0]
        got = predictions[entry.label]
        logits = np.asarray(got["logits"], dtype=np.float32).reshape(got["dims"])
        assert logits.shape == expected.shape
        # INT8 logits leave the model quantized (QuantizeLinear, DequantizeLinear): a tie rounded the
        # other way by another kernel moves one by a step, the least gap between two of its values
        step = float(np.diff(np.unique(expected)).min()) if entry.precision == "int8" else 0.0
        tolerance = max(TOLERANCE, 1.001 * step)
        assert np.abs(logits - expected).max() <= tolerance, (entry.label, float(np.abs(logits - expected).max()), step)
        top2 = np.sort(expected, axis=1)[:, -2:]
        decided = top2[:, 1] - top2[:, 0] > 2 * tolerance  # every row but (INT8) near-ties
        assert np.asarray(got["argmax"])[decided].tolist() == expected.argmax(axis=1)[decided].tolist(), entry.label
        assert decided.mean() > 0.9 if step else decided.all()
        assert got["accuracy"] == pytest.approx(float(np.mean(expected.argmax(axis=1) == np.asarray(labels))))


def test_the_js_policy_makes_the_python_policys_decisions_in_the_browser(page):
    traces = json.loads(TRACES.read_text())
    result = page.evaluate("traces => nefl.replayTraces(traces)", traces)
    assert result["cases"] == len(traces["cases"])
    assert result["steps"] == sum(len(c["steps"]) for c in traces["cases"])
    assert result["mismatches"] == []


def test_the_adaptive_mode_serves_requests_with_the_policys_ladder(page, export_dir):
    manifest = load_manifest(export_dir)
    page.locator("#adaptive-run").click()  # measures this browser's latencies first when none are
    page.wait_for_function("nefl.adaptive().requests.length >= 30", timeout=10_000)
    page.locator("#adaptive-run").click()
    page.wait_for_function("!nefl.adaptive().running")
    run = page.evaluate("nefl.adaptive()")
    fp32 = {t.label for t in manifest.tiers if t.precision == "fp32"}
    assert run["ladder"] and set(run["ladder"]) <= fp32
    assert {r["label"] for r in run["requests"]} <= set(run["ladder"])
    assert run["switches"][0]["from"] is None and run["switches"][0]["to"] in run["ladder"]
    assert "requests; now serving" in page.locator("#adaptive-status").inner_text()


def test_the_downloaded_latency_table_is_read_by_select(page, export_dir, tmp_path):
    manifest = load_manifest(export_dir)
    page.locator("#runs").fill("5")
    page.locator("#warmup").fill("1")
    page.locator("#latency-run").click()
    page.wait_for_function("document.querySelector('#latency-status').textContent.includes('entries')", timeout=10_000)
    with page.expect_download() as download:
        page.locator("#latency-download").click()
    saved = tmp_path / "browser-table.json"
    download.value.save_as(saved)
    data = json.loads(saved.read_text())
    table = parse_latency_table(data, str(saved))
    assert table.runs == 5 and table.warmup == 1 and table.machine.provider == "wasm"
    assert table.machine.onnxruntime.startswith("onnxruntime-web ")
    assert table.manifest_sha256 == hashlib.sha256((export_dir / "manifest.json").read_bytes()).hexdigest()
    by_precision = [t for p in dict.fromkeys(t.precision for t in manifest.tiers) for t in manifest.tiers if t.precision == p]
    assert [(e.label, e.sha256, e.batch) for e in table.entries] == [(t.label, t.sha256, 1) for t in by_precision]
    table.check_matches(manifest, 1)
    result = CliRunner().invoke(app, ["select", str(export_dir), "--latency-table", str(saved), "--latency-ms", "1000", "--json"])
    assert result.exit_code == 0, result.output
    assert f"({saved.name})" in json.loads(result.stdout)["reason"]


def test_a_tampered_model_file_is_refused(browser, server):
    session = Page(browser, server)

    def tampered(route):
        body = bytearray(route.fetch().body())
        body[len(body) // 2] ^= 0xFF
        route.fulfill(status=200, body=bytes(body), headers={"Content-Type": "application/octet-stream"})

    try:
        session.page.route("**/export/nested.fp32.onnx", tampered)
        ready = session.open()
        assert ready["ok"] is False and "nested.fp32.onnx: sha256" in ready["error"] and "refusing" in ready["error"]
        assert session.page.locator("#error").is_visible()
        assert "refused" in session.page.locator("#file-status").inner_text()
        assert session.page.locator("#classify-run").is_disabled()
        assert session.outside == []
    finally:
        session.close()


def test_the_precision_chooser_loads_and_verifies_each_file(page, export_dir):
    manifest = load_manifest(export_dir)
    for precision in dict.fromkeys(t.precision for t in manifest.tiers):
        page.locator("#precision").select_option(precision)
        file = next(t.file for t in manifest.tiers if t.precision == precision)
        page.wait_for_function(f"document.querySelector('#file-status').textContent.includes('{file},')")
        assert "verified" in page.locator("#file-status").inner_text()
        labels = [t.label for t in sorted(manifest.tiers, key=lambda t: t.index) if t.precision == precision]
        assert page.locator("#tier option").all_inner_texts() == labels
    page.locator("#precision").select_option("fp32")
    page.wait_for_function("document.querySelector('#file-status').textContent.includes('nested.fp32.onnx,')")


def test_screenshot_of_the_page(page, tmp_path):
    page.locator("#tier").select_option(label="mid")
    page.locator("#classify-run").click()
    page.wait_for_function("document.querySelector('#classify-status').textContent.includes('right on')")
    assert page.locator("#samples .sample.right, #samples .sample.wrong").count() == 64
    path = tmp_path / "serve-page.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    print(f"screenshot: {path}")


def test_a_phone_over_plain_http_runs_the_page_on_one_thread(browser, server, export_dir, tmp_path):
    phone = server.replace("127.0.0.1", PHONE_HOST)
    session = Page(browser, phone, query="?threads=2", viewport=PHONE, is_mobile=True, has_touch=True)
    try:
        assert session.open() == {"ok": True, "error": None}
        page = session.page
        assert page.evaluate("[isSecureContext, typeof crypto.subtle, crossOriginIsolated]") == [False, "undefined", False]
        footer = page.locator("#footer").inner_text()
        assert "(WASM, 1 thread(s))" in footer and "no secure context" in footer and "2 threads asked, one thread" in footer
        assert "verified" in page.locator("#file-status").inner_text()  # the sha256, without Web Crypto
        assert_like_python(page.evaluate("nefl.predictAll('fp32')"), server, export_dir)
        assert_fits(page)
        path = tmp_path / "serve-page-phone.png"
        page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 10_000
        print(f"phone screenshot: {path}")
        assert session.outside == [] and session.errors == []
    finally:
        session.close()


def assert_fits(page) -> None:
    """Nothing of the page lies beyond the screen's width: the document does not scroll sideways
    and every element, the tables' cells included, ends within the screen."""
    width = page.evaluate("window.innerWidth")
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    cut = page.evaluate("""w => [...document.querySelectorAll('body *')].filter(e => {
        const r = e.getBoundingClientRect();
        return r.width > 0 && r.right > w + 0.5;
      }).map(e => `${e.id || e.tagName}:${Math.round(e.getBoundingClientRect().right)}`)""", width)
    assert cut == [], f"cut off at {width} px: {cut}"


def test_the_status_names_the_tier_its_grid_shows(page, export_dir):
    """After a tier change the status is about the new tier: its own accuracy once classified,
    or that it is not classified yet; never the previous tier's figure under the new grid."""
    manifest = load_manifest(export_dir)
    fp32 = sorted((t for t in manifest.tiers if t.precision == "fp32"), key=lambda t: t.index)
    first, last = fp32[0], fp32[-1]
    page.locator("#precision").select_option("fp32")
    page.wait_for_function("document.querySelector('#file-status').textContent.includes('verified')")
    page.evaluate("nefl.state.predictions.clear()")
    page.locator("#tier").select_option(str(last.index))
    assert page.locator("#classify-status").inner_text() == f"{last.label}: not classified yet (Classify runs every tier)"
    page.locator("#classify-run").click()
    page.wait_for_function("document.querySelector('#classify-status').textContent.includes('right on')")
    results = page.evaluate("Object.fromEntries([...nefl.state.predictions].map(([k, v]) => [k, v.accuracy]))")
    for tier in (first, last):
        page.locator("#tier").select_option(str(tier.index))
        status = page.locator("#classify-status").inner_text()
        assert status == f"{tier.label}: {100 * results[tier.label]:.1f}% right on 64 samples", status


def test_the_adaptive_mode_shows_its_ladder_and_why_it_stays(page):
    page.locator("#precision").select_option("fp32")
    page.wait_for_function("document.querySelector('#file-status').textContent.includes('verified')")
    page.locator("#runs").fill("30")
    page.locator("#warmup").fill("5")
    page.locator("#adaptive-remeasure").click()
    page.wait_for_function("document.querySelector('#ladder-status').textContent.startsWith('Ladder')", timeout=20_000)
    ladder = page.locator("#ladder-status").inner_text()
    assert "median (p25–p75) in this browser" in ladder
    spreads = page.locator("#latency-table tbody tr td:nth-child(3)").all_inner_texts()
    assert spreads and all("–" in cell for cell in spreads)
    page.locator("#deadline").evaluate("(s, v) => { s.value = v; s.dispatchEvent(new Event('input')); }", "0.001")
    page.locator("#adaptive-run").click()
    page.wait_for_function("nefl.adaptive().requests.length >= 20", timeout=10_000)
    page.locator("#adaptive-run").click()
    page.wait_for_function("!nefl.adaptive().running")
    run = page.evaluate("nefl.adaptive()")
    # a deadline no tier meets: the policy ends on its fastest step and says why it stays there
    assert run["requests"][-1]["label"] == run["ladder"][0]
    assert f"Not switching: {run['ladder'][0]} is the fastest step and still over the deadline" in run["why"]


@pytest.fixture(scope="module")
def tls_server(export_dir, tmp_path_factory):
    cert, key = self_signed([PHONE_HOST, "127.0.0.1"], folder=tmp_path_factory.mktemp("tls"))
    yield from serving(export_dir, tls=server_context(cert, key))


def test_a_phone_over_tls_gets_a_secure_context_and_threads(browser, tls_server, server, export_dir):
    phone = tls_server.replace("127.0.0.1", PHONE_HOST)
    assert phone.startswith("https://")
    session = Page(browser, phone, query="?threads=2", viewport=PHONE, ignore_https_errors=True)
    try:
        assert session.open() == {"ok": True, "error": None}
        page = session.page
        assert page.evaluate("[isSecureContext, typeof crypto.subtle, crossOriginIsolated]") == [True, "object", True]
        assert "(WASM, 2 thread(s)); cross-origin isolated" in page.locator("#footer").inner_text()
        assert_like_python(page.evaluate("nefl.predictAll('fp32')"), server, export_dir)
        assert session.outside == [] and session.errors == []
    finally:
        session.close()

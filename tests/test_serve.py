"""`nefl-zoo serve` without a browser: routes, content types and headers, paths outside the
served folders refused, the one-line errors (exit 2) of a bad export folder or a missing
onnxruntime-web, and the bundled samples.

The routing tests serve a stand-in web/ folder and export folder (files of known bytes; the
export's manifest is not validated here, tests/test_browser.py serves a real export)."""

from __future__ import annotations

import base64
import http.client
import json
import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import nefl_zoo_cli.serve as serve
from nefl_zoo_cli.app import app

SHAPE = [1, 16, 16]
MANIFEST = {
    "schema_version": 4, "format": "nested", "model": "resnet20",
    "input": {"name": "input", "shape": SHAPE, "batch": None, "normalization": None, "dataset": "digits"},
    "output": {"name": "logits", "num_classes": 10},
    "tiers": [
        {"name": "small", "precision": "fp32", "file": "nested.fp32.onnx", "index": 0},
        {"name": "full", "precision": "fp32", "file": "nested.fp32.onnx", "index": 1},
        {"name": "small", "precision": "int8", "file": "nested.int8.onnx", "index": 0},
        {"name": "full", "precision": "int8", "file": "link.onnx", "index": 1},  # a link out of the folder
    ],
}

runner = CliRunner()


def make_web(tmp_path: Path) -> Path:
    """A web/ folder: the page, lib/, onnxruntime-web's dist/ and a file beside them."""
    root = tmp_path / "web"
    files = {
        "page/index.html": "<!doctype html><title>page</title>",
        "page/app.mjs": "export const app = 1;",
        "page/style.css": "body {}",
        "page/.hidden.mjs": "secret",
        "lib/nested.mjs": "export const nested = 1;",
        "node_modules/onnxruntime-web/dist/ort.wasm.min.mjs": "export const ort = 1;",
        "node_modules/onnxruntime-web/dist/ort-wasm-simd-threaded.wasm": b"\0asm\x01\0\0\0",
        "node_modules/@noble/hashes/sha2.js": "export const sha256 = 1;",
        "secret.txt": "not served",
    }
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def make_export(tmp_path: Path) -> Path:
    """An export folder: manifest.json, its files, files it does not name, a link out of it."""
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps(MANIFEST))
    (folder / "nested.fp32.onnx").write_bytes(b"fp32 model bytes")
    (folder / "nested.int8.onnx").write_bytes(b"int8 model bytes")
    (folder / "other.onnx").write_bytes(b"not in the manifest")
    (folder / "notes.txt").write_text("not in the manifest")
    (tmp_path / "outside.onnx").write_bytes(b"outside the export folder")
    (folder / "link.onnx").symlink_to(tmp_path / "outside.onnx")
    return folder


def as_it_is(folder: Path) -> dict:
    """The stand-in export's manifest taken as it is (the real reader wants a real export)."""
    return json.loads((folder / "manifest.json").read_text())


@pytest.fixture
def web(tmp_path) -> Path:
    return make_web(tmp_path)


@pytest.fixture
def export(tmp_path) -> Path:
    return make_export(tmp_path)


@pytest.fixture
def unchecked(monkeypatch):
    monkeypatch.setattr(serve, "check_export", as_it_is)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """The folder holding the served web/ and export/ folders."""
    root = tmp_path_factory.mktemp("served")
    make_web(root)
    make_export(root)
    return root


@pytest.fixture(scope="module")
def server(served):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve, "check_export", as_it_is)
        httpd = serve.make_server(served / "export", port=0, samples=8, web=served / "web")
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def request(httpd, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of a request for ``path`` sent as it is (not normalised)."""
    host, port = httpd.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@pytest.mark.parametrize(
    "path, file, content_type",
    [
        ("/", "page/index.html", "text/html; charset=utf-8"),
        ("/index.html", "page/index.html", "text/html; charset=utf-8"),
        ("/app/app.mjs", "page/app.mjs", "text/javascript; charset=utf-8"),
        ("/app/style.css", "page/style.css", "text/css; charset=utf-8"),
        ("/lib/nested.mjs", "lib/nested.mjs", "text/javascript; charset=utf-8"),
        ("/ort/ort.wasm.min.mjs", "node_modules/onnxruntime-web/dist/ort.wasm.min.mjs", "text/javascript; charset=utf-8"),
        ("/ort/ort-wasm-simd-threaded.wasm", "node_modules/onnxruntime-web/dist/ort-wasm-simd-threaded.wasm", "application/wasm"),
        ("/noble/sha2.js", "node_modules/@noble/hashes/sha2.js", "text/javascript; charset=utf-8"),
        ("/export/manifest.json", "../export/manifest.json", "application/json"),
        ("/export/nested.fp32.onnx", "../export/nested.fp32.onnx", "application/octet-stream"),
        ("/export/nested.int8.onnx?v=1", "../export/nested.int8.onnx", "application/octet-stream"),
    ],
)
def test_routes_serve_their_files_with_their_type_cross_origin_isolated(server, served, path, file, content_type):
    status, headers, body = request(server, path)
    assert status == 200
    assert body == (served / "web" / file).read_bytes()
    assert headers["Content-Type"] == content_type
    assert headers["Content-Length"] == str(len(body))
    assert headers["Cross-Origin-Opener-Policy"] == "same-origin"
    assert headers["Cross-Origin-Embedder-Policy"] == "require-corp"
    assert headers["Cache-Control"] == "no-store"


@pytest.mark.parametrize(
    "path",
    [
        "/export/other.onnx",  # an .onnx file the manifest does not name
        "/export/notes.txt",
        "/export/link.onnx",  # named by the manifest, but a link to a file outside the folder
        "/export/../outside.onnx",
        "/export/%2e%2e/outside.onnx",
        "/export/..%2foutside.onnx",
        "/export//etc/passwd",
        "/export/",
        "/app/../secret.txt",
        "/app/%2e%2e/secret.txt",
        "/app/..%2f..%2fexport%2fnested.fp32.onnx",
        "/app/.hidden.mjs",
        "/app/",
        "/lib/../page/index.html",
        "/ort/../../../../secret.txt",
        "/ort/%2fetc%2fpasswd",
        "/secret.txt",
        "/web/secret.txt",
        "/..%5csecret.txt",
        "/app/" + "a" * 300 + ".mjs",  # a name the OS refuses (too long)
    ],
)
def test_paths_outside_the_served_files_are_refused(server, path):
    status, _, body = request(server, path)
    assert status == 404 and b"not served" not in body and b"outside" not in body


def test_head_has_no_body_and_other_methods_are_refused(server):
    status, headers, body = request(server, "/app/app.mjs", "HEAD")
    assert status == 200 and body == b"" and headers["Content-Length"] == str(len(b"export const app = 1;"))
    status, headers, _ = request(server, "/app/app.mjs", "POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD"


def decode(samples: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(samples["data"]), dtype="<f4").reshape(samples["shape"])


def test_samples_are_the_digits_test_images_as_the_data_module_prepares_them(server):
    from nefl_zoo.export.data import load_run_images

    status, headers, body = request(server, "/samples.json")
    assert status == 200 and headers["Content-Type"] == "application/json"
    samples = json.loads(body)
    run = load_run_images({"dataset": "digits"}, SHAPE, train_images=1)
    assert samples["shape"] == [8, *SHAPE] and samples["count"] == 8 and samples["random"] is False
    assert samples["dataset"] == "digits" and "digits test split" in samples["source"]
    assert samples["labels"] == run.labels[:8].tolist()
    np.testing.assert_array_equal(decode(samples), run.test[:8])


@pytest.mark.parametrize(
    "dataset, why", [("mnist", "the mnist dataset cannot be loaded here"), (None, "the manifest names no dataset")]
)
def test_samples_without_a_loadable_dataset_are_seeded_random_inputs(tmp_path, monkeypatch, dataset, why):
    monkeypatch.chdir(tmp_path)  # no data/ folder: MNIST is not there
    manifest = {"input": {"shape": [3, 8, 8], "dataset": dataset}}
    samples = serve.sample_images(manifest, 5)
    assert samples["random"] is True and samples["labels"] is None and samples["shape"] == [5, 3, 8, 8]
    assert why in samples["source"]
    np.testing.assert_array_equal(decode(samples), decode(serve.sample_images(manifest, 5)))  # seeded


def invoke(*args) -> tuple[int, str]:
    result = runner.invoke(app, ["serve", *map(str, args)])
    return result.exit_code, result.output


def one_error(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    return lines[0]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp: tmp / "missing", "no such export folder"),
        (lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "not a folder"),
        (lambda tmp: tmp, "no manifest.json (not an export folder"),
        (lambda tmp: (tmp / "manifest.json").write_text("{not json") and tmp, "manifest.json"),
        (lambda tmp: (tmp / "manifest.json").write_text('{"schema_version": 99}') and tmp,
         "schema_version: unsupported version 99"),
    ],
)
def test_a_bad_export_folder_is_one_line_and_exit_2(tmp_path, make, message):
    code, output = invoke(make(tmp_path), "--port", 0)
    assert code == 2
    assert message in one_error(output)


def test_a_missing_onnxruntime_web_names_npm_ci(tmp_path, web, export, unchecked, monkeypatch):
    monkeypatch.setattr(serve, "WEB", web)
    for file in (web / serve.ORT_DIST).iterdir():
        file.unlink()
    code, output = invoke(export, "--port", 0)
    assert code == 2
    line = one_error(output)
    assert "onnxruntime-web is not installed" in line and "cd web && " in line and "npm ci" in line


@pytest.mark.parametrize("args, message", [
    (["--samples", 0], "--samples: must be an integer in 1..10000, got 0"),
    (["--samples", 10**6], "--samples: must be an integer in 1..10000, got 1000000"),
    (["--port", 70000], "--port: must be an integer in 0..65535, got 70000"),
    (["--port", -1], "--port: must be an integer in 0..65535, got -1"),
    (["--host", "a b"], "--host: must be a host name or an IP address, got 'a b'"),
    (["--host", "host:"], "--host: must be a host name or an IP address, got 'host:'"),
    (["--host", ""], "--host: must be a host name or an IP address, got ''"),
])
def test_bad_options_are_one_line_and_exit_2(export, args, message, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("options out of bounds reached the server")

    monkeypatch.setattr(serve, "make_server", never)  # refused before: nothing is prepared or served
    code, output = invoke(export, *args)
    assert code == 2 and one_error(output) == f"error: {message}"


def test_a_port_in_use_is_one_line_and_exit_2(web, export, unchecked, monkeypatch):
    monkeypatch.setattr(serve, "WEB", web)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, output = invoke(export, "--port", taken.getsockname()[1])
    assert code == 2 and "cannot listen" in one_error(output) and "--port 0" in output


def test_serve_prints_the_url_and_stops_on_ctrl_c(web, export, unchecked, monkeypatch):
    monkeypatch.setattr(serve, "WEB", web)
    served = []

    def interrupted(self, poll_interval=0.5):
        served.append(serve.url_of(self))
        raise KeyboardInterrupt

    monkeypatch.setattr(serve.Server, "serve_forever", interrupted)
    code, output = invoke(export, "--port", 0)
    assert code == 0, output
    assert served and served[0].startswith("http://127.0.0.1:") and f"at {served[0]}" in output
    assert output.strip().endswith("stopped")



def test_a_real_nested_export_is_accepted_and_any_other_format_refused(nested_export_dir, tmp_path):
    manifest = serve.check_export(nested_export_dir)
    assert manifest["format"] == "nested" and manifest["tiers"]
    folder = tmp_path / "files"
    shutil.copytree(nested_export_dir, folder)
    tiers = [{k: v for k, v in tier.items() if k != "index"} for tier in manifest["tiers"]]  # one file per tier
    (folder / "manifest.json").write_text(json.dumps({**manifest, "format": "files", "tiers": tiers}))
    with pytest.raises(serve.ServeError, match=r"format 'files'; the page runs one nested file per precision"):
        serve.check_export(folder)


def test_inside_takes_only_plain_paths_to_files_under_the_base(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b.onnx").write_bytes(b"x")
    assert serve.inside(tmp_path, "a/b.onnx") == (tmp_path / "a" / "b.onnx").resolve()
    for relative in ("a//b.onnx", "/a/b.onnx", "a/./b.onnx", "a/b.onnx/", "", "a", "a/../a/b.onnx", "a/.b"):
        assert serve.inside(tmp_path, relative) is None, relative


def test_an_ipv6_host_listens_on_ipv6(served, unchecked):
    try:  # the machine's own IPv6 loopback, probed without the code under test
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    httpd = serve.make_server(served / "export", host="::1", port=0, samples=1, web=served / "web")
    try:
        assert httpd.address_family == socket.AF_INET6 and serve.url_of(httpd).startswith("http://[::1]:")
    finally:
        httpd.server_close()


@pytest.mark.parametrize("error, shown", [(ValueError(""), "(ValueError)"), (OSError("first line\nsecond"), "(first line)")])
def test_a_dataset_that_fails_to_load_is_named_with_its_first_line(monkeypatch, error, shown):
    def failing(*args):
        raise error

    monkeypatch.setattr(serve, "_test_images", failing)
    samples = serve.sample_images({"input": {"shape": [1, 4, 4], "dataset": "digits"}}, 2)
    assert samples["random"] is True
    assert samples["source"].endswith(f"no labels: the digits dataset cannot be loaded here {shown}")


@pytest.mark.parametrize("host, warned", [("localhost", False), ("127.0.0.1", False), ("0.0.0.0", True)])
def test_only_a_host_other_machines_reach_is_warned_about(web, export, unchecked, monkeypatch, host, warned):
    monkeypatch.setattr(serve, "WEB", web)
    monkeypatch.setattr(serve.Server, "serve_forever", lambda self, poll_interval=0.5: (_ for _ in ()).throw(KeyboardInterrupt))
    code, output = invoke(export, "--host", host, "--port", 0)
    assert code == 0, output
    assert (f"warning: listening on {host}: other machines can reach the page" in output) == warned


def test_without_a_checkout_the_page_is_served_from_the_installed_copy(tmp_path, export, unchecked, monkeypatch):
    """A wheel has no web/ beside the package: the copy setup.py built into it (page, lib, ort,
    noble) is served; with neither, one line names the fix."""
    checkout = make_web(tmp_path / "checkout")
    installed = tmp_path / "installed"
    for prefix, source in {"page": "page", "lib": "lib", "ort": serve.ORT_DIST, "noble": serve.NOBLE}.items():
        shutil.copytree(checkout / source, installed / prefix)
    monkeypatch.setattr(serve, "WEB", tmp_path / "site-packages" / "web")  # no checkout there
    monkeypatch.setattr(serve, "INSTALLED", installed)
    assert serve.web_roots() == {"app": installed / "page", "lib": installed / "lib", "ort": installed / "ort",
                                 "noble": installed / "noble"}
    site = serve.Site(export, samples=1)
    assert site.resolve("/noble/sha2.js") == (installed / "noble" / "sha2.js", "text/javascript; charset=utf-8")
    assert site.resolve("/ort/ort-wasm-simd-threaded.wasm")[0] == installed / "ort" / "ort-wasm-simd-threaded.wasm"
    monkeypatch.setattr(serve, "INSTALLED", tmp_path / "nothing")
    code, output = invoke(export, "--port", 0)
    assert code == 2 and "installed without its page" in one_error(output)


def test_a_missing_noble_hashes_names_npm_ci(tmp_path, web, export, unchecked, monkeypatch):
    monkeypatch.setattr(serve, "WEB", web)
    (web / serve.NOBLE / "sha2.js").unlink()
    code, output = invoke(export, "--port", 0)
    assert code == 2 and "@noble/hashes is not installed" in one_error(output) and "npm ci" in output


def test_tls_serves_https_with_a_cached_self_signed_certificate(web, export, unchecked, monkeypatch, tmp_path):
    """--tls: the certificate is made once into the cache folder (private files) and its SHA-256
    fingerprint printed; a second start reuses it; the page is served over HTTPS."""
    import ssl

    from nefl_zoo_cli import tls

    monkeypatch.setattr(serve, "WEB", web)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    printed = []

    def interrupted(self, poll_interval=0.5):
        printed.append(serve.url_of(self))
        raise KeyboardInterrupt

    monkeypatch.setattr(serve.Server, "serve_forever", interrupted)
    first = invoke(export, "--port", 0, "--tls")
    certs = sorted((tmp_path / "cache" / "nefl-zoo" / "tls").glob("*.crt"))
    assert first[0] == 0 and len(certs) == 1 and printed[0].startswith("https://127.0.0.1:")
    assert f"certificate SHA-256 fingerprint: {tls.fingerprint(certs[0])}" in first[1]
    assert len(tls.fingerprint(certs[0])) == 32 * 3 - 1
    assert oct(certs[0].with_suffix(".key").stat().st_mode & 0o777) == "0o600"
    assert invoke(export, "--port", 0, "--tls")[1] == first[1].replace(printed[0], printed[1])  # the same certificate
    cert, key = certs[0], certs[0].with_suffix(".key")
    httpd = serve.make_server(export, port=0, web=web, tls=tls.server_context(cert, key))
    thread = threading.Thread(target=serve.Server.__mro__[1].serve_forever, args=(httpd,), kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        client = ssl.create_default_context(cafile=str(cert))
        host, port = httpd.server_address[:2]
        connection = http.client.HTTPSConnection("localhost", port, context=client, timeout=30)
        connection.request("GET", "/app/app.mjs")
        response = connection.getresponse()
        assert response.status == 200 and response.read() == b"export const app = 1;"
        connection.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("args, message", [
    (["--cert", "cert.pem"], "--cert and --key: give both"),
    (["--cert", "cert.pem", "--key", "key.pem"], "not a PEM certificate and its private key"),
])
def test_a_bad_certificate_is_one_line_and_exit_2(web, export, unchecked, monkeypatch, tmp_path, args, message):
    monkeypatch.setattr(serve, "WEB", web)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cert.pem").write_text("not a certificate")
    (tmp_path / "key.pem").write_text("not a key")
    code, output = invoke(export, "--port", 0, *args)
    assert code == 2 and message in one_error(output)

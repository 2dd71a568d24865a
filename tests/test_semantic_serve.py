"""`serve` at the edges of what it may serve, by request and status only: a link out of the export
folder into a sibling folder whose name starts with the export folder's name, the files a
manifest names that a page does not need, and a re-export picked up without a restart
(TESTING.md, "Semantic mistakes"). The manifest is a stand-in taken as it is (``check_export``
replaced); tests/test_browser.py serves a real export."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import pytest

import nefl_zoo_cli.serve as serve


def tier(file, name="full", precision="fp32", index=0) -> dict:
    return {"name": name, "precision": precision, "file": file, "index": index}


def site(tmp_path: Path, name: str = "export") -> tuple[Path, Path]:
    """A web/ folder (page, lib, onnxruntime-web's dist, @noble/hashes) and an empty export folder ``name``."""
    web = tmp_path / "web"
    for file in ("page/index.html", "page/app.mjs", "lib/nested.mjs", "node_modules/onnxruntime-web/dist/ort.wasm.min.mjs",
                 "node_modules/@noble/hashes/sha2.js"):
        (web / file).parent.mkdir(parents=True, exist_ok=True)
        (web / file).write_text(f"// {file}")
    export = tmp_path / name
    export.mkdir()
    return web, export


def write_manifest(export: Path, tiers: list, **more) -> None:
    manifest = {"schema_version": 4, "format": "nested", "model": "resnet20", "input": {"name": "input", "shape": [1, 8, 8], "dataset": None},
                "output": {"name": "logits", "num_classes": 10}, "tiers": tiers, **more}
    (export / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def served(monkeypatch):
    """Start a server of ``(web, export)`` (port 0) and yield a ``GET path -> (status, body)``
    (its ``address``: the server's host and port)."""
    monkeypatch.setattr(serve, "check_export", lambda folder: json.loads((folder / "manifest.json").read_text()))
    servers = []

    def start(web: Path, export: Path):
        httpd = serve.make_server(export, port=0, samples=1, web=web)
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(httpd)

        def get(path: str) -> tuple[int, bytes]:
            connection = http.client.HTTPConnection(*httpd.server_address[:2], timeout=30)
            try:
                connection.putrequest("GET", path, skip_accept_encoding=True)
                connection.endheaders()
                response = connection.getresponse()
                return response.status, response.read()
            finally:
                connection.close()

        get.address = httpd.server_address[:2]
        return get

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_a_link_into_a_sibling_folder_sharing_the_export_folders_prefix_is_refused(tmp_path, served):
    """``export/old.onnx`` links to ``export-old/model.onnx`` and ``web/page/link.mjs`` to
    ``web/page-old/secret.mjs``: both resolve outside their folders though their paths start with
    the folder's own path as a string; refused (404), while a link to a file inside the folder is
    served. Broken by hand: ``str(path).startswith(str(root))`` for ``path.is_relative_to(root)``
    in ``inside`` fails here."""
    web, export = site(tmp_path)
    (export / "nested.fp32.onnx").write_bytes(b"model")
    (export / "alias.onnx").symlink_to(export / "nested.fp32.onnx")
    sibling = tmp_path / "export-old"
    sibling.mkdir()
    (sibling / "model.onnx").write_bytes(b"another export's model")
    (export / "old.onnx").symlink_to(sibling / "model.onnx")
    (web / "page-old").mkdir()
    (web / "page-old" / "secret.mjs").write_text("secret")
    (web / "page" / "link.mjs").symlink_to(web / "page-old" / "secret.mjs")
    write_manifest(export, [tier("nested.fp32.onnx"), tier("alias.onnx", index=1), tier("old.onnx", precision="int8")])
    get = served(web, export)
    assert get("/export/alias.onnx") == (200, b"model")
    assert get("/export/old.onnx")[0] == 404 and get("/app/link.mjs")[0] == 404
    assert get("/app/app.mjs") == (200, b"// page/app.mjs")


def test_only_the_models_and_the_manifest_are_served_from_the_export_folder_whatever_it_names(tmp_path, served):
    """The manifest's tiers name a model, a text file and a weights file, and other fields name
    a calibration file and another model: only the tiers' model and the manifest are served.
    Broken by hand: the ``.onnx`` filter left out of ``Site.export_files``, or every string of
    the manifest taken for a file to serve, fails here."""
    web, export = site(tmp_path)
    for file in ("nested.fp32.onnx", "notes.txt", "weights.safetensors", "calibration.npy", "teacher.onnx"):
        (export / file).write_bytes(file.encode())
    write_manifest(export, [tier("nested.fp32.onnx"), tier("notes.txt", index=1), tier("weights.safetensors", precision="int8")],
                   calibration="calibration.npy", teacher="teacher.onnx")
    get = served(web, export)
    assert get("/export/nested.fp32.onnx") == (200, b"nested.fp32.onnx")
    assert get("/export/manifest.json")[0] == 200
    refused = ("notes.txt", "weights.safetensors", "calibration.npy", "teacher.onnx")
    assert [get(f"/export/{file}")[0] for file in refused] == [404] * len(refused)


def test_a_head_answer_carries_no_body_on_the_wire(tmp_path, served):
    """HEAD answers with GET's headers and not one byte of body (the raw bytes up to the
    server's close), else a kept-alive connection would read the body as its next answer.
    Broken by hand: ``body=True`` in ``Handler.do_HEAD`` fails here (``http.client`` hides it)."""
    import socket

    web, export = site(tmp_path)
    (export / "nested.fp32.onnx").write_bytes(b"model")
    write_manifest(export, [tier("nested.fp32.onnx")])
    get = served(web, export)
    assert get("/app/app.mjs")[0] == 200
    with socket.create_connection(get.address, timeout=30) as raw:
        raw.sendall(b"HEAD /app/app.mjs HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 15" in head and body == b""


def test_a_re_export_is_served_as_it_is_now(tmp_path, served):
    """The server re-reads the manifest: after a re-export that names ``b.onnx`` instead of
    ``a.onnx`` (both files still in the folder), ``b.onnx`` is served and ``a.onnx`` no longer.
    Broken by hand: the served names read once when the server starts fails here."""
    web, export = site(tmp_path)
    (export / "a.onnx").write_bytes(b"a")
    (export / "b.onnx").write_bytes(b"b")
    write_manifest(export, [tier("a.onnx")])
    get = served(web, export)
    assert get("/export/a.onnx") == (200, b"a") and get("/export/b.onnx")[0] == 404
    write_manifest(export, [tier("b.onnx")])
    assert get("/export/b.onnx") == (200, b"b") and get("/export/a.onnx")[0] == 404

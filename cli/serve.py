"""``serve``: a local page that runs a nested export in the browser (onnxruntime-web, WASM).

The standard library's threaded HTTP server, bound to localhost by default, serves::

    /                the page (page/index.html)
    /app/FILE        the page's static files (page/)
    /lib/FILE        the JS runtime modules (lib/: nested.mjs, policy.mjs)
    /ort/FILE        onnxruntime-web's WASM build
    /noble/FILE      @noble/hashes (SHA-256 without Web Crypto, which plain HTTP lacks)
    /export/FILE     manifest.json and the nested .onnx files its tiers name, nothing else
    /samples.json    the first N test images of the manifest's input.dataset, as the project's
                     data module prepares them at the manifest's input shape (seeded random
                     inputs without labels when the dataset cannot be loaded)

The page and what it loads come from a source checkout's web/ (onnxruntime-web and
@noble/hashes from its node_modules, `npm ci`), or else from the copy installed with nefl-zoo
(setup.py builds it into the wheel). Every response asks for cross-origin isolation (COOP/COEP,
so onnxruntime-web may use threads; browsers grant it only to a secure context: localhost, or
``--tls``) and is not cached (a re-export is picked up on reload). Nothing outside the served
folders is served: each request path is resolved and refused unless it lies inside its folder.
The samples are prepared in a background thread as the server starts (torch is imported then,
never when the CLI starts).
"""

from __future__ import annotations

import base64
import json
import mimetypes
import os
import shutil
import socket
import ssl
import sys
import threading
from functools import partial
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit

import typer

from .errors import fail, guarded

WEB = Path(__file__).resolve().parent.parent / "web"  # a source checkout's web/ folder
INSTALLED = Path(__file__).resolve().parent / "web"  # the copy installed with nefl-zoo (setup.py)
ORT_DIST = Path("node_modules") / "onnxruntime-web" / "dist"
NOBLE = Path("node_modules") / "@noble" / "hashes"
NPM_FIX = "cd web && ONNXRUNTIME_NODE_INSTALL=skip npm ci"
SAMPLE_SEED = 0
MAX_SAMPLES = 10_000  # images bundled with the page (a CIFAR test split; 120 MB of float32 at 3x32x32)
MANIFEST = "manifest.json"

MIME = {
    ".html": "text/html; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".map": "application/json",
    ".wasm": "application/wasm",
    ".onnx": "application/octet-stream",
    ".png": "image/png",
    ".svg": "image/svg+xml",
    ".ico": "image/x-icon",
    ".txt": "text/plain; charset=utf-8",
}
HEADERS = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cross-Origin-Resource-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class ServeError(ValueError):
    """An export folder or web/ checkout the page cannot be served from (one line)."""


def mime_type(path: Path) -> str:
    """The Content-Type of a served file, by its suffix."""
    return MIME.get(path.suffix.lower()) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"


def inside(base: Path, relative: str) -> Path | None:
    """The file ``relative`` (a URL path, already unquoted) names under ``base``, or ``None``
    when it is not a file strictly inside ``base`` once resolved (``..``, absolute paths,
    symbolic links out of it, hidden names, folders)."""
    parts = relative.split("/")
    if not relative or any(p in ("", ".", "..") or p.startswith(".") or "\\" in p or "\0" in p for p in parts):
        return None
    root = base.resolve()
    try:  # a name the OS refuses (too long) is no file either
        path = (root / relative).resolve()
        found = path.is_relative_to(root) and path != root and path.is_file()
    except (OSError, RuntimeError):
        return None
    return path if found else None


def check_export(folder: Path) -> dict:
    """The manifest of the nested export in ``folder`` (validated by the project's reader);
    :class:`ServeError` or the reader's one-line error otherwise."""
    from nefl_zoo.manifest import load_manifest

    if not folder.exists():
        raise ServeError(f"{folder}: no such export folder (`nefl-zoo export SOURCE --out {folder}` writes one)")
    if not folder.is_dir():
        raise ServeError(f"{folder}: not a folder; give the export folder that holds {MANIFEST}")
    if not (folder / MANIFEST).is_file():
        raise ServeError(f"{folder}: no {MANIFEST} (not an export folder; `nefl-zoo export` writes one)")
    manifest = load_manifest(folder / MANIFEST)
    if manifest.format != "nested":
        raise ServeError(
            f"{folder / MANIFEST}: format {manifest.format!r}; the page runs one nested file per precision "
            f"(re-export with `nefl-zoo export SOURCE --format nested`)"
        )
    for entry in manifest.tiers:
        if not (folder / entry.file).is_file():
            raise ServeError(f"{folder / MANIFEST}: tier {entry.label}: {entry.file} is missing from the folder")
    return manifest.model_dump(mode="json")


def web_roots(web: Path | None = None) -> dict[str, Path]:
    """The folders the page is served from, by URL prefix: ``web`` (default: the checkout's
    web/) laid out as the repository's web/ with its node_modules, or else, with no ``web``
    given and no checkout, the copy installed with nefl-zoo; :class:`ServeError` naming the fix."""
    source = WEB if web is None else web
    if (source / "page" / "index.html").is_file():
        for package, module, check in (("onnxruntime-web", ORT_DIST, "ort.wasm.min.mjs"), ("@noble/hashes", NOBLE, "sha2.js")):
            if not (source / module / check).is_file():
                raise ServeError(f"{package} is not installed ({source / module} is missing); run `{NPM_FIX}`")
        return {"app": source / "page", "lib": source / "lib", "ort": source / ORT_DIST, "noble": source / NOBLE}
    if web is None and (INSTALLED / "page" / "index.html").is_file():
        return {"app": INSTALLED / "page", "lib": INSTALLED / "lib", "ort": INSTALLED / "ort", "noble": INSTALLED / "noble"}
    raise ServeError(f"{source / 'page' / 'index.html'} is missing and nefl-zoo was installed without its page "
                     f"(reinstall nefl-zoo from a wheel, or run `{NPM_FIX}` in a checkout)")


def sample_images(manifest: dict, count: int) -> dict:
    """``/samples.json``: the first ``count`` test images of the manifest's dataset as the
    project's data module prepares them (flat little-endian float32, base64) with their labels,
    or seeded random normal inputs without labels when the dataset cannot be loaded."""
    import numpy as np

    spec = manifest["input"]
    shape = [int(d) for d in spec["shape"]]
    dataset = spec.get("dataset")
    images, labels, note = None, None, None
    if dataset:
        try:
            images, labels = _test_images(dataset, shape, count)
            source = f"the first {len(images)} images of the {dataset} test split"
        except Exception as exc:  # noqa: BLE001 (whatever stops the data module, the page still runs)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            note = f"the {dataset} dataset cannot be loaded here ({first})"
    else:
        note = "the manifest names no dataset"
    if images is None:
        images = np.random.default_rng(SAMPLE_SEED).standard_normal((count, *shape), dtype=np.float32)
        source = f"{count} seeded random normal inputs (seed {SAMPLE_SEED}), no labels: {note}"
    images = np.ascontiguousarray(images, dtype="<f4")
    return {
        "dataset": dataset,
        "source": source,
        "random": labels is None,
        "count": int(images.shape[0]),
        "shape": list(images.shape),
        "dtype": "float32",
        "data": base64.b64encode(images.tobytes()).decode("ascii"),
        "labels": labels,
    }


def _test_images(dataset: str, shape: list[int], count: int):
    """The first ``count`` test images and labels of ``dataset`` at ``shape``, prepared as
    training evaluates (the data module with the config nefl_zoo.export.data's
    ``load_run_images`` uses: no augmentation; only these images are read, not the split)."""
    import numpy as np

    from nefl_zoo.data.loading import load_data
    from nefl_zoo.data.config import DataConfig

    config = DataConfig.model_validate({"dataset": dataset, "augment": False, "partition": "iid", "local_split": None})
    loaded = load_data(config, Path(config.root), tuple(shape), 1, SAMPLE_SEED)
    pairs = [loaded.test[i] for i in range(min(count, len(loaded.test)))]
    return np.stack([np.asarray(x, np.float32) for x, _ in pairs]), [int(y) for _, y in pairs]


class Site:
    """What the server serves (see the module docstring); :meth:`resolve` maps a request path
    to ``(body, content_type)`` or ``None`` (404)."""

    def __init__(self, export_dir: Path, samples: int = 64, web: Path | None = None):
        self.manifest = check_export(export_dir)
        self.export_dir = export_dir.resolve()
        self.roots = web_roots(web)
        self.samples = samples
        self._samples_json: bytes | None = None
        self._samples_ready = threading.Event()
        self._thread = threading.Thread(target=self._prepare_samples, name="nefl-samples", daemon=True)
        self._thread.start()

    def _prepare_samples(self) -> None:
        try:
            self._samples_json = json.dumps(sample_images(self.manifest, self.samples)).encode()
        except Exception as exc:  # noqa: BLE001 (served as an error, the page says so)
            self._samples_json = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        finally:
            self._samples_ready.set()

    def samples_json(self) -> bytes:
        """The bytes of ``/samples.json`` (waits for the background preparation)."""
        self._samples_ready.wait()
        assert self._samples_json is not None
        return self._samples_json

    def export_files(self) -> set[str]:
        """The names ``/export/`` serves: manifest.json and the files the manifest's tiers name
        (re-read, so that a re-export is served as it is now)."""
        try:
            tiers = json.loads((self.export_dir / MANIFEST).read_text(encoding="utf-8")).get("tiers", [])
            names = {t["file"] for t in tiers if isinstance(t, dict) and isinstance(t.get("file"), str)}
        except (OSError, ValueError, AttributeError):
            names = set()
        return {MANIFEST} | {n for n in names if n.endswith(".onnx")}

    def resolve(self, url_path: str) -> tuple[bytes | Path, str] | None:
        path = unquote(urlsplit(url_path).path)
        if path in ("/", "/index.html"):
            page = self.roots["app"] / "index.html"
            return page, mime_type(page)
        if path == "/samples.json":
            return self.samples_json(), MIME[".json"]
        head, _, rest = path.lstrip("/").partition("/")
        if head == "export":
            if rest not in self.export_files():
                return None
            found = inside(self.export_dir, rest)
        elif head in self.roots:
            found = inside(self.roots[head], rest)
        else:
            return None
        return (found, mime_type(found)) if found is not None else None


class Handler(BaseHTTPRequestHandler):
    """GET and HEAD of :class:`Site`'s paths; everything else 404 or 405."""

    server_version = "nefl-zoo-serve"
    protocol_version = "HTTP/1.1"

    def __init__(self, *args, site: Site, quiet: bool, **kwargs):
        self.site, self.quiet = site, quiet
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._respond(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._respond(body=False)

    def _respond(self, body: bool) -> None:
        found = self.site.resolve(self.path)
        if found is None:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", MIME[".txt"], body)
            return
        content, kind = found
        if not isinstance(content, Path):
            self._send(HTTPStatus.OK, content, kind, body)
            return
        with open(content, "rb") as f:  # streamed: a model file may be large
            self._head(HTTPStatus.OK, kind, os.fstat(f.fileno()).st_size)
            if body:
                shutil.copyfileobj(f, self.wfile, 1 << 20)

    def _head(self, status: HTTPStatus, kind: str, length: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(length))
        for name, value in HEADERS.items():
            self.send_header(name, value)
        self.end_headers()

    def _send(self, status: HTTPStatus, data: bytes, kind: str, body: bool) -> None:
        self._head(status, kind, len(data))
        if body:
            self.wfile.write(data)

    def _refuse(self) -> None:
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        if not self.quiet:
            super().log_message(format, *args)


class Server(ThreadingHTTPServer):
    """One thread per connection; a browser that drops a connection is not an error. With a TLS
    context each connection's handshake happens in its own thread, so a slow or failing client
    never holds up the others."""

    daemon_threads = True
    block_on_close = False
    tls: ssl.SSLContext | None = None

    def get_request(self):
        connection, address = super().get_request()
        if self.tls is not None:
            connection = self.tls.wrap_socket(connection, server_side=True, do_handshake_on_connect=False)
        return connection, address

    def finish_request(self, request, client_address) -> None:
        if isinstance(request, ssl.SSLSocket):
            try:
                request.do_handshake()
            except (ssl.SSLError, OSError):  # a client that does not trust the certificate, or left
                return
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class Server6(Server):
    """:class:`Server` on an IPv6 address (``--host ::1``)."""

    address_family = socket.AF_INET6


def make_server(export_dir: Path, host: str = "127.0.0.1", port: int = 0, samples: int = 64,
                quiet: bool = True, web: Path | None = None, tls: ssl.SSLContext | None = None) -> Server:
    """A server of ``export_dir``'s page (not yet serving: call ``serve_forever``), over HTTPS
    with ``tls``; :class:`ServeError` (or the manifest reader's error) for what cannot be served."""
    site = Site(export_dir, samples, web)
    server = (Server6 if ":" in host else Server)((host, port), partial(Handler, site=site, quiet=quiet))
    server.site = site  # type: ignore[attr-defined]
    server.tls = tls
    return server


def url_of(server: Server) -> str:
    """The URL the server's page is at (``https`` when it serves TLS)."""
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in str(host) else host
    return f"{'https' if server.tls else 'http'}://{shown}:{port}/"


def serve(
    export_dir: Path = typer.Argument(..., help="the export folder (manifest.json and the nested .onnx files)"),
    host: str = typer.Option("127.0.0.1", help="host name or IP address to listen on (default: this machine only)"),
    port: int = typer.Option(8000, help="port to listen on (0: any free port)"),
    samples: int = typer.Option(64, help=f"test images of the manifest's dataset bundled with the page (at most {MAX_SAMPLES})"),
    log: bool = typer.Option(False, "--log/--no-log", help="print one line per request (on stderr)"),
    tls: bool = typer.Option(False, "--tls", help="serve HTTPS with a self-signed certificate (its fingerprint is printed): "
                             "a phone on the local network then gets a secure context and onnxruntime-web's threads"),
    cert: Optional[Path] = typer.Option(None, "--cert", help="HTTPS with this PEM certificate (with --key) instead of a self-signed one"),
    key: Optional[Path] = typer.Option(None, "--key", help="the private key (PEM) of --cert"),
) -> None:
    """Serve a local page that runs the export's tiers in the browser (onnxruntime-web): predictions,
    adaptive tier choice under a deadline, and a latency table for `select --latency-table`.
    A phone on the local network opens it with --host 0.0.0.0 (add --tls for threads)."""
    from nefl_zoo.manifest import ManifestError

    from nefl_zoo.bounds import MAX_PORT, host as checked_host, number

    number("--samples", samples, 1, MAX_SAMPLES, integer=True)  # a ValueError is one line, exit 2 (guarded)
    number("--port", port, 0, MAX_PORT, integer=True)
    checked_host("--host", host)
    from .tls import options_context

    try:
        context, fingerprint = options_context(tls, cert, key, host)
        server = make_server(export_dir, host, port, samples, quiet=not log, tls=context)
    except (ServeError, ManifestError, ValueError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"--host {host} --port {port}: cannot listen ({exc.strerror or exc}); --port 0 takes any free port") from None
    if host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(f"warning: listening on {host}: other machines can reach the page", err=True)
        if context is None:
            typer.echo("note: over plain HTTP another device runs the page single-threaded; --tls gives it threads", err=True)
    typer.echo(f"serving {export_dir} at {url_of(server)} (Ctrl-C stops)")
    if fingerprint is not None:
        typer.echo(f"certificate SHA-256 fingerprint: {fingerprint}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        typer.echo("stopped")
    finally:
        server.server_close()


def register(app: typer.Typer) -> None:
    """Add ``serve`` to ``app``."""
    app.command()(guarded(serve))


__all__ = ["Site", "ServeError", "make_server", "register", "serve", "url_of", "web_roots"]

"""Packaging step of the ``serve`` page: the wheel carries the page, the JavaScript runtime and
the onnxruntime-web files it loads, so that ``nefl-zoo serve`` works where nefl-zoo is
installed (pyproject.toml holds everything else).

``build_py`` and ``sdist`` first copy them into ``cli/web/`` (git-ignored; installed as
``nefl_zoo_cli/web``): the page and runtime from ``web/``, onnxruntime-web and
``@noble/hashes`` from ``web/node_modules``, which ``npm ci`` installs from web/'s lockfile
when it is absent. A wheel built from the sdist finds the copy already there and needs no npm.
An editable install skips the step: ``serve`` then runs from the checkout's ``web/``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
WEB = ROOT / "web"
ASSETS = ROOT / "cli" / "web"
MODULES = WEB / "node_modules"
# what the page loads, by folder of cli/web/: (source folder, file names)
COPIES = {
    "page": (WEB / "page", ["index.html", "app.mjs", "style.css"]),
    "lib": (WEB / "lib", ["nested.mjs", "policy.mjs"]),
    "ort": (MODULES / "onnxruntime-web" / "dist", ["ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm"]),
    "noble": (MODULES / "@noble" / "hashes", ["sha2.js", "_md.js", "_u64.js", "utils.js", "LICENSE"]),
}
LICENSES = {"ort/package.json": MODULES / "onnxruntime-web" / "package.json"}  # its license and version


def build_web_assets() -> None:
    """Fill cli/web/ from web/ (``npm ci`` first when web/node_modules lacks a file); keep a
    complete copy when web/node_modules is absent (a wheel built from the sdist)."""
    missing = [f"{folder}/{name}" for folder, (_, names) in COPIES.items() for name in names if not (ASSETS / folder / name).is_file()]
    if not missing and not MODULES.is_dir():
        return
    if not (WEB / "package-lock.json").is_file():
        raise SystemExit(f"cli/web/ lacks {', '.join(missing)} and there is no web/ to build it from")
    if not all((source / name).is_file() for source, names in COPIES.values() for name in names):
        env = {**os.environ, "ONNXRUNTIME_NODE_INSTALL": "skip"}
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=WEB, env=env, check=True)
    shutil.rmtree(ASSETS, ignore_errors=True)
    for folder, (source, names) in COPIES.items():
        (ASSETS / folder).mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(source / name, ASSETS / folder / name)
    for target, source in LICENSES.items():
        shutil.copyfile(source, ASSETS / target)


class BuildPy(build_py):
    """``build_py`` that builds the serve page's assets first (not for an editable install)."""

    def run(self) -> None:
        if not self.editable_mode:
            build_web_assets()
        super().run()


class SDist(sdist):
    """``sdist`` that builds the serve page's assets first, so the sdist carries them."""

    def run(self) -> None:
        build_web_assets()
        super().run()


setup(cmdclass={"build_py": BuildPy, "sdist": SDist})

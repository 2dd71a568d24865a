"""The npm package as an app gets it: ``npm pack`` of web/, installed offline into a scratch app
(with the app's own onnxruntime-node), where web/'s ``node --test`` suite and examples run on a
fresh export against logits that Python's onnxruntime computed on the same files, and the
package's TypeScript declarations type-check an app's code.

Needs ``cd web && ONNXRUNTIME_NODE_INSTALL=skip npm ci`` (which also fills npm's cache the
offline install reads); without web/node_modules the test is skipped locally and fails on CI
(``CI`` set)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest


WEB = Path(__file__).resolve().parent.parent / "web"
BATCH = 3


@pytest.fixture(scope="module")
def node():
    node = shutil.which("node")
    missing = None if node else "node is not installed"
    if node and not (WEB / "node_modules" / "onnxruntime-node").is_dir():
        missing = "web/node_modules is absent: run `cd web && ONNXRUNTIME_NODE_INSTALL=skip npm ci`"
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing} (required on CI)")
        pytest.skip(missing)
    return node


@pytest.fixture(scope="module")
def export(nested_export_dir) -> Path:
    return nested_export_dir


PACKAGE_FILES = {"package.json", "README.md", "LICENSE", "lib/nested.mjs", "lib/nested.d.ts", "lib/policy.mjs", "lib/policy.d.ts"}


def npm(*args: str, cwd: Path) -> str:
    done = subprocess.run(["npm", *args, "--no-audit", "--no-fund", "--loglevel=error"], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "ONNXRUNTIME_NODE_INSTALL": "skip"})
    assert done.returncode == 0, f"npm {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


def app_lockfile(tarball: Path, manifest: dict) -> dict:
    """A lockfile for an app that depends on ``tarball`` alone: the package and its dependency
    closure as web/'s lockfile pins them, each with its registry address, so that ``npm ci
    --offline`` takes them from npm's cache (web/'s ``npm ci`` put them there)."""
    web_lock = json.loads((WEB / "package-lock.json").read_text())["packages"]
    spec = f"file:{tarball.name}"
    packages = {"": {"name": "scratch-app", "dependencies": {manifest["name"]: spec}}}
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
    packages[f"node_modules/{manifest['name']}"] = {
        "version": manifest["version"], "resolved": spec, "integrity": integrity,
        **{k: manifest[k] for k in ("dependencies", "peerDependencies", "peerDependenciesMeta", "engines") if k in manifest},
    }
    todo = list(manifest.get("dependencies", {}))
    while todo:
        name = todo.pop()
        key = f"node_modules/{name}"
        if key in packages:
            continue
        entry = {k: v for k, v in web_lock[key].items() if k not in ("dev", "peer")}
        entry.setdefault("resolved", f"https://registry.npmjs.org/{name}/-/{name.split('/')[-1]}-{entry['version']}.tgz")
        packages[key] = entry
        todo.extend(entry.get("dependencies", {}))
    return {"name": "scratch-app", "lockfileVersion": 3, "requires": True, "packages": packages}


@pytest.fixture(scope="module")
def app(node, tmp_path_factory) -> Path:
    """A scratch app that installed the packed tarball (offline), with its own onnxruntime-node
    (web/'s copy, linked: the peer dependency an app brings) and web/'s tests and examples."""
    root = tmp_path_factory.mktemp("npm")
    tarball = root / npm("pack", "--pack-destination", str(root), cwd=WEB).strip().splitlines()[-1]
    with tarfile.open(tarball) as packed:
        files = {name.removeprefix("package/") for name in packed.getnames()}
        manifest = json.load(packed.extractfile("package/package.json"))
    assert files == PACKAGE_FILES, f"the tarball holds {sorted(files)}"
    assert "private" not in manifest and manifest["exports"]["./nested"]["types"] == "./lib/nested.d.ts"
    (root / "package.json").write_text(json.dumps({"name": "scratch-app", "private": True, "type": "module",
                                                   "dependencies": {manifest["name"]: f"file:{tarball.name}"}}))
    (root / "package-lock.json").write_text(json.dumps(app_lockfile(tarball, manifest)))
    npm("ci", "--offline", cwd=root)
    (root / "node_modules" / "onnxruntime-node").symlink_to(WEB / "node_modules" / "onnxruntime-node")
    for folder in ("test", "examples"):
        shutil.copytree(WEB / folder, root / folder)
    return root


def python_cases(folder: Path) -> dict:
    """Per manifest label: an input batch and the logits Python's onnxruntime gives on the
    label's nested file, fed ``input`` and the int64 scalar ``tier`` directly."""
    manifest = json.loads((folder / "manifest.json").read_text())
    spec = manifest["input"]
    images = np.random.default_rng(0).standard_normal((spec["batch"] or BATCH, *spec["shape"])).astype(np.float32)
    sessions: dict[str, ort.InferenceSession] = {}
    cases = {}
    for entry in manifest["tiers"]:
        label = entry["name"] if entry["precision"] == "fp32" else f"{entry['name']}:{entry['precision']}"
        if entry["file"] not in sessions:
            sessions[entry["file"]] = ort.InferenceSession(str(folder / entry["file"]), providers=["CPUExecutionProvider"])
        feeds = {spec["name"]: images, "tier": np.array(entry["index"], dtype=np.int64)}
        (logits,) = sessions[entry["file"]].run([manifest["output"]["name"]], feeds)
        cases[label] = {"input": images.ravel().tolist(), "dims": list(images.shape),
                        "logits": logits.ravel().tolist(), "logits_dims": list(logits.shape)}
    return cases


def test_node_runs_every_tier_of_every_precision_like_python(node, app, export, tmp_path):
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(python_cases(export)))
    env = {**os.environ, "NEFL_EXPORT_DIR": str(export), "NEFL_CASES": str(cases), "NEFL_REPO": str(WEB.parent)}
    done = subprocess.run([node, "--test", "--test-reporter=tap", "test/"], cwd=app, env=env,
                          capture_output=True, text=True, timeout=120)
    report = done.stdout + done.stderr
    counts = {key: int(n) for key, n in re.findall(r"^# (pass|fail|cancelled|skipped|todo) (\d+)$", report, re.M)}
    failed = [line for line in report.splitlines() if line.lstrip().startswith(("not ok", "error:", "expected", "actual", "stack"))]
    assert done.returncode == 0, "\n".join(failed) or report[-4000:]
    assert counts.get("pass", 0) > 0 and counts.get("fail") == 0 and counts.get("skipped") == 0, report[-4000:]
    assert counts.get("cancelled") == 0 and counts.get("todo") == 0, report[-4000:]


CONSUMER = """
import * as ort from "onnxruntime-node";
import { loadNestedModel, readNestedMetadata, type NestedMetadata, type TierInfo } from "nefl-zoo-web/nested";
import { AdaptivePolicy, Candidate, Deadline } from "nefl-zoo-web/policy";

export async function serve(bytes: Uint8Array, sha256: string): Promise<string> {
  const table: NestedMetadata = readNestedMetadata(bytes);
  const tiers: TierInfo[] = table.tiers;
  const model = await loadNestedModel(ort, bytes, { sha256, size: bytes.length });
  const policy = new AdaptivePolicy(tiers.map((t) => new Candidate({ label: t.name, accuracy: t.accuracy, macs: t.macs,
    expectedMs: 1 })), new Deadline({ ms: 20 }));
  const { logits, dims } = await model.run(policy.choose(), new Float32Array(4), 1);
  policy.observe(policy.current, 1.5);
  // @ts-expect-error: a tier is a name or an index
  await model.run(true, new Float32Array(4));
  // @ts-expect-error: Deadline needs its ms
  new Deadline({ percentile: 90 });
  return `${logits[0]} ${dims.length} ${policy.switches.length}`;
}
"""


def test_typescript_declarations_type_check_an_app(app):
    """The package's declarations accept an app's correct use with the real onnxruntime-node
    module and reject misuses: two in app.ts (each ``@ts-expect-error`` is itself an error if
    the line type-checks), one in wrong.ts (which proves the declarations are read at all)."""
    (app / "app.ts").write_text(CONSUMER)
    (app / "wrong.ts").write_text('import { loadNestedModel } from "nefl-zoo-web/nested";\nexport const n: number = loadNestedModel;\n')
    tsc = WEB / "node_modules" / "typescript" / "bin" / "tsc"
    done = subprocess.run([shutil.which("node"), str(tsc), "--noEmit", "--strict", "--target", "es2022", "--module", "nodenext",
                           "--moduleResolution", "nodenext", "--skipLibCheck", "app.ts", "wrong.ts"],
                          cwd=app, capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stdout.splitlines() if ": error TS" in line]
    assert len(errors) == 1 and errors[0].startswith("wrong.ts(2,") and "TS2322" in errors[0], done.stdout + done.stderr

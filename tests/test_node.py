"""The nested export runs in Node (onnxruntime-node) as in Python: ``node --test`` in web/ on a
fresh export, against logits that Python's onnxruntime computed on the same files.

Needs ``cd web && ONNXRUNTIME_NODE_INSTALL=skip npm ci``; without web/node_modules the test is
skipped locally and fails on CI (``CI`` set)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
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


def test_node_runs_every_tier_of_every_precision_like_python(node, export, tmp_path):
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(python_cases(export)))
    env = {**os.environ, "NEFL_EXPORT_DIR": str(export), "NEFL_CASES": str(cases)}
    done = subprocess.run([node, "--test", "--test-reporter=tap", "test/"], cwd=WEB, env=env,
                          capture_output=True, text=True, timeout=120)
    report = done.stdout + done.stderr
    counts = {key: int(n) for key, n in re.findall(r"^# (pass|fail|cancelled|skipped|todo) (\d+)$", report, re.M)}
    assert done.returncode == 0, report[-4000:]
    assert counts.get("pass", 0) > 0 and counts.get("fail") == 0 and counts.get("skipped") == 0, report[-4000:]
    assert counts.get("cancelled") == 0 and counts.get("todo") == 0, report[-4000:]

"""Every shipped spec's comments against what it compiles to: each tier's comment gives the
measured parameter ratio of its slim module (3 decimals) and, where it says so, the nominal
gamma and the blocks kept per stage; it notes where the paper's table is off its nominal gamma
by more than 0.02. Any YAML added under ``specs/`` (training configs aside) is covered
without a new test."""

import re
from pathlib import Path

import pytest
import torch

from nefl_zoo.models import create_model
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import load_spec

ROOT = Path(__file__).resolve().parents[1] / "specs"
SPECS = sorted(p for p in ROOT.rglob("*.yaml") if p.relative_to(ROOT).parts[0] != "train")
TIER_COMMENT = re.compile(
    r"^ *# (?:nominal gamma (?P<nominal>[0-9.]+), )?measured params ratio (?P<ratio>[0-9.]+)(?P<rest>.*)\n *- name: (?P<name>\S+)",
    re.MULTILINE,
)
BLOCKS = re.compile(r"blocks per stage \[(?P<blocks>[0-9, ]+)\]")
NOTE = re.compile(r" -- NOTE: the paper's table is off its nominal gamma \((?P<ratio>[0-9.]+) vs (?P<nominal>[0-9.]+)\)$")


def params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_the_specs_are_found():
    assert len(SPECS) >= 19


@pytest.mark.parametrize("path", SPECS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_tier_comment_states_the_compiled_ratio(path):
    spec = load_spec(path)
    compiled = compile_spec(spec)
    with torch.device("meta"):
        full = params(create_model(spec.model, **spec.model_args))
        measured = {name: params(tier.build()) / full for name, tier in compiled.tiers.items()}
    comments = list(TIER_COMMENT.finditer(path.read_text()))
    assert [c["name"] for c in comments] == [t.name for t in spec.tiers], f"{path}: one comment right above each tier"
    for comment, tier in zip(comments, spec.tiers):
        ratio = measured[tier.name]
        where = f"{path}: tier {tier.name}"
        assert comment["ratio"] == f"{ratio:.3f}", f"{where}: comment says {comment['ratio']}, compiled {ratio:.4f}"
        nominal = float(comment["nominal"]) if comment["nominal"] else tier.gamma
        if comment["nominal"] and tier.gamma is not None:
            assert nominal == pytest.approx(tier.gamma), f"{where}: nominal gamma {nominal} vs gamma {tier.gamma}"
        blocks = BLOCKS.search(comment["rest"])
        if blocks:
            kept = [sum(1 for step in stage if step) for stage in tier.steps] if tier.steps else None
            assert kept is None or [int(b) for b in blocks["blocks"].split(",")] == kept, f"{where}: blocks per stage {kept}"
        if nominal is None:
            continue
        note = NOTE.search(comment["rest"])
        off = abs(round(ratio, 3) - nominal) > 0.02 + 1e-9
        assert (note is not None) == off, f"{where}: {ratio:.3f} vs nominal {nominal}: a NOTE exactly when off by > 0.02"
        if note:
            assert (note["ratio"], float(note["nominal"])) == (comment["ratio"], nominal), where

"""A small nested export shared by the runtime, Node and browser tests.

A ResNet20 shaped for scikit-learn's digits (1 x 16 x 16, 10 classes) with seeded random
weights and trained-looking norms, three tiers (a narrow one with skipped blocks, a middle one,
the full model), exported in the default nested format at FP32 and INT8.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

SPEC = {
    "model": "resnet20",
    "model_args": {"num_classes": 10, "in_chans": 1, "img_size": 16},
    "inconsistent": ["steps", "norm"],
    "tiers": [
        {"name": "small", "gamma_w": 0.25, "steps": [[1, 0, 0.5], [1, 0.7, 0], [1, 0, 1]]},
        {"name": "mid", "gamma_w": 0.5},
        {"name": "full"},
    ],
}


def graphs(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    """The model's main graph and every subgraph under it (a nested model's ``If`` branches)."""
    found, todo = [], [model.graph]
    while todo:
        graph = todo.pop()
        found.append(graph)
        todo.extend(a.g for node in graph.node for a in node.attribute if a.type == onnx.AttributeProto.GRAPH)
    return found


def calibration_images(input_size) -> np.ndarray:
    """256 seeded random images: the exporter calibrates INT8 on 192 and holds out every 4th (64)
    for the INT8 file's top-1 agreement with FP32 (>= 0.95: up to three near-ties may flip)."""
    return np.random.default_rng(0).standard_normal((256, *input_size)).astype(np.float32)


def trained_looking_state(compiled) -> dict[str, torch.Tensor]:
    """Global state whose norms are not the identity and whose step sizes are not 1, so that
    folding, per-tier tensors and slices all matter (negative BN scales included)."""
    generator = torch.Generator().manual_seed(0)
    state = compiled.init_global_state()
    for key, value in state.items():
        if value.dtype != torch.float32:
            continue
        if "running_var" in key:
            value.copy_(torch.rand(value.shape, generator=generator) + 0.5)
        elif ".bn" in key or "downsample.1" in key:
            value.copy_(torch.randn(value.shape, generator=generator) * 0.5 + (1.0 if key.endswith("weight") else 0.0))
        elif "step" in key:
            value.mul_(0.8)
    return state


def nested_export(folder: str | Path, precisions=("fp32", "int8"), **options) -> Path:
    """Export the three tiers into ``folder`` (the default nested format) and return it;
    ``options``: fields of :class:`ExportOptions` over these defaults."""
    from nefl_zoo.export import ExportOptions, ExportSource, export_tiers
    from nefl_zoo.slim import compile_spec
    from nefl_zoo.spec import parse_spec

    torch.manual_seed(0)  # the global state's initialisation: the same export every time
    compiled = compile_spec(parse_spec(SPEC))
    state = trained_looking_state(compiled)
    source = ExportSource(compiled, state, "test", accuracy={"small": 0.6, "mid": 0.7, "full": 0.8}, dataset="digits")
    settings = {"precisions": list(precisions), "calibration": calibration_images(compiled.input_size), "latency_runs": 1, "threads": 1,
                "format": "nested", **options}
    export_tiers(source, folder, ExportOptions(**settings))
    return Path(folder)

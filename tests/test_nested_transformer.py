"""The nested model of a transformer: its Linear layers on token sequences export as ``MatMul``
with the weight transposed, and the nested file reads that weight transposed from the one
shared copy of the global tensor (not a second, transposed copy).

A two-block ViT (64 wide, four heads) with a half-width tier that skips a block, exported as
the nested model at FP32 and checked against PyTorch (the tolerance of the exporter's own check).
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from nefl_zoo.export import ExportOptions, ExportSource, export_tiers
from nefl_zoo.manifest import load_manifest
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec

from .support.exports import graphs
from .test_export import VIT_SPEC, trained_like_state


@pytest.fixture(scope="module")
def vit_export(tmp_path_factory):
    torch.manual_seed(0)
    compiled = compile_spec(parse_spec(VIT_SPEC))
    state = trained_like_state(compiled)
    out = tmp_path_factory.mktemp("nested")
    export_tiers(ExportSource(compiled, state, "vit"), out,
                 ExportOptions(precisions=["fp32"], latency_runs=1, threads=1, format="nested"), warn=pytest.fail)
    return compiled, state, out


def read_from(producers: dict[str, onnx.NodeProto], name: str) -> str:
    """The name outside the branch that ``name`` is computed from (through first inputs)."""
    while name in producers:
        name = producers[name].input[0]
    return name


def test_every_tier_of_a_nested_transformer_reads_its_linear_weights_transposed_from_one_copy(vit_export):
    compiled, state, nested = vit_export
    model = onnx.load(nested / "nested.fp32.onnx")
    onnx.checker.check_model(model, full_check=True)
    top = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for key in ("blocks.0.attn.qkv.weight", "blocks.1.mlp.fc1.weight"):  # torch's (out, in) layout, bit for bit
        np.testing.assert_array_equal(top[key], state[key].numpy())
    for graph in graphs(model)[1:]:  # each tier's branch transposes the shared weights it reads
        producers = {out: node for node in graph.node for out in node.output}
        transposed = {read_from(producers, n.input[0]) for n in graph.node if n.op_type == "Transpose"}
        assert {"blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight"} <= transposed, graph.name
        assert all(numpy_helper.to_array(t).size < 64 * 64 for t in graph.initializer), graph.name
    manifest = load_manifest(nested)
    full_file = manifest.tier("full").weights_mb * 2**20  # the full tier's own self-contained file
    assert (nested / "nested.fp32.onnx").stat().st_size <= 1.10 * full_file

    x = torch.randn(4, *compiled.input_size, generator=torch.Generator().manual_seed(1))
    session = ort.InferenceSession(str(nested / "nested.fp32.onnx"))
    for tier in manifest.tiers:
        logits = session.run(None, {"input": x.numpy(), "tier": np.array(tier.index, np.int64)})[0]
        with torch.no_grad():
            expected = compiled[tier.name].load(state).eval()(x).numpy()
        np.testing.assert_allclose(logits, expected, atol=1e-4 * max(1.0, float(np.abs(expected).max())), rtol=0)

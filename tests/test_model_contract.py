"""The contract every registered model keeps, checked over ``list_models()``.

A new model family gets these checks by adding small ``model_args`` to :data:`MODEL_ARGS`.
Each model is compiled with three tiers: ``narrow`` (half the parameters by width, blocks
removed), ``skip`` (full width, the same blocks removed: the first of every stage, a
projection block where the stage has one, and the last of stages deeper than two) and ``full``.
"""

from __future__ import annotations

from types import SimpleNamespace

import onnxruntime as ort
import pytest
import torch

from nefl_zoo.export import ExportOptions, ExportSource, export_tiers
from nefl_zoo.models import count_params, create_model, list_models, load_pretrained
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec

CIFAR = dict(in_chans=1, img_size=8)
TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)
MODEL_ARGS = {
    "resnet20": CIFAR,
    "resnet32": CIFAR,
    "resnet44": CIFAR,
    "resnet56": CIFAR,
    "resnet110": CIFAR,
    "resnet18": dict(stem="cifar", img_size=16, planes=(8, 16, 32, 64)),
    "resnet34": dict(img_size=16, planes=(8, 16, 32, 64)),  # the NeFL stem (max-pool)
    "wide_resnet101_2": dict(img_size=32, planes=(4, 8, 16, 32)),  # the ImageNet stem
    "vit_b_16": TINY_VIT,
    "vit_tiny_16": TINY_VIT | dict(embed_dim=48, num_heads=3),
    **dict.fromkeys(
        ["mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small", "efficientnet_b0", "shufflenet_v2_x1_0", "shufflenet_v2_x0_5"],
        dict(num_classes=10, in_chans=1, img_size=32),
    ),
}
# ONNX export is most of this file's time: models whose block types and stem another exported
# model already has are not exported again (a new family is).
NOT_EXPORTED = {"resnet18", "resnet32", "resnet44", "resnet56", "resnet110", "vit_b_16",
                "mobilenet_v3_large", "efficientnet_b0", "shufflenet_v2_x0_5"}  # blocks as mobilenet_v3_small's / x1_0's


def skip_steps(depths: tuple[int, ...], fixed: set[tuple[int, int]]) -> list[list[float]]:
    """The ``skip`` tier's steps; blocks the model declares it cannot skip are kept."""
    return [
        [0.0 if (j == 0 or (d > 2 and j == d - 1)) and (s, j) not in fixed else 1.0 for j in range(d)]
        for s, d in enumerate(depths)
    ]


@pytest.fixture(scope="module", params=list_models())
def case(request):
    name = request.param
    if name not in MODEL_ARGS:
        pytest.fail(f"{name} has no entry in MODEL_ARGS of tests/test_model_contract.py: add small model_args for it")
    args = MODEL_ARGS[name]
    with torch.device("meta"):
        meta = create_model(name, **args)
    steps = skip_steps(meta.stage_depths, meta.fixed_blocks())
    spec = parse_spec({
        "model": name,
        "model_args": args,
        "tiers": [{"name": "narrow", "gamma_w": 0.5, "steps": steps}, {"name": "skip", "steps": steps}, {"name": "full"}],
    })
    torch.manual_seed(0)
    compiled = compile_spec(spec)
    full = compiled.create_global_model().eval()
    state = compiled.init_global_state(full)
    x = torch.randn(2, *compiled.input_size)
    return SimpleNamespace(name=name, args=args, steps=steps, compiled=compiled, full=full, state=state, x=x)


def slim_models(case):
    return {name: ct.load(case.state).eval() for name, ct in case.compiled.tiers.items()}


def test_the_table_lists_exactly_the_registered_models():
    assert set(MODEL_ARGS) == set(list_models()), "MODEL_ARGS must have one entry per registered model"


@torch.no_grad()
def test_full_tier_is_the_global_model_bit_for_bit(case):
    sub = case.compiled["full"].load(case.state).eval()
    ours, theirs = sub.state_dict(), case.full.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(sub(case.x), case.full(case.x))


def test_extract_then_scatter_is_the_identity(case):
    state = {k: v.clone() for k, v in case.state.items()}
    for ct in case.compiled.tiers.values():
        ct.scatter_(state, ct.extract(state))
        moved = [k for k in state if not torch.equal(state[k], case.state[k])]
        assert not moved, f"tier {ct.name} moved {moved[:3]}"


@torch.no_grad()
def test_a_skipped_block_computes_what_a_zero_step_computes(case):
    masked = case.compiled["full"].load(case.state).eval()
    for stage, block, module in masked.residual_blocks():
        for step in module.step_names:
            getattr(module, step).fill_(case.steps[stage][block])
    if all(v for stage in case.steps for v in stage):
        pytest.skip(f"{case.name} has no block that can be skipped")
    skip = case.compiled["skip"].load(case.state).eval()
    assert count_params(skip) < count_params(masked)
    assert torch.equal(skip(case.x), masked(case.x))


def test_every_slice_fits_its_global_tensor(case):
    shapes = case.compiled.global_shapes()
    assert set(shapes) == set(case.state)
    for ct in case.compiled.tiers.values():
        ct.slice_map.check(shapes)


def test_load_pretrained_round_trips_and_skips_steps_and_another_classifier(case, tmp_path):
    saved = case.full.state_dict()
    torch.save(saved, tmp_path / "w.pth")
    fresh = create_model(case.name, **case.args)
    assert load_pretrained(fresh, tmp_path / "w.pth") == []
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())

    other = create_model(case.name, **(case.args | {"num_classes": case.full.num_classes + 1}))
    classifier = case.full.default_cfg["classifier"]
    head = {k for k in saved if k.startswith(f"{classifier}.")}
    skipped = load_pretrained(other, {k: v for k, v in saved.items() if k not in case.full.step_keys()})
    assert set(skipped) == set(case.full.step_keys()) | head


@torch.no_grad()
def test_the_contract(case):
    """Every tier's slim module declares what it is, for its own widths and blocks."""
    compiled, x = case.compiled, case.x
    assert (compiled.num_classes, compiled.num_features) == (case.full.num_classes, case.full.num_features)
    assert compiled.classifier == case.full.default_cfg["classifier"]
    assert compiled.feature_info == case.full.feature_info
    for name, model in slim_models(case).items():
        cfg, stages = model.default_cfg, model.stage_names
        assert tuple(cfg["input_size"]) == compiled.input_size
        assert model.get_submodule(cfg["first_conv"]).in_channels == cfg["input_size"][0]
        assert model.get_classifier() is model.get_submodule(cfg["classifier"])

        features = model.forward_features(x)
        logits = model(x)
        assert torch.equal(logits, model.forward_head(features))
        pooled = model.forward_head(features, pre_logits=True)
        assert pooled.shape == (2, model.num_features)
        assert torch.equal(model.get_classifier()(pooled), logits)
        assert model.num_classes == compiled.num_classes and logits.shape == (2, model.num_classes)

        final, intermediates = model.forward_intermediates(x)
        assert torch.equal(final, features)
        assert len(model.feature_info) == len(intermediates) == len(stages) == len(model.stage_depths)
        for info, stage, out in zip(model.feature_info, stages, intermediates):
            assert info["module"] == stage
            if out.ndim == 4:  # N, C, H, W
                assert out.shape[1] == info["num_chs"], (name, stage)
                assert x.shape[-1] // out.shape[-1] == info["reduction"], (name, stage)
            else:  # N, tokens, D
                assert out.shape[-1] == info["num_chs"], (name, stage)
                assert out.shape[1] >= (x.shape[-1] // info["reduction"]) ** 2, (name, stage)
        last = model.forward_intermediates(x, indices=1, intermediates_only=True)
        first = model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
        assert torch.equal(last[0], intermediates[-1]) and torch.equal(first[0], intermediates[0])

        _check_blocks(model, compiled[name].tier.steps)


def _check_blocks(model, steps):
    """``residual_blocks()`` agrees with ``step_keys()``, the tier's steps and ``param_kinds()``;
    the blocks that cannot be skipped are all there, without steps."""
    steps = steps or [[1.0] * d for d in model.stage_depths]
    blocks = {(s, j): m for s, j, m in model.residual_blocks()}
    fixed = model.fixed_blocks()
    assert fixed <= set(blocks) and not any(blocks[sj].step_names for sj in fixed)
    with_branch = {sj for sj, m in blocks.items() if m.step_names}
    assert with_branch == {(s, j) for s, stage in enumerate(steps) for j, v in enumerate(stage) if v != 0} - fixed
    assert sorted(model.step_keys().values()) == sorted(sj for sj in with_branch for _ in blocks[sj].step_names)
    params = dict(model.named_parameters())
    for key, sj in model.step_keys().items():
        assert params[key] is getattr(blocks[sj], key.rsplit(".", 1)[1])
        assert params[key].shape == ()
    kinds = model.param_kinds()
    assert {k for k, kind in kinds.items() if kind == "steps"} == set(model.step_keys())
    assert set(kinds) == set(model.state_dict())


def test_branch_parameters_are_what_removing_a_block_removes(case):
    full = case.full
    removed = sum(
        p.numel()
        for s, j, m in full.residual_blocks()
        if case.steps[s][j] == 0
        for _, p in m.branch_parameters()
    )
    skip = case.compiled["skip"].build()
    assert count_params(full) - count_params(skip) == removed


def export_steps(fixed: set[tuple[int, int]], depths: list[int]) -> list[list[float]]:
    """The exported tier's blocks: in every stage the first removed (a projection shortcut
    stays) and the second kept, deeper ones removed, so that a deep family exports a graph as
    small as a shallow one's with every kind of block in it; blocks the model cannot skip
    (``fixed``) are kept."""
    return [[1.0 if j == min(1, d - 1) or (s, j) in fixed else 0.0 for j in range(d)] for s, d in enumerate(depths)]


@torch.no_grad()
def test_one_tier_exports_to_onnx_and_matches_pytorch(case, tmp_path):
    if case.name in NOT_EXPORTED:
        pytest.skip("same block types and stem as an exported model")
    steps = export_steps(case.full.fixed_blocks(), [len(s) for s in case.steps])
    spec = parse_spec({"model": case.name, "model_args": case.args, "tiers": [{"name": "shallow", "gamma_w": 0.5, "steps": steps}]})
    compiled = compile_spec(spec)
    state = compiled.init_global_state(case.full)
    manifest = export_tiers(ExportSource(compiled, state, "contract"), tmp_path, ExportOptions(latency_runs=1, threads=1))
    session = ort.InferenceSession(str(tmp_path / manifest.tier("shallow").file), providers=["CPUExecutionProvider"])
    expected = compiled["shallow"].load(state).eval()(case.x)
    (got,) = session.run(None, {session.get_inputs()[0].name: case.x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=1e-4, rtol=1e-4)

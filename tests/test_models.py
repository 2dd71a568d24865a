import subprocess
import sys
import warnings

import pytest
import timm
import torch
import torchvision

from nefl_zoo.models import (
    ModelArgsError,
    ModelInfo,
    UnknownModelError,
    create_model,
    is_model,
    list_models,
    load_pretrained,
    model_info,
    register_model,
    register_source,
)
from nefl_zoo.models import registry
from nefl_zoo.models.pretrained import PretrainedError
from nefl_zoo.models.registry import _MODELS

from .conftest import TINY_VIT


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def test_registry_lists_the_zoo():
    assert set(list_models()) >= {
        "resnet20", "resnet32", "resnet44", "resnet56", "resnet110",
        "resnet18", "resnet34", "wide_resnet101_2", "vit_b_16",
    }
    assert list_models("resnet1*") == ["resnet110", "resnet18"]
    with pytest.raises(UnknownModelError, match="unknown model 'resnet9'"):
        create_model("resnet9")


def test_registry_keeps_metadata_and_warns_on_a_duplicate_name():
    info = model_info("wide_resnet101_2")
    assert info.module == "nefl_zoo.models.resnet"
    assert info.summary == "Wide-ResNet-101-2 (bottleneck inner width x2), torchvision-compatible."
    original = _MODELS["resnet20"]  # restored after the test (conftest's _model_registry)
    with pytest.warns(UserWarning, match="model 'resnet20' from tests.test_models replaces the one from nefl_zoo.models.resnet"):
        @register_model
        def resnet20(**kwargs):
            """Another resnet20."""
            return original.fn(**kwargs)
    assert model_info("resnet20").summary == "Another resnet20."


def test_register_model_with_declared_arguments_checks_them_and_keeps_the_first_doc_line():
    from nefl_zoo.models.args import ModelArgs

    @register_model(args=ModelArgs)  # the base arguments only: no img_size, which resnet20 takes
    def tiny_checked_resnet(**kwargs):
        """A checked resnet20.

        Its second paragraph is not the summary."""
        return create_model("resnet20", **kwargs)

    assert tiny_checked_resnet.__name__ == "tiny_checked_resnet"  # the decorator returns the function
    assert model_info("tiny_checked_resnet") == ModelInfo("tiny_checked_resnet", tiny_checked_resnet, __name__,
                                                          "A checked resnet20.", ModelArgs)
    assert create_model("tiny_checked_resnet", num_classes=3).num_classes == 3
    with pytest.raises(ModelArgsError, match=r"^img_size: unknown argument \(this model takes num_classes, in_chans, "
                                             r"gamma_w, channel_multiple, steps\)$"):
        create_model("tiny_checked_resnet", img_size=8)


def test_the_default_channel_multiple_is_the_declared_one_and_1_without_declared_arguments():
    @register_model
    def undeclared_resnet(**kwargs):
        return create_model("resnet20", **kwargs)

    assert [registry.default_channel_multiple(m) for m in ("mobilenet_v2", "resnet20", "undeclared_resnet")] == [8, 1, 1]


def test_a_prefix_is_resolved_by_the_source_a_higher_layer_registers(monkeypatch):
    """The registry knows no source itself (``torchvision:`` and ``timm:`` are nest's): a
    registered resolver answers for its prefix, an unknown prefix is an unknown model."""
    monkeypatch.setattr(registry, "_SOURCES", dict(registry._SOURCES))

    def toy(name):
        if name != "toy:small":
            raise UnknownModelError(f"unknown model {name!r}: no such toy")
        return ModelInfo(name, lambda **kwargs: create_model("resnet20", **kwargs), __name__, "A toy.")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same resolver again: no warning
        register_source("toy", toy)
        register_source("toy", toy)
    assert is_model("toy:small") and not is_model("toy:big") and not is_model("keras:resnet50")
    assert create_model("toy:small", num_classes=3).num_classes == 3
    with pytest.raises(UnknownModelError, match=r"^unknown model 'toy:big': no such toy$"):
        create_model("toy:big")
    with pytest.raises(UnknownModelError, match=r"^unknown model 'keras:resnet50'; available: .*resnet20.*, "
                                                r"timm:NAME, torchvision:NAME, toy:NAME$"):
        model_info("keras:resnet50")
    available = str(pytest.raises(UnknownModelError, model_info, "keras:resnet50").value).split("; available: ")[1]
    assert available.split(", ")[: len(list_models())] == list_models()
    with pytest.warns(UserWarning, match=r"^model source 'toy' from tests.test_models replaces the one from tests.test_models$"):
        register_source("toy", lambda name: toy(name))


def test_library_names_work_from_the_model_registry_alone_in_a_fresh_process():
    """``from nefl_zoo.models import create_model`` reaches torchvision:/timm: models without
    importing nefl_zoo.nesting first: the package root declares it, loaded on the first such name."""
    code = ("import sys; from nefl_zoo.models import is_model, model_info\n"
            "assert 'nefl_zoo.nesting' not in sys.modules\n"
            "assert is_model('timm:resnet18') and not is_model('torchvision:resnet_nope')\n"
            "assert model_info('torchvision:resnet18').module == 'nefl_zoo.nesting.net'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("name, depths", [("resnet20", (3, 3, 3)), ("resnet56", (9, 9, 9)), ("resnet110", (18, 18, 18)), ("resnet34", (3, 4, 6, 3))])
def test_stage_depths(name, depths):
    with torch.device("meta"):
        assert create_model(name).stage_depths == depths


def test_parameter_counts_match_torchvision_plus_one_step_per_block():
    with torch.device("meta"):
        for ours, theirs, blocks in [("resnet18", "resnet18", 8), ("resnet34", "resnet34", 16), ("wide_resnet101_2", "wide_resnet101_2", 33)]:
            ref = getattr(torchvision.models, theirs)(num_classes=1000)
            assert n_params(create_model(ours, stem="imagenet", num_classes=1000)) == n_params(ref) + blocks


def test_every_block_has_a_scalar_step_and_the_cifar_resnet20_count_is_exact():
    m = create_model("resnet20")
    params = dict(m.named_parameters())
    steps = {k: params[k] for k in m.step_keys()}
    assert len(steps) == 9 and all(v.shape == () and v.item() == 1.0 for v in steps.values())
    assert m.step_keys()["layer3.2.step"] == (2, 2)
    # stem 3x3x3x16 + bn, 9 blocks of two 3x3 convs + bn, two 1x1 projections + bn, fc 64->10
    convs = 3 * 16 * 9 + 3 * 2 * 16 * 16 * 9 + (16 * 32 * 9 + 32 * 32 * 9 + 2 * 2 * 32 * 32 * 9) + (32 * 64 * 9 + 64 * 64 * 9 + 2 * 2 * 64 * 64 * 9)
    bns = 2 * (16 + 3 * 2 * 16 + 3 * 2 * 32 + 3 * 2 * 64) + 2 * (32 + 64)
    proj = 16 * 32 + 32 * 64
    assert n_params(m) == convs + bns + proj + 64 * 10 + 10 + 9


def test_removed_blocks_are_absent_and_first_block_projection_stays():
    m = create_model("resnet20", steps=[[1, 0, 1], [0, 1, 1], [1, 1, 1]])
    keys = m.state_dict().keys()
    assert not any(k.startswith("layer1.1.") for k in keys)
    assert "layer2.0.downsample.0.weight" in keys and "layer2.0.conv1.weight" not in keys
    assert "layer2.0.step" not in keys
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("name, ref_fn, stem", [("resnet18", torchvision.models.resnet18, "imagenet"), ("resnet34", torchvision.models.resnet34, "imagenet")])
def test_torchvision_weights_give_the_same_logits(name, ref_fn, stem, tmp_path):
    ref = ref_fn(num_classes=10).eval()
    path = tmp_path / "w.pth"
    torch.save(ref.state_dict(), path)
    ours = create_model(name, stem=stem, num_classes=10, pretrained=str(path)).eval()
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


def test_wide_resnet_weights_give_the_same_logits():
    ref = torchvision.models.wide_resnet101_2(num_classes=10).eval()
    ours = create_model("wide_resnet101_2", num_classes=10).eval()
    skipped = load_pretrained(ours, ref.state_dict())  # a state dict: files are read as the ResNets' above are
    assert len(skipped) == 33 and set(skipped) == set(ours.step_keys())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


def test_timm_vit_weights_give_the_same_logits(tmp_path):
    ref = timm.models.VisionTransformer(**TINY_VIT).eval()
    path = tmp_path / "vit.pth"
    torch.save({"model": ref.state_dict()}, path)
    ours = create_model("vit_b_16", **TINY_VIT, pretrained=str(path)).eval()
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)
    features = ours.forward_features(x)  # normed tokens, as timm's
    torch.testing.assert_close(features, ref.forward_features(x), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.forward_head(features, pre_logits=True), ref.forward_head(ref.forward_features(x), pre_logits=True), atol=1e-5, rtol=0)


def test_depthfl_exits_read_the_stages_one_by_one():
    """``forward_intermediates`` of a depth-1 slim ResNet is its stem then its first stage."""
    m = create_model("resnet20", steps=[[1, 1, 1], [0, 0, 0], [0, 0, 0]]).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        (out,) = m.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
        assert torch.equal(out, m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x))))))
    assert [info["num_chs"] for info in m.feature_info] == [16, 32, 64]
    with torch.device("meta"):
        shapes = [f.shape for f in create_model("resnet18").forward_intermediates(torch.empty(2, 3, 32, 32), intermediates_only=True)]
    assert shapes == [(2, 64, 16, 16), (2, 128, 8, 8), (2, 256, 4, 4), (2, 512, 2, 2)]


def test_imagenet_head_is_left_when_classes_differ():
    ref = torchvision.models.resnet18(num_classes=1000)
    ours = create_model("resnet18", stem="imagenet", num_classes=10)
    skipped = load_pretrained(ours, ref.state_dict())
    assert set(skipped) >= {"fc.weight", "fc.bias"}
    torch.testing.assert_close(ours.layer4[1].conv2.weight, ref.layer4[1].conv2.weight)


def test_bad_pretrained_inputs(tmp_path):
    m = create_model("resnet20")
    with pytest.raises(PretrainedError, match="no such weights file"):
        load_pretrained(m, tmp_path / "missing.pth")
    with pytest.raises(PretrainedError, match="lack 'conv1.weight'"):
        load_pretrained(m, {k: v for k, v in m.state_dict().items() if k != "conv1.weight"})
    wrong = create_model("resnet20", gamma_w=0.25).state_dict()
    with pytest.raises(PretrainedError, match=r"conv1.weight: pretrained shape \(8, 3, 3, 3\)"):
        load_pretrained(m, wrong)


@pytest.mark.parametrize(
    "kwargs, field, message",
    [
        ({"stem": "cifar"}, "stem", "unknown argument (this model takes num_classes, in_chans, gamma_w, channel_multiple, steps, img_size)"),
        ({"num_classes": 0}, "num_classes", "Input should be greater than or equal to 1"),
        ({"gamma_w": 1.5}, "gamma_w", "Input should be less than or equal to 1"),
    ],
)
def test_bad_model_arguments_name_the_argument_and_what_it_takes(kwargs, field, message):
    with pytest.raises(ModelArgsError) as refused:
        create_model("resnet20", **kwargs)
    assert (refused.value.field, refused.value.message, str(refused.value)) == (field, message, f"{field}: {message}")


def test_a_model_arguments_error_without_a_field_is_its_message():
    assert str(ModelArgsError("", "the arguments contradict each other")) == "the arguments contradict each other"


def test_the_package_root_exports_its_names_lazily_and_nest_stays_the_function():
    """``nefl_zoo.nest`` is the function, also once the subpackage ``nefl_zoo.nesting`` is
    imported: the names differ, so the package root is a plain module (no module class of its
    own)."""
    import types

    import nefl_zoo
    import nefl_zoo.nesting.plan  # noqa: F401 - sets nefl_zoo.nesting, never nefl_zoo.nest
    import nefl_zoo.slim
    import nefl_zoo.spec

    assert nefl_zoo.__all__ == ["NestError", "SpecError", "SubmodelSpec", "TierSpec", "auto_tier", "build_submodel",
                                "compile_spec", "create_model", "extract", "list_models", "load_pretrained",
                                "load_spec", "nest", "parse_spec", "register_model", "scatter_"]
    assert nefl_zoo.create_model is create_model and nefl_zoo.compile_spec is nefl_zoo.slim.compile_spec
    assert nefl_zoo.SpecError is nefl_zoo.spec.SpecError
    from nefl_zoo.nesting import NestError, nest

    assert nefl_zoo.nest is nest and callable(nefl_zoo.nest) and nefl_zoo.nesting is sys.modules["nefl_zoo.nesting"]
    assert nefl_zoo.NestError is NestError is nefl_zoo.models.NestError
    assert type(nefl_zoo) is types.ModuleType
    with pytest.raises(AttributeError, match=r"^module 'nefl_zoo' has no attribute 'nope'$"):
        nefl_zoo.nope  # noqa: B018


def test_declared_loaders_run_once_in_order_and_a_failing_one_stays_pending():
    from nefl_zoo import plugins

    ran, failures = [], [RuntimeError("not yet")]

    def flaky():
        if failures:
            raise failures.pop()
        ran.append("flaky")

    try:
        plugins.declare("test topic", lambda: ran.append("first"))
        plugins.declare("test topic", flaky)
        plugins.declare("test topic", lambda: ran.append("last"))
        with pytest.raises(RuntimeError, match="not yet"):
            plugins.load("test topic")
        assert ran == ["first"]
        plugins.load("test topic")
        plugins.load("test topic")
        plugins.load("another topic")  # nothing declared: nothing to do
        assert ran == ["first", "flaky", "last"]
    finally:
        plugins._PENDING.pop("test topic", None)


def test_the_vit_defaults_are_vit_b_16():
    from nefl_zoo.models.vit import VisionTransformer

    with torch.device("meta"):
        vit = VisionTransformer()
    assert len(vit.blocks) == 12 and vit.blocks[0].attn.num_heads == 12 and vit.num_features == 768
    assert vit.default_cfg["input_size"] == (3, 224, 224) and vit.head.out_features == 1000


def test_a_vit_narrowed_by_heads_keeps_whole_heads_rounded_to_the_multiple_and_slices_q_k_v_apart():
    from nefl_zoo.models.vit import VisionTransformer

    args = dict(img_size=16, patch_size=8, embed_dim=64, depth=1, num_heads=8, num_classes=3, width="heads")
    full = VisionTransformer(**args)
    slim = VisionTransformer(**args, gamma_w=0.3, channel_multiple=4)  # 8 * sqrt(0.3) = 4.4 heads: 4, a multiple of 4
    assert slim.blocks[0].attn.num_heads == 4 and VisionTransformer(**args, gamma_w=0.3).blocks[0].attn.num_heads == 5
    assert slim.blocks[0].attn.head_dim == 8 and slim.num_features == 64  # whole heads, the whole embedding
    key = "blocks.0.attn.qkv.weight"
    rows = slim.slice_index(key, slim.state_dict()[key].shape, full.state_dict()[key].shape)[0]
    expected = torch.cat([torch.arange(0, 32), torch.arange(64, 96), torch.arange(128, 160)])  # the first 4 heads of q, k, v
    assert rows.dtype == torch.int64 and torch.equal(rows, expected)


def test_a_resnets_default_input_is_224_with_the_imagenet_stem_and_32_with_the_cifar_one():
    with torch.device("meta"):
        sizes = [create_model(name, **args).default_cfg["input_size"]
                 for name, args in [("resnet18", {"stem": "imagenet"}), ("resnet18", {}), ("resnet20", {"in_chans": 1}),
                                    ("resnet18", {"stem": "imagenet", "img_size": 64})]]
    assert sizes == [(3, 224, 224), (3, 32, 32), (1, 32, 32), (3, 64, 64)]

import pytest
import torch

from nefl_zoo.models import create_model
from nefl_zoo.slim import build_submodel, compile_spec, extract, scatter_, split_tier_key
from nefl_zoo.spec import parse_spec


def test_full_tier_equals_the_global_model_bitwise(resnet20_spec):
    compiled = compile_spec(resnet20_spec)
    full = compiled.create_global_model().eval()
    state = compiled.init_global_state(full)
    sub = compiled["full"].load(state).eval()
    x = torch.randn(4, 3, 32, 32)
    assert torch.equal(sub(x), full(x))


def test_full_vit_tier_equals_the_global_model_bitwise(vit_spec):
    compiled = compile_spec(vit_spec)
    full = compiled.create_global_model().eval()
    sub = compiled["full"].load(compiled.init_global_state(full)).eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(sub(x), full(x))


def test_skipping_equals_masking_the_global_model(resnet20_spec):
    """A physically removed block computes what the paper's masked (step 0) block computes."""
    steps = [[1, 0, 1], [0, 1, 1], [1, 1, 0]]
    spec = parse_spec({"model": "resnet20", "tiers": [{"name": "d", "steps": steps}, {"name": "full"}]})
    compiled = compile_spec(spec)
    full = compiled.create_global_model().eval()
    slim = compiled["d"].load(compiled.init_global_state(full)).eval()
    with torch.no_grad():
        for s, b, block in full.residual_blocks():
            block.step.fill_(steps[s][b])
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(slim(x), full(x), atol=1e-6, rtol=0)
    assert sum(p.numel() for p in slim.parameters()) < sum(p.numel() for p in full.parameters())


def test_extract_scatter_round_trip(resnet20_spec):
    compiled = compile_spec(resnet20_spec)
    state = compiled.init_global_state()
    before = {k: v.clone() for k, v in state.items()}
    for name in compiled.tiers:
        sub = extract(state, resnet20_spec, name)
        scatter_(state, resnet20_spec, name, sub)
        assert all(torch.equal(state[k], before[k]) for k in state)
    # new values written through one tier come back exactly, and nothing else moves
    small = compiled["small"]
    new = {k: torch.randn(v.shape) if v.is_floating_point() else v + 1 for k, v in small.extract(state).items()}
    small.scatter_(state, new)
    back = small.extract(state)
    assert all(torch.equal(back[k], new[k]) for k in new)
    assert torch.equal(state["fc.weight"][:, 32:], before["fc.weight"][:, 32:])
    assert torch.equal(state["layer1.0.bn1.weight@medium"], before["layer1.0.bn1.weight@medium"])


def test_slice_map_counts_and_bounds(resnet20_spec, vit_spec):
    for spec in (resnet20_spec, vit_spec):
        compiled = compile_spec(spec)
        shapes = compiled.global_shapes()
        for ct in compiled.tiers.values():
            model = ct.build()
            ct.slice_map.check(shapes)
            params = dict(model.named_parameters())
            assert sum(p.numel() for p in params.values()) == sum(ct.slice_map[k].numel for k in params)
            assert sum(v.numel() for v in model.state_dict().values()) == ct.slice_map.numel()
            assert set(ct.slice_map) == set(model.state_dict())


def test_slim_widths_are_ceil_of_sqrt_gamma(resnet20_spec):
    small = build_submodel(resnet20_spec, "small")  # gamma_w 0.25 -> half the channels
    assert small.conv1.weight.shape == (8, 3, 3, 3)  # stem: outputs only
    assert small.layer3[0].downsample[0].weight.shape == (32, 16, 1, 1)
    assert small.fc.weight.shape == (10, 32)  # classifier: inputs only
    m = create_model("resnet110", gamma_w=0.46)  # ceil(16 * 0.678) = 11
    assert m.conv1.out_channels == 11 and m.fc.in_features == 44


def test_narrower_width_slices_are_prefixes_of_wider_ones(resnet20_spec, vit_spec):
    for spec, narrow, wide in [(resnet20_spec, "small", "medium"), (resnet20_spec, "medium", "full"), (vit_spec, "half", "full")]:
        compiled = compile_spec(spec)
        shapes = compiled.global_shapes()
        a, b = compiled[narrow].slice_map, compiled[wide].slice_map
        for key, ea in a.items():
            if not ea.consistent or key not in b:
                continue
            mask_a = torch.zeros(shapes[ea.global_key], dtype=torch.bool)
            mask_b = torch.zeros_like(mask_a)
            ea.put_(mask_a, torch.ones(ea.shape, dtype=torch.bool))
            b[key].put_(mask_b, torch.ones(b[key].shape, dtype=torch.bool))
            assert torch.all(mask_b[mask_a]), key  # narrow region lies inside the wide one
            assert torch.equal(ea.gather(mask_b), torch.ones(ea.shape, dtype=torch.bool))


def test_inconsistent_tensors_are_per_tier(resnet20_spec):
    compiled = compile_spec(resnet20_spec)
    state = compiled.init_global_state()
    assert state["layer3.0.step@small"].item() == 2.0  # D_O-style initial step from the spec
    assert state["layer3.0.step@full"].item() == 1.0
    assert state["layer1.0.bn1.weight@small"].shape == (8,)
    assert "layer1.0.bn1.weight" not in state and "layer1.0.conv1.weight" in state
    tiers = {split_tier_key(k)[1] for k in state} - {None}
    assert tiers == {"small", "medium", "full"}
    assert compiled["small"].slice_map["layer1.0.bn1.running_var"].global_key == "layer1.0.bn1.running_var@small"


def test_vit_heads_stay_aligned_and_qkv_are_sliced_separately(vit_spec):
    compiled = compile_spec(vit_spec)
    state = compiled.init_global_state()
    sub = compiled["half"].extract(state)
    full_qkv = state["blocks.0.attn.qkv.weight"]  # [3 * 4 heads * 16, 64]
    slim_qkv = sub["blocks.0.attn.qkv.weight"]  # [3 * 4 heads * 12, 46]
    assert slim_qkv.shape == (3 * 4 * 12, 46)
    for part in range(3):
        for head in range(4):
            rows = slim_qkv[(part * 4 + head) * 12:(part * 4 + head + 1) * 12]
            start = part * 64 + head * 16
            assert torch.equal(rows, full_qkv[start:start + 12, :46])
    proj = sub["blocks.0.attn.proj.weight"]
    assert torch.equal(proj[:, 12:24], state["blocks.0.attn.proj.weight"][:46, 16:28])
    assert "blocks.0.norm1.weight" in state  # LayerNorm shared, steps per tier
    assert compiled["half"].load(state)(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_frozen_steps_when_not_learnable():
    spec = parse_spec({"model": "resnet20", "tiers": [{"name": "nl", "learnable_steps": False}, {"name": "l"}]})
    compiled = compile_spec(spec)
    frozen, learn = compiled["nl"].build(), compiled["l"].build()
    assert [p.requires_grad for k, p in frozen.named_parameters() if k in frozen.step_keys()] == [False] * 9
    assert [p.requires_grad for k, p in learn.named_parameters() if k in learn.step_keys()] == [True] * 9
    assert all(p.requires_grad for k, p in frozen.named_parameters() if k not in frozen.step_keys())


def test_pretrained_norm_statistics_reach_every_tier(resnet20_spec):
    compiled = compile_spec(resnet20_spec)
    full = compiled.create_global_model()
    with torch.no_grad():
        full.bn1.running_mean.copy_(torch.arange(16.0))
    state = compiled.init_global_state(full)
    assert torch.equal(state["bn1.running_mean@small"], torch.arange(8.0))
    assert torch.equal(state["bn1.running_mean@full"], torch.arange(16.0))


def test_compiled_spec_exposes_the_full_models_contract(resnet20_spec, vit_spec):
    resnet, vit = compile_spec(resnet20_spec), compile_spec(vit_spec)
    assert (resnet.num_classes, resnet.num_features, resnet.classifier) == (10, 64, "fc")
    assert [(i["module"], i["num_chs"], i["reduction"]) for i in resnet.feature_info] == [("layer1", 16, 1), ("layer2", 32, 2), ("layer3", 64, 4)]
    assert resnet.step_keys["layer2.0.step"] == (1, 0)
    assert (vit.num_classes, vit.num_features, vit.classifier) == (10, 64, "head")
    assert vit.feature_info == [{"module": "blocks", "num_chs": 64, "reduction": 8}]
    assert vit.step_keys == {"blocks.0.step_attn": (0, 0), "blocks.0.step_mlp": (0, 0), "blocks.1.step_attn": (0, 1), "blocks.1.step_mlp": (0, 1)}


def test_unknown_tier_is_a_clear_error(resnet20_spec):
    with pytest.raises(KeyError, match="no tier 'huge'; tiers: small, medium, full"):
        compile_spec(resnet20_spec)["huge"]


# ---- slice maps by hand: every bound of SliceEntry.fits, mixed index regions (issue 13) ----
from nefl_zoo.slim import SliceEntry, SliceMap, tier_key  # noqa: E402


def entry(index, shape, key="w", kind="weight"):
    return SliceEntry(key, index, shape, kind, True)


@pytest.mark.parametrize(
    "index, shape, fits",
    [
        ((slice(0, 4), slice(0, 3)), (4, 3), True),  # the whole tensor
        ((slice(1, 4), slice(2, 3)), (3, 1), True),  # an inner region touching the far edges
        ((slice(0, 5), slice(0, 3)), (5, 3), False),  # stop past the end of dimension 0
        ((slice(0, 4), slice(1, 4)), (4, 3), False),  # stop past the end of dimension 1
        ((slice(-1, 3), slice(0, 3)), (4, 3), False),  # negative start
        ((slice(0, 3), slice(0, 3)), (2, 3), False),  # region longer than the entry's shape
        ((slice(0, 2), slice(0, 3)), (3, 3), False),  # region shorter than the entry's shape
        ((torch.tensor([0, 3]), slice(0, 3)), (2, 3), True),
        ((torch.tensor([0, 4]), slice(0, 3)), (2, 3), False),  # index past the end
        ((torch.tensor([-1, 2]), slice(0, 3)), (2, 3), False),  # negative index
        ((torch.tensor([0, 1, 2]), slice(0, 3)), (2, 3), False),  # more indices than the shape
        ((slice(0, 4),), (4,), False),  # fewer dimensions than the tensor
        ((slice(0, 4), slice(0, 3), slice(0, 1)), (4, 3, 1), False),  # more dimensions
        ((), (4, 3), True),  # () = the whole tensor, of the same shape
        ((), (3, 4), False),
        ((), (4,), False),
    ],
)
def test_slice_entry_fits_checks_every_bound(index, shape, fits):
    assert entry(index, shape).fits(torch.Size([4, 3])) is fits
    slice_map = SliceMap({"sub": entry(index, shape)})
    if fits:
        slice_map.check({"w": torch.Size([4, 3])})
    else:
        with pytest.raises(ValueError, match=r"^sub: region .* does not fit \(4, 3\)$"):
            slice_map.check({"w": torch.Size([4, 3])})


def test_slice_map_check_names_a_missing_global_key():
    with pytest.raises(ValueError, match=r"^sub: global key 'w' does not exist$"):
        SliceMap({"sub": entry((), (4, 3))}).check({"v": torch.Size([4, 3])})


def test_slice_map_by_hand_gather_scatter_add_and_counts():
    """Regions written out element by element: a prefix slice, and an index tensor crossed with
    a slice (the ViT-head case), on a 4x5 tensor."""
    glob = {"w": torch.arange(20.0).view(4, 5), "b@t": torch.arange(3, dtype=torch.long)}
    slice_map = SliceMap({
        "prefix": SliceEntry("w", (slice(1, 3), slice(0, 2)), (2, 2), "weight", True),
        "heads": SliceEntry("w", (torch.tensor([0, 3]), slice(2, 5)), (2, 3), "norm", True),
        "steps": SliceEntry("b@t", (), (3,), "steps", False),
    })
    assert len(slice_map) == 3 and list(slice_map) == ["prefix", "heads", "steps"]
    assert [slice_map[k].numel for k in slice_map] == [4, 6, 3]
    assert slice_map.numel() == 13 and slice_map.numel(("weight", "steps")) == 7 and slice_map.numel(("norm",)) == 6
    sub = slice_map.extract(glob)
    assert sub["prefix"].tolist() == [[5.0, 6.0], [10.0, 11.0]]
    assert sub["heads"].tolist() == [[2.0, 3.0, 4.0], [17.0, 18.0, 19.0]]
    assert sub["steps"].tolist() == [0, 1, 2]
    sub["prefix"].fill_(-1.0)  # extract returns copies: the global state is untouched
    assert glob["w"][1, 0] == 5.0
    new = {"prefix": torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64),
           "heads": torch.full((2, 3), 9.0), "steps": torch.tensor([7, 8, 9])}
    slice_map.scatter_(glob, new)
    assert glob["w"].dtype == torch.float32 and glob["b@t"].tolist() == [7, 8, 9]
    assert glob["w"].tolist() == [
        [0.0, 1.0, 9.0, 9.0, 9.0],
        [1.0, 2.0, 7.0, 8.0, 9.0],
        [3.0, 4.0, 12.0, 13.0, 14.0],
        [15.0, 16.0, 9.0, 9.0, 9.0],
    ]
    counts = torch.ones(4, 5)  # add_ adds to what is there
    slice_map["heads"].add_(counts, 2.0)
    slice_map["prefix"].add_(counts, torch.ones(2, 2))
    slice_map["prefix"].add_(counts, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert counts.tolist() == [[1, 1, 3, 3, 3], [3, 4, 1, 1, 1], [5, 6, 1, 1, 1], [1, 1, 3, 3, 3]]
    assert tier_key("layer1.0.step", "g0.5") == "layer1.0.step@g0.5"
    assert split_tier_key("layer1.0.step@g0.5") == ("layer1.0.step", "g0.5")
    assert split_tier_key("fc.weight") == ("fc.weight", None)

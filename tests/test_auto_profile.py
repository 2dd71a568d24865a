import json

import pytest
import torch
from torch import nn

from nefl_zoo.auto import auto_tier
from nefl_zoo.models import create_model
from nefl_zoo.profile import count_macs, count_params, profile_tiers, to_csv, to_json, to_markdown
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import SubmodelSpec


@pytest.mark.parametrize("model, gamma, mode", [("resnet110", 0.2, "balanced"), ("resnet110", 0.4, "depth"), ("resnet56", 0.6, "balanced"), ("resnet18", 0.2, "width"), ("resnet34", 0.5, "balanced")])
def test_auto_tier_reaches_the_target_within_one_percent(model, gamma, mode):
    found = auto_tier(model, gamma, mode)
    assert found.within_tolerance and not found.note
    slim = create_model(model, gamma_w=found.tier.gamma_w, steps=found.tier.steps)
    with torch.device("meta"):
        full = create_model(model)
    measured = count_params(slim) / count_params(full)
    assert measured == pytest.approx(found.params_ratio, abs=1e-12)
    assert abs(measured - gamma) <= 0.01 * gamma


def test_auto_tier_modes_differ_as_named():
    width = auto_tier("resnet56", 0.5, "width").tier
    depth = auto_tier("resnet56", 0.5, "depth").tier
    balanced = auto_tier("resnet56", 0.25, "balanced").tier
    assert width.steps is None and width.gamma_w < 1
    assert depth.gamma_w == 1 and any(0 in stage for stage in depth.steps)
    assert balanced.gamma_w == 0.5 and any(0 in stage for stage in balanced.steps)


def test_auto_tier_says_when_it_cannot():
    found = auto_tier("resnet18", 0.2, "depth")  # ResNet18 has too few blocks for 0.2 by depth alone
    assert not found.within_tolerance
    assert "cannot reach parameter ratio 0.2 within 1%" in found.note
    with pytest.raises(ValueError, match=r"gamma must be in \(0, 1\]"):
        auto_tier("resnet20", 1.5)


def expected_macs(model: nn.Module, input_size) -> int:
    """Independent count with forward hooks: conv/linear MACs, BN (2 per element, eval, affine),
    adaptive average pool (1 per input element), residual add and step multiply (1 per element)."""
    total = 0

    def hook(module, inputs, output):
        nonlocal total
        if isinstance(module, nn.Conv2d):
            total += output.numel() * module.in_channels * module.kernel_size[0] * module.kernel_size[1]
        elif isinstance(module, nn.Linear):
            total += output.numel() * module.in_features
        elif isinstance(module, nn.BatchNorm2d):
            total += 2 * output.numel()
        elif isinstance(module, nn.AdaptiveAvgPool2d):
            total += inputs[0].numel()
        elif getattr(module, "step_names", ()):  # a residual block with its branch
            total += 2 * output.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    with torch.no_grad():
        model.eval()(torch.zeros(1, *input_size))
    for h in handles:
        h.remove()
    return total


def test_macs_count_convolutions_norms_and_the_step_multiply_and_add():
    for m in (create_model("resnet20"), create_model("resnet20", gamma_w=0.25, steps=[[1, 0, 1], [0, 1, 1], [1, 1, 0]])):
        assert count_macs(m, (3, 32, 32)) == expected_macs(m, (3, 32, 32))


def test_profile_tiers_and_formats(resnet20_spec):
    profiles = profile_tiers(compile_spec(resnet20_spec), latency_batch=2)
    full = profiles[-1]
    assert (full.params_ratio, full.macs_ratio, full.blocks_per_stage) == (1.0, 1.0, [3, 3, 3])
    small = profiles[0]
    assert small.blocks_per_stage == [2, 2, 2]  # layer2.0 keeps only its projection shortcut
    assert small.params == count_params(compile_spec(resnet20_spec)["small"].build())
    assert 0 < small.macs_ratio < profiles[1].macs_ratio < 1
    assert all(p.latency_ms > 0 for p in profiles)
    md = to_markdown(profiles)
    assert md.splitlines()[0].startswith("| tier | gamma | gamma_w | params |") and "fvcore" in md
    assert [line.startswith("| ") and line.endswith(" |") for line in md.splitlines()[2:5]] == [True] * 3
    assert md.splitlines()[2].startswith("| small |")
    rows = to_csv(profiles).splitlines()
    assert rows[0].startswith("name,gamma,gamma_w,params,params_ratio,macs") and len(rows) == 4
    assert ",2/2/2," in rows[1] and ",3/3/3," in rows[3]
    assert to_json(profiles).startswith('{\n  "macs_note": ')  # indented for people reading it
    data = json.loads(to_json(profiles))
    assert [t["name"] for t in data["tiers"]] == ["small", "medium", "full"]


def test_vit_macs_count_attention_matmuls(vit_spec):
    profiles = profile_tiers(compile_spec(vit_spec))
    assert profiles[-1].macs_ratio == 1.0
    full = compile_spec(vit_spec).create_global_model()
    tokens, dim, hidden, depth = 17, 64, 256, 2
    linear = tokens * dim * (3 * dim + dim + 2 * hidden)
    attention = 2 * tokens * tokens * dim  # q @ k^T and attn @ v over all heads
    core = 16 * dim * 3 * 8 * 8 + depth * (linear + attention) + dim * 10
    # the rest is norms, the step multiplies and residual adds: a few percent
    assert core < count_macs(full, (3, 32, 32)) < 1.1 * core


def test_width_ratio_is_a_parameter_ratio_against_the_full_model():
    spec = SubmodelSpec(model="resnet20", tiers=[{"name": "only", "gamma_w": 0.5}])
    (p,) = profile_tiers(compile_spec(spec))
    assert 0.5 <= p.params_ratio < 0.55  # against the full model, not the largest tier


# ---- the MACs cache (issue 11): fvcore's figures, keyed by everything that changes them ----
from nefl_zoo import profile as prof  # noqa: E402
from nefl_zoo.spec import load_spec, shipped_specs_dir  # noqa: E402



def _no_fvcore(*args):
    raise AssertionError("fvcore traced although the cache holds the figure")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(prof.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "macs"


@pytest.mark.parametrize("name", ["resnet56/nefl-wd-aligned", "vit"])
def test_cached_macs_are_fvcores(name, cache, monkeypatch, vit_spec):
    """A cold profile counts with fvcore (checked against the independent hook count for
    ResNets, by hand for the ViT above); a warm one returns the same figures without tracing."""
    spec = vit_spec if name == "vit" else load_spec(shipped_specs_dir() / f"{name}.yaml")
    if len(spec.tiers) > 3:  # g0.2, g0.4 and g1: three fvcore traces keep it quick
        spec = spec.model_copy(update={"tiers": spec.tiers[:2] + spec.tiers[-1:]})
    compiled = compile_spec(spec)
    cold = profile_tiers(compiled)
    if spec.model.startswith("resnet"):
        for ct, p in zip(compiled.tiers.values(), cold):
            assert p.macs == expected_macs(ct.build(), compiled.input_size), ct.name
    assert len(list(cache.iterdir())) == len(compiled.tiers)  # the full tier is the full model
    monkeypatch.setattr(prof, "count_macs", _no_fvcore)
    assert [p.macs for p in profile_tiers(compiled)] == [p.macs for p in cold]


def test_macs_cache_key_changes_with_the_signature_and_never_crosses_models(cache, monkeypatch):
    tier = {"name": "t", "gamma_w": 0.5, "steps": [[1, 1, 0], [1, 1, 1], [1, 1, 1]]}
    base = {"model": "resnet20", "tiers": [tier]}
    variants = {
        "base": base,
        "model": {"model": "resnet32", "tiers": [{"name": "t", "gamma_w": 0.5}]},
        "model_args": base | {"model_args": {"num_classes": 100}},
        "gamma_w": base | {"tiers": [tier | {"gamma_w": 0.6}]},
        "channel_multiple": base | {"channel_multiple": 8},
        "kept": base | {"tiers": [tier | {"steps": [[1, 1, 1], [1, 1, 1], [1, 1, 0]]}]},
    }
    seen = {}
    for label, spec in variants.items():
        spec = SubmodelSpec.model_validate(spec)
        ct = compile_spec(spec)["t"]
        sig = prof.macs_signature(spec, ct.tier, (3, 32, 32))
        macs = prof.tier_macs(sig, ct.build)
        assert macs == expected_macs(ct.build(), (3, 32, 32)), label
        seen[label] = macs
    assert len(list(cache.iterdir())) == len(variants)  # one entry per signature
    assert len(set(seen.values())) == len(variants)  # ... each with its own figure
    # a larger input or another counter version is another entry
    base = SubmodelSpec.model_validate(base)
    ct = compile_spec(base)["t"]
    sig = prof.macs_signature(base, ct.tier, (3, 32, 32))
    bigger = prof.tier_macs(prof.macs_signature(base, ct.tier, (3, 64, 64)), ct.build)
    assert bigger > seen["base"] and len(list(cache.iterdir())) == len(variants) + 1
    monkeypatch.setattr(prof, "_code_digest", lambda: "edited models")
    edited = prof.macs_signature(base, ct.tier, (3, 32, 32))
    assert edited != sig
    monkeypatch.setattr(prof, "MACS_COUNTER_VERSION", prof.MACS_COUNTER_VERSION + 1)
    assert prof.macs_signature(base, ct.tier, (3, 32, 32)) not in (sig, edited)


def test_a_corrupt_or_foreign_cache_entry_is_recounted(cache, monkeypatch):
    spec = SubmodelSpec(model="resnet20", tiers=[{"name": "t", "gamma_w": 0.25}])
    ct = compile_spec(spec)["t"]
    sig = prof.macs_signature(spec, ct.tier, (3, 32, 32))
    true = prof.tier_macs(sig, ct.build)
    (entry,) = cache.iterdir()
    other = prof.macs_signature(spec, None, (3, 32, 32))
    for text in ("{not json", '{"macs": 5}', json.dumps({"signature": other, "macs": 5}),
                 json.dumps({"signature": json.loads(entry.read_text())["signature"], "macs": "5"})):
        entry.write_text(text)
        assert prof.tier_macs(sig, ct.build) == true
        assert json.loads(entry.read_text())["macs"] == true  # rewritten
    monkeypatch.setattr(prof, "count_macs", _no_fvcore)
    assert prof.tier_macs(sig, ct.build) == true  # and trusted again once whole


def test_an_unwritable_cache_only_costs_the_speed_up(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(prof.CACHE_ENV, str(blocker))  # a file where the folder should be
    spec = SubmodelSpec(model="resnet20", tiers=[{"name": "t"}])
    ct = compile_spec(spec)["t"]
    assert prof.tier_macs(prof.macs_signature(spec, ct.tier, (3, 32, 32)), ct.build) == expected_macs(ct.build(), (3, 32, 32))


def test_cache_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(prof.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert prof.cache_dir() == tmp_path / "nefl-zoo"
    monkeypatch.setenv(prof.CACHE_ENV, str(tmp_path / "mine"))
    assert prof.cache_dir() == tmp_path / "mine"


def test_the_batch_check_counts_the_largest_working_set_and_names_it(monkeypatch):
    from torch import nn

    from nefl_zoo import memory
    from nefl_zoo.profile import check_batch_fits, peak_activation_bytes

    class PureTensorOps(nn.Module):  # no module is called: the input alone is the working set
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(1, 1)

        def forward(self, x):
            return x * 2

    assert peak_activation_bytes(PureTensorOps(), (3, 4, 4)) == 4 * 48
    conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1))
    assert peak_activation_bytes(conv, (1, 4, 4)) == 4 * (16 + 128)  # its input plus its 8 output channels
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 10 * 2**20)
    check_batch_fits(conv, (1, 4, 4), 4000)  # 4 x 576 bytes each: 9 MiB
    with pytest.raises(ValueError) as refused:
        check_batch_fits(conv, (1, 4, 4), 5000)
    assert str(refused.value) == ("batch 5000: needs about 11.0 MiB (0.00 MiB per input), more than the 10.0 MiB of "
                                  "memory available; use a batch of at most 4,551")


def test_depth_mode_keeps_the_stages_in_equal_proportion_within_tolerance():
    found = auto_tier("resnet110", 0.5, "depth")  # three stages of 18 blocks
    kept = [sum(1 for s in stage if s) for stage in found.tier.steps]
    assert kept == [10, 9, 9] and abs(found.params_ratio - 0.5) <= 0.01 * 0.5 and found.note == ""


def test_only_balanced_mode_refuses_a_gamma_whose_width_ratio_rounds_to_zero_and_notes_name_a_multiple_above_1():
    with pytest.raises(ValueError, match="too small for balanced mode"):
        auto_tier("resnet20", 0.00001)
    assert auto_tier("resnet20", 0.00001, "width").tier.gamma_w > 0
    note = auto_tier("resnet18", 0.2, "depth").note
    assert note.startswith("resnet18 cannot reach parameter ratio 0.2 within 1% in depth mode; closest is ")


def test_the_latency_search_keeps_the_largest_tier_within_the_budget_on_the_grid(monkeypatch):
    """Latency faked as thousands of parameters: the search must land on the largest tier whose
    latency is at most the budget, the budget itself included."""
    import nefl_zoo.export.onnx_file
    from nefl_zoo.auto import latency_tier

    def fake_ms(module, input_size, batch, threads, runs):
        return sum(p.numel() for p in module.parameters()) / 1000

    monkeypatch.setattr(nefl_zoo.export.onnx_file, "onnx_latency_ms", fake_ms)

    def ms_at(gamma):
        tier = auto_tier("resnet20", gamma).tier
        return fake_ms(compile_spec(SubmodelSpec(model="resnet20", tiers=[tier]))[tier.name].build(), None, 1, 1, 1)

    budget = ms_at(0.37)
    found = latency_tier("resnet20", budget)
    chosen = round(found.tier.gamma * 100)
    assert found.latency_ms == budget  # the budget itself fits
    assert ms_at((chosen + 1) / 100) > budget  # the next gamma on the grid does not

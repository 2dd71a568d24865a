"""Where clients compute, at the points a mistake stays silent: each precision's autocast dtype
and gradient scaling, CPU tensors handed back as they are, and a placement that ends with its
block even when the block fails (TESTING.md, "Semantic mistakes")."""

import pytest
import torch

from nefl_zoo.fl.training.device import Placement, placed, placement, to_cpu

CPU = torch.device("cpu")


@pytest.mark.parametrize("precision, dtype, scaled", [("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
                                                      ("fp16", torch.float16, True)], ids=["fp32", "bf16", "fp16"])
def test_each_precision_computes_in_its_dtype_and_only_fp16_scales_its_gradients(precision, dtype, scaled):
    """A matrix product inside the placement's autocast comes out in the precision's dtype (fp32:
    no autocast at all); fp16, whose gradients underflow, gets a gradient scaler, bf16 (float32's
    exponent range) and fp32 none. Broken by hand: bf16 and fp16 swapped in ``DTYPES``, or a
    scaler for every reduced precision, fails here."""
    where = Placement(CPU, precision)
    with where.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
        assert torch.is_autocast_enabled("cpu") == (precision != "fp32")
    assert isinstance(where.scaler(), torch.amp.GradScaler) == scaled and (where.scaler() is None) == (not scaled)


def test_cpu_tensors_are_handed_back_as_they_are():
    """``to_cpu`` of tensors already on the CPU returns those very tensors (a client's reply is
    not copied once more). Broken by hand: ``v.detach().cpu().clone()`` fails here."""
    state = {"w": torch.ones(3), "n": torch.tensor([2])}
    assert all(to_cpu(state)[k] is state[k] for k in state)


def test_a_placement_ends_with_its_block_even_when_the_block_fails():
    """Nested placements restore the outer one, and a block that raises leaves the default (CPU,
    fp32) behind, not its own placement. Broken by hand: ``_CURRENT.reset`` after ``yield``
    without ``try/finally`` fails here."""
    outer, inner = Placement(CPU, "bf16"), Placement(CPU, "fp16")
    with placed(outer):
        with pytest.raises(RuntimeError, match="client failed"):
            with placed(inner):
                assert placement() is inner
                raise RuntimeError("client failed")
        assert placement() is outer
    assert placement() == Placement() == Placement(CPU, "fp32")

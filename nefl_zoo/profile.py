"""Parameter, MAC and latency accounting per tier, with fvcore.

fvcore counts one multiply-add as one flop, so its totals are reported as MACs. Beyond
fvcore's own handles (convolution, linear/matmul, batch and layer norm) we register fvcore's
element-wise counter for ``add`` and ``mul`` so that the step-size multiply and the residual
add are counted, at one op per output element. fvcore counts global average pooling at one
op per input element; activations, max-pooling and softmax are not counted.
"""

from __future__ import annotations

import csv
import io
import json
import math
import warnings
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .memory import WORKING_SET_FACTOR, check_batch_memory
from .models import count_params
from .slim import CompiledSpec, CompiledTier
from .timing import median_ms

MACS_NOTE = (
    "MACs by fvcore (1 multiply-add = 1); step-size multiply and residual add counted at "
    "1 per element, global average pooling at 1 per input element; activations, max-pooling "
    "and softmax not counted."
)
ELEMENTWISE_OPS = ("aten::add", "aten::add_", "aten::mul", "aten::mul_")


@dataclass
class TierProfile:
    """Cost of one tier, absolute and as a ratio of the full model."""

    name: str
    gamma: float | None
    gamma_w: float
    params: int
    params_ratio: float
    macs: int
    macs_ratio: float
    blocks_per_stage: list[int]
    latency_ms: float | None = None
    latency_ratio: float | None = None


def _analysis(model: nn.Module, input_size: tuple[int, ...]):
    with warnings.catch_warnings():  # fvcore traces with torch.jit, which warns it is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        from fvcore.nn import FlopCountAnalysis
        from fvcore.nn.jit_handles import elementwise_flop_counter

    x = torch.zeros(1, *input_size)
    analysis = FlopCountAnalysis(model.eval(), x)
    per_output_element = elementwise_flop_counter(input_scale=0, output_scale=1)
    analysis.set_op_handle(**{op: per_output_element for op in ELEMENTWISE_OPS})
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    return analysis


def count_macs(model: nn.Module, input_size: tuple[int, ...]) -> int:
    """MACs of one forward pass of a single input of shape ``input_size`` (C, H, W)."""
    with torch.no_grad():
        return int(_analysis(model, input_size).total())


def macs_by_module(model: nn.Module, input_size: tuple[int, ...], depth: int = 2) -> dict[str, int]:
    """MACs per module, for modules at most ``depth`` levels deep (``""`` is the model)."""
    with torch.no_grad():
        counts = _analysis(model, input_size).by_module()
    return {k: int(v) for k, v in counts.items() if (k.count(".") + 1 if k else 0) <= depth}


def peak_activation_bytes(model: nn.Module, input_size: tuple[int, ...]) -> int:
    """Largest working set of one module (its input plus output tensors) on one input of shape
    ``input_size``: a lower bound of the memory a forward pass needs per sample."""
    peak = 0

    def hook(module, inputs, output) -> None:
        nonlocal peak
        tensors = [t for t in (*inputs, *(output if isinstance(output, (tuple, list)) else (output,)))
                   if isinstance(t, torch.Tensor)]
        peak = max(peak, sum(t.numel() * t.element_size() for t in tensors))

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, *input_size))
    finally:
        for handle in handles:
            handle.remove()
    return max(peak, 4 * math.prod(input_size))


def check_batch_fits(model: nn.Module, input_size: tuple[int, ...], batch: int) -> None:
    """``ValueError`` before any allocation when ``batch`` inputs cannot fit in memory
    (:func:`nefl_zoo.memory.check_batch_memory`, :data:`~nefl_zoo.memory.WORKING_SET_FACTOR`
    times :func:`peak_activation_bytes` per input)."""
    per_sample = WORKING_SET_FACTOR * peak_activation_bytes(model, input_size)
    check_batch_memory(batch, per_sample, what=f"{per_sample / 2**20:,.2f} MiB per input")


def measure_latency_ms(model: nn.Module, input_size: tuple[int, ...], batch: int, runs: int = 7) -> float:
    """Median CPU wall time of a forward pass of ``batch`` inputs, in milliseconds."""
    model.eval()
    x = torch.randn(batch, *input_size)
    with torch.inference_mode():
        return median_ms(lambda: model(x), runs)


def blocks_per_stage(ct: CompiledTier, depths: tuple[int, ...]) -> list[int]:
    """Residual branches kept per stage."""
    if ct.tier.steps is None:
        return list(depths)
    return [sum(1 for s in stage if s != 0) for stage in ct.tier.steps]


def profile_tiers(compiled: CompiledSpec, latency_batch: int | None = None) -> list[TierProfile]:
    """Parameters, MACs (and, with ``latency_batch``, median latency) of every tier; a
    ``latency_batch`` that cannot fit in memory is a ``ValueError`` before any work."""
    full = compiled.create_global_model()
    if latency_batch:
        check_batch_fits(full, compiled.input_size, latency_batch)
    full_params, full_macs = count_params(full), count_macs(full, compiled.input_size)
    full_latency = measure_latency_ms(full, compiled.input_size, latency_batch) if latency_batch else None
    depths = full.stage_depths
    out = []
    for ct in compiled.tiers.values():
        model = ct.build()
        params, macs = count_params(model), count_macs(model, compiled.input_size)
        prof = TierProfile(
            name=ct.name,
            gamma=ct.tier.gamma,
            gamma_w=ct.tier.gamma_w,
            params=params,
            params_ratio=params / full_params,
            macs=macs,
            macs_ratio=macs / full_macs,
            blocks_per_stage=blocks_per_stage(ct, depths),
        )
        if latency_batch:
            prof.latency_ms = measure_latency_ms(model, compiled.input_size, latency_batch)
            prof.latency_ratio = prof.latency_ms / full_latency
        out.append(prof)
    return out


COLUMNS = ["tier", "gamma", "gamma_w", "params", "params_ratio", "macs", "macs_ratio", "blocks"]


def table_rows(profiles: list[TierProfile]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows shared by the table, markdown and csv outputs."""
    header = list(COLUMNS)
    with_latency = any(p.latency_ms is not None for p in profiles)
    if with_latency:
        header += ["latency_ms", "latency_ratio"]
    rows = []
    for p in profiles:
        row = [
            p.name,
            "" if p.gamma is None else f"{p.gamma:g}",
            f"{p.gamma_w:g}",
            f"{p.params:,}",
            f"{p.params_ratio:.3f}",
            f"{p.macs / 1e6:,.2f}M",
            f"{p.macs_ratio:.3f}",
            "/".join(map(str, p.blocks_per_stage)),
        ]
        if with_latency:
            row += [f"{p.latency_ms:.2f}", f"{p.latency_ratio:.3f}"]
        rows.append(row)
    return header, rows


def to_markdown(profiles: list[TierProfile]) -> str:
    """A markdown table with the MACs footnote."""
    header, rows = table_rows(profiles)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + f"\n\n{MACS_NOTE}\n"


def to_csv(profiles: list[TierProfile]) -> str:
    """CSV with raw (unformatted) numbers."""
    buf = io.StringIO()
    fields = list(asdict(profiles[0]))
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for p in profiles:
        row = asdict(p)
        row["blocks_per_stage"] = "/".join(map(str, p.blocks_per_stage))
        writer.writerow(row)
    return buf.getvalue()


def to_json(profiles: list[TierProfile]) -> str:
    """JSON with raw numbers and the MACs note."""
    return json.dumps({"macs_note": MACS_NOTE, "tiers": [asdict(p) for p in profiles]}, indent=2)

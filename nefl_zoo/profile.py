"""Parameter, MAC and latency accounting per tier, with fvcore.

fvcore counts one multiply-add as one flop, so its totals are reported as MACs. Beyond
fvcore's own handles (convolution, linear/matmul, batch and layer norm) we register fvcore's
element-wise counter for ``add`` and ``mul`` so that the step-size multiply and the residual
add are counted, at one op per output element. fvcore counts global average pooling at one
op per input element; activations, max-pooling and softmax are not counted.

fvcore traces the model with the JIT, which dominates ``nefl-zoo build`` and ``profile``;
:func:`tier_macs` keeps each count in the user's cache directory (:func:`cache_dir`), keyed by
everything that changes it (:func:`macs_signature`), and traces only on a miss.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .memory import WORKING_SET_FACTOR, check_batch_memory
from .version import __version__
from .files import atomic_write
from .models import count_params
from .slim import CompiledSpec, CompiledTier
from .spec import SubmodelSpec, TierSpec
from .timing import median_ms

MACS_NOTE = (
    "MACs by fvcore (1 multiply-add = 1); step-size multiply and residual add counted at "
    "1 per element, global average pooling at 1 per input element; activations, max-pooling "
    "and softmax not counted."
)
ELEMENTWISE_OPS = ("aten::add", "aten::add_", "aten::mul", "aten::mul_")
MACS_COUNTER_VERSION = 1  # bump whenever what count_macs counts changes (invalidates the cache)
CACHE_ENV = "NEFL_ZOO_CACHE_DIR"


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


def cache_dir() -> Path:
    """Where nefl-zoo caches figures: ``$NEFL_ZOO_CACHE_DIR``, else ``$XDG_CACHE_HOME/nefl-zoo``,
    else ``~/.cache/nefl-zoo``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nefl-zoo"


def macs_signature(spec: SubmodelSpec, tier: TierSpec | None, input_size: tuple[int, ...]) -> dict:
    """Everything the MACs of ``tier`` of ``spec`` (``None``: the full model) depend on: the
    model, its arguments, the width ratio and channel multiple, the kept blocks, the input
    size and the versions of the counter (ours, fvcore's, torch's, nefl-zoo's and a digest of
    the model and counter code)."""
    from importlib.metadata import version

    args = spec.tier_args(tier) if tier is not None else {"gamma_w": 1.0, "channel_multiple": 1, "steps": None}
    kept = None if args["steps"] is None else [[v != 0 for v in stage] for stage in args["steps"]]
    return {  # written the same for the same module: all blocks kept is None, full width multiple 1
        "model": spec.model,
        "model_args": spec.model_args,
        "gamma_w": args["gamma_w"],
        "channel_multiple": args["channel_multiple"] if args["gamma_w"] < 1 else 1,
        "kept_blocks": None if kept is None or all(map(all, kept)) else kept,
        "input_size": list(input_size),
        "counter": [MACS_COUNTER_VERSION, version("fvcore"), torch.__version__, __version__, _code_digest()],
    }


@functools.cache
def _code_digest() -> str:
    """sha256 of the code the figures come from (the zoo's model files and this counter), so
    that an edited model never meets a figure cached for the old one."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for path in [*sorted((here / "models").glob("*.py")), Path(__file__)]:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def tier_macs(signature: dict, build: Callable[[], nn.Module]) -> int:
    """MACs of the module ``build()`` makes, whose :func:`macs_signature` is ``signature``:
    read from the cache, else counted with fvcore (:func:`count_macs`) and cached.

    An entry is a JSON file named by the hash of the signature holding the signature and the
    count, written atomically; one that is unreadable, malformed or holds another signature is
    ignored and rewritten. A cache that cannot be written only costs the speed-up."""
    text = json.dumps(signature, sort_keys=True, default=repr)
    path = cache_dir() / "macs" / f"{hashlib.sha256(text.encode()).hexdigest()}.json"
    try:
        entry = json.loads(path.read_text())
        if entry["signature"] == json.loads(text) and type(entry["macs"]) is int and entry["macs"] >= 0:
            return entry["macs"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    macs = count_macs(build(), tuple(signature["input_size"]))
    payload = json.dumps({"signature": json.loads(text), "macs": macs})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda p: p.write_text(payload))
    except OSError:
        pass
    return macs


def macs_by_module(model: nn.Module, input_size: tuple[int, ...], depth: int = 2) -> dict[str, int]:
    """MACs per module, for modules at most ``depth`` levels deep (``""`` is the model)."""
    with torch.no_grad():
        counts = _analysis(model, input_size).by_module()
    return {k: int(v) for k, v in counts.items() if (k.count(".") + 1 if k else 0) <= depth}


def leaf_tensor_bytes(model: nn.Module, input_size: tuple[int, ...]) -> list[tuple[int, int]]:
    """(input bytes, output bytes) of every leaf module call in one eval forward pass of a zero
    input of shape ``input_size`` (batch 1)."""
    calls = []

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def hook(module, inputs, output) -> None:
        calls.append((nbytes(inputs), nbytes(output if isinstance(output, (tuple, list)) else (output,))))

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, *input_size))
    finally:
        for handle in handles:
            handle.remove()
    return calls


def peak_activation_bytes(model: nn.Module, input_size: tuple[int, ...]) -> int:
    """Largest working set of one module (its input plus output tensors) on one input of shape
    ``input_size``: a lower bound of the memory a forward pass needs per sample."""
    peak = max((i + o for i, o in leaf_tensor_bytes(model, input_size)), default=0)
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
    ``latency_batch`` that cannot fit in memory is a ``ValueError`` before any work.

    Parameters are counted on shape-only (meta-device) modules and MACs come from
    :func:`tier_macs`, so only uncached counts and latencies build real modules."""
    spec, size = compiled.spec, compiled.input_size
    with torch.device("meta"):
        full_meta = compiled.create_global_model()
    full_params = count_params(full_meta)
    full_macs = tier_macs(macs_signature(spec, None, size), compiled.create_global_model)
    full = None
    if latency_batch:
        full = compiled.create_global_model()
        check_batch_fits(full, size, latency_batch)
    full_latency = measure_latency_ms(full, size, latency_batch) if latency_batch else None
    out = []
    for ct in compiled.tiers.values():
        with torch.device("meta"):
            params = count_params(ct.build())
        macs = tier_macs(macs_signature(spec, ct.tier, size), ct.build)
        prof = TierProfile(
            name=ct.name,
            gamma=ct.tier.gamma,
            gamma_w=ct.tier.gamma_w,
            params=params,
            params_ratio=params / full_params,
            macs=macs,
            macs_ratio=macs / full_macs,
            blocks_per_stage=blocks_per_stage(ct, full_meta.stage_depths),
        )
        if latency_batch:
            prof.latency_ms = measure_latency_ms(ct.build(), size, latency_batch)
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

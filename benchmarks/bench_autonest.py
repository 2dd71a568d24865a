"""Coverage of automatic nesting (nefl_zoo.nest) over torchvision's classifiers and popular timm families.

For each model: build the nesting plan (fx trace + channel analysis, meta device), the parameter
ratio of the width tier closest to gamma = 0.5 (``auto_tier(..., mode="width")``), and, for
models under --max-params, the exactness check of the contract test (a tier at gamma_w 0.5 with
every other skippable block removed equals the global model with the removed channels and
blocks zeroed; max |diff| relative to the logits' scale). Results go to a JSON lines file (one
model per line; rerunning skips models already there), and ``--table`` prints the markdown table.

    OMP_NUM_THREADS=1 python benchmarks/bench_autonest.py --out benchmarks/autonest.jsonl
    python benchmarks/bench_autonest.py --out benchmarks/autonest.jsonl --table
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

NOT_CNN = ("vit_", "swin_", "maxvit_")  # torchvision's transformers: outside the CNN count
TIMM = [
    "resnet50", "resnext50_32x4d", "seresnet50", "regnety_016", "regnetx_016", "efficientnet_b0", "tf_efficientnet_lite0",
    "efficientnetv2_rw_s", "mobilenetv2_100", "mobilenetv3_large_100", "mobilevit_s", "convnext_tiny", "ghostnet_100",
    "densenet121", "rexnet_100", "mixnet_s", "mnasnet_100", "fbnetc_100", "spnasnet_100", "hardcorenas_a", "lcnet_100",
    "dla34", "dpn68", "cspresnet50", "cspdarknet53", "darknet53", "vgg11_bn", "inception_v3", "xception41",
    "res2net50_26w_4s", "selecsls42b", "skresnet18", "repvgg_a2", "resnetv2_50", "ese_vovnet19b_dw", "gernet_s",
    "hrnet_w18_small", "tinynet_a", "efficientvit_b0", "nf_resnet50",
]
SMALL_INPUT = 64
BIG_INPUT = {"inception_v3": 96, "googlenet": 64}


def run_one(name: str, max_params: float) -> dict:
    from nefl_zoo.models import count_params, create_model
    from nefl_zoo.nest.plan import _PLANS
    from nefl_zoo.nest.sources import NestError
    from nefl_zoo.nest.verify import zeroed_parity
    from nefl_zoo.slim import compile_spec
    from nefl_zoo.spec import parse_spec

    size = BIG_INPUT.get(name.split(":")[1], SMALL_INPUT)
    args = {"num_classes": 10, "img_size": size}
    row = {"model": name}
    start = time.perf_counter()
    try:
        with torch.device("meta"):
            full = create_model(name, **args)
        row["build_s"] = round(time.perf_counter() - start, 2)
        row["params"] = count_params(full)
        row["blocks"] = sum(full.stage_depths)
        row["unskippable"] = len(full.plan.unskippable)
        row["channel_norms"] = bool(full.plan.channels.channel_stats)
        row["gamma_w"] = width_for(full.plan, 0.5)
        with torch.device("meta"):
            row["ratio"] = round(count_params(create_model(name, **args, gamma_w=row["gamma_w"])) / row["params"], 4)
        if row["params"] <= max_params:
            steps = [[0.0 if j % 2 else 1.0 for j in range(d)] for d in full.stage_depths] or None
            spec = parse_spec({"model": name, "model_args": args, "tiers": [{"name": "t", "gamma_w": 0.5, "steps": steps}]})
            torch.manual_seed(0)
            x = torch.randn(2, 3, size, size)
            compiled = compile_spec(spec)
            diff = zeroed_parity(compiled, "t", x)
            with torch.no_grad():
                scale = float(compiled["t"].build().eval()(x).abs().max()) or 1.0
            row["zeroed_diff"] = diff / max(scale, 1.0)
        row["nests"] = "yes" if row["blocks"] else "width only"
    except NestError as exc:
        row["nests"], row["reason"] = "no", str(exc)
    except Exception as exc:  # noqa: BLE001 - reported in the table, never hidden
        row["nests"], row["reason"] = "no", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    row["total_s"] = round(time.perf_counter() - start, 2)
    _PLANS.clear()
    gc.collect()
    return row


def width_for(plan, gamma: float) -> float:
    """``gamma_w`` (0.001 grid) whose width-only parameter ratio is closest to ``gamma``,
    counted from the plan's kept channels (bisection; the count grows with ``gamma_w``)."""
    import math

    shapes = plan.param_shapes

    def params(gamma_w: float) -> int:
        keep = plan.keep(gamma_w, 1)
        total = 0
        for key, shape in shapes.items():
            index = plan.index(key, keep)
            total += math.prod(n if i is None else (i.stop if isinstance(i, slice) else len(i))
                               for i, n in zip(index, shape)) if index else math.prod(shape)
        return total

    full = params(1.0)
    lo, hi = 1, 1000
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if params(mid / 1000) / full < gamma else (lo, mid)
    return min((lo, max(1, lo - 1)), key=lambda k: abs(params(k / 1000) / full - gamma)) / 1000


def table(rows: list[dict]) -> str:
    lines = ["| model | nests? | skippable blocks (not) | params ratio at γ=0.5 (γ_W) | zeroed max diff | build s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["nests"] == "no":
            lines.append(f"| `{r['model']}` | no: {r['reason'].replace('|', '/')} | | | | |")
            continue
        exact = "-" if "zeroed_diff" not in r else f"{r['zeroed_diff']:.0e}"
        note = " (norm over channels)" if r.get("channel_norms") else ""
        lines.append(f"| `{r['model']}` | {r['nests']}{note} | {r['blocks']} ({r['unskippable']}) | "
                     f"{r['ratio']:.3f} ({r['gamma_w']:g}) | {exact} | {r['build_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/autonest.jsonl"))
    parser.add_argument("--table", action="store_true", help="print the markdown table of --out")
    parser.add_argument("--only", nargs="*", help="model names (torchvision:NAME / timm:NAME)")
    parser.add_argument("--max-params", type=float, default=30e6, help="exactness check below this many parameters")
    args = parser.parse_args()
    done = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    if args.table:
        print(table(done))
        return
    torch.set_num_threads(1)
    import torchvision

    names = args.only or [f"torchvision:{n}" for n in torchvision.models.list_models(module=torchvision.models)
                          if not n.startswith(NOT_CNN)] + [f"timm:{n}" for n in TIMM]
    seen = {r["model"] for r in done}
    for name in names:
        if name in seen:
            continue
        row = run_one(name, args.max_params)
        print(json.dumps(row), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""Coverage of automatic nesting (nefl_zoo.nesting): one model per timm module and sub-family, and
every torchvision classifier, each up to 100M parameters.

For each model: the nesting plan (fx trace + channel analysis, meta device), the parameter
ratio of the width tier gamma_W 0.5, and two checks of a tier at gamma_W 0.5 with every other
skippable block removed: *exactness* (it equals the global model with the removed channels and
blocks zeroed, max |diff| relative to the logits' scale) and *ONNX parity* (its ONNX file, as
``nefl-zoo export`` writes it, gives its logits under onnxruntime). A model's class: ``exact``,
``inexact by construction`` (a norm's statistics span narrowed channels: GroupNorm, a CNN's
LayerNorm), or ``refused`` with the construct named. Results go to a JSON lines file (one model
per line; rerunning skips models already there); ``--table`` prints the markdown tables. Either
way the tables of every model in the file go to ``benchmarks/results/autonest.json`` and its
figure to ``docs/benchmarks/img/autonest.png`` (``--plot-only`` redraws the figure alone).

    OMP_NUM_THREADS=1 python benchmarks/bench_autonest.py --out benchmarks/autonest.jsonl
    python benchmarks/bench_autonest.py --out benchmarks/autonest.jsonl --table

A timm *sub-family* is the name's leading word (``tf_`` and similar prefixes dropped): the
smallest model of each. Transformers are the models of :data:`TRANSFORMER_MODULES`; the other
timm modules are CNN-like (hybrids with attention blocks included).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import tempfile
import time
from pathlib import Path

import torch

import publish

MAX_PARAMS = 100e6
EXACT = 1e-4  # relative difference below which a tier counts as the zeroed global model
TRANSFORMER_MODULES = {
    "beit", "cait", "coat", "convit", "crossvit", "davit", "deit", "eva", "gcvit", "hiera", "hieradet_sam2", "levit",
    "maxxvit", "mvitv2", "naflexvit", "nest", "pit", "pvt_v2", "qwen3_vit", "swin_transformer", "swin_transformer_v2",
    "swin_transformer_v2_cr", "tiny_vit", "tnt", "twins", "vision_transformer", "vision_transformer_hybrid",
    "vision_transformer_relpos", "vision_transformer_sam", "visformer", "vitamin", "volo", "xcit", "gemma4_vit",
    "deepseek_vit", "efficientformer_v2",
}


def family(name: str) -> str:
    """A timm model's sub-family: its leading word, version included (``mobilenetv3``)."""
    bare = re.sub(r"^(tf|legacy|gluon|timm)_", "", name)
    found = re.match(r"[a-z]+(?:v\d+)?", bare)
    return found.group(0) if found else bare


def model_list(cache: Path) -> list[dict]:
    """The models of the table (cached in ``cache``: building every timm model takes minutes)."""
    if cache.exists():
        return json.loads(cache.read_text())
    import timm
    import torchvision

    def params(make) -> int | None:
        from nefl_zoo.nesting.sources import Source, construct

        try:  # parameters on the meta device, also for constructors that size layers with tensors (RegNet)
            with torch.device("meta"):
                return sum(p.numel() for p in construct(Source("count", make)).parameters())
        except Exception:  # noqa: BLE001 - a model that does not build is left out, and said
            return None

    chosen = {}
    for module in sorted(timm.list_modules()):
        for name in timm.list_models(module=module):
            fam = family(name)
            if fam == "test":
                continue
            n = params(lambda: timm.create_model(name, pretrained=False, num_classes=10))
            key = (module, fam)
            if n is not None and (key not in chosen or n < chosen[key]["params"]):
                kind = "transformer" if module in TRANSFORMER_MODULES else "cnn"
                chosen[key] = {"model": f"timm:{name}", "kind": kind, "family": f"{module}/{fam}", "params": n}
    rows = sorted(chosen.values(), key=lambda r: r["family"])
    for name in torchvision.models.list_models(module=torchvision.models):
        n = params(lambda: torchvision.models.get_model(name, weights=None, num_classes=10))
        rows.append({"model": f"torchvision:{name}", "kind": "torchvision", "family": name, "params": n})
    cache.write_text(json.dumps(rows, indent=0))
    return rows


def onnx_difference(tier: torch.nn.Module, x: torch.Tensor) -> float:
    """Max |difference| between ``tier`` and its ONNX file under onnxruntime, as ``export``
    measures it, relative to max(1, max |logit|) (``export`` refuses above 1e-4)."""
    from nefl_zoo.export.onnx_file import INPUT_NAME, write_onnx
    from nefl_zoo.export.verify import max_abs_diff
    from nefl_zoo.runtime.session import session_from_bytes

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tier.onnx"
        write_onnx(tier, path, tuple(x.shape[1:]), x.shape[0], False, None)
        session = session_from_bytes(path.read_bytes(), str(path))
    with torch.no_grad():
        want = tier(x)
    got = torch.from_numpy(session.run(None, {INPUT_NAME: x.numpy()})[0])
    return max_abs_diff(got, want) / max(float(want.abs().max()), 1.0)


def run_one(entry: dict) -> dict:
    from nefl_zoo.models import count_params, create_model
    from nefl_zoo.nesting.plan import _PLANS
    from nefl_zoo.nesting.sources import NestError
    from nefl_zoo.nesting.verify import randomise_zeros, zeroed_parity
    from nefl_zoo.slim import compile_spec
    from nefl_zoo.spec import parse_spec

    name = entry["model"]
    row = dict(entry)
    start = time.perf_counter()
    try:
        size = input_size(name)
        args = {"num_classes": 10, "img_size": size}
        with torch.device("meta"):
            full = create_model(name, **args)
            half = create_model(name, **args, gamma_w=0.5)
        row["build_s"] = round(time.perf_counter() - start, 2)
        row["size"] = size
        row["blocks"], row["unskippable"] = sum(full.stage_depths), len(full.plan.unskippable)
        row["inexact_norms"] = len(full.plan.inexact_norms)
        row["kept_whole"] = len(full.plan.channels.kept_whole)
        row["attention"] = full.plan.channels.attention
        row["ratio"] = round(count_params(half) / count_params(full), 4)
        steps = [[0.0 if j % 2 else 1.0 for j in range(d)] for d in full.stage_depths] or None
        spec = parse_spec({"model": name, "model_args": args, "tiers": [{"name": "t", "gamma_w": 0.5, "steps": steps}]})
        torch.manual_seed(0)
        x = torch.randn(2, 3, size, size)
        compiled = compile_spec(spec)
        tier = randomise_zeros(compiled["t"].build().eval())
        with torch.no_grad():
            scale = float(tier(x).abs().max())
        row["zeroed_diff"] = zeroed_parity(compiled, "t", x) / max(scale, 1.0)
        try:
            row["onnx_diff"] = onnx_difference(tier, x)
        except Exception:  # noqa: BLE001 - where torch.onnx cannot export the library's own model either, said so
            row["onnx_diff"] = None
            row["onnx_note"] = original_export_error(name, args, x)
        exact = row["zeroed_diff"] <= EXACT
        row["class"] = "exact" if exact else "inexact by construction" if row["inexact_norms"] else "NOT EXACT"
    except NestError as exc:
        row["class"], row["reason"] = "refused", str(exc)
    except Exception as exc:  # noqa: BLE001 - reported in the table, never hidden
        row["class"], row["reason"] = "crash", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    row["total_s"] = round(time.perf_counter() - start, 2)
    _PLANS.clear()
    gc.collect()
    return row


def input_size(name: str) -> int:
    """The size a network is analysed and checked at: its own (timm's default configuration,
    a fixed size), 224 for torchvision's."""
    from nefl_zoo.nesting.plan import _fixed_size
    from nefl_zoo.nesting.sources import construct, library_source

    source = library_source(name, 10, 3)
    with torch.device("meta"):
        model = construct(source)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return _fixed_size(source, model) or (cfg.get("input_size") or (3, 224, 224))[-1]


def original_export_error(name: str, args: dict, x: torch.Tensor) -> str:
    """Why a tier's ONNX export failed: the library's own (un-nested) model fails the same way,
    or only the tier does (a nesting bug: raised)."""
    from nefl_zoo.nesting.sources import library_source

    original = library_source(name, args["num_classes"], 3).make().eval()
    try:
        onnx_difference(original, x)
    except Exception as exc:  # noqa: BLE001
        return f"torch.onnx cannot export the original model either ({type(exc).__name__})"
    raise RuntimeError("the tier fails to export to ONNX, the original model does not")


def table(rows: list[dict]) -> str:
    lines = []
    for kind, title in (("cnn", "timm, CNN-like"), ("transformer", "timm, transformers"), ("torchvision", "torchvision")):
        part = sorted((r for r in rows if r["kind"] == kind and r["class"] != "skipped"), key=lambda r: r["model"])
        skipped = [r["model"] for r in rows if r["kind"] == kind and r["class"] == "skipped"]
        nests = sum(r["class"] in ("exact", "inexact by construction") for r in part)
        lines += [f"**{title}: {nests} of {len(part)} nest** "
                  f"({sum(r['class'] == 'exact' for r in part)} exactly)", "",
                  "| model | class | params | ratio at γ_W 0.5 | skippable blocks | zeroed diff | ONNX diff |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        if skipped:
            lines[-4] += f"; over 100M parameters, not run: {', '.join(f'`{m}`' for m in skipped)}"
        for r in part:
            if r["class"] in ("refused", "crash"):
                lines.append(f"| `{r['model']}` | {r['class']}: {r.get('reason', '').replace('|', '/')} | {r['params'] / 1e6:.1f}M | | | | |")
                continue
            whole = f", {r['kept_whole']} layers kept whole" if r.get("kept_whole") else ""
            onnx = f"{r['onnx_diff']:.0e}" if r.get("onnx_diff") is not None else r.get("onnx_note", "")
            lines.append(f"| `{r['model']}` | {r['class']}{whole} | {r['params'] / 1e6:.1f}M | {r['ratio']:.3f} | "
                         f"{r['blocks']} | {r['zeroed_diff']:.0e} | {onnx} |")
        lines.append("")
    return "\n".join(lines)


def publish_tables(rows: list[dict], source: Path, measured: bool) -> None:
    """The tables of ``rows`` (every model of ``source``) as the run of ``results/autonest.json``:
    with the machine and load of this run when it ``measured`` models, else with the commit that
    last changed ``source`` (its lines do not record the machine)."""
    if measured:
        info = publish.provenance()
        info["load_after"] = info.pop("load_before")  # taken at the end of the run
    else:
        commit = publish._git("log", "-1", "--format=%h %ad", "--date=short", "--", str(source))
        info = {"source": f"tabulated from {source} (one line per model, as measured)", "commit": commit.split(" ")[0],
                "date": commit.split(" ")[-1], "machine": "not recorded in the file", "load": "not recorded in the file"}
    run = {"command": "OMP_NUM_THREADS=1 python benchmarks/bench_autonest.py --out benchmarks/autonest.jsonl",
           "provenance": info, "tables": publish.parse_tables(table(rows))}
    data = publish.record("autonest", run)
    print(f"wrote {publish.results_path('autonest').relative_to(publish.ROOT)} and "
          f"{publish.figure('autonest', data).relative_to(publish.ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/autonest.jsonl"))
    parser.add_argument("--models", type=Path, default=Path("benchmarks/autonest_models.json"),
                        help="the model list (written on first use)")
    parser.add_argument("--table", action="store_true", help="print the markdown tables of --out")
    parser.add_argument("--only", nargs="*", help="model names (torchvision:NAME / timm:NAME)")
    args = parser.parse_args()
    done = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    if args.table:
        print(table(done))
        publish_tables(done, args.out, measured=False)
        return
    torch.set_num_threads(1)
    entries = model_list(args.models)
    if args.only:
        entries = [e for e in entries if e["model"] in args.only]
    seen = {r["model"] for r in done}
    for entry in entries:
        if entry["model"] in seen:
            continue
        if entry["params"] is None or entry["params"] > MAX_PARAMS:
            row = {**entry, "class": "skipped", "reason": "over 100M parameters" if entry["params"] else "does not build"}
        else:
            row = run_one(entry)
        print(json.dumps(row), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        done.append(row)
    publish_tables(done, args.out, measured=True)


if __name__ == "__main__":
    publish.run("autonest", main, capture=False)

"""Slim modules vs the paper's masked execution, per tier, on CPU.

For every tier: the MACs ratio (fvcore) and the measured latency ratio of (a) our physically
slimmed module and (b) masked execution as in the paper's code (every block present, skipped
ones multiplied by a step of 0), both against the full model. Latencies are medians over
interleaved repetitions (batch 64). Also times ``build`` itself, after ``import torch``.

    python benchmarks/bench_slim.py [--batch 64] [--reps 5] [--threads 1]

Results: every table printed goes to ``benchmarks/results/slim.json`` and the figure drawn from it
to ``docs/benchmarks/img/slim.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from nefl_zoo.auto import auto_tier
from nefl_zoo.models import create_model
from nefl_zoo.profile import count_macs
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import SubmodelSpec, load_spec, shipped_specs_dir
from nefl_zoo.timing import median_ms

import publish  # results JSON and figure (benchmarks/publish.py)

SPECS = ["resnet110/nefl-w", "resnet110/nefl-d", "resnet110/nefl-wd", "resnet56/nefl-d", "resnet56/nefl-wd"]


def masked_model(spec, tier):
    """The paper's way: all blocks run; skipped ones have their step fixed to 0."""
    model = create_model(spec.model, **spec.model_args, **(spec.tier_args(tier) | {"steps": None}))
    if tier.steps:
        with torch.no_grad():
            for stage, block, module in model.residual_blocks():
                for name in module.step_names:
                    getattr(module, name).fill_(tier.steps[stage][block])
    return model.eval()


def median_latencies(models: dict[str, torch.nn.Module], x: torch.Tensor, reps: int) -> dict[str, float]:
    times = {k: [] for k in models}
    with torch.inference_mode():
        for m in models.values():
            m(x)
        for _ in range(reps):  # interleaved, so that machine noise hits every model alike
            for k, m in models.items():
                start = time.perf_counter()
                m(x)
                times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def bench_spec(name: str, batch: int, reps: int) -> list[str]:
    spec = load_spec(shipped_specs_dir() / f"{name}.yaml")
    compiled = compile_spec(spec)
    full = compiled.create_global_model().eval()
    size = compiled.input_size
    models = {"full": full}
    for ct in compiled.tiers.values():
        models[f"slim:{ct.name}"] = ct.build().eval()
        models[f"masked:{ct.name}"] = masked_model(spec, ct.tier)
    lat = median_latencies(models, torch.randn(batch, *size), reps)
    full_macs = count_macs(full, size)
    rows = []
    for ct in compiled.tiers.values():
        macs_ratio = count_macs(models[f"slim:{ct.name}"], size) / full_macs
        slim = lat[f"slim:{ct.name}"] / lat["full"]
        masked = lat[f"masked:{ct.name}"] / lat["full"]
        gamma = ct.tier.gamma or 1.0
        target = "n/a (gamma < 0.4)" if gamma < 0.4 else ("yes" if slim <= 1.3 * macs_ratio else "NO")
        rows.append(
            f"| {name} | {ct.name} | {macs_ratio:.3f} | {slim:.3f} | {slim / macs_ratio:.2f} | "
            f"{masked:.3f} | {lat[f'slim:{ct.name}']:.1f} | {lat[f'masked:{ct.name}']:.1f} | {target} |"
        )
    return rows


def bench_build(reps: int = 20) -> str:
    spec = load_spec(shipped_specs_dir() / "resnet110/nefl-wd.yaml")
    compiled = compile_spec(spec)

    def auto_build():
        found = auto_tier("resnet110", 0.2)
        compile_spec(SubmodelSpec(model="resnet110", tiers=[found.tier]))[found.tier.name].build()

    return (
        f"resnet110, after `import torch`, median of {reps}: "
        f"slim module of tier g0.2 {median_ms(compiled['g0.2'].build, reps):.1f} ms; "
        f"compiling the 5-tier NeFL-WD spec (slice maps) {median_ms(lambda: compile_spec(spec), reps):.1f} ms; "
        f"`build --gamma 0.2` path (auto_tier search + compile + slim module) {median_ms(auto_build, reps):.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, "
          f"{args.threads} thread(s), batch {args.batch}, median of {args.reps} interleaved runs")
    print("| spec | tier | MACs ratio | slim latency ratio | slim / MACs | masked latency ratio | slim ms | masked ms | slim <= 1.3 x MACs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in SPECS:
        for row in bench_spec(name, args.batch, args.reps):
            print(row, flush=True)
    print()
    print(bench_build())


if __name__ == "__main__":
    publish.run("slim", main)

"""Run several methods x seeds on one setup; tabulate worst/avg accuracy per BN treatment, NeFL's
paired differences against each baseline, and plot accuracy vs MACs and vs round.

A method entry is a registered method name (``fjord``) or ``METHOD=SPEC`` (``nefl=resnet20/nefl-d``:
the method on another spec file or shipped spec, with the same tier names; its row is named by
the spec's file stem).
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Callable

import numpy as np

from .config import RunConfig, apply_overrides, parse_config
from .devices.report import devices_report
from .engine import Engine, RunObserver, RunResult
from .strategy.registry import get_method
from .training.bn import BN_TREATMENTS


@dataclass(frozen=True)
class Entry:
    """One row of a comparison: a method (optionally one of its variants, ``variant``, and further
    ``method_args``), optionally on its own spec file; ``fixed_steps`` freezes every tier's step sizes (the NeFL paper's N/L);
    ``config_model_args`` keeps the config's ``model_args`` (input size, channels) with the spec's
    tiers; ``name`` replaces the table label; ``overrides`` sets config keys (``{"devices.policy": "wait_all"}``)."""

    key: str
    method: str
    spec: Path | None = None
    variant: str | None = None
    fixed_steps: bool = False
    config_model_args: bool = False
    name: str | None = None
    method_args: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        label = get_method(self.method).label + (f" [{self.variant}]" if self.variant else "")
        return f"{label} ({self.spec.stem})" if self.spec is not None else label


def parse_entry(text: str) -> Entry:
    """``METHOD[:VARIANT][=SPEC]`` (a spec file or shipped spec name); ``KeyError`` for an
    unknown method, :class:`~nefl_zoo.spec.SpecError` for a missing spec."""
    from ..spec import resolve_spec_path

    head, _, spec = (s.strip() for s in text.partition("="))
    method, _, variant = (s.strip() for s in head.partition(":"))
    get_method(method)
    suffix = f"-{variant}" if variant else ""
    if not spec:
        return Entry(method + suffix, method, variant=variant or None)
    path = resolve_spec_path(spec).resolve()
    return Entry(path.stem + suffix, method, path, variant=variant or None)


def nefl_table1(config: RunConfig) -> list[Entry]:
    """The rows of the NeFL paper's Table 1 and its ablation on the config's model: NeFL-W, -D,
    -D_O (where the model ships ``MODEL/nefl-d_o``) and -WD with learnable and fixed (N/L) step
    sizes on the shipped ``MODEL/nefl-{w,d,d_o,wd}`` specs, HeteroFL and FjORD (the NeFL authors'
    variant) on the W spec, DepthFL (the NeFL paper's variant) on the D spec and, where the model
    ships ``MODEL/depthfl-nested``, on its nested prefixes (the paper appendix's reading, ``nested``),
    and FedAvg on the full model; the specs' tiers with the config's ``model_args``.
    ``SpecError`` when the model has no shipped W, D and WD specs."""
    from ..spec import SpecError, resolve_spec_path

    model = config.submodel_spec().model
    specs = {}
    for kind, name in (("w", "nefl-w"), ("d", "nefl-d"), ("d_o", "nefl-d_o"), ("wd", "nefl-wd"), ("nested", "depthfl-nested")):
        try:
            specs[kind] = resolve_spec_path(f"{model}/{name}").resolve()
        except SpecError:
            if kind not in ("d_o", "nested"):
                raise
    nested = specs.pop("nested", None)
    rows = []
    for kind, path in specs.items():
        rows.append(Entry(f"nefl-{kind}", "nefl", path, config_model_args=True, name=f"NeFL-{kind.upper()}"))
        rows.append(Entry(f"nefl-{kind}-nl", "nefl", path, fixed_steps=True, config_model_args=True, name=f"NeFL-{kind.upper()} (N/L)"))
    rows += [Entry("heterofl", "heterofl", specs["w"], config_model_args=True, name="HeteroFL"),
             Entry("fjord-nefl", "fjord", specs["w"], "nefl", config_model_args=True, name="FjORD (NeFL's)"),
             Entry("depthfl-nefl", "depthfl", specs["d"], "nefl", config_model_args=True, name="DepthFL (NeFL's)"),
             *([Entry("depthfl-nested", "depthfl", nested, "nefl", config_model_args=True, name="DepthFL (NeFL's, nested)",
                      method_args={"nested": True})] if nested else []),
             Entry("fedavg", "fedavg", specs["w"], config_model_args=True, name="FedAvg (full model)")]
    return rows


def time_entries(config: RunConfig) -> list[Entry]:
    """Time to accuracy (``devices:``): NeFL, HeteroFL, FjORD (NeFL's) on the config's spec, DepthFL (NeFL's) on the
    model's D spec, FedAvg waiting for every online client (``wait_all``) and on full-model clients only."""
    from ..spec import resolve_spec_path

    depth = resolve_spec_path(f"{config.submodel_spec().model}/nefl-d").resolve()
    return [Entry("nefl", "nefl"), Entry("heterofl", "heterofl"), Entry("fjord-nefl", "fjord", variant="nefl", name="FjORD (NeFL's)"),
            Entry("depthfl-nefl", "depthfl", depth, "nefl", config_model_args=True, name="DepthFL (NeFL's)"),
            Entry("fedavg-wait", "fedavg", name="FedAvg (waits for everyone)", overrides={"devices.policy": "wait_all", "devices.tiers": "environment"}),
            Entry("fedavg-full", "fedavg_full", name="FedAvg (full-model clients)")]


#: ``compare --preset NAME``: the entries of a named comparison for a config
PRESETS: dict[str, Callable[[RunConfig], list[Entry]]] = {"nefl-table1": nefl_table1, "time-to-accuracy": time_entries}


def entry_config(config: RunConfig, entry: Entry, seed: int) -> RunConfig:
    """``config`` for one entry and seed (the entry's spec, variant and step sizes replacing the config's)."""
    from ..spec import load_spec

    cfg = config.with_method(entry.method, seed)
    if entry.spec is None and entry.variant is None and not entry.fixed_steps and not entry.method_args and not entry.overrides:
        return cfg
    data = apply_overrides(cfg.to_dict(), [f"{k}={v}" for k, v in entry.overrides.items()], f"{config.name}:{entry.key}")
    if entry.variant is not None or entry.method_args:
        data["method_args"] = ({"variant": entry.variant} if entry.variant is not None else {}) | entry.method_args
    spec = load_spec(entry.spec).model_dump(mode="json", exclude_none=True) if entry.spec is not None else data["spec"]
    if entry.config_model_args:
        spec["model_args"] = dict(config.submodel_spec().model_args)
    if entry.fixed_steps:
        spec["tiers"] = [{**t, "learnable_steps": False} for t in spec["tiers"]]
    data["spec"] = spec
    return parse_config(data, f"{config.name}:{entry.key}")


@dataclass
class Comparison:
    """Per entry key, the runs' results; plus the markdown and the files written."""

    runs: dict[str, list[RunResult]]
    markdown: str
    results_md: Path
    plot: Path


def _run(config: dict, out: str, threads: int | None) -> RunResult:
    import torch

    if threads:
        torch.set_num_threads(threads)
    return Engine(parse_config(config, out), out).run(overwrite=True)


def treatments(runs: dict[str, list[RunResult]]) -> list[str]:
    """The BN treatments the runs evaluated (``TREATMENT/NAME`` extra metrics); ``running``
    alone when none did (methods with an evaluation of their own, e.g. FedLPS)."""
    found = {k.split("/")[0] for rs in runs.values() for r in rs for k in r.extra}
    return [t for t in BN_TREATMENTS if t in found] or ["running"]


def accuracies(result: RunResult, treatment: str) -> dict[str, float]:
    """Per submodel, the final accuracy under ``treatment`` (the reported one for a method that
    has no BN treatments)."""
    return {t: result.extra.get(f"{treatment}/{t}", a) for t, a in result.acc.items()}


def worst_case(result: RunResult, acc: dict[str, float]) -> float:
    """The worst case of ``acc`` (one run's accuracies, e.g. under one BN treatment): the
    smallest submodel's accuracy, as in the NeFL paper (``result.worst_case``); the minimum for a
    method whose names are not submodels (FedLPS's tasks)."""
    return min(acc.values()) if result.worst_case is None else acc.get(result.worst_case, float("nan"))


def _mean_std(values) -> str:
    a = 100 * np.asarray(values, dtype=float)
    return f"{a.mean():.2f} ± {a.std(ddof=1) if len(a) > 1 else 0.0:.2f}"


def results_table(config: RunConfig, entries: list[Entry], runs: dict[str, list[RunResult]],
                  macs: dict[str, float | None] | None = None) -> str:
    """Markdown in the layout of the NeFL paper's Table 1 (worst and avg accuracy) per BN
    treatment, with each entry's MACs per client-round (``macs``, :func:`client_round_macs`;
    none: no column), the per-submodel means, and every NeFL row's paired difference against each
    baseline: mean ± std over seeds of (NeFL - baseline) and how many seeds NeFL wins."""
    seeds = len(next(iter(runs.values())))
    model = config.submodel_spec().model
    lines = [
        f"Top-1 accuracy (%) of the worst-case submodel (the smallest, as in the NeFL paper), the average and the "
        f"minimum over submodels, mean ± std over "
        f"{seeds} seed(s); {config.data.dataset}, {config.data.partition}"
        + (f" (alpha {config.data.alpha})" if config.data.partition == "dirichlet" else "")
        + f", {config.rounds} rounds, {config.clients.num_clients} clients x {config.clients.fraction}.",
    ]
    nefl = [e for e in entries if e.method == "nefl"]
    baselines = [e for e in entries if e.method != "nefl"]
    for treatment in treatments(runs):
        stats = {e.key: [accuracies(r, treatment) for r in runs[e.key]] for e in entries}
        worst = {k: [worst_case(r, a) for r, a in zip(runs[k], v)] for k, v in stats.items()}
        avg = {k: [float(np.mean(list(a.values()))) for a in v] for k, v in stats.items()}
        least = {k: [min(a.values()) for a in v] for k, v in stats.items()}
        head, rule = "| Model | Method | Worst | Avg | Min |", "|---|---|---|---|---|"
        if macs is not None:
            head, rule = head + " MACs per client-round (M) |", rule + "---|"
        lines += ["", f"BN statistics at evaluation: **{treatment}**", "", head, rule]
        for e in entries:
            cell = "" if macs is None else (" – |" if macs.get(e.key) is None else f" {macs[e.key] / 1e6:.1f} |")
            lines.append(f"| {model} | {e.label} | {_mean_std(worst[e.key])} | {_mean_std(avg[e.key])} | {_mean_std(least[e.key])} |{cell}")
        names = list(dict.fromkeys(t for e in entries for t in stats[e.key][0]))
        lines += ["", "| Method | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for e in entries:
            cells = (f"{100 * np.mean([a[t] for a in stats[e.key]]):.2f}" if t in stats[e.key][0] else "–" for t in names)
            lines.append(f"| {e.label} | " + " | ".join(cells) + " |")
        for e in entries:  # further models a method evaluates (DepthFL's exits' ensemble)
            r0 = runs[e.key][0]
            for name in sorted({k.split("/", 1)[1] for k in r0.extra if k.startswith(f"{treatment}/")} - set(r0.acc)):
                lines += ["", f"{e.label} {name}: {_mean_std([r.extra[f'{treatment}/{name}'] for r in runs[e.key]])}"]
        if nefl and baselines:
            lines += ["", f"NeFL minus baseline, worst case, paired by seed: mean ± std (seeds NeFL is ahead, of {seeds})", "",
                      "| Baseline | " + " | ".join(e.label for e in nefl) + " |", "|---|" + "---|" * len(nefl)]
            for b in baselines:
                cells = []
                for n in nefl:
                    d = np.asarray(worst[n.key]) - np.asarray(worst[b.key])
                    cells.append(f"{_mean_std(d)} ({int((d > 0).sum())}/{len(d)})")
                lines.append(f"| {b.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def curves(out: Path, entries: list[Entry], runs: dict[str, list[RunResult]], seeds: list[int],
           treatment: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per entry, the evaluated rounds and the worst-case accuracy (%, :func:`worst_case`) per seed and round."""
    out_curves = {}
    for e in entries:
        per_seed = [[(r["round"], a) for r, a in worst_points(out / e.key / f"seed{seed}", result, treatment)]
                    for seed, result in zip(seeds, runs[e.key])]
        rounds = np.array([r for r, _ in per_seed[0]])
        out_curves[e.key] = (rounds, np.array([[a for _, a in s] for s in per_seed]))
    return out_curves


def worst_points(run_dir: Path, result: RunResult, treatment: str) -> list[tuple[dict, float]]:
    """Every evaluated round's record of a run (``metrics.jsonl``) and its worst-case accuracy (%, :func:`worst_case`) under ``treatment``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r, 100 * worst_case(result, {t: r.get("extra", {}).get(f"{treatment}/{t}", a) for t, a in r["acc"].items()}))
            for r in records if "acc" in r]


def flatness(curve: tuple[np.ndarray, np.ndarray], test_images: int, window: int = 5) -> tuple[float, float]:
    """(change of the seed-mean worst-case accuracy over the last ``window`` rounds, its noise):
    a curve has flattened when the change is within the noise, the larger of the seed std at the
    end and the binomial standard error of one evaluation on ``test_images`` images (points)."""
    rounds, acc = curve
    mean = acc.mean(0)
    earlier = int(np.searchsorted(rounds, rounds[-1] - window))
    p = mean[-1] / 100
    std = float(acc[:, -1].std(ddof=1)) if len(acc) > 1 else 0.0
    return float(abs(mean[-1] - mean[earlier])), max(std, 100 * float(np.sqrt(p * (1 - p) / test_images)))


_SIZES: dict[tuple, list[int]] = {}


def client_sizes(config: RunConfig, input_size: tuple[int, int, int]) -> list[int]:
    """Training samples of every client of ``config`` (its partition for its seed; the same for
    every method, so read once per data section, client count and seed)."""
    from ..data.loading import load_data

    devices = config.devices if config.data.partition == "devices" else None  # the device classes shape the data
    key = (config.data.model_dump_json(), str(devices), str(config.data_root()), input_size, config.clients.num_clients, config.seed)
    if key not in _SIZES:
        data = load_data(config.data, config.data_root(), input_size, config.clients.num_clients, config.seed, devices)
        _SIZES[key] = [len(data.client_dataset(c)) for c in range(config.clients.num_clients)]
    return _SIZES[key]


def client_round_macs(config: RunConfig, entry: Entry, seeds: list[int], out: Path) -> float | None:
    """MACs per client-round of an entry's finished runs in ``out/KEY/seedN``: the mean, over every
    client a round trained (all rounds, all seeds), of ``local_epochs x n_k x c(level)``, with
    ``n_k`` the client's training samples and ``c`` the forward MACs per training image of the
    level it trained (the method's ``client_macs``: a tier's fvcore count; FjORD's expected drawn
    width plus its p_max teacher; DepthFL's trunk, bottlenecks and exits). Forward passes only
    (backward adds about twice as much for every method). ``None`` for a method without
    ``client_macs`` (FedGH, FedLPS)."""
    total, count = 0.0, 0
    for seed in seeds:
        cfg = entry_config(config, entry, seed)
        strategy = cfg.build_strategy()
        if not hasattr(strategy, "client_macs"):
            return None
        sizes, per_level = client_sizes(cfg, strategy.info.input_size), {}
        for line in (out / entry.key / f"seed{seed}" / "metrics.jsonl").read_text().splitlines():
            for cid, client in json.loads(line).get("per_client", {}).items():
                level = client["tier"]
                if level not in per_level:
                    per_level[level] = strategy.client_macs(level)
                total += cfg.train.local_epochs * sizes[int(cid)] * per_level[level]
                count += 1
    return total / count if count else None


def _macs(config: RunConfig) -> dict[str, int]:
    """MACs of the method's submodels by name; none for a method whose evaluated models are not
    tiers of a compiled spec (FedLPS reports accuracy per task)."""
    from ..profile import profile_tiers

    compiled = getattr(config.build_strategy(), "compiled", None)
    return {p.name: p.macs for p in profile_tiers(compiled)} if compiled is not None else {}


def plot_comparison(config: RunConfig, entries: list[Entry], runs: dict[str, list[RunResult]], out: Path, path: Path) -> None:
    """Left: accuracy of every submodel against its MACs (mean ± std over seeds); right: the
    worst-case accuracy against the round (mean, band: ± std), one line per entry; both with
    the first BN treatment the runs share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    treatment = treatments(runs)[0]
    seeds = [config.seed + s for s in range(len(next(iter(runs.values()))))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for e, (rounds, acc) in zip(entries, curves(out, entries, runs, seeds, treatment).values()):
        macs = _macs(entry_config(config, e, config.seed))
        tiers = sorted((t for t in runs[e.key][0].acc if t in macs), key=macs.__getitem__)
        if tiers:
            a = np.array([[100 * accuracies(r, treatment)[t] for t in tiers] for r in runs[e.key]])
            left.errorbar([macs[t] / 1e6 for t in tiers], a.mean(0), yerr=a.std(0), marker="o", capsize=3, label=e.label)
        line, = right.plot(rounds, acc.mean(0), label=e.label)
        right.fill_between(rounds, acc.mean(0) - acc.std(0), acc.mean(0) + acc.std(0), color=line.get_color(), alpha=0.15)
    left.set(xlabel="MACs per image (millions)", ylabel="top-1 accuracy (%)", title=f"final accuracy, BN {treatment}")
    right.set(xlabel="round", ylabel="worst-case top-1 accuracy (%)", title="worst-case submodel vs round")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(f"{config.submodel_spec().model} on {config.data.dataset} ({config.data.partition})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_methods(
    config: RunConfig, methods: list[str | Entry], seeds: int, out: str | Path, observer: Callable[[], RunObserver] | None = None,
    jobs: int = 1, threads: int | None = None, reuse: bool = False, plot: bool = True, target: float | None = None,
) -> Comparison:
    """Train every entry (an :class:`Entry` or its text, :func:`parse_entry`) with seeds
    ``config.seed .. config.seed + seeds - 1`` into ``out/KEY/seedN``, ``jobs`` runs at a time
    (more than one: each in its own process with ``threads`` torch threads, no observer). Every
    run evaluates both BN treatments. With ``reuse``, a run whose ``summary.json`` exists is read,
    not trained again (an interrupted comparison goes on where it stopped). ``plot``: also draw
    ``comparison.png``. With ``devices:``, also the time to ``target`` accuracy (:func:`report`).

    The config's ``method_args`` apply to its own method; the other methods use their defaults
    (an entry's ``variant`` sets theirs). ``observer`` makes one observer per run (e.g. a progress bar)."""
    out = Path(out)
    config = config.model_copy(update={"eval": config.eval.model_copy(update={"bn_both": True})})
    entries = [m if isinstance(m, Entry) else parse_entry(m) for m in methods]
    jobs_list = [(e, config.seed + s) for s in range(seeds) for e in entries]  # seed by seed: a cut-short grid has whole seeds
    configs = {(e.key, seed): entry_config(config, e, seed) for e, seed in jobs_list}
    results: dict[tuple[str, int], RunResult] = {}
    if reuse:
        done = {k: out / k[0] / f"seed{k[1]}" / "summary.json" for k in configs}
        results = {k: RunResult(**json.loads(p.read_text())) for k, p in done.items() if p.is_file()}
        configs = {k: c for k, c in configs.items() if k not in results}
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            futures = {k: pool.submit(_run, c.to_dict(), str(out / k[0] / f"seed{k[1]}"), threads) for k, c in configs.items()}
            results.update({k: f.result() for k, f in futures.items()})
    else:
        for k, cfg in configs.items():
            engine = Engine(cfg, out / k[0] / f"seed{k[1]}")
            results[k] = engine.run(overwrite=True, observer=observer() if observer else None)
    runs = {e.key: [results[(e.key, config.seed + s)] for s in range(seeds)] for e in entries}
    return report(config, entries, runs, out, plot, target)


def load_runs(config: RunConfig, methods: list[str | Entry], seeds: int, out: str | Path) -> dict[str, list[RunResult]]:
    """The results of finished runs in ``out/KEY/seedN`` (their ``summary.json``)."""
    runs = {}
    for e in (m if isinstance(m, Entry) else parse_entry(m) for m in methods):
        paths = [Path(out) / e.key / f"seed{config.seed + s}" / "summary.json" for s in range(seeds)]
        runs[e.key] = [RunResult(**json.loads(p.read_text())) for p in paths]
    return runs


def report(config: RunConfig, entries: list[Entry], runs: dict[str, list[RunResult]], out: str | Path, plot: bool = True,
           target: float | None = None) -> Comparison:
    """Write ``results.md``, ``results.json``, (``plot``) ``comparison.png`` and the time to ``target`` accuracy (``devices:``) into ``out``."""
    out = Path(out)
    seeds = [config.seed + s for s in range(len(next(iter(runs.values()))))]
    macs = {e.key: client_round_macs(config, e, seeds, out) for e in entries}
    markdown = results_table(config, entries, runs, macs)
    if config.devices is not None:  # time to accuracy on the simulated clock; what each device class gets
        treatment = treatments(runs)[0]
        points = {e.key: [worst_points(out / e.key / f"seed{s}", r, treatment) for s, r in zip(seeds, runs[e.key])] for e in entries}
        markdown += devices_report(f"{config.submodel_spec().model} on {config.data.dataset}", {e.key: e.label for e in entries},
                                   seeds, points, treatment, out, plot, target)
    results_md, figure = out / "results.md", out / "comparison.png"
    results_md.write_text(f"# {config.name}: method comparison\n\n{markdown}\n" + (f"![accuracy vs MACs and vs round]({figure.name})\n" if plot else ""))
    (out / "results.json").write_text(json.dumps({k: [asdict(r) for r in rs] for k, rs in runs.items()}, indent=2))
    if plot:
        plot_comparison(config, entries, runs, out, figure)
    return Comparison(runs, markdown, results_md, figure)

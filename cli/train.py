"""``nefl-zoo train``, ``compare``, ``methods`` and ``clientapp``: nested federated training, in
process, on Flower's simulation engine, or as a long-running ClientApp of a Flower deployment."""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import List, Optional

import typer

from .console import json_option, print_json, stdout_to_stderr
from .errors import fail, guarded, require_positive, user_errors
from .progress import RichProgress


class EngineName(str, Enum):
    """Where ``train`` runs: in this process, or on Flower's simulation engine."""

    embedded = "embedded"
    flower = "flower"


def _setup(threads: int | None) -> None:
    import logging

    import torch

    if threads:
        torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def train(
    config: Optional[str] = typer.Argument(None, help="training config YAML, or a shipped config's name (`nefl-zoo configs`); omit with --resume"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="run directory (default: runs/NAME-METHOD-sSEED)"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="continue the run in this directory from its checkpoint"),
    set_: List[str] = typer.Option([], "--set", help="override a config key, e.g. --set rounds=3 --set data.alpha=0.5"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or summary table"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a run already in the run directory"),
    engine_name: EngineName = typer.Option(
        EngineName.embedded, "--engine", help="embedded (in process) or flower (Flower's simulation engine; needs the flower extra)"
    ),
    as_json: bool = json_option(),
) -> None:
    """Train one method on one configuration; write metrics, checkpoints and the global state.
    With --json: no progress bar; the final accuracies and bytes moved as JSON."""
    if config is None and resume is None:
        raise fail("give a CONFIG file or --resume RUN_DIR")
    flower = _flower() if engine_name is EngineName.flower else None
    require_positive(threads=threads)
    _setup(threads)
    from nefl_zoo.fl.config import ConfigError, apply_overrides, load_config, parse_config
    from nefl_zoo.fl.engine import Engine, resume_config
    from nefl_zoo.spec import SpecError

    with user_errors(ConfigError, SpecError):
        if resume is not None:
            saved = resume_config(resume).to_dict()
            cfg = parse_config(apply_overrides(saved, set_, str(resume)), str(resume))
            run_dir = resume
        else:
            cfg = load_config(config, set_)
            run_dir = out or Path("runs") / f"{cfg.name}-{cfg.method}-s{cfg.seed}"
        _check_folder("--resume" if resume is not None else "--out", run_dir)
        with RichProgress() if not (quiet or as_json) else contextlib.nullcontext() as progress, stdout_to_stderr(as_json):
            if flower is not None:
                result = flower.simulate(cfg, run_dir, resume=resume is not None, overwrite=overwrite, observer=progress, threads=threads)
            else:
                result = Engine(cfg, run_dir).run(resume=resume is not None, overwrite=overwrite, observer=progress)
    if as_json:
        print_json({"method": cfg.method, "name": cfg.name, "run_dir": str(run_dir), **asdict(result)})


def _flower(what: str = "--engine flower"):
    """``nefl_zoo.fl.flower``, or a one-line error naming the extra to install."""
    try:
        from nefl_zoo.fl import flower
    except ImportError as exc:
        raise fail(f"{what} needs Flower: pip install 'nefl-zoo[flower]' ({exc})") from None
    return flower


def clientapp(
    runtime_api_address: str = typer.Option("127.0.0.1:9094", "--runtime-api-address",
                                            help="the SuperNode's Runtime API as HOST:PORT, IPv6 in brackets (flower-supernode --port)"),
    insecure: bool = typer.Option(False, "--insecure", help="plain HTTP to the SuperNode (its default)"),
    root_certificates: Optional[Path] = typer.Option(None, "--root-certificates", help="CA certificate of a TLS Runtime API"),
    poll: float = typer.Option(0.25, "--poll", help="seconds between requests for a task while idle, at most 3600 (each costs the SuperNode and this process about 3 ms of CPU)"),
) -> None:
    """A long-running ClientApp process for a SuperNode started with --isolation process: imports,
    data and model set-up once per node instead of once per message."""
    from nefl_zoo.bounds import MAX_POLL_S, address, number

    if not insecure and root_certificates is None:
        raise fail("--insecure or --root-certificates: say how to reach the SuperNode's Runtime API")
    if insecure and root_certificates is not None:
        raise fail("--insecure or --root-certificates: give one (plain HTTP, or TLS checked against the certificate)")
    address("--runtime-api-address", runtime_api_address)  # a ValueError is one line, exit 2 (guarded)
    number("--poll", poll, 0, MAX_POLL_S, open_low=True)
    _flower("nefl-zoo clientapp")
    _setup(None)
    from nefl_zoo.fl.flower.worker import serve

    certificates = None
    if root_certificates is not None:
        with user_errors(OSError):
            certificates = root_certificates.read_bytes()
    serve(runtime_api_address, insecure=insecure, root_certificates=certificates, poll=poll)


def compare(
    config: str = typer.Argument(..., help="training config YAML shared by every method, or a shipped config's name (`nefl-zoo configs`)"),
    methods: Optional[str] = typer.Option(
        None, "--methods",
        help="comma-separated methods (default: nefl,fjord,heterofl,depthfl); METHOD:VARIANT sets method_args.variant; "
        "METHOD=SPEC runs a method on another spec file or shipped spec (nefl=resnet20/nefl-d, depthfl:nefl=resnet20/nefl-d)",
    ),
    preset: Optional[str] = typer.Option(
        None, "--preset", help="a named set of entries instead of --methods: nefl-table1 (the NeFL paper's Table 1 rows and ablation)"
    ),
    seeds: int = typer.Option(3, "--seeds", help="seeds per method (config seed, +1, ...)"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="output folder (default: runs/compare-NAME)"),
    set_: List[str] = typer.Option([], "--set", help="override a config key for every run"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bars"),
    jobs: int = typer.Option(1, "--jobs", help="runs at a time, each in its own process (no progress bars)"),
    as_json: bool = json_option(),
) -> None:
    """Run several methods x seeds on one setup; write results.md (Table 1 layout, both BN
    treatments, NeFL's paired differences) and a plot. With --json: no progress bars; every
    run's result and the files written as JSON."""
    require_positive(seeds=seeds, threads=threads, jobs=jobs)
    _setup(threads)
    from nefl_zoo.fl import registered_methods
    from nefl_zoo.fl.compare import PRESETS, compare_methods, parse_entry
    from nefl_zoo.fl.config import MAX_SEED, ConfigError, load_config
    from nefl_zoo.spec import SpecError

    if preset is not None and methods is not None:
        raise fail("--preset: give --preset or --methods, not both")
    if preset is not None and preset not in PRESETS:
        raise fail(f"--preset: expected {', '.join(PRESETS)}, got {preset!r}")
    known = registered_methods()
    names = [m.strip() for m in (methods or "nefl,fjord,heterofl,depthfl").split(",") if m.strip()]
    unknown = [m for m in names if m.partition("=")[0].partition(":")[0].strip() not in known]
    if preset is None and (not names or unknown):
        raise fail(f"--methods: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    try:
        keys = [parse_entry(m).key for m in names] if preset is None else []
    except SpecError as exc:
        raise fail(f"--methods: {exc}") from None
    if len(set(keys)) < len(keys):
        raise fail(f"--methods: two entries share a name ({', '.join(keys)}); give spec files different names")
    with user_errors(ConfigError, SpecError):
        cfg = load_config(config, set_)
        if preset is not None:
            names = PRESETS[preset](cfg)
        if cfg.seed + seeds - 1 > MAX_SEED:
            raise fail(f"--seeds: seeds {cfg.seed}..{cfg.seed + seeds - 1} go past {MAX_SEED}; lower seed or --seeds")
        folder = out or Path("runs") / f"compare-{cfg.name}"
        _check_folder("--out", folder)
        with stdout_to_stderr(as_json):
            progress = None if quiet or as_json or jobs > 1 else RichProgress
            result = compare_methods(cfg, names, seeds, folder, progress, jobs=jobs, threads=threads)
    if as_json:
        runs = {key: [asdict(r) for r in rs] for key, rs in result.runs.items()}
        print_json({"out": str(folder), "results_md": str(result.results_md), "plot": str(result.plot), "runs": runs})
        return
    typer.echo(result.markdown)
    typer.echo(f"wrote {result.results_md} and {result.plot}")


def _check_folder(option: str, path: Path) -> None:
    """Exit with a one-line error when ``path`` (or a folder above it) exists as a file."""
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise fail(f"{option}: {folder} is a file, not a folder")
            return


def methods(as_json: bool = json_option()) -> None:
    """List the registered FL methods with their method_args and defaults."""
    from nefl_zoo.fl import registered_methods

    rows = [
        {
            "method": name,
            "label": cls.label,
            "method_args": cls.Settings().model_dump(mode="json"),
            "description": " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()).replace("``", ""),
        }
        for name, cls in registered_methods().items()
    ]
    if as_json:
        print_json(rows)
        return
    from rich.table import Table

    from .console import console

    table = Table("method", "label", "method_args (defaults)", "description")
    for r in rows:
        args = ", ".join(f"{k}: {v}" for k, v in r["method_args"].items()) or "none"
        table.add_row(r["method"], r["label"], args, r["description"])
    console().print(table)


def configs(as_json: bool = json_option()) -> None:
    """List the shipped training configs, which `train` and `compare` take by name."""
    from nefl_zoo.fl.config import shipped_configs, shipped_configs_dir
    from nefl_zoo.userfiles import read_text, read_yaml

    rows = []
    for name in shipped_configs():
        path = shipped_configs_dir() / f"{name}.yaml"
        data = read_yaml(path)
        spec = data.get("spec")
        rows.append({
            "config": name,
            "method": data.get("method", "nefl"),
            "model": spec.get("model") if isinstance(spec, dict) else spec,
            "dataset": (data.get("data") or {}).get("dataset"),
            "rounds": data.get("rounds"),
            "description": _header(read_text(path)),
        })
    if as_json:
        print_json(rows)
        return
    from rich.table import Table

    from .console import console

    table = Table("config", "method", "model", "dataset", "rounds", "description")
    for r in rows:
        table.add_row(r["config"], r["method"], str(r["model"]), str(r["dataset"]), str(r["rounds"]), r["description"])
    console().print(table)


def _header(text: str, width: int = 80) -> str:
    """The first sentence of a YAML file's leading comment, cut at ``width`` characters."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    sentence = " ".join(" ".join(lines).split())
    end = sentence.find(". ")
    sentence = sentence if end < 0 else sentence[: end + 1]
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."


def register(app: typer.Typer) -> None:
    """Add ``train``, ``compare``, ``configs``, ``methods`` and ``clientapp`` to the ``nefl-zoo`` app."""
    app.command("train")(guarded(train))
    app.command("configs")(guarded(configs))
    app.command("compare")(guarded(compare))
    app.command("methods")(guarded(methods))
    app.command("clientapp")(guarded(clientapp))

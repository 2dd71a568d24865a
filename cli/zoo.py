"""``models``, ``specs``, ``schema``, ``build`` and ``profile``."""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from .console import console, json_option, print_json, stdout_to_stderr
from .errors import fail, guarded, require_positive, user_errors


class Format(str, Enum):
    table = "table"
    markdown = "markdown"
    csv = "csv"
    json = "json"  # deprecated: --json


FORMAT_JSON_NOTE = "note: --format json is deprecated and will be removed; use --json (the same output)"


class Mode(str, Enum):
    balanced = "balanced"
    width = "width"
    depth = "depth"


def models(as_json: bool = json_option()) -> None:
    """List the zoo's models with their stages and full-size parameter counts."""
    import torch

    from nefl_zoo.models import count_params, create_model, list_models, model_info

    rows = []
    for name in list_models():
        with torch.device("meta"):
            m = create_model(name)
        rows.append({
            "model": name,
            "blocks_per_stage": list(m.stage_depths),
            "params": count_params(m),
            "input_size": list(m.default_cfg["input_size"]),
            "description": model_info(name).summary,
        })
    if as_json:
        print_json(rows)
        return
    from rich.table import Table

    table = Table("model", "blocks per stage", "params", "input", "description")
    for r in rows:
        table.add_row(
            r["model"], "/".join(map(str, r["blocks_per_stage"])), f"{r['params'] / 1e6:.2f}M",
            "x".join(map(str, r["input_size"])), r["description"],
        )
    console().print(table)


def specs(as_json: bool = json_option()) -> None:
    """List the shipped specs (the specs/ folder, or NEFL_ZOO_SPECS) and their tiers."""
    from nefl_zoo.spec import SpecError, load_spec, shipped_specs_dir

    root = shipped_specs_dir()
    rows = []
    for path in sorted(root.glob("*/*.yaml")):
        if path.parent.name == "train":
            continue
        name = str(path.relative_to(root).with_suffix(""))
        try:
            spec = load_spec(path)
        except SpecError as exc:
            rows.append({"spec": name, "error": str(exc)})
            continue
        rows.append({"spec": name, "model": spec.model, "tiers": [{"name": t.name, "gamma": t.gamma} for t in spec.tiers]})
    if as_json:
        print_json(rows)
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table("spec", "model", "tiers (nominal gamma)")
    for r in rows:
        if "error" in r:
            table.add_row(r["spec"], "[red]invalid[/]", escape(r["error"]))
            continue
        tiers = ", ".join(t["name"] if t["gamma"] is None else f"{t['name']} ({t['gamma']:g})" for t in r["tiers"])
        table.add_row(r["spec"], r["model"], tiers)
    console().print(table)


def schema(as_json: bool = typer.Option(False, "--json", help="accepted like every command's --json; the schema is JSON either way")) -> None:
    """Print the JSON Schema of spec files (for editor completion)."""
    from nefl_zoo.spec import json_schema

    print_json(json_schema())


def build(
    model: Optional[str] = typer.Argument(None, help="zoo model (optional with --spec)"),
    gamma: Optional[float] = typer.Option(None, help="target parameter ratio in (0, 1] (default 1)"),
    mode: Mode = typer.Option(Mode.balanced, help="how to reach gamma"),
    channel_multiple: Optional[int] = typer.Option(
        None, help="round every width to a multiple of N (1: the paper's rule; default: the model's, 8 for mobile families)"
    ),
    latency_ms: Optional[float] = typer.Option(
        None, help="instead of --gamma: the largest tier within this onnxruntime latency here (measured)"
    ),
    batch: int = typer.Option(1, help="batch for --latency-ms"),
    threads: int = typer.Option(1, help="onnxruntime threads for --latency-ms"),
    spec: Optional[Path] = typer.Option(None, help="spec file or shipped spec name"),
    tier: Optional[str] = typer.Option(None, help="tier of --spec"),
    pretrained: Optional[str] = typer.Option(None, help="weights file or torchvision:/timm: name"),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="write the weights to this .safetensors file and the tier spec beside it (.yaml)"
    ),
    as_json: bool = json_option(),
) -> None:
    """Build a physically slimmed submodel and say what it is."""
    from nefl_zoo.spec import SpecError, SubmodelSpec

    gamma = _checked_gamma(gamma, latency_ms)
    require_positive(channel_multiple=channel_multiple, batch=batch, threads=threads)
    if out is not None:
        _check_out(out)
    measured, note = None, ""
    with user_errors(SpecError), stdout_to_stderr(as_json):  # an exporter's progress lines (--latency-ms)
        if spec is not None:
            if latency_ms is not None:
                raise fail("--latency-ms: builds a tier of a MODEL, not one of --spec")
            sub, chosen = _spec_tier(spec, model, tier)
        else:
            chosen, note, measured = _model_tier(model, gamma, mode, channel_multiple, latency_ms, batch, threads)
            sub = SubmodelSpec(model=model, tiers=[chosen])
        report, slim = _build_report(sub, chosen.name, pretrained, weights=out is not None or pretrained is not None)
        if out is not None:
            _write_submodel(out, slim, sub, chosen.name)
            report["out"] = str(out)
    if measured is not None:
        report |= {"latency_ms": measured.latency_ms, "budget_ms": latency_ms, "batch": batch, "threads": threads}
    if as_json:
        print_json(report | ({"note": note} if note else {}))
        return
    typer.echo(_build_line(report, out))
    if measured is not None:
        typer.echo(
            f"onnxruntime latency here: {measured.latency_ms:.3f} ms at batch {batch}, {threads} thread(s) "
            f"(budget {latency_ms:g} ms, {measured.latency_ms / latency_ms:.0%} of it; "
            f"{len(measured.candidates)} candidates measured)"
        )
    if note:
        typer.echo(f"note: {note}", err=True)


def _checked_gamma(gamma: float | None, latency_ms: float | None) -> float:
    """``--gamma`` (default 1), refused with ``--latency-ms`` or outside (0, 1]; ``--latency-ms``
    refused unless finite and positive."""
    if gamma is not None and latency_ms is not None:
        raise fail("--latency-ms: give --gamma or --latency-ms, not both")
    if latency_ms is not None and not (math.isfinite(latency_ms) and latency_ms > 0):
        raise fail(f"--latency-ms: must be a finite number > 0, got {latency_ms:g}")
    gamma = 1.0 if gamma is None else gamma
    if not 0 < gamma <= 1:
        raise fail(f"--gamma: must be in (0, 1], got {gamma:g}")
    return gamma


def _spec_tier(spec: Path, model: str | None, tier: str | None):
    """The spec of ``--spec`` and its tier ``--tier`` (needed when it has several)."""
    from nefl_zoo.spec import load_spec, resolve_spec_path

    sub = load_spec(resolve_spec_path(spec))
    if model is not None and model != sub.model:
        raise fail(f"{spec}: model: spec is for {sub.model}, not {model}")
    if tier is None:
        if len(sub.tiers) != 1:
            raise fail(f"{spec}: tiers: give --tier, one of {', '.join(t.name for t in sub.tiers)}")
        tier = sub.tiers[0].name
    return sub, sub.tier(tier)


def _model_tier(model: str | None, gamma: float, mode: Mode, channel_multiple: int | None, latency_ms: float | None,
                batch: int, threads: int):
    """The tier of MODEL found for ``gamma`` (or measured for ``latency_ms``): ``(tier, note,
    measured)``, ``measured`` the latency search's result or ``None``."""
    if model is None:
        raise fail("give a MODEL or --spec FILE (see `nefl-zoo models`)")
    from nefl_zoo.auto import auto_tier
    from nefl_zoo.models import NestError, is_model, list_models

    if not is_model(model):
        raise fail(f"model: unknown model {model!r}; one of {', '.join(list_models())}")
    if latency_ms is not None:
        from nefl_zoo.auto import latency_tier

        try:
            measured = latency_tier(model, latency_ms, batch, threads, mode.value, channel_multiple)
        except ValueError as exc:
            raise fail(f"--latency-ms: {exc}") from None
        return measured.tier, "", measured
    try:
        found = auto_tier(model, gamma, mode.value, channel_multiple=channel_multiple)
    except NestError as exc:  # torchvision:/timm: networks that cannot be nested
        raise fail(f"model: {model}: {exc}") from None
    except ValueError as exc:
        raise fail(f"--gamma: {str(exc).removeprefix('gamma ')}") from None
    return found.tier, found.note, None


def _build_line(report: dict, out: Path | None) -> str:
    """The one line ``build`` prints about its tier."""
    blocks = "/".join(map(str, report["blocks_per_stage"]))
    return (
        f"{report['model']} tier {report['tier']}: {report['params']:,} params "
        f"({report['params_ratio']:.3f} of full), {report['macs'] / 1e6:,.1f}M MACs "
        f"({report['macs_ratio']:.3f}), gamma_w={report['gamma_w']:g}"
        + (f", channels a multiple of {report['channel_multiple']}" if report["channel_multiple"] > 1 else "")
        + f", blocks per stage {blocks}"
        + (f", written to {out}" if out else "")
    )


def _build_report(spec, tier: str, pretrained: str | None, weights: bool) -> tuple[dict, "object"]:
    """What ``tier`` of ``spec`` is; with ``weights`` also the slim module carrying the full
    model's (``pretrained``) weights, else shape-only modules and cached MACs (no weights)."""
    import torch

    from nefl_zoo.models import count_params
    from nefl_zoo.profile import blocks_per_stage, macs_signature, tier_macs
    from nefl_zoo.slim import compile_spec

    compiled = compile_spec(spec)
    ct = compiled[tier]
    slim = None
    if weights:
        full = compiled.create_global_model(pretrained=pretrained)
        slim = ct.load(compiled.init_global_state(full))
    with torch.device("meta"):
        full_meta = compiled.create_global_model()
        full_params, params = count_params(full_meta), count_params(ct.build())
    size = compiled.input_size
    macs = tier_macs(macs_signature(spec, ct.tier, size), ct.build)
    full_macs = tier_macs(macs_signature(spec, None, size), compiled.create_global_model)
    report = {
        "model": spec.model,
        "tier": tier,
        "params": params,
        "params_ratio": params / full_params,
        "macs": macs,
        "macs_ratio": macs / full_macs,
        "gamma": ct.tier.gamma,
        "gamma_w": ct.tier.gamma_w,
        "channel_multiple": spec.tier_args(ct.tier)["channel_multiple"],
        "blocks_per_stage": blocks_per_stage(ct, full_meta.stage_depths),
    }
    return report, slim


WEIGHTS_SUFFIX = ".safetensors"


def _check_out(out: Path) -> None:
    """Exit with a one-line error, before any work, unless ``out`` can take the weights and
    the one-tier spec beside it (``OUT`` with ``.yaml``): a ``.safetensors`` file name, neither
    it nor the spec an existing folder, its parent a folder or not yet there."""
    spec = out.with_suffix(".yaml")
    if out.is_dir():
        raise fail(f"--out: {out} is a folder; give a weights file name such as {out / ('model' + WEIGHTS_SUFFIX)}")
    if out.suffix.lower() != WEIGHTS_SUFFIX:
        raise fail(
            f"--out: {out}: expected a {WEIGHTS_SUFFIX} file name for the weights "
            f"(the tier spec is written beside it as {out.stem}.yaml)"
        )
    if spec.is_dir():
        raise fail(f"--out: {spec} (the tier spec written beside the weights) is a folder")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise fail(f"--out: {parent} is a file, not a folder")
            break


def _write_submodel(out: Path, slim, spec, tier: str) -> None:
    """Weights as safetensors and a one-tier spec as YAML, each written atomically."""
    import yaml
    from safetensors.torch import save_file

    from nefl_zoo.files import atomic_write

    out.parent.mkdir(parents=True, exist_ok=True)
    one = spec.model_copy(update={"tiers": [spec.tier(tier)]})
    weights = {k: v.contiguous() for k, v in slim.state_dict().items()}
    atomic_write(out, lambda p: save_file(weights, str(p)))
    text = yaml.safe_dump(one.model_dump(exclude_none=True), sort_keys=False)
    atomic_write(out.with_suffix(".yaml"), lambda p: p.write_text(text))


def profile(
    spec: str = typer.Argument(..., help="spec file or shipped spec name (e.g. resnet110/nefl-wd)"),
    fmt: Format = typer.Option(Format.table, "--format", help="table format (json: deprecated, use --json)"),
    by_module: bool = typer.Option(False, "--by-module", help="per-module MACs and parameters"),
    latency: bool = typer.Option(False, "--latency", help="measure median CPU latency per tier"),
    batch: int = typer.Option(64, help="batch size for --latency"),
    as_json: bool = json_option(),
) -> None:
    """Parameters, MACs (and latency) of every tier of a spec, as a table for papers."""
    from nefl_zoo import profile as prof
    from nefl_zoo.slim import compile_spec
    from nefl_zoo.spec import SpecError, load_spec, resolve_spec_path

    require_positive(batch=batch)
    if as_json and fmt not in (Format.table, Format.json):
        raise fail(f"--json: prints JSON; leave out --format {fmt.value}")
    if fmt is Format.json:
        typer.echo(FORMAT_JSON_NOTE, err=True)
    fmt = Format.json if as_json else fmt
    with user_errors(SpecError):
        sub = load_spec(resolve_spec_path(spec))
        compiled = compile_spec(sub)
        if by_module:
            _print_by_module(compiled, fmt)
            return
        profiles = prof.profile_tiers(compiled, latency_batch=batch if latency else None)
    if fmt is Format.markdown:
        typer.echo(prof.to_markdown(profiles))
    elif fmt is Format.csv:
        typer.echo(prof.to_csv(profiles), nl=False)
    elif fmt is Format.json:
        typer.echo(prof.to_json(profiles))
    else:
        from rich.table import Table

        header, rows = prof.table_rows(profiles)
        table = Table(*header, title=f"{sub.model}: {spec}", caption=prof.MACS_NOTE)
        for row in rows:
            table.add_row(*row)
        console().print(table)


def _print_by_module(compiled, fmt: Format) -> None:
    from nefl_zoo.models import count_params
    from nefl_zoo.profile import macs_by_module

    records = []
    for ct in compiled.tiers.values():
        model = ct.build()
        macs = macs_by_module(model, compiled.input_size)
        records += [
            {"tier": ct.name, "module": k or "(total)", "params": count_params(model.get_submodule(k)), "macs": v}
            for k, v in macs.items()
        ]
    if fmt is Format.json:
        print_json(records)
    elif fmt is Format.csv:
        typer.echo("tier,module,params,macs")
        for r in records:
            typer.echo(f"{r['tier']},{r['module']},{r['params']},{r['macs']}")
    elif fmt is Format.markdown:
        typer.echo("| tier | module | params | MACs |\n|---|---|---|---|")
        for r in records:
            typer.echo(f"| {r['tier']} | {r['module']} | {r['params']:,} | {r['macs']:,} |")
    else:
        from rich.table import Table

        table = Table("tier", "module", "params", "MACs")
        for r in records:
            table.add_row(r["tier"], r["module"], f"{r['params']:,}", f"{r['macs']:,}")
        console().print(table)


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""
    for command in (models, specs, schema, build, profile):
        app.command()(guarded(command))

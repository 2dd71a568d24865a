"""The comparison's report (nefl_zoo/fl/compare.py) from finished runs written by hand: the whole
markdown table, MACs per client-round, the figure's data, reuse of finished runs, and the entries
a method text or a preset makes. No run is trained here."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from nefl_zoo.fl.compare import (Entry, client_round_macs, client_sizes, compare_methods, entry_config, flatness, load_runs,
                                 nefl_table1, parse_entry, results_table)
from nefl_zoo.fl.engine import RunResult

from .conftest import tiny

TIERS = ("g0.25", "g0.5", "g1")
ACC = {"nefl": [(0.5, 0.7, 0.9), (0.6, 0.8, 0.9)], "heterofl": [(0.4, 0.7, 0.8), (0.7, 0.6, 0.8)]}
TRAINED = [{"0": "g0.25", "3": "g1"}, {"1": "g0.5"}]  # per round: client -> level; an evaluation-only record after


def result(key: str, seed: int) -> RunResult:
    acc = dict(zip(TIERS, ACC[key][seed]))
    extra = {f"running/{t}": a for t, a in acc.items()} | {f"recompute/{t}": a + 0.05 for t, a in acc.items()}
    if key == "nefl":  # a further model the method evaluates (DepthFL's ensemble of exits)
        extra |= {"running/ensemble": 0.95 - 0.02 * seed, "recompute/ensemble": 0.96}
    return RunResult(acc, acc["g0.25"], float(np.mean(list(acc.values()))), min(acc.values()), "g0.25", 0, 0, 2, extra)


def write_runs(out, seeds: int = 2) -> dict[str, list[RunResult]]:
    """Finished runs of NeFL and HeteroFL: ``summary.json`` and ``metrics.jsonl`` per seed; in
    round 1, NeFL's accuracy with running statistics 10 points below what it reports, HeteroFL's
    evaluation without BN treatments (its reported accuracy counts)."""
    runs = {}
    for key in ACC:
        runs[key] = [result(key, s) for s in range(seeds)]
        for s, r in enumerate(runs[key]):
            folder = out / key / f"seed{s}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps(asdict(r)))
            first = {t: a - 0.1 for t, a in r.acc.items()}
            extra = {"extra": {f"running/{t}": a - 0.1 for t, a in first.items()}} if key == "nefl" else {}  # none: the reported
            lines = [{"round": 1, "per_client": {c: {"tier": t} for c, t in TRAINED[0].items()}, "acc": first, **extra},
                     {"round": 2, "per_client": {c: {"tier": t} for c, t in TRAINED[1].items()}},
                     {"round": 2, "acc": r.acc, "extra": r.extra}]
            (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return runs


def section(treatment: str, shift: float, ensemble: str) -> str:
    """One BN treatment's part of the table: accuracies ``shift`` points above the running ones."""
    def v(x):
        return f"{x + shift:.2f}"

    return f"""
BN statistics at evaluation: **{treatment}**

| Model | Method | Worst | Avg | Min | MACs per client-round (M) |
|---|---|---|---|---|---|
| resnet20 | NeFL | {v(55)} ± 7.07 | {v(73 + 1 / 3)} ± 4.71 | {v(55)} ± 7.07 | 1.5 |
| resnet20 | HeteroFL | {v(55)} ± 21.21 | {v(66 + 2 / 3)} ± 4.71 | {v(50)} ± 14.14 | – |

| Method | g0.25 | g0.5 | g1 |
|---|---|---|---|
| NeFL | {v(55)} | {v(75)} | {v(90)} |
| HeteroFL | {v(55)} | {v(65)} | {v(80)} |

NeFL ensemble: {ensemble}

NeFL minus baseline, worst case, paired by seed: mean ± std (seeds NeFL is ahead, of 2)

| Baseline | NeFL |
|---|---|
| HeteroFL | 0.00 ± 14.14 (1/2) |
"""


TABLE = ("Top-1 accuracy (%) of the worst-case submodel (the smallest, as in the NeFL paper), the average and the minimum "
         "over submodels, mean ± std over 2 seed(s); digits, iid, 2 rounds, 4 clients x 1.0.\n"
         + section("running", 0, "94.00 ± 1.41") + section("recompute", 5, "96.00 ± 0.00"))  # recomputed: 5 points up


def test_the_table_has_every_treatment_row_column_further_model_and_paired_difference(tmp_path):
    config = tiny(rounds=2)
    runs = write_runs(tmp_path)
    entries = [Entry("nefl", "nefl"), Entry("heterofl", "heterofl")]
    table = results_table(config, entries, runs, {"nefl": 1.5e6, "heterofl": None})
    assert table == TABLE  # recomputed statistics: every accuracy 5 points higher
    alone = results_table(config, entries[:1], {"nefl": runs["nefl"]})
    assert "NeFL minus baseline" not in alone and "MACs" not in alone and "| resnet20 | NeFL | 55.00 ± 7.07 | 73.33 ± 4.71 | 55.00 ± 7.07 |\n" in alone
    no_treatments = {k: [RunResult(**{**asdict(r), "extra": {}}) for r in rs] for k, rs in runs.items()}
    assert "BN statistics at evaluation: **running**" in results_table(config, entries, no_treatments)
    dirichlet = tiny(rounds=2, data__partition="dirichlet", data__alpha=0.3)
    assert "; digits, dirichlet (alpha 0.3), 2 rounds" in results_table(dirichlet, entries, runs)


def test_macs_per_client_round_average_every_trained_client_of_every_round_and_seed(tmp_path, monkeypatch):
    from nefl_zoo.fl import compare
    from nefl_zoo.data.loading import load_data

    monkeypatch.setattr(compare, "_SIZES", {})  # read here, not from an earlier test's cache

    config = tiny(rounds=2)
    write_runs(tmp_path)
    strategy = config.build_strategy()
    data = load_data(config.data, config.data_root(), strategy.info.input_size, 4, config.seed)
    sizes = [len(data.client_dataset(c)) for c in range(4)]
    assert client_sizes(config, strategy.info.input_size) == sizes
    assert len(client_sizes(tiny(clients__num_clients=2), strategy.info.input_size)) == 2  # read again for other clients
    per_client = [config.train.local_epochs * sizes[int(c)] * strategy.client_macs(t) for r in TRAINED for c, t in r.items()]
    expected = sum(per_client) / len(per_client)  # the same clients in both seeds
    assert client_round_macs(config, Entry("nefl", "nefl"), [0, 1], tmp_path) == pytest.approx(expected, rel=1e-12)


def test_reused_runs_are_reported_with_their_table_and_figure_and_nothing_is_trained(tmp_path, monkeypatch):
    import matplotlib.colors
    import matplotlib.figure

    from nefl_zoo.profile import profile_tiers

    config = tiny(rounds=2)
    runs = write_runs(tmp_path)
    assert load_runs(config, ["nefl", "heterofl"], 2, tmp_path) == runs
    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    done = compare_methods(config, ["nefl", "heterofl"], 2, tmp_path, reuse=True)
    assert done.runs == runs  # read, not trained again (training would not give these numbers)
    assert done.results_md.read_text() == f"# tiny: method comparison\n\n{done.markdown}\n![accuracy vs MACs and vs round](comparison.png)\n"
    assert done.markdown.startswith(TABLE.split("| resnet20 | NeFL |")[0])  # the MACs are measured: checked above
    (fig,) = figures
    left, right = fig.axes
    assert (left.get_xlabel(), left.get_ylabel(), left.get_title()) == ("MACs per image (millions)", "top-1 accuracy (%)",
                                                                         "final accuracy, BN running")
    assert (right.get_xlabel(), right.get_ylabel()) == ("round", "worst-case top-1 accuracy (%)")
    macs = {p.name: p.macs / 1e6 for p in profile_tiers(config.build_strategy().compiled)}
    points = left.lines[0].get_data()  # NeFL's submodels by MACs: mean accuracy over seeds
    assert np.array_equal(points[0], [macs[t] for t in TIERS]) and np.allclose(points[1], [55, 75, 90])
    nefl, heterofl = right.lines  # the worst case per round, mean over seeds, under running statistics
    assert np.array_equal(nefl.get_xdata(), [1, 2]) and np.allclose(nefl.get_ydata(), [35, 55])  # not the reported 45
    assert np.allclose(heterofl.get_ydata(), [45, 55])
    for line, band, spread in zip(right.lines, right.collections, [5, 15]):  # +- the std over seeds, in the line's colour
        assert np.isclose(band.get_paths()[0].vertices[:, 1].max(), line.get_ydata().max() + spread)
        assert np.allclose(band.get_facecolor()[0][:3], matplotlib.colors.to_rgb(line.get_color()))
    assert all(g.get_alpha() == 0.3 for ax in (left, right) for g in ax.xaxis.get_gridlines())


def test_a_flat_curve_of_one_seed_has_only_the_test_sets_standard_error():
    rounds, acc = np.array([1, 2, 3]), np.array([[40.0, 50.0, 60.0]])
    change, noise = flatness((rounds, acc), 100, window=1)
    assert change == 10.0 and noise == pytest.approx(100 * np.sqrt(0.6 * 0.4 / 100))


def test_entries_carry_their_variant_spec_and_arguments():
    assert parse_entry("fjord:nefl") == Entry("fjord-nefl", "fjord", variant="nefl")
    spec = parse_entry("fjord:nefl=resnet20/nefl-w")
    assert (spec.key, spec.variant, spec.spec.name) == ("nefl-w-nefl", "nefl", "nefl-w.yaml")
    config = tiny(rounds=2)
    variant = entry_config(config, Entry("fjord-nefl", "fjord", variant="nefl"), 3)
    assert (variant.method, variant.seed, variant.method_args["variant"]) == ("fjord", 3, "nefl")
    assert variant.submodel_spec() == config.submodel_spec()
    rows = {e.key: (e.method, e.variant, e.spec.stem, e.method_args) for e in nefl_table1(config)}
    assert rows["depthfl-nefl"] == ("depthfl", "nefl", "nefl-d", {}) and rows["fjord-nefl"] == ("fjord", "nefl", "nefl-w", {})
    assert rows["depthfl-nested"] == ("depthfl", "nefl", "depthfl-nested", {"nested": True})
    assert rows["heterofl"][:2] == ("heterofl", None) and rows["nefl-d-nl"][:2] == ("nefl", None)

"""Latency measured on the device: `python -m nefl_zoo.runtime bench` (torch-free), its table
file and `select --latency-table`."""

import hashlib
import json
import re
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from nefl_zoo.export import ExportSource, export_tiers
from nefl_zoo.manifest import load_manifest
from nefl_zoo.runtime import TierRuntime
from nefl_zoo.runtime.__main__ import main as bench_main
from nefl_zoo.runtime.latency import (
    LatencyTableError,
    interleaved_times_ms,
    load_latency_table,
    machine_description,
    measure_latency_table,
    median_p95,
    parse_latency_table,
)
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import parse_spec
from nefl_zoo_cli.app import app

from .support.device import BLOCK, bench

SPEC = {  # two shallow, narrow tiers: the quickest export that still has a choice to make
    "model": "resnet20",
    "tiers": [
        {"name": "small", "gamma_w": 0.25, "steps": [[1, 0, 0], [1, 0, 0], [1, 0, 0]]},
        {"name": "big", "gamma_w": 0.5, "steps": [[1, 0, 0], [1, 0, 0], [1, 0, 0]]},
        {"name": "full"},
    ],
}
@pytest.fixture(scope="module")
def package(tmp_path_factory):
    compiled = compile_spec(parse_spec(SPEC))
    out = tmp_path_factory.mktemp("export")
    source = ExportSource(compiled, compiled.init_global_state(), "test", accuracy={"small": 0.7, "big": 0.8})
    export_tiers(source, out, tiers=["small", "big"], latency_runs=1)
    return out


def assert_one_line(stderr, message):
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert message in stderr, stderr


def test_the_blocker_really_makes_torch_unimportable():
    for module in ("torch", "typer"):
        done = subprocess.run([sys.executable, "-c", BLOCK + f"import {module}"], capture_output=True, text=True)
        assert done.returncode != 0 and f"BLOCKED import of {module}" in done.stderr, done.stderr
    import torch  # noqa: F401 (and without the blocker it is importable: the control means something)


def test_bench_runs_without_torch_and_writes_every_label_at_every_batch(package, tmp_path):
    out = tmp_path / "device.json"
    done = bench(package / "manifest.json", "--batch", "1,3", "--runs", "3", "--warmup", "1", "--threads", "1", "--out", out)
    assert done.returncode == 0 and "BLOCKED" not in done.stderr, done.stderr
    assert re.search(r"^small\s+3\s+[0-9.]+\s+[0-9.]+$", done.stdout, re.M), done.stdout
    table = load_latency_table(out)
    manifest = load_manifest(package)
    assert {(e.label, e.batch) for e in table.entries} == {(t, b) for t in ("small", "big") for b in (1, 3)}
    assert all(e.runs == 3 and 0 < e.median_ms <= e.p95_ms for e in table.entries)
    assert (table.model, table.threads, table.runs, table.warmup) == ("resnet20", 1, 3, 1)
    assert {e.sha256 for e in table.entries if e.label == "big"} == {manifest.tier("big").sha256}
    assert table.manifest_sha256 == hashlib.sha256((package / "manifest.json").read_bytes()).hexdigest()
    table.check_matches(manifest, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["device.json"]  # no temporary file left beside it


def test_bench_json_goes_to_stdout_and_labels_restrict_it(package):
    done = bench(package, "--labels", "big", "--runs", "1", "--warmup", "0", "--json")
    assert done.returncode == 0 and "BLOCKED" not in done.stderr, done.stderr
    data = json.loads(done.stdout)
    assert data["schema"] == "nefl-zoo-latency-table" and [e["label"] for e in data["entries"]] == ["big"]


def test_bench_prints_the_table_it_writes(package, tmp_path, capsys):
    """In this process (the subprocess tests above prove the torch-free run): the text table's
    lines are the written file's entries; without --threads the header says "default"."""
    out = tmp_path / "t.json"
    bench_main(["bench", str(package), "--runs", "2", "--warmup", "0", "--batch", "1,2", "--labels", "small, big", "--out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    table = load_latency_table(out)
    assert {(e.label, e.batch) for e in table.entries} == {(t, b) for t in ("small", "big") for b in (1, 2)}
    assert lines[0] == f"resnet20 on {table.machine.processor}: 2 timed rounds after 0 warmup, default threads"
    assert lines[1] == "label  batch   median ms      p95 ms"
    assert lines[2:-1] == [f"{e.label:<5}  {e.batch:>5}  {e.median_ms:>10.3f}  {e.p95_ms:>10.3f}" for e in table.entries]
    assert lines[-1] == f"wrote {out}"
    bench_main(["bench", str(package), "--runs", "1", "--warmup", "0", "--labels", "big", "--out", str(out)])
    (e,) = load_latency_table(out).entries  # a label narrower than the header: the column is the header's width
    assert capsys.readouterr().out.splitlines()[1:3] == [lines[1], f"big    {1:>5}  {e.median_ms:>10.3f}  {e.p95_ms:>10.3f}"]
    bench_main(["bench", str(package), "--runs", "1", "--warmup", "0", "--threads", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert (data["runs"], data["warmup"], data["threads"]) == (1, 0, 2) and {e["batch"] for e in data["entries"]} == {1}


class Measured(Exception):
    """Raised by the stand-in for the timing: what ``bench`` asked it to measure."""


def test_bench_defaults_are_the_ones_its_help_states(package, monkeypatch, capsys):
    def measure(runtime, batches, runs, warmup, labels):
        raise Measured(runtime.threads, batches, runs, warmup, labels)

    monkeypatch.setattr("nefl_zoo.runtime.latency.measure_latency_table", measure)
    with pytest.raises(Measured) as measured:
        bench_main(["bench", str(package)])
    assert measured.value.args == (None, [1], 20, 2, None)
    with pytest.raises(Measured) as measured:
        bench_main(["bench", str(package), "--threads", "1", "--labels", " big,small "])
    assert measured.value.args == (1, [1], 20, 2, ["big", "small"])
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps the help at the terminal's width
    for argv, lines in [
        (["--help"], ["usage: python -m nefl_zoo.runtime [-h] {bench} ...", "The torch-free tier runtime's commands.",
                      "bench time every tier on this device and write its latency table"]),
        (["bench", "--help"], [
            "usage: python -m nefl_zoo.runtime bench [-h] [--batch BATCH] [--runs RUNS] [--warmup WARMUP] [--threads THREADS] [--labels LABELS] [--out OUT] [--json] package",
            "package an export folder or its manifest.json",
            "--batch BATCH comma-separated batch sizes (default: 1)",
            "--runs RUNS timed rounds, every entry once per round (default: 20)",
            "--warmup WARMUP untimed rounds first (default: 2)",
            "--threads THREADS onnxruntime intra-op threads (default: one per core)",
            "--labels LABELS comma-separated entries to time (default: all)",
            "--out OUT write the table to this file (atomically)",
            "--json print the table as JSON instead of text"]),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench_main(argv)
        shown = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
        assert exit_.value.code == 0 and all(line in shown for line in lines), shown


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "1,x"], "--batch: expected comma-separated integers, got '1,x'"),
        (["--batch", "0"], "--batch: must be an integer in 1..65536, got 0"),
        (["--batch", "2,100000"], "--batch: must be an integer in 1..65536, got 100000"),
        (["--batch", "2,2"], "--batch: each size once, got [2, 2]"),
        (["--runs", "0"], "--runs: must be an integer in 1..100000, got 0"),
        (["--runs", str(10**12)], "--runs: must be an integer in 1..100000, got 1000000000000"),
        (["--warmup", "-1"], "--warmup: must be an integer in 0..100000, got -1"),
        (["--threads", "0"], "--threads: must be an integer in 1..1024, got 0"),
        (["--threads", "100000"], "--threads: must be an integer in 1..1024, got 100000"),
        (["--labels", "nope"], "unknown tier 'nope'"),
        (["--out", "/nonexistent-dir/t.json"], "/nonexistent-dir/"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bench_bad_input_is_one_line_and_exit_2(package, args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_main(["bench", str(package), "--runs", "1", *args])
    assert exit_.value.code == 2
    assert_one_line(capsys.readouterr().err, message)


@pytest.mark.parametrize(
    "argv, line",
    [
        ([], "the following arguments are required: command (`python -m nefl_zoo.runtime --help` lists the options)"),
        (["bench"], "the following arguments are required: package (`python -m nefl_zoo.runtime bench --help` lists the options)"),
    ],
)
def test_a_missing_command_or_package_is_one_line_and_exit_2(argv, line, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_main(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err == f"error: {line}\n"


@pytest.mark.parametrize(
    "error, line",
    [
        (KeyError(), "error: KeyError"),
        (OSError(28, "No space left on device", "/full/t.json"), "error: /full/t.json: No space left on device"),
        (OSError("the device went away"), "error: the device went away"),
        (MemoryError(), "error: not enough memory; use a smaller --batch"),
    ],
)
def test_errors_while_timing_are_one_line_and_exit_2(package, monkeypatch, capsys, error, line):
    def measure(*args):
        raise error

    monkeypatch.setattr("nefl_zoo.runtime.latency.measure_latency_table", measure)
    with pytest.raises(SystemExit) as exit_:
        bench_main(["bench", str(package)])
    assert exit_.value.code == 2 and capsys.readouterr().err == line + "\n"


def test_bench_out_errors_name_what_was_given_before_anything_is_timed(package, tmp_path, monkeypatch, capsys):
    """``--out`` naming a folder, or a file in a missing folder, is refused before timing in one
    line naming what the user gave (a folder was reported as the temporary file beside it); a
    write that fails later names it too."""
    monkeypatch.setattr("nefl_zoo.runtime.latency.measure_latency_table", lambda *args: pytest.fail("timed"))
    for out, message in ((tmp_path, f"--out {tmp_path}: is a folder; give the table's file name (e.g. {tmp_path / 'latency.json'})"),
                         (tmp_path / "no" / "t.json", f"--out {tmp_path / 'no' / 't.json'}: its folder {tmp_path / 'no'} does not exist")):
        with pytest.raises(SystemExit) as exit_:
            bench_main(["bench", str(package), "--out", str(out)])
        assert exit_.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"
    table = measure_latency_table(TierRuntime(package), [1], runs=1, warmup=0)

    def replaced_by_a_folder(tmp, path):  # a folder made at the path while the table was timed
        raise IsADirectoryError(21, "Is a directory", str(tmp), str(path))

    monkeypatch.setattr("os.replace", replaced_by_a_folder)
    with pytest.raises(IsADirectoryError) as err:
        table.save(tmp_path / "t.json")
    assert err.value.filename == str(tmp_path / "t.json") and not list(tmp_path.glob(".*.tmp"))


def test_select_and_the_policy_accept_the_same_latencies(package, table_file, tmp_path):
    """A latency the adaptive policy refuses (below a microsecond) is refused by a table and by
    ``select`` alike; ``select`` took a table of 0 ms entries that the policy then refused."""
    from nefl_zoo.runtime import Deadline

    with pytest.raises(LatencyTableError, match=r"entries\[0\].median_ms: .*greater than or equal to 0.001"):
        load_latency_table(edited(table_file, tmp_path, lambda d: d["entries"][0].update(median_ms=0.0, p95_ms=0.0)))
    zero = {t.label: 0.0 for t in load_manifest(package).tiers}
    with pytest.raises(ValueError, match=r"latencies\[small\]: must be a number in \[0.001, 86400000\], got 0.0"):
        TierRuntime(package).select(latency_ms=1, latencies=zero)
    with pytest.raises(ValueError, match=r"expected_ms: must be a number in \[0.001, 86400000\], got 0.0"):
        TierRuntime(package, policy=Deadline(ms=1), latencies=zero)


def test_bench_of_a_missing_package_is_one_line(tmp_path):
    done = bench(tmp_path / "nothing")  # in a subprocess: a real exit code
    assert done.returncode == 2
    assert_one_line(done.stderr, "cannot read the manifest")


def test_median_and_p95_of_known_run_times():
    assert median_p95([5.0]) == (5.0, 5.0)
    assert median_p95([4.0, 1.0, 3.0, 2.0]) == (2.5, 4.0)
    times = [float(t) for t in range(20, 0, -1)]  # 1..20 shuffled: 19 of 20 are <= 19
    assert median_p95(times) == (10.5, 19.0)
    assert median_p95([1.0] * 95 + [100.0] * 5) == (1.0, 1.0)
    assert median_p95([1.0] * 94 + [100.0] * 6) == (1.0, 100.0)


def test_runs_are_interleaved_and_every_timed_run_is_kept():
    ticks, calls = iter(range(100)), []
    times = interleaved_times_ms({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2, 1, lambda: next(ticks))
    assert calls == ["a", "b"] * 3
    assert times == {"a": [1000.0, 1000.0], "b": [1000.0, 1000.0]}  # each call one tick of the fake clock


def test_a_table_is_built_from_the_recorded_times(package):
    clock = iter([0.0, 0.002, 1.0, 1.001, 2.0, 2.010]).__next__  # three timed runs: 2, 1, 10 ms
    table = measure_latency_table(TierRuntime(package), [2], runs=3, warmup=0, labels=["small"], clock=clock)
    [entry] = table.entries
    assert (entry.label, entry.batch, entry.runs) == ("small", 2, 3)
    assert entry.median_ms == pytest.approx(2.0) and entry.p95_ms == pytest.approx(10.0)


def test_a_batch_the_export_cannot_take_is_refused_before_timing(package, tmp_path, monkeypatch):
    runtime = TierRuntime(package)
    monkeypatch.setattr("nefl_zoo.memory.available_memory_bytes", lambda: 2**30)
    with pytest.raises(ValueError, match="batch 65536: needs about .* more than the 1.0 GiB"):
        measure_latency_table(runtime, [1, 65536], runs=1, warmup=0)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"each size once"):
        measure_latency_table(runtime, [1, 1], runs=1, warmup=0)
    assert runtime._sessions == {}  # nothing was loaded or timed
    shutil.copytree(package, tmp_path / "fixed")
    data = json.loads((tmp_path / "fixed" / "manifest.json").read_text())
    data["input"]["batch"] = 1
    (tmp_path / "fixed" / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="this export has a fixed batch of 1, got --batch 2"):
        measure_latency_table(TierRuntime(tmp_path / "fixed"), [1, 2], runs=1, warmup=0)


@pytest.fixture(scope="module")
def table_file(package, tmp_path_factory):
    path = tmp_path_factory.mktemp("table") / "device.json"
    measure_latency_table(TierRuntime(package), [1, 2], runs=1, warmup=0).save(path)
    return path


def edited(table_file, tmp_path, edit):
    data = json.loads(table_file.read_text())
    edit(data)
    path = tmp_path / "device.json"
    path.write_text(json.dumps(data))
    return path


def test_a_table_round_trips(table_file, tmp_path):
    table = load_latency_table(table_file)
    table.save(tmp_path / "again.json")
    again = load_latency_table(tmp_path / "again.json")
    assert again.model_dump() == table.model_dump() and again.measured_on.endswith("(again.json)")
    assert table.for_batch(2) == {e.label: e.median_ms for e in table.entries if e.batch == 2}
    assert table.for_batch(1, "p95") == {e.label: e.p95_ms for e in table.entries if e.batch == 1}


@pytest.mark.parametrize(
    "edit, field, message",
    [
        (lambda d: d.pop("schema"), "schema", "required key is missing (not a latency table"),
        (lambda d: d.update(schema="nefl-zoo-manifest"), "schema", "'nefl-zoo-manifest', not 'nefl-zoo-latency-table'"),
        (lambda d: d.update(version=2), "version", "unsupported version 2"),
        (lambda d: d.update(runs=0), "runs", "greater than or equal to 1"),
        (lambda d: d.update(runs=10**12), "runs", "less than or equal to 100000"),
        (lambda d: d.update(warmup=10**6), "warmup", "less than or equal to 100000"),
        (lambda d: d.update(threads=0), "threads", "greater than or equal to 1"),
        (lambda d: d.update(threads=10**5), "threads", "less than or equal to 1024"),
        (lambda d: d["entries"][0].update(batch=10**9), "entries[0].batch", "less than or equal to 65536"),
        (lambda d: d["entries"][0].update(runs=0), "entries[0].runs", "greater than or equal to 1"),
        (lambda d: d["entries"][1].update(p95_ms=1e300), "entries[1].p95_ms", "less than or equal to 86400000"),
        (lambda d: d.update(colour="red"), "colour", "unknown key"),
        (lambda d: d["entries"][1].update(median_ms=-1), "entries[1].median_ms", "greater than or equal to 0.001"),
        (lambda d: d["entries"][1].update(median_ms=0, p95_ms=0), "entries[1].median_ms", "greater than or equal to 0.001"),
        (lambda d: d["entries"][0].update(p95_ms=d["entries"][0]["median_ms"] / 2), "entries[0].p95_ms", "is below median_ms"),
        (lambda d: d["entries"].append(d["entries"][0]), "entries[4]", "a second entry for small at batch 1"),
        (lambda d: d["machine"].pop("processor"), "machine.processor", "required key is missing"),
        (lambda d: d.update(entries=[]), "entries", "at least 1 item"),
    ],
)
def test_a_bad_table_names_the_file_and_field(table_file, tmp_path, edit, field, message):
    path = edited(table_file, tmp_path, edit)
    with pytest.raises(LatencyTableError) as err:
        load_latency_table(path)
    assert str(err.value).startswith(f"{path}: {field}: ") and "\n" not in str(err.value), err.value
    assert message in str(err.value)


def test_a_file_that_is_not_a_json_table_is_one_line(package, tmp_path):
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(LatencyTableError, match=r"t.json: not valid JSON \(line 1"):
        load_latency_table(tmp_path / "t.json")
    with pytest.raises(LatencyTableError, match=r"manifest.json: schema: required key is missing"):
        load_latency_table(package / "manifest.json")  # a manifest is not a table


def test_a_table_of_another_package_or_file_is_refused(table_file, tmp_path, package):
    manifest = load_manifest(package)
    with pytest.raises(LatencyTableError, match=r"device.json: entries: nothing measured at batch 7 \(batches: 1, 2;"):
        load_latency_table(table_file).for_batch(7)
    other = load_latency_table(edited(table_file, tmp_path, lambda d: d.update(model="resnet56")))
    with pytest.raises(LatencyTableError, match=r"model: 'resnet56', but the manifest is of 'resnet20'"):
        other.check_matches(manifest, 1)
    renamed = load_latency_table(edited(table_file, tmp_path, lambda d: [e.update(label="g1" + e["label"]) for e in d["entries"]]))
    with pytest.raises(LatencyTableError, match=r"entries: no entry for small at batch 1 \(run `python -m nefl_zoo"):
        renamed.check_matches(manifest, 1)
    stale = load_latency_table(edited(table_file, tmp_path, lambda d: d["entries"][1].update(sha256="0" * 64)))
    with pytest.raises(LatencyTableError, match=r"entries\[1\]\.sha256: big was timed on another file"):
        stale.check_matches(manifest, 1)
    other_manifest = load_latency_table(edited(table_file, tmp_path, lambda d: d.update(manifest_sha256="1" * 64)))
    other_manifest.check_matches(manifest, 2)  # same tier files, rewritten manifest: still applies


runner = CliRunner()


def select(*args):
    return runner.invoke(app, ["select", *map(str, args)])


def test_select_uses_the_devices_latencies(package, table_file, tmp_path):
    manifest = load_manifest(package)
    budget = 10 * max(t.latency.median_ms for t in manifest.tiers)  # every tier fits on the export machine

    def slow_device(data):  # the big tier 100x over the budget on the device, the small within it
        for e in data["entries"]:
            e["median_ms"] = e["p95_ms"] = budget * 100 if e["label"] == "big" else budget / 2

    device = edited(table_file, tmp_path, slow_device)
    on_export = select(package, "--latency-ms", budget, "--json")
    assert on_export.exit_code == 0 and json.loads(on_export.stdout)["label"] == "big", on_export.output
    on_device = select(package, "--latency-ms", budget, "--latency-table", device, "--batch", 2, "--json")
    assert on_device.exit_code == 0, on_device.output
    choice = json.loads(on_device.stdout)
    assert choice["label"] == "small" and choice["fitting"] == ["small"]
    processor = load_latency_table(device).machine.processor
    assert f"{budget / 2:.3g} ms at batch 2 on {processor} (device.json)" in choice["reason"]


@pytest.mark.parametrize(
    "args, edit, message",
    [
        (["--batch", 5], None, "device.json: entries: nothing measured at batch 5 (batches: 1, 2;"),
        ([], lambda d: d.update(entries=[e for e in d["entries"] if e["label"] != "small"]), "no entry for small at batch 1"),
        ([], lambda d: d.update(version="1"), "device.json: version: unsupported version '1'"),
        ([], lambda d: d.update(model="vit_b_16"), "device.json: model: 'vit_b_16', but the manifest is of 'resnet20'"),
    ],
)
def test_select_with_a_table_that_does_not_fit_exits_2(package, table_file, tmp_path, args, edit, message):
    path = edited(table_file, tmp_path, edit or (lambda d: None))
    result = select(package, "--latency-ms", 5, "--latency-table", path, *args)
    assert result.exit_code == 2, result.output
    assert_one_line(result.stderr, message)


def test_select_with_a_missing_table_exits_2(package, tmp_path):
    result = select(package, "--latency-table", tmp_path / "none.json")
    assert result.exit_code == 2
    assert_one_line(result.stderr, "none.json: cannot read the latency table")


def test_for_batch_gives_the_percentile_asked_for_and_errors_name_the_file(table_file, tmp_path):
    path = edited(table_file, tmp_path, lambda d: [e.update(p95_ms=2 * e["median_ms"] + 1) for e in d["entries"]])
    table = load_latency_table(path)
    assert table.for_batch(2) == table.for_batch(2, "median") == {e.label: e.median_ms for e in table.entries if e.batch == 2}
    assert table.for_batch(2, "p95") == {e.label: 2 * e.median_ms + 1 for e in table.entries if e.batch == 2}
    with pytest.raises(ValueError) as err:
        table.for_batch(2, "p50")
    assert str(err.value) == "percentile: expected median or p95, got 'p50'"
    saved = tmp_path / "moved.json"
    table.save(saved)
    assert saved.read_text().startswith('{\n  "schema": "nefl-zoo-latency-table",\n  "version": 1,')
    assert not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(LatencyTableError) as err:
        table.for_batch(9)
    assert str(err.value).startswith(f"{saved}: entries: nothing measured at batch 9")


def test_check_matches_names_the_file_it_read(table_file, tmp_path, package):
    manifest = load_manifest(package)
    renamed = edited(table_file, tmp_path, lambda d: [e.update(label="g1" + e["label"]) for e in d["entries"]])
    with pytest.raises(LatencyTableError) as err:
        load_latency_table(renamed).check_matches(manifest, 1)
    assert str(err.value) == (f"{renamed}: entries: no entry for small at batch 1 "
                              "(run `python -m nefl_zoo.runtime bench --batch 1` on the device)")
    stale = edited(table_file, tmp_path, lambda d: d["entries"][1].update(sha256="0" * 64))
    with pytest.raises(LatencyTableError) as err:
        load_latency_table(stale).check_matches(manifest, 1)
    assert str(err.value).startswith(f"{stale}: entries[1].sha256: big was timed on another file")


@pytest.mark.parametrize("data, kind", [([1, 2], "list"), ("table", "str"), (None, "NoneType")])
def test_a_table_that_is_not_an_object_is_one_line(data, kind):
    with pytest.raises(LatencyTableError) as err:
        parse_latency_table(data, "dev.json")
    assert str(err.value) == f"dev.json: expected a JSON object, got {kind}"


@pytest.mark.parametrize("kwargs, message", [
    ({"runs": 0}, "runs: must be an integer in 1..100000, got 0"), ({"runs": True}, "runs: must be an integer in 1..100000, got True"),
    ({"runs": 100_001}, "runs: must be an integer in 1..100000, got 100001"),
    ({"warmup": -1}, "warmup: must be an integer in 0..100000, got -1"), ({"warmup": 1.0}, "warmup: must be an integer in 0..100000, got 1.0"),
    ({"batches": [True]}, "batch: must be an integer in 1..65536, got True"), ({"batches": []}, "batch: give at least one batch size"),
    ({"batches": [2, 0]}, "batch: must be an integer in 1..65536, got 0"), ({"batches": [10**9]}, "batch: must be an integer in 1..65536, got 1000000000"),
])
def test_bad_counts_are_refused_before_timing(package, kwargs, message):
    runtime = TierRuntime(package)
    with pytest.raises(ValueError) as err:
        measure_latency_table(runtime, **{"batches": [1], "runs": 1, "warmup": 0, **kwargs})
    assert str(err.value) == message and runtime._sessions == {}


def test_the_table_records_the_runtime_threads_and_counts(package):
    table = measure_latency_table(TierRuntime(package, threads=1), [1], runs=2, warmup=1, labels=["big"])
    assert (table.threads, table.runs, table.warmup, [e.label for e in table.entries]) == (1, 2, 1, ["big"])


def test_interleaved_times_take_no_warmup_unless_asked():
    ticks, calls = iter(range(100)), []
    times = interleaved_times_ms({"a": lambda: calls.append("a")}, 2, clock=lambda: next(ticks))
    assert calls == ["a", "a"] and times == {"a": [1000.0, 1000.0]}


def test_machine_description_falls_back_when_the_platform_says_nothing(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    monkeypatch.setattr("os.cpu_count", lambda: None)
    machine = machine_description()
    assert (machine.processor, machine.cpu_count, machine.provider) == ("riscv64", 1, "CPUExecutionProvider")
    monkeypatch.setattr(platform, "processor", lambda: "Acme 9")
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert (machine_description("X").processor, machine_description().cpu_count, machine_description("X").provider) == ("Acme 9", 6, "X")

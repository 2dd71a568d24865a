"""The run store under faults: a kill at every named crash point, then resume, gives the run an
uninterrupted one gives, bit for bit and record for record; damaged, foreign or mismatched
checkpoints are one-line errors that change nothing; one process at a time holds a run
directory.

The crash runs are forked from one helper process (``python -c``, torch imported once, one
thread) so that each kill costs a fraction of a second; ``NEFL_ZOO_CRASH_AT=POINT[:N]`` makes
the child ``os._exit(99)`` the N-th time it reaches POINT (see ``nefl_zoo.files.crash_point``).
The resumes run in this process.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from nefl_zoo.files import CRASH_EXIT_CODE, DirLock, LockedError, atomic_write
from nefl_zoo.fl.strategy import registry
from nefl_zoo.fl.engine import Engine
from nefl_zoo.runs.store import CHECKPOINT_JSON, CheckpointError, RunExistsError, RunStore, read_pointer, rng_states
from nefl_zoo.fl.strategy.registry import register_method
from tests.conftest import tiny
from tests.test_fl_strategy import Counting  # NeFL with per-client and server state

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def counting_registered():
    saved = registry.registered_methods()
    register_method("store_counting", label="Counting")(Counting)
    try:
        yield
    finally:
        registry._METHODS.clear()
        registry._METHODS.update(saved)


def fault_config(**overrides):
    """4 rounds, a checkpoint every 2, 2 of 16 clients a round, one epoch: ~0.1 s a round."""
    spec = {"model": "resnet20", "model_args": {"in_chans": 1, "img_size": 8},
            "tiers": [{"name": "g0.25", "gamma_w": 0.25}, {"name": "g1", "gamma_w": 1.0}]}
    settings = dict(method="store_counting", spec=spec, clients__num_clients=16, clients__fraction=0.125,
                    train__local_epochs=1, data__max_test_samples=64, eval__every=1)
    return tiny(**{**settings, **overrides})


# -- the crash runs, forked from one helper process -------------------------------------------
DRIVER = r"""
import json, os, signal, sys, time, traceback
import torch
torch.set_num_threads(1)
from tests import test_store as t
registration = t.counting_registered()
registration.__enter__()  # kept: the registry is restored when it is discarded
t.fault_config()  # imports and data loading happen once, here, not in every child
from nefl_zoo.fl.engine import Engine
Engine(t.fault_config(), os.path.join(sys.argv[2], "warm-up"))
codes = []
started = time.monotonic()
for step in json.loads(open(sys.argv[1]).read()):
    pid = os.fork()
    if pid == 0:
        try:
            if step["crash"]:
                os.environ["NEFL_ZOO_CRASH_AT"] = step["crash"]
            config = t.fault_config(seed=step.get("seed", 0))
            Engine(config, step["dir"]).run(resume=step["resume"], overwrite=step.get("overwrite", False))
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    if step.get("kill_at_line"):  # a real SIGKILL as soon as metrics.jsonl has that many lines
        metrics = os.path.join(step["dir"], "metrics.jsonl")
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            try:
                with open(metrics) as f:
                    if f.read().count("\n") >= step["kill_at_line"]:
                        os.kill(pid, signal.SIGKILL)
                        break
            except FileNotFoundError:
                pass
            time.sleep(0.002)
    _, status = os.waitpid(pid, 0)
    codes.append(os.waitstatus_to_exitcode(status))
    print(f"{time.monotonic() - started:6.2f} s  {step['crash']}  {os.path.basename(step['dir'])}", file=sys.stderr)
print(json.dumps(codes))
"""

# name: the crash steps (crash point, resume?); the resume after them happens in the test
CASES = {
    "between checkpoints (round 3 logged)": [("log:jsonl:3", False)],
    "torn metrics line": [("log:jsonl:3", False)],
    "new generation half written": [("save:partial:2", False)],
    "new generation complete, not committed": [("save:before-commit:2", False)],
    "pointer written, not renamed": [("before-rename:checkpoint.json:2", False)],
    "first commit, global.safetensors not linked": [("save:committed:1", False)],
    "last commit, global.safetensors stale": [("save:committed:2", False)],
    "global linked, client state stale": [("publish:global.safetensors:2", False)],
    "old generation not yet deleted": [("save:published:2", False)],
    "before summary.json": [("summary", False)],
    "resume killed twice while replacing metrics": [
        ("save:before-commit:2", False), ("before-rename:metrics.jsonl", True), ("before-rename:metrics.csv", True)],
}
COMMITTED = {  # the checkpoint.json round right after the crash steps
    "between checkpoints (round 3 logged)": 2, "torn metrics line": 2, "new generation half written": 2,
    "new generation complete, not committed": 2, "pointer written, not renamed": 2,
    "first commit, global.safetensors not linked": 2, "last commit, global.safetensors stale": 4,
    "global linked, client state stale": 4, "old generation not yet deleted": 4, "before summary.json": 4,
    "resume killed twice while replacing metrics": 2,
}
KILL_AT_LINE = (1, 2, 3, 4)  # a real SIGKILL once metrics.jsonl holds this many records
OTHER_CRASHES = {  # directory: crash point and step options, for the tests further down
    "export-stale": ("save:committed:2", {}),
    "no-checkpoint": ("save:before-commit:1", {}),
    "overwrite": ("overwrite:cleared", {"seed": 1, "overwrite": True}),  # over a copy of the reference run
}


def case_dir(root: Path, name: str) -> Path:
    return root / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The reference run (uninterrupted, in this process) and every crashed run directory."""
    root = tmp_path_factory.mktemp("faults")
    with counting_registered():
        Engine(fault_config(), root / "reference").run()
        steps = []
        for name, crashes in CASES.items():
            for point, resume in crashes:
                steps.append({"dir": str(case_dir(root, name)), "crash": point, "resume": resume})
        steps += [{"dir": str(root / f"sigkill-{n}"), "crash": None, "resume": False, "kill_at_line": n} for n in KILL_AT_LINE]
        shutil.copytree(root / "reference", root / "overwrite")
        steps += [{"dir": str(root / name), "crash": point, "resume": False, **options}
                  for name, (point, options) in OTHER_CRASHES.items()]
        plan = root / "plan.json"
        plan.write_text(json.dumps(steps))
        done = subprocess.run([sys.executable, "-c", DRIVER, str(plan), str(root)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stderr[-3000:]
        codes = json.loads(done.stdout.strip().splitlines()[-1])
    yield root, dict(zip([(s["dir"], s["crash"]) for s in steps], codes))


def records(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time_s"} for line in (run / name).read_text().splitlines()]


def csv_rows(run: Path) -> list[list[str]]:
    rows = list(csv.reader((run / "metrics.csv").read_text().splitlines()))
    drop = rows[0].index("time_s")
    return [r[:drop] + r[drop + 1:] for r in rows]


def assert_same_run(reference: Path, run: Path) -> None:
    """Bit-identical tensors, the same metrics records (time aside) and a tidy directory."""
    for name in ("global.safetensors", "clients.safetensors", "server.safetensors"):
        a, b = load_file(str(reference / name)), load_file(str(run / name))
        assert a.keys() == b.keys(), name
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, f"{name}: {differ[:3]} differ from the uninterrupted run"
    assert records(run) == records(reference)
    assert csv_rows(run) == csv_rows(reference)
    assert json.loads((run / "summary.json").read_text()) == json.loads((reference / "summary.json").read_text())
    committed = RunStore(run, []).read_checkpoint()
    published = load_file(str(run / "global.safetensors"))
    assert all(torch.equal(committed.state[k], published[k]) for k in published)
    generation = read_pointer(run).generation
    stray = [p.name for p in run.iterdir() if (p.name.startswith("ckpt-") and not p.name.startswith(generation + "."))
             or p.name.endswith(".tmp")]
    assert not stray, stray


@pytest.mark.parametrize("name", list(CASES))
def test_a_kill_at_every_crash_point_then_resume_is_bit_identical(faults, name):
    root, codes = faults
    run = case_dir(root, name)
    for point, _ in CASES[name]:
        assert codes[(str(run), point)] == CRASH_EXIT_CODE, f"crash point {point} was never reached"
    assert read_pointer(run).round == COMMITTED[name]
    published = run / "global.safetensors"
    if name == "first commit, global.safetensors not linked":
        assert not published.exists()
    elif name != "last commit, global.safetensors stale":  # the one window: committed, not yet linked
        committed = RunStore(run, []).read_checkpoint().state
        assert all(torch.equal(t, committed[k]) for k, t in load_file(str(published)).items())
    if name.startswith("between checkpoints") or name == "torn metrics line":
        assert [r["round"] for r in records(run)] == [1, 2, 3]  # round 3's line, stale
    if name == "torn metrics line":
        text = (run / "metrics.jsonl").read_text()
        (run / "metrics.jsonl").write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])  # cut mid-line
    with counting_registered():
        Engine(fault_config(), run).run(resume=True)
    assert_same_run(root / "reference", run)


@pytest.mark.parametrize("lines", KILL_AT_LINE)
def test_a_real_sigkill_during_training_then_resume_is_bit_identical(faults, lines):
    root, codes = faults
    run = root / f"sigkill-{lines}"
    assert codes[(str(run), None)] in (-9, 0)  # killed, or (a slow poll) finished first
    with counting_registered():
        if (run / CHECKPOINT_JSON).exists():
            Engine(fault_config(), run).run(resume=True)
            assert_same_run(root / "reference", run)
        else:  # killed before its first checkpoint: nothing to resume, and it says so
            assert lines < 3
            with pytest.raises(FileNotFoundError, match="no checkpoint.json to resume from"):
                Engine(fault_config(), run).run(resume=True)


# -- crashes with nothing to resume, and --overwrite ------------------------------------------
def test_a_run_killed_before_its_first_checkpoint_says_so_and_can_start_again(faults):
    root, codes = faults
    run = root / "no-checkpoint"
    assert codes[(str(run), "save:before-commit:1")] == CRASH_EXIT_CODE
    with counting_registered():
        with pytest.raises(FileNotFoundError, match=r"no checkpoint.json to resume from \(the run stopped before its first"):
            Engine(fault_config(), run).run(resume=True)
        with pytest.raises(RunExistsError, match="already holds a run"):
            Engine(fault_config(), run).run()
        Engine(fault_config(), run).run(overwrite=True)
    assert_same_run(root / "reference", run)


def test_overwrite_removes_the_old_commit_point_first(faults):
    root, codes = faults
    run = root / "overwrite"
    assert codes[(str(run), "overwrite:cleared")] == CRASH_EXIT_CODE
    assert not (run / CHECKPOINT_JSON).exists()  # the old run cannot be resumed under the new config
    with counting_registered():
        with pytest.raises(FileNotFoundError, match="no checkpoint.json to resume from"):
            Engine(fault_config(seed=1), run).run(resume=True)
        Engine(fault_config(), run).run(overwrite=True)
    assert_same_run(root / "reference", run)


# -- damaged, foreign and mismatched checkpoints: one line, nothing changed --------------------
@pytest.fixture
def finished(faults, tmp_path):
    root, _ = faults
    run = tmp_path / "run"
    shutil.copytree(root / "reference", run)
    return run


def resume_error(run: Path, **overrides) -> str:
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.name != "run.lock"}
    with counting_registered(), pytest.raises(ValueError) as info:
        Engine(fault_config(**overrides), run).run(resume=True)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name != "run.lock"} == before  # metrics untouched
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_changed_or_truncated_checkpoint_file_is_refused(finished):
    generation = read_pointer(finished).generation
    path = finished / f"{generation}.global.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    message = resume_error(finished)
    assert message.startswith(f"{path}: ") and "changed or damaged" in message
    path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    assert "sha256" in resume_error(finished)
    path.unlink()
    assert "missing, though checkpoint.json names it" in resume_error(finished)


@pytest.mark.parametrize("edit, expected", [
    (lambda p: "{not json", "checkpoint.json: "),
    (lambda p: "[]", "checkpoint.json: "),
    (lambda p: json.dumps({**p, "round": "4"}), "round: "),
    (lambda p: json.dumps({**p, "round": -1}), "round: "),
    (lambda p: json.dumps({**p, "generation": "../../etc/passwd"}), "generation: "),
    (lambda p: json.dumps({k: v for k, v in p.items() if k != "files"}), "files: "),
    (lambda p: json.dumps({**p, "format": 1}), "format: "),
    (lambda p: "[" * 100000, "checkpoint.json: "),
])
def test_a_malformed_checkpoint_json_is_one_line(finished, edit, expected):
    pointer = json.loads((finished / CHECKPOINT_JSON).read_text())
    (finished / CHECKPOINT_JSON).write_text(edit(pointer))
    assert expected in resume_error(finished)


def test_a_checkpoint_beyond_the_configured_rounds_is_refused(finished):
    message = resume_error(finished, rounds=3)
    assert "round: 4 completed rounds, but the configuration has only 3" in message


def test_a_checkpoint_of_another_model_is_refused(finished):
    spec = {"model": "resnet20", "model_args": {"in_chans": 1, "img_size": 8},
            "tiers": [{"name": "g0.25", "gamma_w": 0.25}, {"name": "g0.5", "gamma_w": 0.5}, {"name": "g1", "gamma_w": 1.0}]}
    assert "the checkpoint does not belong to this configuration" in resume_error(finished, spec=spec)


def test_a_checkpoint_with_wrong_shapes_but_valid_hashes_is_refused(finished):
    store = RunStore(finished, [])
    checkpoint = store.read_checkpoint()
    key = "conv1.weight"
    checkpoint.state[key] = checkpoint.state[key][:4].clone()
    store.open()
    try:
        store.resume(checkpoint)
        store.save(checkpoint, checkpoint.config)
    finally:
        store.close()
    message = resume_error(finished)
    assert f"{key}: torch.float32 (4, 1, 3, 3), the configuration needs torch.float32 (16, 1, 3, 3)" in message


# -- the lock ------------------------------------------------------------------------------
def test_a_run_directory_is_locked_while_in_use(finished):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from nefl_zoo.files import DirLock; "
                               "lock = DirLock(sys.argv[1]); lock.acquire(); print('locked', flush=True); time.sleep(60)", str(finished)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        expected = re.escape(f"{finished}: another nefl-zoo process (pid {holder.pid}) is using this run directory")
        with counting_registered(), pytest.raises(LockedError, match=f"^{expected}"):
            Engine(fault_config(rounds=5), finished).run(resume=True)
        from nefl_zoo.export import load_run_dir

        with pytest.raises(LockedError, match=f"^{expected}"):
            load_run_dir(finished)
    finally:
        holder.kill()
        holder.wait()
    assert load_run_dir(finished).description == str(finished)  # released when its holder died


def test_a_second_process_cannot_train_into_a_running_run(finished):
    lock = DirLock(finished)
    lock.acquire()  # the running `train`
    try:
        with counting_registered(), pytest.raises(LockedError, match=rf"\(pid {os.getpid()}\)"):
            Engine(fault_config(rounds=5), finished).run(resume=True)
        with counting_registered(), pytest.raises(LockedError):
            Engine(fault_config(), finished).run(overwrite=True)
    finally:
        lock.release()
    with counting_registered():
        engine = Engine(fault_config(rounds=5), finished)
        engine.run(resume=True)
    assert not engine.store._lock.held  # released at the end of the run
    assert [r["round"] for r in records(finished)] == [1, 2, 3, 4, 5]


# -- export reads what was committed ---------------------------------------------------------
def test_export_reads_the_committed_checkpoint_and_verifies_spec(faults, tmp_path):
    from nefl_zoo.export import load_run_dir

    root, _ = faults
    run = tmp_path / "run"
    shutil.copytree(root / "export-stale", run)  # killed right after its last commit
    reference = load_file(str(root / "reference" / "global.safetensors"))
    stale = load_file(str(run / "global.safetensors"))
    assert any(not torch.equal(stale[k], reference[k]) for k in reference)
    source = load_run_dir(run)
    assert all(torch.equal(source.global_state[k], reference[k]) for k in reference)
    assert source.accuracy == records(root / "reference")[-1]["acc"]
    assert source.dataset == "digits"
    (run / "spec.yaml").write_text((run / "spec.yaml").read_text() + "# edited\n")
    with pytest.raises(CheckpointError, match="spec.yaml: changed since the checkpoint was written"):
        load_run_dir(run)


def test_export_of_a_plain_run_dir_drops_a_torn_last_line(faults, tmp_path):
    from nefl_zoo.export import load_run_dir

    root, _ = faults
    run = tmp_path / "plain"
    run.mkdir()
    for name in ("spec.yaml", "global.safetensors"):
        shutil.copy(root / "reference" / name, run / name)
    (run / "metrics.jsonl").write_text('{"acc": {"g1": 0.5}}\n{"acc": {"g1": 0.')
    assert load_run_dir(run).accuracy == {"g1": 0.5}


# -- atomic_write --------------------------------------------------------------------------
def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    target = tmp_path / "x.json"
    atomic_write(target, lambda p: p.write_text("{}"))
    assert events == [("fsync", str(tmp_path / ".x.json.tmp")), ("replace", str(target)), ("fsync", str(tmp_path))]
    assert target.read_text() == "{}" and not (tmp_path / ".x.json.tmp").exists()


# -- any checkpoint.json or run.json: a checkpoint or one line -------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
                    max_leaves=20)
FIELDS = ["format", "round", "generation", "files", "spec_sha256", "config", "totals", "last_eval"]


def small_run(folder: Path, run_json: bytes) -> dict:
    """A committed checkpoint of one tensor whose run.json holds ``run_json``; its pointer."""
    from safetensors.torch import save

    from nefl_zoo.runs.checkpoint import sha256

    folder.mkdir(exist_ok=True)
    blobs = {"global.safetensors": save({"w": torch.zeros(2)}), "run.json": run_json}
    generation = "ckpt-000001-0123abcd"
    for role, data in blobs.items():
        (folder / f"{generation}.{role}").write_bytes(data)
    pointer = {"format": 2, "round": 1, "generation": generation, "config": {}, "totals": {}, "last_eval": {},
               "files": {role: {"sha256": sha256(data), "bytes": len(data)} for role, data in blobs.items()}}
    (folder / CHECKPOINT_JSON).write_text(json.dumps(pointer))
    return pointer


def read_or_one_line(folder: Path) -> None:
    from nefl_zoo.runs.checkpoint import read_checkpoint

    try:
        read_checkpoint(folder, {"w": torch.zeros(2)}, rounds=5)
    except (CheckpointError, FileNotFoundError) as exc:
        assert "\n" not in str(exc) and str(exc).startswith(str(folder)), str(exc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=st.one_of(
    st.binary(max_size=300).map(lambda b: ("bytes", b)),
    JSON.map(lambda v: ("json", v)),
    st.tuples(st.sampled_from(FIELDS), JSON).map(lambda kv: ("field", kv)),
))
def test_any_checkpoint_json_is_read_or_refused_in_one_line(tmp_path, edit):
    kind, value = edit
    pointer = small_run(tmp_path / "run", json.dumps({"rng": rng_states(), "metrics": [{"round": 1}]}).encode())
    path = tmp_path / "run" / CHECKPOINT_JSON
    from nefl_zoo.runs.checkpoint import read_checkpoint

    assert read_checkpoint(tmp_path / "run")[0].round == 1  # unedited, it reads
    if kind == "bytes":
        path.write_bytes(value)
    elif kind == "json":
        path.write_text(json.dumps(value))
    else:
        path.write_text(json.dumps({**pointer, value[0]: value[1]}))
    read_or_one_line(tmp_path / "run")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.one_of(st.binary(max_size=200), JSON.map(lambda v: json.dumps(v).encode()),
                         st.fixed_dictionaries({"rng": JSON, "metrics": JSON}).map(lambda v: json.dumps(v).encode())))
def test_any_run_json_with_a_matching_hash_is_read_or_refused_in_one_line(tmp_path, content):
    small_run(tmp_path / "run", content)
    read_or_one_line(tmp_path / "run")

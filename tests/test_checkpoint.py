"""The run store and checkpoint reader on hand-made tensors, without training: what each file
holds after create / log / save, what a resume keeps and drops, and each refusal of
``read_checkpoint``. Fast (no model, no data), so ``make mutation`` runs it for
``nefl_zoo/runs/store.py`` and ``nefl_zoo/runs/checkpoint.py``; the fault-injection runs of a real
training are in ``tests/test_store.py``."""

from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file

from nefl_zoo.runs.checkpoint import Checkpoint, CheckpointError, check_state, read_checkpoint, read_pointer, saved_config
from nefl_zoo.runs.store import RunExistsError, RunStore

COLUMNS = ["round", "loss", "acc_a", "acc_b"]
CONFIG = {"rounds": 4, "name": "unit"}  # not in sorted order: the files keep the order given
SPEC = {"model": "resnet20", "inconsistent": ["steps"], "tiers": [{"name": "a"}]}


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), value), "n@a": torch.tensor(int(value), dtype=torch.long)}


def record(r: int) -> dict:
    rec = {"round": r, "loss": 1.0 / r}
    if r % 2 == 0:
        rec["acc"] = {"a": 0.1 * r, "b": 0.2 * r}
    return rec


def open_store(out, create=True, overwrite=False) -> RunStore:
    store = RunStore(out, COLUMNS)
    store.open(create=create, overwrite=overwrite)
    return store


def checkpoint(r: int, clients=None, server=None) -> Checkpoint:
    return Checkpoint(r, state(float(r)), clients or {}, server or {}, {"bytes_down": 10 * r, "bytes_up": r}, {"worst": 0.5 * r})


@pytest.fixture
def run(tmp_path):
    """Rounds 1-3 logged, a checkpoint after round 2 (with client and server state), lock released."""
    out = tmp_path / "run"
    store = open_store(out)
    store.create(CONFIG, SPEC, overwrite=False)
    for r in (1, 2):
        store.log(record(r))
    store.save(checkpoint(2, {3: {"h": torch.ones(2)}, 0: {"h": torch.zeros(2), "g": torch.arange(3)}},
                          {"opt": torch.tensor([7.0])}), CONFIG)
    store.log(record(3))
    store.close()
    return out


def lines(path) -> list[str]:
    return path.read_text().splitlines()


def test_create_log_and_save_write_exactly_these_files(run):
    assert yaml.safe_load((run / "config.yaml").read_text()) == CONFIG
    assert list(yaml.safe_load((run / "config.yaml").read_text())) == ["rounds", "name"]
    spec_bytes = (run / "spec.yaml").read_bytes()
    assert yaml.safe_load(spec_bytes) == SPEC and list(yaml.safe_load(spec_bytes)) == ["model", "inconsistent", "tiers"]
    assert [json.loads(line) for line in lines(run / "metrics.jsonl")] == [record(1), record(2), record(3)]
    assert lines(run / "metrics.csv") == ["round,loss,acc_a,acc_b", "1,1.0,,", "2,0.5,0.2,0.4", "3,0.3333333333333333,,"]
    pointer = json.loads((run / "checkpoint.json").read_text())
    generation = pointer["generation"]
    assert generation.startswith("ckpt-000002-") and len(generation) == len("ckpt-000002-") + 8
    assert (pointer["format"], pointer["round"], pointer["config"]) == (2, 2, CONFIG)
    assert pointer["totals"] == {"bytes_down": 20, "bytes_up": 2} and pointer["last_eval"] == {"worst": 1.0}
    assert pointer["spec_sha256"] == hashlib.sha256(spec_bytes).hexdigest()
    roles = ["global.safetensors", "clients.safetensors", "server.safetensors", "run.json"]
    assert sorted(pointer["files"]) == sorted(roles)
    for role in roles:
        data = (run / f"{generation}.{role}").read_bytes()
        assert pointer["files"][role] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert sorted(p.name for p in run.iterdir()) == sorted(
        ["config.yaml", "spec.yaml", "metrics.jsonl", "metrics.csv", "checkpoint.json", "run.lock",
         "global.safetensors", "clients.safetensors", "server.safetensors", *(f"{generation}.{r}" for r in roles)])
    for role in roles[:3]:  # published: the committed bytes, linked
        assert (run / role).read_bytes() == (run / f"{generation}.{role}").read_bytes()
        assert os.path.samefile(run / role, run / f"{generation}.{role}")
    assert load_file(str(run / "clients.safetensors")).keys() == {"3/h", "0/h", "0/g"}
    committed = json.loads((run / f"{generation}.run.json").read_bytes())
    assert committed["metrics"] == [record(1), record(2)]  # round 3 came after the checkpoint


def test_read_checkpoint_returns_what_was_saved_and_changes_nothing(run):
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    ckpt = RunStore(run, COLUMNS).read_checkpoint(template=state(0.0), rounds=2)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert ckpt.round == 2 and ckpt.config == CONFIG and ckpt.records == [record(1), record(2)]
    assert torch.equal(ckpt.state["w"], torch.full((2, 3), 2.0)) and int(ckpt.state["n@a"]) == 2
    assert sorted(ckpt.client_states) == [0, 3] and sorted(ckpt.client_states[0]) == ["g", "h"]
    assert torch.equal(ckpt.client_states[0]["g"], torch.arange(3)) and torch.equal(ckpt.client_states[3]["h"], torch.ones(2))
    assert torch.equal(ckpt.server_state["opt"], torch.tensor([7.0]))
    assert ckpt.totals == {"bytes_down": 20, "bytes_up": 2} and ckpt.last_eval == {"worst": 1.0}
    assert saved_config(run) == (CONFIG, str(run / "checkpoint.json"))


def test_resume_drops_the_records_after_the_checkpoint_and_restores_the_rngs(tmp_path):
    out = tmp_path / "run"
    store = open_store(out)
    store.create(CONFIG, SPEC, overwrite=False)
    store.log(record(1))
    store.log(record(2))
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    store.save(checkpoint(2), CONFIG)
    after_save = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    store.log(record(3))
    store.log(record(4))
    (out / "summary.json").write_text("{}")
    (out / ".metrics.jsonl.tmp").write_text("stale")
    store.close()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)

    store = open_store(out, create=False)
    store.load(template=state(0.0), rounds=4)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == after_save
    assert (out / "metrics.jsonl").read_text() == json.dumps(record(1)) + "\n" + json.dumps(record(2)) + "\n"
    assert lines(out / "metrics.csv") == ["round,loss,acc_a,acc_b", "1,1.0,,", "2,0.5,0.2,0.4"]
    assert not (out / "summary.json").exists() and not (out / ".metrics.jsonl.tmp").exists()
    store.log(record(3))  # the run goes on from the checkpoint, each round once
    store.save(checkpoint(3), CONFIG)
    store.write_summary({"worst": 1})
    store.close()
    assert [json.loads(line)["round"] for line in lines(out / "metrics.jsonl")] == [1, 2, 3]
    assert (out / "summary.json").read_text() == '{\n  "worst": 1\n}'
    assert read_pointer(out).spec_sha256 == hashlib.sha256((out / "spec.yaml").read_bytes()).hexdigest()
    generation = read_pointer(out).generation
    assert generation.startswith("ckpt-000003-")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("ckpt-")) == [f"{generation}.global.safetensors", f"{generation}.run.json"]
    assert not (out / "clients.safetensors").exists() and not (out / "server.safetensors").exists()
    assert torch.equal(load_file(str(out / "global.safetensors"))["w"], torch.full((2, 3), 3.0))


def test_a_new_run_refuses_an_existing_one_and_overwrite_replaces_it(run):
    for name in ("checkpoint.json", "metrics.jsonl"):
        kept = (run / name).read_bytes()
        other = run.parent / f"other-{name}"
        other.mkdir()
        (other / name).write_bytes(kept)
        with pytest.raises(RunExistsError, match=f"^{other}: already holds a run; continue it with --resume {other}, "
                           r"or choose another --out \(--overwrite replaces it\)$"):
            RunStore(other, COLUMNS).open(create=True)  # overwrite is off unless asked for
    store = RunStore(run, COLUMNS)
    with pytest.raises(RuntimeError, match=r"RunStore.open\(\) must be called before writing"):
        store.create(CONFIG, SPEC, overwrite=True)
    store = open_store(run, overwrite=True)
    (run / ".global.safetensors.tmp").write_text("x")
    store.create({"name": "new"}, SPEC, overwrite=True)
    store.close()
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.csv", "metrics.jsonl", "run.lock", "spec.yaml"]
    assert yaml.safe_load((run / "config.yaml").read_text()) == {"name": "new"}
    assert lines(run / "metrics.jsonl") == [] and lines(run / "metrics.csv") == ["round,loss,acc_a,acc_b"]


def test_log_and_save_need_a_created_or_resumed_run(tmp_path):
    store = open_store(tmp_path / "run")
    with pytest.raises(RuntimeError, match=r"create\(\) or resume\(\) must come before log\(\)"):
        store.log(record(1))
    with pytest.raises(RuntimeError, match=r"create\(\) or resume\(\) must come before save\(\)"):
        store.save(checkpoint(1), CONFIG)
    with pytest.raises(RuntimeError, match=r"^RunStore.resume\(\) takes the checkpoint read_checkpoint\(\) returned$"):
        store.resume(checkpoint(1))
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        RunStore(tmp_path / "absent", COLUMNS).open()


@pytest.mark.parametrize(
    "template, field, message",
    [
        ({"w": torch.zeros(2, 3)}, "n@a", r"not in this configuration's global state \(1 unexpected keys\)"),
        ({**state(0.0), "v": torch.zeros(1)}, "v", r"missing \(1 keys missing\)"),
        ({"w": torch.zeros(3, 2), "n@a": torch.tensor(0)}, "w", r"torch.float32 \(2, 3\), the configuration needs torch.float32 \(3, 2\)"),
        ({"w": torch.zeros(2, 3, dtype=torch.float64), "n@a": torch.tensor(0)}, "w", r"torch.float32 \(2, 3\), the configuration needs torch.float64 \(2, 3\)"),
    ],
)
def test_a_state_that_does_not_fit_the_template_is_refused(run, template, field, message):
    generation = read_pointer(run).generation
    with pytest.raises(CheckpointError, match=f"^{run}/{generation}.global.safetensors: {field}: {message}; the checkpoint does not belong"):
        read_checkpoint(run, template)
    check_state(state(5.0), state(0.0), "x")  # same keys, shapes and dtypes: accepted


def test_rounds_beyond_the_configuration_and_damaged_files_are_refused(run):
    with pytest.raises(CheckpointError, match=r"checkpoint.json: round: 2 completed rounds, but the configuration has only 1; resume with --set rounds=N for some N >= 2$"):
        read_checkpoint(run, rounds=1)
    read_checkpoint(run, rounds=2)
    generation = read_pointer(run).generation
    path = run / f"{generation}.server.safetensors"
    data = path.read_bytes()
    changed = data[:-1] + bytes([data[-1] ^ 1])  # same size, other hash
    path.write_bytes(changed)
    new, old = hashlib.sha256(changed).hexdigest()[:12], hashlib.sha256(data).hexdigest()[:12]
    with pytest.raises(CheckpointError, match=rf"^{path}: {len(data)} bytes with sha256 {new}\.\.\., but checkpoint.json names "
                       rf"{len(data)} bytes with sha256 {old}\.\.\. \(changed or damaged\); restore it or start the run again"):
        read_checkpoint(run)


def test_inconsistent_files_with_matching_hashes_are_refused(run):
    """Each file rewritten with a valid hash in checkpoint.json: what its content must be."""
    pointer = json.loads((run / "checkpoint.json").read_text())
    generation = pointer["generation"]

    def replace(role, data):
        (run / f"{generation}.{role}").write_bytes(data)
        pointer["files"][role] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        (run / "checkpoint.json").write_text(json.dumps(pointer))

    run_json = json.loads((run / f"{generation}.run.json").read_bytes())
    replace("run.json", json.dumps({**run_json, "metrics": [record(1)]}).encode())
    with pytest.raises(CheckpointError, match=r"run.json: metrics: records of rounds \[1\]\.\.\., expected 1..2; "):
        read_checkpoint(run)
    replace("run.json", json.dumps({**run_json, "metrics": [record(2), record(1)]}).encode())
    with pytest.raises(CheckpointError, match=r"expected 1..2"):
        read_checkpoint(run)
    replace("run.json", json.dumps(run_json).encode())
    from safetensors.torch import save as save_bytes

    replace("clients.safetensors", save_bytes({"x/h": torch.ones(1)}))
    with pytest.raises(CheckpointError, match=r"clients.safetensors: x/h: not CLIENT/KEY; "):
        read_checkpoint(run)
    replace("clients.safetensors", save_bytes({"3/": torch.ones(1)}))
    with pytest.raises(CheckpointError, match=r"clients.safetensors: 3/: not CLIENT/KEY; "):
        read_checkpoint(run)
    replace("clients.safetensors", b"not safetensors")
    with pytest.raises(CheckpointError, match=r"clients.safetensors: not a readable safetensors file"):
        read_checkpoint(run)
    del pointer["files"]["clients.safetensors"]
    replace("server.safetensors", save_bytes({"opt": torch.tensor([7.0])}))
    assert read_checkpoint(run)[0].client_states == {}
    del pointer["files"]["run.json"]
    (run / "checkpoint.json").write_text(json.dumps(pointer))
    with pytest.raises(CheckpointError, match=r"checkpoint.json: files: names no global.safetensors or run.json; "):
        read_checkpoint(run)


def test_spec_text_is_verified_against_the_checkpoint(run):
    store = RunStore(run, COLUMNS)
    store.read_checkpoint()
    assert yaml.safe_load(store.read_spec_text()) == SPEC
    (run / "spec.yaml").write_text(yaml.safe_dump({**SPEC, "model": "resnet32"}))
    with pytest.raises(CheckpointError, match=r"spec.yaml: changed since the checkpoint was written"):
        store.read_spec_text()
    (run / "spec.yaml").unlink()
    with pytest.raises(FileNotFoundError, match=r"spec.yaml: missing or unreadable"):
        store.read_spec_text()


def test_published_state_is_the_committed_generation(run):
    generation = read_pointer(run).generation
    data = (run / f"{generation}.global.safetensors").read_bytes()
    assert {k: v.tolist() for k, v in load_bytes(data).items()} == {"w": [[2.0] * 3] * 2, "n@a": 2}


def test_read_pointer_problems_are_one_line(run, tmp_path, monkeypatch):
    import nefl_zoo.runs.checkpoint as checkpoint_module

    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path / 'absent'}: no such run directory$"):
        read_pointer(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no checkpoint.json to resume from \(the run stopped before its first "
                       r"checkpoint; start the run again with --overwrite\)$"):
        read_pointer(tmp_path / "empty")
    size = (run / "checkpoint.json").stat().st_size
    monkeypatch.setattr(checkpoint_module, "MAX_POINTER_BYTES", size - 1)
    with pytest.raises(CheckpointError, match=r"checkpoint.json: larger than 0 MiB, not a checkpoint pointer; start the run again"):
        read_pointer(run)
    monkeypatch.setattr(checkpoint_module, "MAX_POINTER_BYTES", size)
    assert read_pointer(run).round == 2
    pointer = json.loads((run / "checkpoint.json").read_text())
    (run / "checkpoint.json").write_text(json.dumps({**pointer, "totals": {"bytes_up": 1.5}}))
    with pytest.raises(CheckpointError, match=r"checkpoint.json: totals.bytes_up: .*; not a checkpoint this nefl-zoo wrote "
                       r"\(start the run again with --overwrite\)$"):
        read_pointer(run)


@pytest.mark.parametrize("content", [b"[]", b"{}", json.dumps({"metrics": [], "rng": {"python": [3]}}).encode(), b"\xff"])
def test_a_run_json_that_is_not_rng_states_and_records_is_refused(run, content):
    pointer = json.loads((run / "checkpoint.json").read_text())
    path = run / f"{pointer['generation']}.run.json"
    path.write_bytes(content)
    pointer["files"]["run.json"] = {"sha256": hashlib.sha256(content).hexdigest(), "bytes": len(content)}
    (run / "checkpoint.json").write_text(json.dumps(pointer))
    with pytest.raises(CheckpointError, match=rf"^{path}: not the RNG states and metrics records of a checkpoint \(.*\); start the run again"):
        read_checkpoint(run)


def test_without_hard_links_the_committed_files_are_copied(tmp_path, monkeypatch):
    def no_links(*args):
        raise OSError("hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "run"
    store = open_store(out)
    store.create(CONFIG, SPEC, overwrite=False)
    store.log(record(1))
    store.save(checkpoint(1, server={"s": torch.ones(1)}), CONFIG)
    store.close()
    generation = read_pointer(out).generation
    for role in ("global.safetensors", "server.safetensors"):
        assert (out / role).read_bytes() == (out / f"{generation}.{role}").read_bytes()
        assert not os.path.samefile(out / role, out / f"{generation}.{role}")
    assert not list(out.glob(".*.tmp"))


def test_missing_or_unreadable_checkpoint_files_are_named(run):
    generation = read_pointer(run).generation
    path = run / f"{generation}.clients.safetensors"
    path.unlink()
    with pytest.raises(CheckpointError, match=rf"^{path}: missing, though checkpoint.json names it; restore it or start the run again with --overwrite$"):
        read_checkpoint(run)
    path.mkdir()  # a directory in its place cannot be read
    with pytest.raises(CheckpointError, match=rf"^{path}: cannot read it \(Is a directory\)$"):
        read_checkpoint(run)


def test_records_of_other_rounds_are_named_by_their_first_three(run):
    pointer = json.loads((run / "checkpoint.json").read_text())
    path = run / f"{pointer['generation']}.run.json"
    run_json = json.loads(path.read_bytes())
    data = json.dumps({**run_json, "metrics": [record(r) for r in (1, 2, 3, 4, 5)]}).encode()
    path.write_bytes(data)
    pointer["files"]["run.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (run / "checkpoint.json").write_text(json.dumps(pointer))
    with pytest.raises(CheckpointError, match=rf"^{path}: metrics: records of rounds \[1, 2, 3\]\.\.\., expected 1..2; start the run again"):
        read_checkpoint(run)


def test_client_keys_may_contain_the_separator_and_server_state_defaults_to_empty(tmp_path):
    out = tmp_path / "run"
    store = open_store(out)
    store.create(CONFIG, SPEC, overwrite=False)
    store.log(record(1))
    store.save(checkpoint(1, {12: {"layer/x": torch.ones(2)}}), CONFIG)
    store.close()
    ckpt, _ = read_checkpoint(out)
    assert list(ckpt.client_states) == [12] and list(ckpt.client_states[12]) == ["layer/x"]
    assert ckpt.server_state == {} and isinstance(ckpt.server_state, dict)


def test_rng_states_round_trip_as_json():
    from nefl_zoo.runs.checkpoint import rng_states, set_rng_states

    random.seed(4), np.random.seed(5), torch.manual_seed(6)
    states = json.loads(json.dumps(rng_states()))
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_states(states)  # the JSON form
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_a_checkpoint_json_that_cannot_be_read_as_a_pointer(run, monkeypatch):
    import nefl_zoo.runs.checkpoint as checkpoint_module

    path = run / "checkpoint.json"
    path.write_bytes(b'{"format": 2, "round": "\xff\xfe"}')  # not UTF-8: a one-line refusal, not a traceback
    with pytest.raises(CheckpointError, match=rf"^{path}: .*not a checkpoint this nefl-zoo wrote \(start the run again with --overwrite\)$"):
        read_pointer(run)
    monkeypatch.setattr(checkpoint_module, "MAX_POINTER_BYTES", 3 << 20)
    path.write_bytes(b" " * ((3 << 20) + 1))
    with pytest.raises(CheckpointError, match=rf"^{path}: larger than 3 MiB, not a checkpoint pointer; start the run again"):
        read_pointer(run)
    path.unlink()
    path.mkdir()
    with pytest.raises(CheckpointError, match=rf"^{path}: cannot read it \(Is a directory\)$"):
        read_pointer(run)


def test_store_reads_pass_the_template_and_rounds_on(run):
    store = open_store(run, create=False)
    with pytest.raises(CheckpointError, match="1 keys missing"):
        store.read_checkpoint(template={**state(0.0), "v": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="the configuration has only 1"):
        store.read_checkpoint(rounds=1)
    with pytest.raises(CheckpointError, match="1 keys missing"):
        store.load(template={**state(0.0), "v": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="the configuration has only 1"):
        store.load(rounds=1)
    ckpt = store.read_checkpoint()
    ckpt.rng = None  # only the checkpoint read_checkpoint() returned, with its RNG states
    with pytest.raises(RuntimeError, match=r"^RunStore.resume\(\) takes the checkpoint"):
        store.resume(ckpt)
    store.load()  # no summary.json to remove: fine
    store.close()
    assert not (run / "summary.json").exists()


def test_overwrite_of_a_run_without_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps(record(1)) + "\n")
    store = open_store(out, overwrite=True)
    store.create(CONFIG, SPEC, overwrite=True)
    store.close()
    assert lines(out / "metrics.jsonl") == []


def test_spec_text_without_a_checkpoint_is_read_unverified_and_must_be_utf8(tmp_path):
    out = tmp_path / "run"
    store = open_store(out)
    store.create(CONFIG, SPEC, overwrite=False)
    reader = RunStore(out, COLUMNS)
    assert yaml.safe_load(reader.read_spec_text()) == SPEC
    (out / "spec.yaml").write_bytes(b"model: r\xe9snet")
    with pytest.raises(CheckpointError, match=rf"^{out / 'spec.yaml'}: not UTF-8 text \(byte 8\)$"):
        reader.read_spec_text()
    (out / "spec.yaml").unlink()
    with pytest.raises(FileNotFoundError, match=rf"^{out / 'spec.yaml'}: missing or unreadable \(No such file or directory\); a run directory holds spec.yaml$"):
        reader.read_spec_text()


def test_crash_points_are_reached_in_the_documented_order(tmp_path, monkeypatch):
    """The names of the store's module docstring, in its order, for an overwrite, a logged round,
    a committed checkpoint with client and server state, and the summary."""
    import nefl_zoo.files as files
    import nefl_zoo.runs.store as store_module

    reached = []
    monkeypatch.setattr(store_module, "crash_point", reached.append)
    monkeypatch.setattr(files, "crash_point", reached.append)
    out = tmp_path / "run"
    store = open_store(out, overwrite=True)
    store.create(CONFIG, SPEC, overwrite=True)
    store.log(record(1))
    store.save(checkpoint(1, {0: {"h": torch.ones(1)}}, {"s": torch.ones(1)}), CONFIG)
    store.write_summary({})
    store.close()
    renames = [name for name in reached if name.startswith("before-rename:")]
    assert [name for name in reached if not name.startswith("before-rename:")] == [
        "overwrite:cleared", "log:jsonl", "save:partial", "save:before-commit", "save:committed",
        "publish:global.safetensors", "publish:clients.safetensors", "publish:server.safetensors", "save:published",
        "summary"]
    assert "before-rename:checkpoint.json" in renames and "before-rename:metrics.jsonl" in renames


def test_one_writer_or_many_readers_and_nested_run_directories(tmp_path):
    from nefl_zoo.files import LockedError

    out = tmp_path / "runs" / "a" / "run"  # parents are made
    writer = RunStore(out, COLUMNS)
    writer.open(create=True)
    assert out.is_dir()
    for shared in (False, True):
        with pytest.raises(LockedError, match=r"another nefl-zoo process \(pid [0-9]+\) is using this run directory"):
            RunStore(out, COLUMNS).open(shared=shared)
    writer.close()
    readers = [RunStore(out, COLUMNS), RunStore(out, COLUMNS)]
    for reader in readers:
        reader.open(shared=True)
    with pytest.raises(LockedError):
        RunStore(out, COLUMNS).open()  # exclusive by default
    for reader in readers:
        reader.close()


def test_after_a_save_the_spec_is_verified_against_it(tmp_path):
    out = tmp_path / "run"
    store = open_store(out)
    store.create(CONFIG, SPEC, overwrite=False)
    store.log(record(1))
    store.save(checkpoint(1), CONFIG)
    (out / "spec.yaml").write_text("model: resnet32\n")
    with pytest.raises(CheckpointError, match="spec.yaml: changed since the checkpoint was written"):
        store.read_spec_text()
    store.close()

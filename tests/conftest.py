import fcntl
import json
import os
from pathlib import Path

import pytest
import torch

from nefl_zoo.spec import parse_spec

TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)


# the files that take longest (seconds of test time, measured 2026-12-06 on 2 cores), longest first
LONGEST = ["test_flower_deployment.py", "test_method_contract_flower.py", "test_readme.py", "test_model_contract.py",
           "test_nested.py", "test_accel.py", "test_store.py", "test_write_errors.py", "test_method_contract.py",
           "test_fl_engine.py", "test_methods_faithful.py", "test_browser.py", "test_edge_models.py"]


def pytest_collection_modifyitems(items):
    """Longest files first, so the xdist workers (``--dist loadfile --no-loadscope-reorder``)
    end together: the files of ``LONGEST`` in its order (the Flower deployment test first: minutes
    of process starts and Flower's polls, in one test), then the others by their number of tests."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(group):
        name = Path(group[0].nodeid.split("::")[0]).name
        return (LONGEST.index(name) if name in LONGEST else len(LONGEST), -len(group))

    order = sorted(files.values(), key=rank)
    items[:] = [item for group in order for item in group]


@pytest.fixture(autouse=True, scope="session")
def _macs_cache(tmp_path_factory):
    """The MACs cache of the whole run in a temporary folder, never the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEFL_ZOO_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(autouse=True, scope="module")
def _fresh_nesting_plans():
    """Each test file analyses the networks it nests itself: no plan cached by another file (or,
    under mutation testing, by the clean run the mutants are forked from) stands in for the code
    under test."""
    from nefl_zoo.nesting.plan import _PLANS

    _PLANS.clear()


@pytest.fixture(autouse=True)
def _model_registry():
    """Models a test registers (``nest``, ``register_model``) are gone after it: no entry left by
    another test (or, under mutation testing, by the clean run the mutants are forked from)
    stands in for the code under test."""
    from nefl_zoo.models import registry

    models = dict(registry._MODELS)
    yield
    registry._MODELS.clear()
    registry._MODELS.update(models)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread for the test (the same arithmetic on every machine), restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def set_server_identity(monkeypatch) -> None:
    """Set what a Flower ServerApp process has set when it builds messages (Flower's
    TaskIdentity), undone with ``monkeypatch``."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


@pytest.fixture
def server_identity(monkeypatch):
    """What a Flower ServerApp process has set when it builds messages."""
    set_server_identity(monkeypatch)


def shared_folder(tmp_path_factory, name: str, make) -> Path:
    """The folder ``make(staging)`` fills (``staging``: an empty folder), made once per test run
    and shared by the xdist workers (read it, never write into it: copy it first): the first to
    take the lock ``NAME.lock`` in their common temporary folder makes it, then renames the
    complete folder into place."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.exists():
            staging = tmp_path_factory.mktemp(name) / name
            staging.mkdir()
            make(staging)
            staging.rename(folder)
    return folder


@pytest.fixture(scope="session")
def nested_export_dir(tmp_path_factory):
    """The small nested export of tests/support/exports.py, made once per test run
    (:func:`shared_folder`)."""
    from .support.exports import nested_export

    return shared_folder(tmp_path_factory, "nested-export", nested_export)


@pytest.fixture
def resnet20_spec():
    """Three tiers of resnet20: narrow with skipped blocks (one a projection block), medium, full."""
    return parse_spec(
        {
            "model": "resnet20",
            "tiers": [
                {"name": "small", "gamma_w": 0.25, "steps": [[1, 0, 1], [0, 1, 1], [2, 1, 0]]},
                {"name": "medium", "gamma_w": 0.5, "steps": [[1, 1, 0], [1, 1, 1], [1, 1, 1]]},
                {"name": "full"},
            ],
        }
    )


@pytest.fixture
def vit_spec():
    return parse_spec(
        {
            "model": "vit_b_16",
            "model_args": TINY_VIT,
            "inconsistent": ["steps"],
            "tiers": [
                {"name": "half", "gamma_w": 0.5, "steps": [[1, 0]]},
                {"name": "full"},
            ],
        }
    )


def tiny(**overrides):
    """A quick run config: resnet20 on 8x8 digits, three width tiers, four clients, four rounds.
    ``a__b=v`` sets nested key ``a.b``."""
    from nefl_zoo.fl.config import parse_config

    data = {
        "name": "tiny", "method": "nefl", "rounds": 4,
        "spec": {
            "model": "resnet20", "model_args": {"in_chans": 1, "img_size": 8},
            "tiers": [{"name": "g0.25", "gamma_w": 0.25}, {"name": "g0.5", "gamma_w": 0.5}, {"name": "g1", "gamma_w": 1.0}],
        },
        "data": {"dataset": "digits", "augment": False},
        "clients": {"num_clients": 4, "fraction": 1.0},
        "train": {"local_epochs": 2, "batch_size": 32, "lr": 0.1, "schedule": "constant"},
        "eval": {"every": 2},
        "checkpoint_every": 2,
    }
    for key, value in overrides.items():
        node = data
        *parents, last = key.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return parse_config(data)


def crash_in_round(config, out, monkeypatch, round_index: int = 2) -> None:
    """Run ``config`` into ``out`` until a simulated crash at the start of round ``round_index``
    (0-based; the default: after two rounds)."""
    from nefl_zoo.fl.engine import Engine

    original = Engine.run_round

    def dies(self, index):
        if index == round_index:
            raise KeyboardInterrupt("simulated crash")
        return original(self, index)

    monkeypatch.setattr(Engine, "run_round", dies)
    with pytest.raises(KeyboardInterrupt):
        Engine(config, out).run()
    monkeypatch.setattr(Engine, "run_round", original)


def assert_equal_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same keys and bit-identical tensors of the same dtypes."""
    assert a.keys() == b.keys()
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def same_tensors(a_dir, b_dir, name: str = "global.safetensors") -> bool:
    """Whether two run directories hold the same tensors (keys, dtypes, values) in ``name``."""
    from safetensors.torch import load_file

    a, b = load_file(str(a_dir / name)), load_file(str(b_dir / name))
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


CONTRACT_LEVELS = ("g0.2", "g0.4", "g0.6", "g0.8", "g1")


def contract_config(method: str):
    """The method contract's run (embedded and Flower): two rounds, five width tiers (one per
    resource level), five clients of which two train each round (so some join late), one local
    epoch in batches of 64, 8:1:1 client splits (for methods that evaluate on clients), one
    evaluation after the last round, a checkpoint every round."""
    spec = {"model": "resnet20", "model_args": {"in_chans": 1, "img_size": 8},
            "tiers": [{"name": t, "gamma_w": float(t[1:])} for t in CONTRACT_LEVELS]}
    # FedLPS pre-trains its encoder on a held-out split when the run starts (its default): 30% held out, 2 epochs
    fedlps = {"data__public_fraction": 0.3, "method_args": {"pretrain_epochs": 2}} if method == "fedlps" else {}
    return tiny(method=method, spec=spec, rounds=2, checkpoint_every=1, eval__every=2, clients__num_clients=5,
                clients__fraction=0.4, train__local_epochs=1, train__batch_size=64, data__local_split=[0.8, 0.1, 0.1], data__max_test_samples=32,
                **fedlps)


def contract_run(tmp_path_factory, method: str) -> Path:
    """The embedded engine's run of :func:`contract_config` for ``method``, made once per test
    run (:func:`shared_folder`; one torch thread): the method contract's reference and the Flower
    simulation's."""
    from nefl_zoo.fl.engine import Engine

    def make(folder: Path) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            Engine(contract_config(method), folder).run()
        finally:
            torch.set_num_threads(threads)

    return shared_folder(tmp_path_factory, f"contract-{method}", make)


def records(run_dir: Path) -> list[dict]:
    """A run's ``metrics.jsonl`` records without their wall times (none before it has any)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [{k: v for k, v in json.loads(line).items() if k != "time_s"} for line in lines]

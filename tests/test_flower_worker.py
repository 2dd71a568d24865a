"""``nefl-zoo clientapp`` (``nefl_zoo.fl.flower.worker``): the long-running ClientApp loop against
a scripted SuperNode (no processes): tasks run one after another in this process, a failing app
gets Flower's error reply and the loop goes on, a SuperNode that is away is waited for, and a new
FAB's modules replace the previous FAB's. The real deployment is ``test_flower_deployment.py``."""

import sys

import httpx
import pytest

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.common.constant import SubStatus  # noqa: E402

from nefl_zoo.fl.flower import worker  # noqa: E402


class Acquired:
    """An AcquireTask response: a task with ``token``, or none (``token`` empty)."""

    def __init__(self, token: str = ""):
        self.token = token

    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's name
        return name == "task" and bool(self.token)


class SuperNode:
    """The Runtime API of one SuperNode, scripted: what AcquireTask answers in turn, and what
    each task's client pushed."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.pushed: list[tuple[str, Message]] = []
        self.outputs: list[tuple[str, str, str]] = []
        self.closed = 0

    def client(self, token=None):
        node = self

        class Client:
            def AcquireTask(self, request):  # noqa: N802
                answer = node.answers.pop(0)
                if isinstance(answer, Exception):
                    raise answer
                return answer

            def close(self):
                node.closed += 1

        client = Client()
        client.token = token
        return client


@pytest.fixture
def server_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def test_serve_runs_each_task_in_process_answers_a_failing_app_with_an_error_and_waits_for_the_node(
        monkeypatch, server_identity):
    node = SuperNode([httpx.ConnectError("refused"), Acquired(), Acquired("ok"), Acquired("bad"), Acquired("ok2")])
    sent = {t: Message(RecordDict({"x": ConfigRecord({"token": t})}), 3, "train") for t in ("ok", "bad", "ok2")}
    calls = []

    def app(message, context):
        token = message.content.config_records["x"]["token"]
        calls.append(token)
        if token == "bad":
            raise ValueError("out of digits")
        return Message(RecordDict({"y": ConfigRecord({"done": token})}), reply_to=message)

    def make_client(address, insecure, certificates, interceptors):
        tokens = [i for i in interceptors if isinstance(i, worker.RuntimeTokenHttpInterceptor)]
        return node.client(tokens[0]._token if tokens else None)  # noqa: SLF001

    class Heartbeat:
        def __init__(self, fn):
            pass

        def start(self):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(worker, "_client", make_client)
    monkeypatch.setattr(worker, "HeartbeatSender", Heartbeat)
    monkeypatch.setattr(worker, "pull_task_input", lambda c: (sent[c.token], f"context-{c.token}", "run", "fab"))
    monkeypatch.setattr(worker._Apps, "get", lambda self, run, fab: app)
    monkeypatch.setattr(worker, "push_message", lambda c, reply, context: node.pushed.append((c.token, reply)))
    monkeypatch.setattr(worker, "push_task_output", lambda client, context, sub_status, details: node.outputs.append(
        (client.token, sub_status, details)))

    assert worker.serve("127.0.0.1:1", insecure=True, poll=0.001, max_tasks=3) == 3
    assert calls == ["ok", "bad", "ok2"]  # one process served all three, in order, past the failure
    assert [(t, s) for t, s, _ in node.outputs] == [("ok", SubStatus.COMPLETED), ("bad", SubStatus.FAILED),
                                                    ("ok2", SubStatus.COMPLETED)]
    assert "out of digits" in node.outputs[1][2]
    replies = dict(node.pushed)
    assert replies["ok"].content.config_records["y"]["done"] == "ok"
    assert replies["bad"].has_error() and "out of digits" in replies["bad"].error.reason
    assert replies["bad"].metadata.reply_to_message_id == sent["bad"].metadata.message_id
    assert node.closed == 4  # each task's client, then the acquiring one


def test_a_new_fab_drops_the_previous_fabs_modules(tmp_path, monkeypatch):
    folders = [tmp_path / "fab-a", tmp_path / "fab-b"]
    for version, folder in enumerate(folders):
        (folder / "probe_app").mkdir(parents=True)
        (folder / "probe_app" / "__init__.py").write_text(f"VERSION = {version}\n")
    installed = []
    apps = worker._Apps()
    monkeypatch.setattr(worker, "get_project_dir", lambda fab_id, version, digest: tmp_path / f"fab-{digest}")
    monkeypatch.setattr(worker, "install_from_fab", lambda content, skip_prompt: installed.append(content))

    def load(fab_id, version, digest):
        sys.path.insert(0, str(tmp_path / f"fab-{digest}"))
        import probe_app

        return probe_app.VERSION

    apps.load = load

    class Run:
        fab_id, fab_version = "nefl/probe", "1"

    class Fab:
        def __init__(self, digest):
            self.hash_str, self.content = digest, b"fab " + digest.encode()

    try:
        assert apps.get(Run, Fab("a")) == 0
        assert apps.get(Run, Fab("a")) == 0  # the same FAB: its modules kept
        assert apps.get(Run, Fab("b")) == 1  # another FAB: its own code, not the cached module
        assert str(folders[0]) not in sys.path
        assert installed == []  # both folders exist: nothing to install
        monkeypatch.setattr(worker, "get_project_dir", lambda fab_id, version, digest: tmp_path / "missing")
        with pytest.raises(ModuleNotFoundError):
            apps.get(Run, Fab("c"))
        assert installed == [b"fab c"]  # a FAB not installed yet is installed first
    finally:
        sys.modules.pop("probe_app", None)
        sys.path[:] = [p for p in sys.path if not p.startswith(str(tmp_path))]

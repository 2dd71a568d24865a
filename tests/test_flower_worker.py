"""``nefl-zoo clientapp`` (``nefl_zoo.fl.flower.worker``): the long-running ClientApp loop against
a scripted SuperNode (no processes): tasks run one after another in this process, a failing app
gets Flower's error reply and the loop goes on, so does a reply the SuperNode is no longer there
to take, a SuperNode that is away is waited for (and said so once), and a new FAB's modules
replace the previous FAB's. The real deployment is ``test_flower_deployment.py``."""

import logging
import sys
import threading

import httpx
import pytest

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.clientapp.client_app import LoadClientAppError  # noqa: E402
from flwr.common.constant import ErrorCode, SubStatus  # noqa: E402
from flwr.supercore.constant import TaskType  # noqa: E402

from nefl_zoo.fl.flower import worker  # noqa: E402

ADDRESS, CERTIFICATES = "127.0.0.1:9", b"ca"


class Acquired:
    """An AcquireTask response: ``task`` says whether it holds a task, ``token`` its token."""

    def __init__(self, token: str = "", task: bool | None = None):
        self.token, self.task = token, bool(token) if task is None else task

    def HasField(self, name: str) -> bool:  # noqa: N802 - protobuf's name
        return name == "task" and self.task


class SuperNode:
    """One SuperNode's Runtime API, scripted: what AcquireTask answers in turn; what was asked
    for and what each task's client pushed."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.requests, self.clients, self.closed = [], [], 0
        self.pushed: dict[str, tuple[Message, object]] = {}
        self.outputs: list[tuple[str, object, str, str]] = []

    def client(self, address, insecure, certificates, interceptors):
        """What ``worker._client`` returns: the acquiring client, or a task's (by its token)."""
        tokens = [i._token for i in interceptors if isinstance(i, worker.RuntimeTokenHttpInterceptor)]  # noqa: SLF001
        names = [i._metadata.component_name for i in interceptors if isinstance(i, worker.RuntimeVersionHttpInterceptor)]  # noqa: SLF001
        self.clients.append((address, insecure, certificates, names, len(tokens)))
        node = self

        class Client:
            token = tokens[0] if tokens else None

            def AcquireTask(self, request):  # noqa: N802
                node.requests.append(list(request.supported_task_types))
                answer = node.answers.pop(0)
                if isinstance(answer, Exception):
                    raise answer
                return answer

            def close(self):
                node.closed += 1

        return Client()


def test_serve_runs_each_task_in_process_answers_a_failing_app_with_an_error_and_waits_for_the_node(
        monkeypatch, server_identity, caplog):
    answers = [httpx.ConnectError("refused"), httpx.ConnectError("refused"), Acquired(), Acquired("", task=True),
               Acquired("ok"), Acquired("bad"), httpx.ConnectError("restarting"), Acquired("noload"), Acquired("nopull"),
               Acquired("lost"), Acquired("ok2")]
    node = SuperNode(answers)
    tokens = ("ok", "bad", "noload", "nopull", "lost", "ok2")
    sent = {t: Message(RecordDict({"x": ConfigRecord({"token": t})}), 3, "train") for t in tokens}
    calls = []

    def app(message, context):
        token = message.content.config_records["x"]["token"]
        calls.append((token, context))
        if token == "bad":
            raise ValueError("out of digits")
        if token == "noload":
            raise LoadClientAppError("no such app")
        return Message(RecordDict({"y": ConfigRecord({"done": token})}), reply_to=message)

    def pull(client):
        if client.token == "nopull":
            raise RuntimeError("No messages received from Runtime API")
        return sent[client.token], f"context-{client.token}", "the run", "the fab"

    def get(self, run, fab):
        assert (run, fab) == ("the run", "the fab")
        return app

    def push_message(client, reply, context):
        if client.token == "lost":  # the SuperNode went away while this task ran
            raise httpx.ConnectError("connection reset")
        node.pushed[client.token] = (reply, context)

    heartbeats = []

    class Heartbeat:
        def __init__(self, fn):
            heartbeats.append(["made", callable(fn)])

        def start(self):
            heartbeats[-1].append("started")

        def stop(self):
            heartbeats[-1].append("stopped")

    monkeypatch.setattr(worker, "_client", node.client)
    monkeypatch.setattr(worker, "HeartbeatSender", Heartbeat)
    monkeypatch.setattr(worker, "pull_task_input", pull)
    monkeypatch.setattr(worker._Apps, "get", get)
    monkeypatch.setattr(worker, "push_message", push_message)
    monkeypatch.setattr(worker, "push_task_output", lambda client, context, sub_status, details: node.outputs.append(
        (client.token, context, sub_status, details)))

    class Waits(threading.Event):
        """Records how long serve waits, without waiting."""

        def __init__(self):
            super().__init__()
            self.timeouts = []

        def wait(self, timeout=None):
            self.timeouts.append(timeout)
            return False

    waits = Waits()
    with caplog.at_level(logging.WARNING, logger="nefl_zoo.fl.flower.worker"):
        assert worker.serve(ADDRESS, insecure=False, root_certificates=CERTIFICATES, poll=0.125, max_tasks=6, stop=waits) == 6
    assert waits.timeouts == [1.0, 1.0, 0.125, 0.125, 1.0]  # a second per try while the node is away, the poll while idle

    # one process served every task, in order, past the failures; the app saw each task's context
    assert calls == [(t, f"context-{t}") for t in tokens if t != "nopull"]
    assert node.requests == [[TaskType.CLIENT_APP]] * len(answers)  # it asks for ClientApp tasks only
    assert node.clients[0] == (ADDRESS, False, CERTIFICATES, ["SuperExec"], 0)
    assert node.clients[1:] == [(ADDRESS, False, CERTIFICATES, ["flwr-clientapp"], 1)] * 6
    assert heartbeats == [["made", True, "started", "stopped"]] * 6
    # Flower's task protocol: each reply and each task's final status, with the task's context
    outputs = {t: (context, status, details) for t, context, status, details in node.outputs}
    assert list(outputs) == ["ok", "bad", "noload", "nopull", "ok2"]  # "lost": nothing reached the node
    assert outputs["ok"] == ("context-ok", SubStatus.COMPLETED, "")
    assert outputs["ok2"] == ("context-ok2", SubStatus.COMPLETED, "")
    assert outputs["bad"] == ("context-bad", SubStatus.FAILED, "<class 'ValueError'>:<'out of digits'>")
    assert outputs["nopull"] == (None, SubStatus.FAILED, "<class 'RuntimeError'>:<'No messages received from Runtime API'>")
    assert set(node.pushed) == {"ok", "bad", "noload", "ok2"}  # no message pulled: no reply
    reply, context = node.pushed["ok"]
    assert reply.content.config_records["y"]["done"] == "ok" and context == "context-ok"
    for token, code in (("bad", ErrorCode.CLIENT_APP_RAISED_EXCEPTION), ("noload", ErrorCode.LOAD_CLIENT_APP_EXCEPTION)):
        reply, context = node.pushed[token]
        assert reply.has_error() and reply.error.code == code and context == f"context-{token}"
        assert reply.error.reason == outputs[token][2]
        assert reply.metadata.reply_to_message_id == sent[token].metadata.message_id
    assert node.closed == 7  # each task's client, then the acquiring one
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [  # an absent SuperNode said once per absence, not per retry
        f"the SuperNode's Runtime API at {ADDRESS} cannot be reached (refused); waiting for it",
        f"the SuperNode's Runtime API at {ADDRESS} cannot be reached (restarting); waiting for it",
        "the reply could not be delivered to the SuperNode: connection reset"]
    errors = [(r.getMessage(), r.exc_info[0]) for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [("ClientApp raised an exception", ValueError), ("ClientApp raised an exception", LoadClientAppError),
                      ("ClientApp raised an exception", RuntimeError)]


def test_serve_stops_when_asked(monkeypatch):
    stop = threading.Event()
    node = SuperNode([Acquired()] * 3)
    monkeypatch.setattr(worker, "_client", node.client)
    original = node.answers

    class Stopping(list):
        def pop(self, i):
            if len(self) == 1:
                stop.set()
            return list.pop(self, i)

    node.answers = Stopping(original)
    assert worker.serve(ADDRESS, insecure=True, poll=0.001, stop=stop) == 0
    assert len(node.requests) == 3 and node.closed == 1


def _fab_folder(folder, version: int) -> None:
    """A Flower App whose ClientApp carries ``version``."""
    (folder / "probe_app").mkdir(parents=True)
    (folder / "probe_app" / "__init__.py").write_text(
        f"from flwr.clientapp import ClientApp\n\napp = ClientApp()\napp.version = {version}\n")
    (folder / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        f'[project]\nname = "probe"\nversion = "1.0.{version}"\ndescription = ""\nlicense = "Apache-2.0"\n'
        'dependencies = []\n\n[tool.flwr.app]\npublisher = "nefl"\n\n'
        '[tool.flwr.app.components]\nserverapp = "probe_app:app"\nclientapp = "probe_app:app"\n\n[tool.flwr.app.config]\n')


def test_a_new_fab_drops_the_previous_fabs_modules(tmp_path, monkeypatch):
    for version, name in enumerate("ab"):
        _fab_folder(tmp_path / f"fab-{name}", version)
    installed, asked = [], []

    def project_dir(fab_id, version, digest):
        assert (fab_id, version) == ("nefl/probe", "1.0"), (fab_id, version)
        asked.append((fab_id, version, digest))
        return tmp_path / f"fab-{digest}"

    monkeypatch.setattr(worker, "get_project_dir", project_dir)
    monkeypatch.setattr("flwr.clientapp.utils.get_project_dir", project_dir)

    def install(content, skip_prompt):
        installed.append((content, skip_prompt))
        _fab_folder(tmp_path / "fab-c", 2)

    monkeypatch.setattr(worker, "install_from_fab", install)

    class Run:
        fab_id, fab_version = "nefl/probe", "1.0"

    class Fab:
        def __init__(self, digest):
            self.hash_str, self.content = digest, b"fab " + digest.encode()

    apps = worker._Apps()
    try:
        assert apps.get(Run, Fab("a")).version == 0  # Flower's own loader, from the FAB's folder
        assert apps.get(Run, Fab("a")).version == 0  # the same FAB: its modules kept
        assert apps.get(Run, Fab("b")).version == 1  # another FAB: its own code, not the cached module
        assert str(tmp_path / "fab-a") not in sys.path and str(tmp_path / "fab-b") in sys.path
        assert asked[0] == ("nefl/probe", "1.0", "a") and installed == []  # installed already: nothing to install
        assert apps.get(Run, Fab("c")).version == 2
        assert installed == [(b"fab c", True)]  # a FAB not installed yet is installed first, without a prompt
    finally:
        sys.modules.pop("probe_app", None)
        sys.path[:] = [p for p in sys.path if not p.startswith(str(tmp_path))]


def test_forgetting_a_fab_keeps_the_modules_of_a_folder_that_only_shares_its_prefix(tmp_path, monkeypatch):
    for name in ("fab-a", "fab-ab"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name.replace('-', '_')}_mod.py").write_text("X = 1\n")
        monkeypatch.syspath_prepend(str(tmp_path / name))
    import fab_a_mod  # noqa: F401
    import fab_ab_mod  # noqa: F401

    try:
        worker._Apps._forget(tmp_path / "fab-a")
        assert "fab_a_mod" not in sys.modules and str(tmp_path / "fab-a") not in sys.path
        assert "fab_ab_mod" in sys.modules and str(tmp_path / "fab-ab") in sys.path
    finally:
        sys.modules.pop("fab_a_mod", None)
        sys.modules.pop("fab_ab_mod", None)

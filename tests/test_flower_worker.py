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
    errors = [(r.getMessage(), r.exc_info) for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [  # one line per failed task, no traceback
        ("train message: answered with an error: ValueError: out of digits", None),
        ("train message: answered with an error: LoadClientAppError: no such app", None),
        ("a task's message could not be read: RuntimeError: No messages received from Runtime API", None)]


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


def test_the_real_clientapp_answers_every_bad_message_with_an_error_and_serves_the_next(monkeypatch, server_identity, caplog):
    """Malformed and unexpected messages through ``serve`` and nefl-zoo's own ClientApp: each
    gets an error reply for that message and one log line without a traceback; the messages
    after them are served, and the process never exits (not even on ``SystemExit``)."""
    import json

    from flwr.app import Array, ArrayRecord, Context, MessageType

    from nefl_zoo.fl.training.device import Placement
    from nefl_zoo.fl.flower import client as flower_client
    from nefl_zoo.fl.flower.nodes import NODE, SETUP
    from nefl_zoo.fl.flower.records import CLIENT, instruction_content
    from nefl_zoo.fl.strategy.base import Instruction

    class Failing:  # a method whose training fails: raises, or exits the process as some libraries do
        def train(self, instruction, dataset, state):
            if instruction.config["fail"] == "exit":
                sys.exit(3)
            raise RuntimeError("CUDA out of memory\n(a second line)")

    class Data:
        def client_dataset(self, partition):
            return [partition]

    real_method = flower_client._method
    monkeypatch.setattr(flower_client, "_method", lambda config, root, device: (Failing(), Data(), Placement())
                        if config == "good" else real_method(config, root, device))

    def setup(run, config):
        return Message(RecordDict({SETUP: ConfigRecord({"run": run, "config": config})}), 3, MessageType.QUERY)

    def train(run, fail="raise", **records):
        content = instruction_content(Instruction(arrays={}, config={"fail": fail}), run, {})
        for name, record in records.items():
            content[name] = record
        return Message(content, 3, MessageType.TRAIN)

    garbage = ArrayRecord({"tensors": Array(dtype="uint8", shape=(4,), stype="nefl.safetensors", data=b"\xff" * 4)})
    other = Message(RecordDict(), 3, MessageType.QUERY)
    other.metadata.__dict__["_message_id"] = "another message"
    bad_json = json.dumps({"method": "bogus"})
    tasks = {  # token: (message, app: None for nefl-zoo's ClientApp, what its error reply says or None when it succeeds)
        "wrong-type": (Message(RecordDict(), 3, "query.bogus"), None, "No query function registered with name 'bogus'"),
        "unknown-type": (Message(RecordDict(), 3, "reconnect"), None, "Invalid message type: reconnect"),
        "no-records": (Message(RecordDict(), 3, MessageType.TRAIN), None, "not a nefl-zoo instruction: no 'nefl.run' or 'nefl.fields'"),
        "no-setup-record": (Message(RecordDict(), 3, MessageType.QUERY), None, "not a nefl-zoo setup message"),
        "setup-bad": (setup("bad", bad_json), None, None),  # answered: its first train message reports why
        "bad-config": (train("bad"), None, "method"),
        "not-set-up": (train("unknown"), None, "this node was not set up for run unknown"),
        "setup-good": (setup("good", "good"), None, None),
        "undecodable": (train("good", **{CLIENT: garbage}), None, "the tensor record does not decode"),
        "training-raises": (train("good"), None, "CUDA out of memory"),
        "training-exits": (train("good", fail="exit"), None, "SystemExit"),
        "answers-none": (setup("good", "good"), lambda message, context: None, "answered with NoneType, not a reply"),
        "answers-another": (setup("good", "good"), lambda message, context: Message(RecordDict(), reply_to=other),
                            "a Message that replies to another message"),
        "ok": (setup("good", "good"), None, None),
    }
    for message, _, _ in tasks.values():  # as Flower's pull_task_input sets it
        message.metadata.__dict__["_message_id"] = message.object_id
    context = Context(run_id=1, node_id=3, node_config={"partition-id": 1, "num-partitions": 4}, state=RecordDict(), run_config={})
    node = SuperNode([Acquired(token) for token in tasks])

    class Heartbeat:
        def __init__(self, fn):
            pass

        start = stop = lambda self: None

    monkeypatch.setattr(worker, "_client", node.client)
    monkeypatch.setattr(worker, "HeartbeatSender", Heartbeat)
    monkeypatch.setattr(worker, "pull_task_input", lambda client: (tasks[client.token][0], context, client.token, "fab"))
    monkeypatch.setattr(worker._Apps, "get", lambda self, token, fab: tasks[token][1] or flower_client.app)
    monkeypatch.setattr(worker, "push_message", lambda client, reply, ctx: node.pushed.__setitem__(client.token, (reply, ctx)))
    monkeypatch.setattr(worker, "push_task_output", lambda client, context, sub_status, details: node.outputs.append(
        (client.token, sub_status)))
    with caplog.at_level(logging.WARNING, logger="nefl_zoo"):
        assert worker.serve(ADDRESS, insecure=True, poll=0.001, max_tasks=len(tasks)) == len(tasks)

    assert list(node.pushed) == list(tasks)  # every message answered, in order
    for token, (message, _, error) in tasks.items():
        reply, _ = node.pushed[token]
        assert reply.metadata.reply_to_message_id == message.metadata.message_id, token
        if error is None:
            assert not reply.has_error() and dict(reply.content.config_records[NODE]) == {"partition-id": 1, "num-partitions": 4}
        else:
            assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION, token
            assert error in reply.error.reason, (token, reply.error.reason)
    assert node.outputs == [(t, SubStatus.FAILED if e else SubStatus.COMPLETED) for t, (_, _, e) in tasks.items()]
    logged = [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records]
    assert len(logged) == len(tasks) - 2  # one line per bad message (the bad setup's warning included), none for the 2 good
    assert all(exc_info is None and "\n" not in text for _, text, exc_info in logged), logged  # no traceback
    assert logged[4][1].startswith("run bad could not be set up on this node (its first message will fail): ")
    errors = [text for level, text, _ in logged if level == logging.ERROR]
    assert errors[0] == f"query.bogus message {tasks['wrong-type'][0].metadata.message_id}: answered with an error: " \
                        "ValueError: No query function registered with name 'bogus'"
    assert errors[-4].endswith("answered with an error: RuntimeError: CUDA out of memory")  # its first line only
    assert errors[-3].endswith("answered with an error: SystemExit: 3")
    assert errors[-2].endswith("answered with an error: TypeError: the ClientApp answered with NoneType, not a reply to the message")


@pytest.mark.parametrize("args, message", [
    (["--runtime-api-address", "host:"], "--runtime-api-address: must be HOST:PORT, got 'host:' (no port)"),
    (["--runtime-api-address", ":80"], "--runtime-api-address: must be HOST:PORT, got ':80' (no host)"),
    (["--runtime-api-address", "host:99999"], "--runtime-api-address: must be HOST:PORT, got 'host:99999' (the port must be in 1..65535)"),
    (["--runtime-api-address", "a b:1"], "--runtime-api-address: must be HOST:PORT, got 'a b:1' ('a b' is not a host name or an IP address)"),
    (["--runtime-api-address", "::1:9094"], "--runtime-api-address: must be HOST:PORT, got '::1:9094' (an IPv6 address goes in brackets: [::1]:9094)"),
    (["--poll", "inf"], "--poll: must be a number in (0, 3600], got inf"),
    (["--poll", "nan"], "--poll: must be a number in (0, 3600], got nan"),
    (["--poll", "-1"], "--poll: must be a number in (0, 3600], got -1.0"),
    (["--poll", "1e9"], "--poll: must be a number in (0, 3600], got 1000000000.0"),
    (["--root-certificates", "ca.pem"], "--insecure or --root-certificates: give one"),
])
def test_clientapp_refuses_bad_options_in_one_line_before_it_serves(args, message, monkeypatch):
    """Each of these used to reach ``serve``, which waited for ever for a SuperNode at an
    address that cannot exist (or polled every ``inf`` seconds)."""
    from typer.testing import CliRunner

    from nefl_zoo_cli.app import app

    served = []
    monkeypatch.setattr(worker, "serve", lambda *args, **kwargs: served.append(args))
    result = CliRunner().invoke(app, ["clientapp", "--insecure", *args])
    assert result.exit_code == 2 and served == [], result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.output


def test_serve_refuses_a_malformed_address_or_poll_before_it_connects(monkeypatch):
    monkeypatch.setattr(worker, "_client", lambda *args: pytest.fail("connected"))
    with pytest.raises(ValueError, match=r"^address: must be HOST:PORT, got 'host:99999' \(the port must be in 1\.\.65535\)$"):
        worker.serve("host:99999", poll=1.0, insecure=True)
    with pytest.raises(ValueError, match=r"^poll: must be a number in \(0, 3600\], got inf$"):
        worker.serve(ADDRESS, poll=float("inf"), insecure=True)

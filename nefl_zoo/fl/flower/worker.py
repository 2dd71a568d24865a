"""A long-running ClientApp process for a SuperNode started with ``--isolation process``.

In its default ``subprocess`` isolation a Flower 1.42 SuperNode starts a fresh ``flwr-clientapp``
process for every message, which pays Python's imports (torch, flwr, the method) and the run's
data loading and model set-up every time: seconds per message. With ``--isolation process``
the SuperNode starts no ClientApp itself and serves its tasks on its Runtime API to whichever
process asks; :func:`serve` is such a process that stays up. It asks for a ClientApp task,
runs it in this process with Flower's own task protocol (pull the message, context and FAB;
run the app; push the reply and the context), and asks for the next one, so imports happen
once per node and the ClientApp's caches (:mod:`nefl_zoo.fl.flower.client` builds the method
and its data once per configuration) survive from message to message.

A message the app cannot serve (of a type it has no function for, without the records it
needs, with arrays that do not decode, for a run whose configuration cannot be built) or that
fails in training, even with ``SystemExit``, or an app that answers with anything but a reply to
the message, gets Flower's error reply for that message, one ``ERROR`` log line (the traceback
only at ``DEBUG``), and the process serves the next one. A reply the SuperNode cannot take is
logged and given up; a SuperNode that is away (restarting) is waited for. Start one per
SuperNode::

    flower-supernode --insecure --superlink HOST:9092 --isolation process --port 9094 ...
    nefl-zoo clientapp --runtime-api-address 127.0.0.1:9094 --insecure
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import httpx
from flwr.app import Message
from flwr.app.error import Error
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.config import get_project_dir
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

from ...bounds import MAX_POLL_S, address as checked_address, number
from ...userfiles import one_line

log = logging.getLogger(__name__)


class _Apps:
    """The ClientApp of the FAB served last. A task of another FAB (a new version of the app)
    drops the modules imported from the previous FAB's folder first, so it runs its own code."""

    def __init__(self) -> None:
        self.load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        self.folder: Path | None = None

    def get(self, run, fab):
        folder = Path(get_project_dir(run.fab_id, run.fab_version, fab.hash_str))
        if not folder.is_dir():
            install_from_fab(fab.content, skip_prompt=True)
        if self.folder is not None and folder != self.folder:
            self._forget(self.folder)
        self.folder = folder
        return self.load(run.fab_id, run.fab_version, fab.hash_str)

    @staticmethod
    def _forget(folder: Path) -> None:
        inside = folder.resolve()
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if path and Path(path).resolve().is_relative_to(inside):
                del sys.modules[name]
        sys.path[:] = [p for p in sys.path if p != str(folder.absolute())]


def _client(address: str, insecure: bool, root_certificates: bytes | None, interceptors: list) -> RuntimeHttpClient:
    return RuntimeHttpClient.from_server_address(server_address=address, insecure=insecure,
                                                 root_certificates=root_certificates, interceptors=interceptors,
                                                 retry_invoker=make_simple_http_retry_invoker())


def _answer(reply: object, message: Message) -> Message:
    """``reply`` when it is a ``Message`` that replies to ``message``; ``TypeError`` otherwise."""
    if not isinstance(reply, Message) or reply.metadata.reply_to_message_id != message.metadata.message_id:
        got = type(reply).__name__ if not isinstance(reply, Message) else "a Message that replies to another message"
        raise TypeError(f"the ClientApp answered with {got}, not a reply to the message")
    return reply


def _failed(message: Message | None, exc: BaseException) -> None:
    """One log line for a message the app failed on (its traceback only at DEBUG)."""
    text = one_line(str(exc).strip().splitlines()[0]) if str(exc).strip() else ""
    why = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if message is None:
        log.error("a task's message could not be read: %s", why)
    else:
        meta = message.metadata
        log.error("%s message%s: answered with an error: %s", meta.message_type, f" {meta.message_id}" if meta.message_id else "", why)
    log.debug("the ClientApp's traceback", exc_info=exc)


def run_task(address: str, token: str, apps: _Apps, *, insecure: bool, root_certificates: bytes | None = None) -> None:
    """Run the ClientApp task that ``token`` grants, in this process, and report it to the SuperNode."""
    client = _client(address, insecure, root_certificates,
                     [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), RuntimeTokenHttpInterceptor(token)])
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = reply = context = None
    status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    try:
        message, context, run, fab = pull_task_input(client)
        reply = _answer(apps.get(run, fab)(message=message, context=context), message)
        status, details = SubStatus.COMPLETED, ""
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - Flower's contract: any failure becomes an error reply
        _failed(message, exc)
        code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(exc, LoadClientAppError) else ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        details = f"{type(exc)}:<'{exc}'>"
        reply = Message(Error(code=code, reason=details), reply_to=message) if message is not None else None
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client=client, context=context, sub_status=status, details=details)
        except Exception as exc:  # noqa: BLE001 - e.g. the SuperNode went away mid-task: it gives the message up
            log.warning("the reply could not be delivered to the SuperNode: %s", one_line(str(exc)) or type(exc).__name__)
        finally:
            heartbeat.stop()
            client.close()


def serve(address: str, *, poll: float, insecure: bool, root_certificates: bytes | None = None,
          max_tasks: int | None = None, stop: threading.Event | None = None) -> int:
    """Serve the ClientApp tasks of the SuperNode whose Runtime API is at ``address`` until
    ``stop`` is set or ``max_tasks`` were run; returns the number of tasks run. Polls every
    ``poll`` seconds while idle, and every second while the SuperNode cannot be reached.
    ``ValueError`` at once for an ``address`` that is not ``HOST:PORT`` or a ``poll`` that is
    not more than 0 and at most an hour (:mod:`nefl_zoo.bounds`)."""
    checked_address("address", address)
    number("poll", poll, 0, MAX_POLL_S, open_low=True)
    stop = stop or threading.Event()
    acquire = _client(address, insecure, root_certificates, [RuntimeVersionHttpInterceptor(component_name="SuperExec")])
    apps, done, away = _Apps(), 0, False
    try:
        while not stop.is_set() and (max_tasks is None or done < max_tasks):
            try:
                res = acquire.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
            except httpx.HTTPError as exc:
                if not away:
                    log.warning("the SuperNode's Runtime API at %s cannot be reached (%s); waiting for it", address, exc)
                away = True
                stop.wait(1.0)
                continue
            away = False
            if res.HasField("task") and res.token:
                run_task(address, res.token, apps, insecure=insecure, root_certificates=root_certificates)
                done += 1
            else:
                stop.wait(poll)
    finally:
        acquire.close()
    return done


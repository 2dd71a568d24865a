"""Flower runs made once per test session for ``test_method_contract_flower.py``, and the
in-process grid the other Flower tests use.

Every registered method runs the method contract's 2-round configuration
(``conftest.contract_config``) on the embedded engine (``embedded-M``) and through Flower's
ServerApp and ClientApp on an in-process grid whose messages cross Flower's protobuf both ways
(``wire-M``); every method whose embedded run keeps per-client state (``clients.safetensors``)
also runs stopped after round 1 and resumed on a fresh grid (``wire-M-resumed``: the nodes'
contexts are new, so the client state can only come from the run's checkpoints). One Flower
simulation (one Ray start: ClientApps in Ray's worker processes) runs NeFL under
``secure_aggregation`` (Flower's SecAgg+: ``flower-nefl-secure``; :func:`secure_contract_config`),
an observer following it. What Ray adds (processes, resources) is the same for every method, so
a new method is picked up from the registry on the grid without an edit here and without
another Ray run.
"""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto

from nefl_zoo.fl.flower.client import app as client_app
from nefl_zoo.fl.strategy.registry import registered_methods
from nefl_zoo.fl.aggregation.secagg import SecureAggregation
from nefl_zoo.fl.strategy.base import ClientInfo

from ..conftest import contract_config, contract_run, set_server_identity

CLIENT_STATES = "clients.safetensors"


class Rounds:
    """An observer that notes what a run reported: its start, each round's number, its end."""

    def __init__(self):
        self.seen: list = []

    def start(self, engine) -> None:
        self.seen.append("start")

    def round(self, record: dict, last_eval: dict) -> None:
        self.seen.append(record["round"])

    def end(self, engine, result) -> None:
        self.seen.append("end")


OBSERVED = Rounds()  # follows the simulation's run (observers run in the ServerApp's thread)
_RUNS: dict[str, Path] = {}


def _with_resume(config, out: Path, name: str, embedded: Path) -> list[tuple]:
    """``(config, folder, resume)`` of ``name``'s run, and of its stop after round 1 and resume
    where the embedded run keeps per-client state."""
    runs = [(config, out / name, False)]
    if (embedded / CLIENT_STATES).exists():
        stopped = config.model_copy(update={"rounds": 1})
        runs += [(stopped, out / f"{name}-resumed", False), (config, out / f"{name}-resumed", True)]
    return runs


def simulation(tmp_path_factory) -> Path:
    """The folder holding every run above, made once per session (one Flower simulation)."""
    if "out" not in _RUNS:
        from nefl_zoo.fl.flower import FlowerEngine, SimulatedRun, simulate_runs

        torch.set_num_threads(1)  # the clients train with one thread each: the same arithmetic
        out = tmp_path_factory.mktemp("flower-runs")
        for method in registered_methods():
            config, embedded = contract_config(method), out / f"embedded-{method}"
            shutil.copytree(contract_run(tmp_path_factory, method), embedded)
            for run_config, folder, resume in _with_resume(config, out, f"wire-{method}", embedded):
                grid = InProcessGrid(config.clients.num_clients, wire=True)
                with pytest.MonkeyPatch.context() as mp:
                    set_server_identity(mp)
                    FlowerEngine(run_config, folder, grid, timeout=30).run(resume=resume)
        # one CPU: one Ray worker process imports torch and the ClientApp, not one per core
        simulate_runs([SimulatedRun(secure_contract_config(), out / "flower-nefl-secure", observer=OBSERVED)], threads=1, cpus=1)
        _RUNS["out"] = out
    return _RUNS["out"]


def secure_contract_config():
    """NeFL's contract run under Flower's SecAgg+ (two clients a round, its defaults)."""
    return contract_config("nefl").model_copy(update={"secure_aggregation": SecureAggregation()})


def submodel_bytes(config) -> tuple[dict[str, int], int]:
    """Bytes of the tensors the method sends a client whose only level is each tier, and of the
    global state."""
    every_client = config.model_copy(update={"clients": config.clients.model_copy(update={"fraction": 1.0})})
    method = every_client.build_strategy()
    torch.manual_seed(0)
    state = method.init_global_state()
    levels = method.info.levels
    instructions = method.configure_train(1, state, [ClientInfo(i, (t,)) for i, t in enumerate(levels)])
    return {t: nbytes(instructions[i].arrays) for i, t in enumerate(levels)}, nbytes(state)


def nbytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors ``state`` holds."""
    return sum(t.numel() * t.element_size() for t in state.values())


def layout(run_dir: Path) -> set[str]:
    """A run directory's file names, the checkpoint generation's id masked."""
    return {re.sub(r"ckpt-\w+-\w+", "ckpt-#", p.name) for p in run_dir.iterdir()}


class InProcessGrid:
    """A Flower Grid whose nodes are this process: each pushed message runs the ClientApp right
    away with its node's Context (no Ray, no processes). With ``wire``, every message and reply
    goes through Flower's protobuf both ways and a ClientApp that raises answers with an error,
    as Flower's runtime does. ``faults`` maps a node id to a function of (ClientApp's reply,
    sent message) giving the ``train`` reply delivered instead (None: none). ``pushed``: every
    message sent; ``answers``: what each ClientApp answered, by message id; ``seen``: every reply
    delivered."""

    def __init__(self, num_nodes: int, faults=None, wire: bool = False):
        self.contexts = {1000 + i: Context(run_id=1, node_id=1000 + i, node_config={"partition-id": i, "num-partitions": num_nodes},
                                           state=RecordDict(), run_config={}) for i in range(num_nodes)}
        self.faults, self.wire = faults or {}, wire
        self.pushed: list[Message] = []
        self.answers: dict[str, Message] = {}
        self.replies: dict[str, Message] = {}  # delivered, not yet pulled
        self.seen: list[Message] = []

    def get_node_ids(self):
        return list(self.contexts)

    def _answer(self, message: Message) -> Message:
        if not self.wire:
            return client_app(message, self.contexts[message.metadata.dst_node_id])
        try:
            answer = client_app(message, self.contexts[message.metadata.dst_node_id])
        except Exception as exc:  # noqa: BLE001 - as Flower's runtime
            answer = Message(Error(code=2, reason=str(exc)), reply_to=message)
        return message_from_proto(message_to_proto(answer))

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.pushed.append(message)  # as the server sent it (the node's copy is its own, and its mods change it)
            if self.wire:
                message = message_from_proto(message_to_proto(message))
            answer = self.answers[message.metadata.message_id] = self._answer(message)
            fault = self.faults.get(message.metadata.dst_node_id) if message.metadata.message_type == "train" else None
            reply = fault(answer, message) if fault else answer
            if reply is not None:
                self.replies[message.metadata.message_id] = reply
                self.seen.append(reply)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

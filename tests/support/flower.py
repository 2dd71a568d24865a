"""One Flower simulation (one Ray start) for the whole test session, shared by
``test_method_contract_flower.py`` and ``test_flower.py``.

Every registered method runs the method contract's 2-round configuration
(``test_method_contract.contract_config``) on the embedded engine (``embedded-M``) and on
Flower's simulation engine (``flower-M``); every method whose embedded run keeps per-client state
(``clients.safetensors``) also runs on Flower stopped after round 1 and resumed
(``flower-M-resumed``). NeFL also runs under ``secure_aggregation`` (Flower's SecAgg+:
``flower-nefl-secure``; :func:`secure_contract_config`). A new method is picked up from the
registry without an edit here.
"""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto

from nefl_zoo.fl.flower.client import app as client_app
from nefl_zoo.fl.registry import registered_methods
from nefl_zoo.fl.secagg import SecureAggregation
from nefl_zoo.fl.strategy import ClientInfo

from ..conftest import contract_config, contract_run

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


OBSERVED = Rounds()  # follows the simulation's NeFL run (observers run in the ServerApp's thread)
_RUNS: dict[str, Path] = {}


def simulation(tmp_path_factory) -> Path:
    """The folder holding every run above, made once per session (one Flower simulation)."""
    if "out" not in _RUNS:
        from nefl_zoo.fl.flower import SimulatedRun, simulate_runs

        torch.set_num_threads(1)  # the simulation's clients train with one thread each: the same arithmetic
        out = tmp_path_factory.mktemp("flower-simulation")
        runs = []
        for method in registered_methods():
            config = contract_config(method)
            shutil.copytree(contract_run(tmp_path_factory, method), out / f"embedded-{method}")
            runs.append(SimulatedRun(config, out / f"flower-{method}", observer=OBSERVED if method == "nefl" else None))
            if (out / f"embedded-{method}" / CLIENT_STATES).exists():
                resumed = out / f"flower-{method}-resumed"
                stopped = config.model_copy(update={"rounds": 1})  # stopped after round 1, then resumed
                runs += [SimulatedRun(stopped, resumed), SimulatedRun(config, resumed, resume=True)]
        runs.append(SimulatedRun(secure_contract_config(), out / "flower-nefl-secure"))
        simulate_runs(runs, threads=1)
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

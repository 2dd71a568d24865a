"""The Flower ``ClientApp``: a node runs the method's client hooks on its own partition.

A node learns a run from its setup (``query``) message: the resolved run configuration, which
it keeps in ``context.state`` under the run's id, and it answers with what its ``node_config``
declares: ``partition-id``, ``num-partitions`` and, optionally, its resource level as
``max-tier`` (every tier of the spec up to that one) or ``levels`` (comma-separated tiers).
Then each ``train`` message runs the method's :meth:`~nefl_zoo.fl.strategy.Strategy.train` on
partition ``partition-id`` of the run's data, and each ``evaluate`` message its
:meth:`~nefl_zoo.fl.strategy.Strategy.evaluate_client` on the partition's own test split.
Per-client state (FedGH's extractor, FedLPS's masks) comes with each message and a ``train``
reply returns it updated: the server keeps and checkpoints it, the node keeps none. Under
``secure_aggregation`` train messages go through Flower's SecAgg+ (:mod:`.secure`): the node
sends its update scattered into the global shapes, masked.

Optional ``node_config`` keys: ``data-root`` (the config's ``data.root`` on this node),
``device`` (the config's ``train.device`` on this node, e.g. ``cpu`` on a node without the
server's GPU) and ``threads`` (torch CPU threads; results are bit-identical to the embedded
engine's only with the same thread count and device). The hooks compute on the run's
``train.device`` and ``train.precision`` (:mod:`~nefl_zoo.fl.training.device`). The method and its data
are built once per process and configuration, when the setup message arrives: in a long-running
ClientApp process (the simulation's actors, ``nefl-zoo clientapp``) rounds find them ready.
"""

from __future__ import annotations

import functools
import json
import logging

import torch
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from ...data.loading import FederatedData, load_data
from ..config import parse_config
from ..strategy.base import Strategy
from ..training.device import Placement, placed
from .nodes import NODE, NODE_KEYS, SETUP
from .records import read_instruction, reply_content
from .secure import SECURE, secure_content, secure_mod

log = logging.getLogger(__name__)
RUNS = "nefl.runs"  # context.state: run id -> its configuration (JSON)

app = ClientApp()


@functools.lru_cache(maxsize=2)
def _method(config_json: str, data_root: str, device: str) -> tuple[Strategy, FederatedData, Placement]:
    data = json.loads(config_json)
    if data_root:
        data["data"]["root"] = data_root
    if device:
        data["train"]["device"] = device
    config = parse_config(data, "the run configuration from the server")
    strategy = config.build_strategy()
    data = load_data(config.data, config.data_root(), strategy.info.input_size, config.clients.num_clients, config.seed)
    return strategy, data, config.placement()


@app.query()
def setup(message: Message, context: Context) -> Message:
    """Keep the run's configuration; answer with this node's partition and resource level."""
    run = message.content.config_records.get(SETUP)
    if run is None or "run" not in run or "config" not in run:
        raise ValueError(f"not a nefl-zoo setup message: no {SETUP!r} record with run and config")
    runs = context.state.config_records.get(RUNS) or ConfigRecord()
    runs[str(run["run"])] = str(run["config"])
    context.state[RUNS] = runs
    try:  # build the method and its data now, not in round 1, where this process lives on
        _built(str(run["config"]), context)
    except Exception as exc:  # noqa: BLE001 - the first train message fails the same way and reports it
        log.warning("run %s could not be set up on this node (its first message will fail): %s", run["run"], exc)
    node = {k: context.node_config[k] for k in NODE_KEYS if k in context.node_config}
    return Message(RecordDict({NODE: ConfigRecord(node)}), reply_to=message)


def _built(config_json: str, context: Context) -> tuple[Strategy, FederatedData, Placement]:
    node = context.node_config
    if "threads" in node:
        torch.set_num_threads(int(node["threads"]))
    return _method(config_json, str(node.get("data-root", "")), str(node.get("device", "")))


@app.train(mods=[secure_mod])
def train(message: Message, context: Context) -> Message:
    """Run the method's client ``train`` hook on this node's partition."""
    return _serve("train", message, context)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Run the method's ``evaluate_client`` hook on this node's own test split."""
    return _serve("evaluate", message, context)


def _serve(kind: str, message: Message, context: Context) -> Message:
    instruction, run, client_state = read_instruction(message.content)
    runs = context.state.config_records.get(RUNS) or {}
    if run not in runs:
        raise RuntimeError(f"this node was not set up for run {run} (no setup message reached it)")
    if "partition-id" not in context.node_config:
        raise ValueError("this node's node_config has no partition-id (flower-supernode --node-config 'partition-id=0 num-partitions=N')")
    strategy, data, where = _built(str(runs[run]), context)
    partition = int(context.node_config["partition-id"])
    with placed(where):
        if kind == "train":
            reply = strategy.train(instruction, data.client_dataset(partition), client_state)
        else:
            reply = strategy.evaluate_client(instruction, data.client_test(partition), client_state)
    if reply.error is not None:
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reply.error), reply_to=message)
    if kind == "train" and SECURE in message.content.config_records:  # SecAgg+ masks the update (secure_mod)
        return Message(secure_content(strategy, instruction, reply, message.content.config_records[SECURE]), reply_to=message)
    return Message(reply_content(reply, client_state if kind == "train" else None), reply_to=message)

"""Secure aggregation on Flower: Flower's SecAgg+ (``SecAggPlusWorkflow`` on the server,
``secaggplus_mod`` on the ClientApp) sums each round's client vectors
(:class:`~nefl_zoo.fl.aggregation.secagg.Layout`: a client's update scattered into the global shapes, with
its per-element weights), so the server learns only the sums it averages.

SecAgg+ in Flower 1.42 runs on the legacy ``fit`` messages: in its 'collect masked vectors'
stage a node trains, puts its vector in a ``FitRes``, and the mod replaces it with the masked,
quantised vector. :class:`SecureMethod` runs that workflow for the
:class:`~nefl_zoo.fl.flower.flower_engine.FlowerEngine`: its train messages are our instructions (each
with the client's own submodel), and the node's reply keeps only its scalars (sample count,
loss, level) in the clear. Nodes that fail or drop out are handled as Flower handles them: their
masks are removed with the other nodes' key shares while at least ``reconstruction_threshold``
remain, otherwise the round keeps the global state. Every other hook is the method's own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Status, bytes_to_ndarray, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.compat.common.recorddict_compat import fitres_to_recorddict
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from ..aggregation.nefedavg import weighted_mean
from ..aggregation.secagg import Layout, SecureAggregation, sum_error
from ..config import ConfigError, RunConfig
from ..methods.common import Nested, reply_weight
from ..strategy.base import Aggregate, Instruction, Reply, Strategy
from ..strategy.registry import get_method, registered_methods
from .nodes import collect
from .records import error_reply, read_reply, reply_content

log = logging.getLogger(__name__)

SECURE = "nefl.secure"  # record of a secure train message: weight scale, clipping range, rounding seed
MASKED = "secagg.masked"  # what the server holds of a client's update: its masked vector
CLIPPED = "secagg_clipped"  # reply metric: elements of the client's vector beyond the clipping range


@functools.lru_cache(maxsize=2)
def layout_of(strategy: Strategy) -> Layout:
    """The method's :class:`~nefl_zoo.fl.aggregation.secagg.Layout` (its global shapes from an initial
    state made without touching torch's RNG)."""
    with torch.random.fork_rng(devices=[]):
        return Layout(strategy, strategy.init_global_state())


def check_secure(config: RunConfig) -> None:
    """A one-line :class:`~nefl_zoo.fl.config.ConfigError` when ``config`` has a
    ``secure_aggregation`` that cannot apply: a method whose aggregation needs individual
    updates, a robust or private ``aggregation``, fewer than 2 clients a round, or sums that
    would overflow ``modulus_range``."""
    settings = config.secure_aggregation
    if settings is None:
        return

    def sums_only(name: str) -> bool:
        cls = get_method(name)
        return issubclass(cls, Nested) and cls.aggregate_train is Nested.aggregate_train

    sampled = max(1, round(config.clients.fraction * config.clients.num_clients))
    reason = None
    if not sums_only(config.method):
        able = ", ".join(m for m in registered_methods() if sums_only(m))
        reason = f"{config.method} aggregates individual updates, not sums, so it cannot run under secure aggregation; methods that can: {able}"
    elif not config.aggregation.plain:
        reason = "the server sees only sums under secure aggregation, so aggregation.rule, clip and dp (individual updates) cannot apply"
    elif sampled < 2:
        reason = f"SecAgg+ needs at least 2 clients per round, the config samples {sampled}"
    elif sampled * settings.quantization_range >= settings.modulus_range:
        reason = (f"{sampled} clients x quantization_range {settings.quantization_range} overflow modulus_range "
                  f"{settings.modulus_range}; lower quantization_range")
    if reason is not None:
        raise ConfigError(config._source, "secure_aggregation", reason)


# -- the node ------------------------------------------------------------------------------------
def secure_mod(message: Message, context: Context, call_next) -> Message:
    """SecAgg+'s client side (Flower's ``secaggplus_mod``) for the train messages of a secure
    round; any other message passes. Stochastic rounding is seeded with the client's training
    seed (a secure run repeats and resumes bit for bit); a failure is an error reply (a dropout)."""
    if RECORD_KEY_CONFIGS not in message.content.config_records:
        return call_next(message, context)
    secure = message.content.config_records.get(SECURE)
    saved = np.random.get_state()
    if secure is not None:
        np.random.seed(int(secure["seed"]) % 2**32)

    def train(msg: Message, ctx: Context) -> Message:
        reply = call_next(msg, ctx)
        if reply.has_error():
            raise RuntimeError(reply.error.reason)
        return reply

    try:
        return secaggplus_mod(message, context, train)
    except Exception as exc:  # noqa: BLE001 - Flower's contract: a failing node answers with an error (a dropout)
        log.warning("secure aggregation failed on this node: %s", exc)
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"secure aggregation: {exc}"), reply_to=message)
    finally:
        np.random.set_state(saved)


def secure_content(strategy: Strategy, instruction: Instruction, reply: Reply, record: Mapping) -> RecordDict:
    """A secure train reply: the client's vector as the ``FitRes`` SecAgg+ masks, its scalars
    (and how many elements the clipping range cut) in the clear, no tensors."""
    weight = reply_weight(strategy.run, reply, strategy.weighting) * float(record["scale"])
    vector, clipped = layout_of(strategy).client_vector(instruction.arrays, reply.arrays, reply.level, weight, float(record["clip"]))
    if clipped:
        log.warning("%d elements of this client's update exceed secure_aggregation.clipping_range and are clipped", clipped)
    content = fitres_to_recorddict(FitRes(Status(Code.OK, ""), ndarrays_to_parameters(vector), 1, {}), keep_input=False)
    clear = dataclasses.replace(reply, arrays={}, metrics={**reply.metrics, CLIPPED: clipped})
    for name, record_ in reply_content(clear).items():
        content[name] = record_
    return content


# -- the server ----------------------------------------------------------------------------------
@dataclasses.dataclass
class _Node:
    node_id: int


class _Legacy:
    """The legacy strategy ``SecAggPlusWorkflow`` drives: it picks the round's nodes and keeps
    the dequantised sum it is given."""

    def __init__(self, nodes: list[int]):
        self.nodes, self.results = nodes, None

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_Node(n), FitIns(parameters, {})) for n in self.nodes]

    def aggregate_fit(self, server_round, results, failures):
        self.results = results
        return None, {}


class _Workflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ whose train messages carry our contents (each node its own submodel)."""

    def __init__(self, contents: dict[int, RecordDict], settings: SecureAggregation, timeout: float):
        super().__init__(settings.num_shares, settings.reconstruction_threshold, max_weight=1.0, clipping_range=settings.clipping_range,
                         quantization_range=settings.quantization_range, modulus_range=settings.modulus_range, timeout=timeout)
        self.contents = contents

    def setup_stage(self, grid, context, state) -> bool:
        ready = super().setup_stage(grid, context, state)
        state.nid_to_fitins = dict(self.contents)
        return ready


def content_bytes(content: RecordDict) -> int:
    """Bytes a message's content carries: arrays' data, and bytes or strings in config records."""
    size = sum(len(a.data) for record in content.array_records.values() for a in record.values())
    for record in content.config_records.values():
        for value in record.values():
            for item in value if isinstance(value, list) else [value]:
                size += len(item) if isinstance(item, (bytes, str)) else 8
    return size


class _Watched:
    """The grid as ``SecAggPlusWorkflow`` sees it: replies collected with
    :func:`~nefl_zoo.fl.flower.nodes.collect`; notes each node's masked vector, errors and the bytes moved."""

    def __init__(self, grid, timeout: float, poll: float, stop: threading.Event | None):
        self.grid, self.timeout, self.poll, self.stop = grid, timeout, poll, stop
        self.masked: dict[int, Message] = {}
        self.errors: dict[int, str] = {}
        self.bytes = {"down": 0, "up": 0}

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.bytes["down"] += sum(content_bytes(m.content) for m in messages)
        replies = collect(self.grid, messages, self.timeout, self.poll, self.stop)
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                self.errors[node] = reply.error.reason
                continue
            self.bytes["up"] += content_bytes(reply.content)
            if Key.MASKED_PARAMETERS in reply.content.config_records.get(RECORD_KEY_CONFIGS, {}):
                self.masked[node] = reply
        return replies


class SecureMethod:
    """A method whose train updates are summed by SecAgg+: :meth:`exchange` runs a round's
    protocol, :meth:`aggregate_train` finishes the method's NeFedAvg from the sum
    (:meth:`~nefl_zoo.fl.aggregation.secagg.Layout.sums`, :func:`~nefl_zoo.fl.aggregation.nefedavg.weighted_mean`);
    every other attribute is the method's.

    Args:
        strategy: a method :func:`check_secure` accepts.
        settings: the run's ``secure_aggregation``.
        scale: what clients multiply their weights by (:func:`~nefl_zoo.fl.methods.common.weight_scale`).
    """

    def __init__(self, strategy: Strategy, settings: SecureAggregation, scale: float, *, timeout: float, poll: float,
                 stop: threading.Event | None):
        self.strategy, self.settings, self.scale = strategy, settings, scale
        self.timeout, self.poll, self.stop = timeout, poll, stop
        self.summed: tuple[np.ndarray, np.ndarray, int] | None = None
        self.bytes = {"down": 0, "up": 0}  # every protocol message of the last round

    def __getattr__(self, name: str):
        return getattr(self.strategy, name)

    def exchange(self, grid, server_round: int, contents: dict[int, tuple[int, RecordDict, int]]) -> dict[int, Reply]:
        """Run one round's SecAgg+ on ``contents`` (node -> client, instruction content, seed);
        return each client's reply in the clear, its tensors the masked vector the server got."""
        if len(contents) < 2:
            self.summed, self.bytes = None, {"down": 0, "up": 0}
            return {cid: error_reply("secure aggregation needs at least 2 clients in a round") for cid, _, _ in contents.values()}
        for _, content, seed in contents.values():
            content[SECURE] = ConfigRecord({"scale": self.scale, "clip": self.settings.clipping_range, "seed": seed})
        legacy = _Legacy(list(contents))
        state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: server_round}), MAIN_PARAMS_RECORD: ArrayRecord()})
        context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}), strategy=legacy)
        watched = _Watched(grid, self.timeout, self.poll, self.stop)
        _Workflow({node: content for node, (_, content, _) in contents.items()}, self.settings, self.timeout)(watched, context)
        self.bytes = watched.bytes
        self.summed = None
        if legacy.results:
            n = len(legacy.results)
            total, weights = (v * n for v in parameters_to_ndarrays(legacy.results[0][1].parameters))
            self.summed = (total, weights, n)
        replies: dict[int, Reply] = {}
        for node, (cid, _, _) in contents.items():
            if node in watched.masked and self.summed is not None:
                message = watched.masked[node]
                reply, _ = read_reply(message)
                masked = [bytes_to_ndarray(b) for b in message.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
                replies[cid] = dataclasses.replace(reply, arrays={MASKED: torch.from_numpy(np.concatenate([m.reshape(-1) for m in masked]))})
                if reply.metrics.get(CLIPPED):
                    log.warning("client %s: %s elements of its update were clipped to +-%g (secure_aggregation.clipping_range)",
                                cid, reply.metrics[CLIPPED], self.settings.clipping_range)
            elif node in watched.errors:
                replies[cid] = error_reply(watched.errors[node])
            elif node in watched.masked:
                replies[cid] = error_reply("secure aggregation halted: too few nodes took part to unmask the sum")
            else:
                replies[cid] = error_reply(f"no reply within {self.timeout:g} s (secure aggregation)")
        return replies

    def aggregate_train(self, server_round: int, global_state: Mapping[str, torch.Tensor], replies: Mapping[int, Reply]) -> Aggregate:
        """The method's NeFedAvg from the round's secure sum (the global state kept without one)."""
        rejected = [(cid, r.error) for cid, r in replies.items() if r.error is not None]
        for cid, reason in rejected:
            log.warning("client %s: reply rejected: %s", cid, reason)
        if self.summed is None:
            return Aggregate(dict(global_state), 0, rejected)
        total, weights, n = self.summed
        sums = layout_of(self.strategy).sums(global_state, total, weights, sum_error(self.settings, n))
        return Aggregate(weighted_mean(global_state, sums), n, rejected)

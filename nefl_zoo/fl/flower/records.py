"""Instructions and replies as Flower records, and back.

An :class:`~nefl_zoo.fl.strategy.Instruction` is already Flower-shaped plain data: its tensors
travel as one ``ArrayRecord`` (only the client's submodel, keyed as the method keys them) and
its flat config as one ``ConfigRecord``. A :class:`~nefl_zoo.fl.strategy.Reply` travels as an
``ArrayRecord``, a ``MetricRecord`` with its numbers (``num_samples``, ``loss``, ...) and a
``ConfigRecord`` with the rest (``tier``, ``tiers``), because a ``MetricRecord`` holds numbers
only. Every message of a run also names the run (``RUN`` record), so one node can serve several
runs without mixing their state.

Decoding a reply never raises: an error message, or content that does not decode, becomes a
``Reply`` with ``error`` set, which every method rejects (and logs) while the round goes on.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from ..strategy import Instruction, Reply, State

ARRAYS, CONFIG, METRICS, LABELS, RUN = "arrays", "config", "metrics", "labels", "nefl.run"


def to_array_record(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Tensors as an ``ArrayRecord`` (same keys, dtypes and shapes)."""
    return ArrayRecord({k: Array(v.detach().cpu().contiguous().numpy()) for k, v in state.items()})


def to_state(record: ArrayRecord) -> State:
    """An ``ArrayRecord`` as tensors (writable copies)."""
    return {k: torch.from_numpy(np.array(a.numpy())) for k, a in record.items()}


def tensor_bytes(record: ArrayRecord) -> int:
    """Bytes of the tensors an ``ArrayRecord`` carries (what :func:`to_array_record` was given;
    the serialisation header of each array is not counted)."""
    return sum(int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in record.values())


def instruction_content(instruction: Instruction, run: str) -> RecordDict:
    """The content of the message that carries ``instruction`` for run ``run``."""
    return RecordDict({
        ARRAYS: to_array_record(instruction.arrays),
        CONFIG: ConfigRecord(dict(instruction.config)),
        RUN: ConfigRecord({"run": run}),
    })


def read_instruction(content: RecordDict) -> tuple[Instruction, str]:
    """An instruction message's content: the instruction and the run it belongs to."""
    arrays = content.array_records.get(ARRAYS)
    instruction = Instruction(to_state(arrays) if arrays is not None else {}, dict(content.config_records[CONFIG]))
    return instruction, str(content.config_records[RUN]["run"])


def _numeric(value) -> bool:
    """What a ``MetricRecord`` holds: an int or float (not a bool), or a non-empty list of them."""
    values = value if isinstance(value, list) and value else [value]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def reply_content(reply: Reply) -> RecordDict:
    """The content of a reply message: tensors, numeric metrics, other metrics."""
    numbers = {k: v for k, v in reply.metrics.items() if _numeric(v)}
    labels = {k: v for k, v in reply.metrics.items() if k not in numbers}
    return RecordDict({ARRAYS: to_array_record(reply.arrays), METRICS: MetricRecord(numbers), LABELS: ConfigRecord(labels)})


def read_reply(message: Message) -> Reply:
    """A reply message as a :class:`Reply`; an error message or undecodable content gives a
    reply with ``error`` set (never an exception)."""
    if message.has_error():
        return Reply({}, {}, error=f"error reply (code {message.error.code}): {message.error.reason}")
    try:
        content = message.content
        arrays = content.array_records.get(ARRAYS)
        metrics: dict = {}
        for kind, records in ((METRICS, content.metric_records), (LABELS, content.config_records)):
            if kind in records:
                metrics.update(records[kind])
        return Reply(to_state(arrays) if arrays is not None else {}, metrics)
    except Exception as exc:  # noqa: BLE001  (a malformed reply must not end the round)
        return Reply({}, {}, error=f"reply does not decode: {type(exc).__name__}: {exc}")

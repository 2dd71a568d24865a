"""Instructions and replies as Flower records, and back.

:class:`~nefl_zoo.fl.strategy.Instruction` and :class:`~nefl_zoo.fl.strategy.Reply` are plain
dataclasses, and they travel field by field (whatever fields they have): a dict of tensors as an
``ArrayRecord`` (only the client's submodel, keyed as the method keys them), any other dict as a
``ConfigRecord``, and the scalar fields together as one ``ConfigRecord`` (``None`` left out:
the field's default on arrival). Beside them a message names its run (``RUN``), so one node can
serve several runs, and may carry the client's persistent state (``CLIENT``): the server sends
it with an instruction and a ``train`` reply returns it updated, so the server's checkpoints hold
it as the embedded engine's do.

Decoding a reply never raises: an error message, or content that does not decode, becomes a
``Reply`` with ``error`` set, which every method rejects (and logs) while the round goes on.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Mapping, TypeVar

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ...runtime.arrays import ArrayFileError, parse_header
from ..strategy.base import Instruction, Reply, State

SCALARS, CLIENT, RUN = "nefl.fields", "nefl.client", "nefl.run"  # record names beside the fields'
PACKED, STYPE, ORDER = "tensors", "nefl.safetensors", "nefl.order"  # the one array of a tensor record
T = TypeVar("T", Instruction, Reply)


def to_array_record(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Tensors as an ``ArrayRecord`` holding one ``Array``: the tensors' safetensors bytes (same
    keys, order, dtypes and shapes on arrival). One array instead of one per tensor: Flower moves
    every array of a message as separate objects, each its own request between SuperLink,
    SuperNode and ClientApp, which cost far more than the bytes for a model of ~100 tensors."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    data = save_tensors(tensors, metadata={ORDER: json.dumps(list(tensors))})
    return ArrayRecord({PACKED: Array(dtype="uint8", shape=(len(data),), stype=STYPE, data=data)})


def to_state(record: ArrayRecord) -> State:
    """An ``ArrayRecord`` written by :func:`to_array_record` as tensors (writable, in the order
    they were given); ``ValueError`` for any other record."""
    array = record.get(PACKED) if len(record) == 1 else None
    if array is None or array.stype != STYPE:
        raise ValueError(f"not a nefl-zoo tensor record (one {STYPE!r} array named {PACKED!r}): {sorted(record)}")
    data = bytes(array.data)
    try:
        order = json.loads(parse_header(data)[1].get(ORDER, "[]"))
        tensors = load_tensors(data)
    except (ArrayFileError, SafetensorError) as exc:
        raise ValueError(f"the tensor record does not decode: {exc}") from None
    if sorted(order) != sorted(tensors):
        raise ValueError("the tensor record's order does not name its tensors")
    return {k: tensors[k] for k in order}


def tensor_bytes(record: ArrayRecord) -> int:
    """Bytes of the tensors a record from :func:`to_array_record` carries (the tensors' own
    bytes, without the safetensors header)."""
    return sum(t.numel() * t.element_size() for t in to_state(record).values())


def _plain(value: Any) -> Any:
    """A value as a ``ConfigRecord`` holds it (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value


def _records(obj: Instruction | Reply) -> dict:
    """``obj``'s fields as records (see the module docstring)."""
    records: dict = {}
    scalars: dict = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, dict):
            tensors = bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())
            records[f.name] = to_array_record(value) if tensors else ConfigRecord({k: _plain(v) for k, v in value.items()})
        elif value is not None:
            scalars[f.name] = _plain(value)
    records[SCALARS] = ConfigRecord(scalars)
    return records


def _read(cls: type[T], content: RecordDict) -> T:
    """The ``cls`` instance that :func:`_records` wrote into ``content``."""
    hints = typing.get_type_hints(cls)
    values: dict = {}
    for f in dataclasses.fields(cls):
        if f.name in content.array_records:
            values[f.name] = to_state(content.array_records[f.name])
        elif f.name in content.config_records:
            values[f.name] = dict(content.config_records[f.name])
        elif f.name in content.config_records[SCALARS]:
            value = content.config_records[SCALARS][f.name]
            values[f.name] = tuple(value) if typing.get_origin(hints[f.name]) is tuple else value
    return cls(**values)


def instruction_content(instruction: Instruction, run: str, client_state: Mapping[str, torch.Tensor]) -> RecordDict:
    """The content of the message that carries ``instruction`` (and the client's state, if it
    has any) for run ``run``."""
    records = {**_records(instruction), RUN: ConfigRecord({"run": run})}
    if client_state:
        records[CLIENT] = to_array_record(client_state)
    return RecordDict(records)


def read_instruction(content: RecordDict) -> tuple[Instruction, str, State]:
    """An instruction message's content: the instruction, its run and the client's state;
    ``ValueError`` in one line for content that is not an instruction or does not decode."""
    missing = [name for name in (RUN, SCALARS) if name not in content.config_records]
    if missing:
        raise ValueError(f"not a nefl-zoo instruction: no {' or '.join(map(repr, missing))} record (has {sorted(content) or 'none'})")
    client = content.array_records.get(CLIENT)
    try:
        run = str(content.config_records[RUN]["run"])
        return _read(Instruction, content), run, to_state(client) if client is not None else {}
    except (KeyError, TypeError) as exc:  # a field missing or of the wrong kind
        raise ValueError(f"the instruction does not decode: {type(exc).__name__}: {exc}") from None


def reply_content(reply: Reply, client_state: Mapping[str, torch.Tensor] | None = None) -> RecordDict:
    """The content of a reply message: the reply's fields and, for a ``train`` reply, the
    client's updated state (possibly empty)."""
    records = _records(reply)
    if client_state is not None:
        records[CLIENT] = to_array_record(client_state)
    return RecordDict(records)


def error_reply(reason: str) -> Reply:
    """The reply of a client that failed or did not answer (every method rejects it)."""
    return Reply(arrays={}, metrics={}, error=reason)


def read_reply(message: Message) -> tuple[Reply, State | None]:
    """A reply message as a :class:`Reply` and the client state it returns (``None``: none); an
    error message or undecodable content gives a reply with ``error`` set (never an exception)."""
    if message.has_error():
        return error_reply(f"error reply (code {message.error.code}): {message.error.reason}"), None
    try:
        client = message.content.array_records.get(CLIENT)
        return _read(Reply, message.content), to_state(client) if client is not None else None
    except Exception as exc:  # noqa: BLE001  (a malformed reply must not end the round)
        return error_reply(f"reply does not decode: {type(exc).__name__}: {exc}"), None

"""Instructions, replies and client state as Flower records and back
(``nefl_zoo.fl.flower.records``): every field, dtype and key order survives, a tensor dict is one
array, and what does not decode becomes a rejected reply, never an exception."""

import dataclasses

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Error, Message, RecordDict  # noqa: E402

from nefl_zoo.fl.flower.records import (instruction_content, read_instruction, read_reply, reply_content,  # noqa: E402
                                        tensor_bytes, to_state)
from nefl_zoo.fl.strategy.base import Instruction, Reply  # noqa: E402

from .conftest import assert_equal_tensors  # noqa: E402


def same(a, b) -> bool:
    """Equal dataclass fields; tensors bit-identical, numbers of the same type."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict) and x and all(isinstance(v, torch.Tensor) for v in x.values()):
            assert_equal_tensors(x, y)
        elif x != y or type(x) is not type(y) or (isinstance(x, dict) and any(type(x[k]) is not type(y[k]) for k in x)):
            return False
    return True


def test_instructions_and_replies_travel_field_by_field_with_the_client_state(server_identity):
    weights = {"conv.weight": torch.randn(4, 3), "bn.num_batches_tracked": torch.tensor(7), "mask": torch.tensor([True, False])}
    instruction = Instruction(weights, {"round": 2, "lr": 0.1, "tiers": ["g0.25", "g0.5"], "prox": 0.0}, level="g0.5")
    client_state = {"extractor.weight": torch.randn(2, 2, dtype=torch.float64)}
    content = instruction_content(instruction, "run-7", client_state)
    back, run, state = read_instruction(content)
    assert same(back, instruction) and run == "run-7"
    assert_equal_tensors(state, client_state)
    assert read_instruction(instruction_content(instruction, "run-7", {}))[2] == {}  # no state: none sent

    sent = Message(content, 3, "train")
    reply = Reply({"conv.weight": torch.randn(4, 3)}, {"tiers": ["g1"], "accuracy": 0.25}, num_samples=10, loss=0.5, level="g1")
    back, state = read_reply(Message(reply_content(reply, client_state), reply_to=sent))
    assert same(back, reply) and back.error is None
    assert same(read_reply(Message(reply_content(Reply({}, num_samples=3)), reply_to=sent))[0], Reply({}, num_samples=3))  # loss None
    assert_equal_tensors(state, client_state)
    assert read_reply(Message(reply_content(reply), reply_to=sent))[1] is None  # an evaluate reply: no state back

    failed, state = read_reply(Message(Error(code=2, reason="out of memory"), reply_to=sent))
    assert "out of memory" in failed.error and state is None
    garbled, state = read_reply(Message(RecordDict({}), reply_to=sent))
    assert garbled.error.startswith("reply does not decode") and state is None


def test_a_state_travels_as_one_array_of_safetensors_bytes_in_its_own_order():
    from flwr.app import Array, ArrayRecord
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    from nefl_zoo.fl.flower.records import to_array_record

    state = {f"layer{i}.weight": torch.randn(8, 3) for i in range(40)}
    state = {"z.step": torch.tensor(0.5), **state, "a.count": torch.tensor(3, dtype=torch.int64)}
    record = to_array_record(state)
    # one array: Flower moves each array of a message as its own objects and requests
    assert list(record) == ["tensors"] and len(get_all_nested_objects(record)) == 3
    back = to_state(record)
    assert list(back) == list(state)  # the sender's order, not safetensors' sorted one
    assert_equal_tensors(back, state)
    assert tensor_bytes(record) == 40 * 8 * 3 * 4 + 4 + 8
    back["a.count"] += 1  # writable
    for foreign in (ArrayRecord({"w": Array(torch.ones(2).numpy())}), ArrayRecord({"tensors": Array(torch.ones(2).numpy())})):
        with pytest.raises(ValueError, match="not a nefl-zoo tensor record"):
            to_state(foreign)


def test_what_does_not_decode_is_refused_in_one_line(server_identity):
    from flwr.app import Array, ArrayRecord
    from safetensors.torch import save

    from nefl_zoo.fl.flower.records import STYPE, to_array_record

    packed = to_array_record({"w": torch.ones(2)})
    assert packed["tensors"].dtype == "uint8" and packed["tensors"].stype == STYPE
    with pytest.raises(ValueError, match="not a nefl-zoo tensor record"):  # one packed array and nothing else
        to_state(ArrayRecord({"tensors": packed["tensors"], "w": Array(torch.ones(2).numpy())}))
    short = Array(dtype="uint8", shape=(4,), stype=STYPE, data=b"\x00" * 4)
    with pytest.raises(ValueError, match="^the tensor record does not decode: shorter than the 8-byte header length$"):
        to_state(ArrayRecord({"tensors": short}))
    data = save({"w": torch.ones(2)})  # safetensors without the sender's order
    unordered = Array(dtype="uint8", shape=(len(data),), stype=STYPE, data=data)
    with pytest.raises(ValueError, match="^the tensor record's order does not name its tensors$"):
        to_state(ArrayRecord({"tensors": unordered}))

    cut = bytes(packed["tensors"].data)[:-4]  # a header that parses, tensors that do not
    with pytest.raises(ValueError, match="^the tensor record does not decode: "):
        to_state(ArrayRecord({"tensors": Array(dtype="uint8", shape=(len(cut),), stype=STYPE, data=cut)}))

    sent = Message(instruction_content(Instruction({"w": torch.ones(2)}), "run-1", {}), 3, "train")
    failed, _ = read_reply(Message(Error(code=2, reason="out of memory"), reply_to=sent))
    assert failed.arrays == {} and failed.metrics == {} and failed.num_samples == Reply({}).num_samples
    garbled, _ = read_reply(Message(RecordDict({}), reply_to=sent))
    assert garbled.error.startswith("reply does not decode: KeyError: ")


def test_tuples_travel_as_lists_and_come_back_as_their_fields_type(server_identity):
    from flwr.app import ConfigRecord

    from nefl_zoo.fl.flower.records import SCALARS, _read, _records

    @dataclasses.dataclass
    class Levels:
        arrays: dict
        levels: tuple[str, ...] = ()
        names: list[str] = dataclasses.field(default_factory=list)
        config: dict = dataclasses.field(default_factory=dict)

    sent = Levels({"w": torch.ones(1)}, ("g0.5", "g1"), ["a"], {"tiers": ("g0.25", "g0.5")})
    records = _records(sent)
    assert isinstance(records[SCALARS], ConfigRecord) and records[SCALARS]["levels"] == ["g0.5", "g1"]
    assert records["config"]["tiers"] == ["g0.25", "g0.5"]
    back = _read(Levels, RecordDict(records))
    assert back.levels == ("g0.5", "g1") and type(back.levels) is tuple  # a tuple field gets a tuple back
    assert back.names == ["a"] and type(back.names) is list
    assert back.config == {"tiers": ["g0.25", "g0.5"]}

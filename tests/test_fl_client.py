"""A client's local training pieces (``nefl_zoo.fl.training.client``): the batches an instruction asks
for and the reply a trained client sends."""

import numpy as np
import torch

from nefl_zoo.fl.training.client import ClientResult, training_batches
from nefl_zoo.data.loading import TensorImages

DATA = TensorImages(torch.arange(10, dtype=torch.float32).view(10, 1, 1, 1), np.arange(10) % 3)


def sizes(**config) -> list[int]:
    return [len(y) for _, y in training_batches(DATA, {"batch_size": 4, "seed": 0, "local_epochs": 1, **config}, torch.device("cpu"))]


def test_the_last_batch_is_kept_dropped_or_merged_as_the_instruction_says():
    assert sizes() == [4, 4, 2]  # an instruction without them: TrainConfig's defaults (min_batch 1, drop)
    assert sizes(min_batch=3) == [4, 4]
    assert sizes(min_batch=3, last_batch="merge") == [4, 6]
    assert sizes(min_batch=3, last_batch="drop", local_epochs=2) == [4, 4, 4, 4]


def test_the_batches_are_the_seeded_shuffle_of_every_sample_once():
    seen = [x.flatten().tolist() for x, _ in training_batches(DATA, {"batch_size": 4, "seed": 3, "local_epochs": 1},
                                                             torch.device("cpu"))]
    again = [x.flatten().tolist() for x, _ in training_batches(DATA, {"batch_size": 4, "seed": 3, "local_epochs": 1},
                                                              torch.device("cpu"))]
    assert seen == again and sorted(v for batch in seen for v in batch) == list(range(10))


def test_a_trained_clients_reply_carries_its_state_count_loss_accuracy_and_level():
    state = {"w": torch.ones(2)}
    reply = ClientResult(state, 12, {"loss": 0.5, "accuracy": 0.75}).reply("g0.5")
    assert reply.arrays is state and reply.num_samples == 12 and reply.loss == 0.5 and reply.level == "g0.5"
    assert reply.metrics == {"accuracy": 0.75} and reply.error is None


def test_a_state_loads_only_when_it_fits_the_module():
    import pytest
    from torch import nn

    from nefl_zoo.fl.strategy.local_model import load_entries

    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    full = {k: torch.full_like(v, 0.5) for k, v in net.state_dict().items()}
    params = {k: v for k, v in full.items() if k in dict(net.named_parameters())}
    load_entries(net, params)  # buffers may be missing
    assert torch.equal(net[0].weight, torch.full((2, 2), 0.5))
    load_entries(net, {k: v for k, v in params.items() if k != "2.bias"}, unused=["2.bias"])
    with pytest.raises(KeyError) as missing:
        load_entries(net, {k: v for k, v in params.items() if not k.startswith("0.")})
    assert missing.value.args[0] == "state does not fit the module: missing ['0.bias', '0.weight'], unexpected []"
    with pytest.raises(KeyError) as many:
        load_entries(net, {})
    assert many.value.args[0] == ("state does not fit the module: missing ['0.bias', '0.weight', '1.bias'], "
                                  "unexpected []")  # the first three of five
    extra = {**params, **{f"x{i}": torch.zeros(1) for i in range(5)}}
    with pytest.raises(KeyError) as unexpected:
        load_entries(net, extra)
    assert unexpected.value.args[0] == "state does not fit the module: missing [], unexpected ['x0', 'x1', 'x2']"

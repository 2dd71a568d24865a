"""Secure, private and robust aggregation at their edges: a SecAgg+ sum that could wrap modulo
the field is refused (and one a step below it is not), the weight scale's headroom at exactly
its bound, DP-FedAvg's refusal of a reply at a level the server did not assign with the fixed
denominators counting every assigned client, and invalid updates kept out of norm bounding
(TESTING.md, "Semantic mistakes")."""

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.common.secure_aggregation.quantization import quantize  # noqa: E402

from nefl_zoo.fl.aggregation.nefedavg import Update  # noqa: E402
from nefl_zoo.fl.aggregation.rules import AggregationConfig, aggregate_updates  # noqa: E402
from nefl_zoo.fl.config import ConfigError  # noqa: E402
from nefl_zoo.fl.flower.secure import check_secure  # noqa: E402
from nefl_zoo.fl.aggregation.privacy import noise_generator, private_mean  # noqa: E402
from nefl_zoo.fl.aggregation.robust import coordinate_rule  # noqa: E402
from nefl_zoo.fl.aggregation.secagg import SecureAggregation, sum_error
from nefl_zoo.fl.methods.common import weight_scale  # noqa: E402
from nefl_zoo.fl.strategy.base import ClientInfo, Reply  # noqa: E402
from nefl_zoo.slim import SliceEntry, SliceMap  # noqa: E402

from .conftest import tiny  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize("clients, fraction, q, refused", [
    (2, 1.0, 2**15, True),  # 2 x 2**15 = M: two clients at the top sum to 0 modulo M
    (2, 1.0, 2**15 - 1, False),  # 2 x (2**15 - 1) = M - 2: no wrap
    (4, 0.5, 2**15 - 1, False),  # 2 of 4 clients a round: the round's clients count, not the population
    (4, 0.75, 2**15 - 1, True),  # 3 a round
])
def test_a_sum_that_could_wrap_modulo_the_field_is_refused(clients, fraction, q, refused):
    """SecAgg+ quantises each element to an integer in [0, Q] (Flower's ``quantize``: +c becomes
    Q itself) and sums modulo M (here 2**16), so ``n`` clients a round wrap as soon as
    ``n Q >= M``. Broken by hand: ``>`` for ``>=`` in ``check_secure`` (the first case
    accepted), or the population's size for the round's clients (the third refused), fails here."""
    m, n = 2**16, round(clients * fraction)
    top = quantize([np.array([8.0])], 8.0, q)[0]  # a client's element at +clipping_range
    assert int(top[0]) == q
    assert ((n * q) % m != n * q) == refused  # n clients at the top: the sum modulo M is not the sum
    config = tiny(clients__num_clients=clients, clients__fraction=fraction, secure_aggregation={"quantization_range": q, "modulus_range": m})
    if not refused:
        check_secure(config)
        return
    with pytest.raises(ConfigError, match=rf"secure_aggregation: {n} clients x quantization_range {q} overflow "
                                          rf"modulus_range {m}; lower quantization_range$"):
        check_secure(config)


def test_the_smallest_weight_needs_twice_the_sum_error_of_headroom_exactly():
    """Two clients a round: the sum error is ``e = 2 x 2c / Q = 2**-17``. Weighted by samples over
    partitions of 1 and 65,536 images, the smallest scaled weight is 2**-16 = 2e exactly: refused
    (it could read as unheld); over 1 and 65,535 it clears 2e and is accepted with scale
    1 / 65,535. Broken by hand: ``<`` for ``<=``, or a headroom of ``1 *`` or ``3 *`` for
    ``2 *`` the error in ``weight_scale``, fails here."""
    settings, strategy = SecureAggregation(), tiny(train__weighting="samples").build_strategy()
    assert sum_error(settings, 2) == 2.0**-17
    with pytest.raises(ValueError, match=r"^secure_aggregation: the smallest client weight \(1.5e-05 scaled\) is within SecAgg\+'s "
                                         r"quantisation error; raise quantization_range$"):
        weight_scale(strategy, [1, 2**16], settings, 2)
    assert weight_scale(strategy, [1, 2**16 - 1], settings, 2) == 1 / (2**16 - 1)


def private(**more):
    """The tiny run's NeFL with DP-FedAvg (clip 1, noise multiplier 1), its initial state and
    its three clients' round-1 instructions (every client may take any tier)."""
    strategy = tiny(clients__num_clients=3, aggregation={"clip": 1.0, "dp": {"noise_multiplier": 1.0}}, **more).build_strategy()
    state = strategy.init_global_state()
    levels = strategy.info.levels
    return strategy, state, strategy.configure_train(1, state, [ClientInfo(c, levels) for c in range(3)])


def changed(strategy, state, level):
    """The tensors of ``level`` from ``state`` with the first element of its first float tensor
    raised by 0.01 (an update well within the clip)."""
    arrays = SliceMap(dict(strategy.entries(level))).extract(state)
    key = next(k for k, t in arrays.items() if t.is_floating_point())
    arrays[key] = arrays[key].clone()
    arrays[key].view(-1)[0] += 0.01
    return arrays


def test_a_dp_reply_at_an_unassigned_level_is_refused_and_every_assigned_client_counts():
    """Client 0 replies at a tier other than the one it was assigned, client 1 as assigned,
    client 2 fails. Only client 1's update is aggregated; the noisy mean divides each element by
    the clients *assigned* a tier holding it (all three, failed and refused included), with the
    round's seeded noise. Broken by hand, each fails here: the level check left out of
    ``Nested.aggregate_train`` (client 0 aggregated), the denominators taken from the replies
    rather than the assignment (the wrong holder set)."""
    strategy, state, instructions = private()
    assigned = {c: i.level for c, i in instructions.items()}
    other = next(t for t in strategy.info.levels if t != assigned[0])
    replies = {0: Reply(changed(strategy, state, other), num_samples=10, level=other),
               1: Reply(changed(strategy, state, assigned[1]), num_samples=10, level=assigned[1]),
               2: Reply({}, error="no reply")}
    result = strategy.aggregate_train(1, state, replies)
    assert result.accepted == 1
    assert result.rejected == [(0, f"reply level {other!r} is not the assigned {assigned[0]!r}"), (2, "no reply")]
    expected = private_mean(state, [Update(strategy.entries(assigned[1]), replies[1].arrays, 1.0, 1)],
                            [strategy.entries(assigned[c]) for c in range(3)], 1.0, 1.0, noise_generator(strategy.run.seed, 1))
    assert result.state.keys() == expected.keys()
    assert all(torch.equal(result.state[k], expected[k]) for k in expected)


def test_dp_refuses_to_aggregate_a_round_it_did_not_assign():
    """The fixed denominators are the assignment of the same round: aggregating round 2 after
    configuring round 1 is an error, not a mean over last round's clients. Broken by hand: the
    round check left out of ``Nested.aggregate_train`` fails here."""
    strategy, state, instructions = private()
    replies = {c: Reply(changed(strategy, state, i.level), num_samples=10, level=i.level) for c, i in instructions.items()}
    with pytest.raises(RuntimeError, match=r"^nefl: aggregation.dp needs configure_train of round 2 first \(its denominators\)$"):
        strategy.aggregate_train(2, state, replies)


def test_an_invalid_update_is_rejected_before_norm_bounding_and_never_counted_or_used():
    """Three valid updates of ``w`` (norms 3, 4 and 0.5 from the zero state) and one of weight -1
    far out: with ``clip: 1`` and the median, the invalid one is rejected, only the two valid
    updates beyond the bound count as clipped, and the median is over the three valid clipped
    updates alone. Broken by hand: the updates clipped before the validity check (the invalid
    one clipped into a valid-looking update, counted and used by the median) fails here."""
    entries = {"w": SliceEntry("w", (slice(0, 2),), (2,), "weight", True)}
    glob = {"w": torch.zeros(2)}
    valid = [Update(entries, {"w": torch.tensor(v)}, 1.0, c) for c, v in enumerate([[3.0, 0.0], [0.0, 4.0], [0.3, 0.4]])]
    bad = Update(entries, {"w": torch.tensor([50.0, 50.0])}, -1.0, "bad")
    state, rejected, metrics = aggregate_updates(glob, [*valid, bad], AggregationConfig(rule="median", clip=1.0))
    assert rejected == [("bad", "weight -1.0 is not a positive number")] and metrics == {"clipped": 2}
    clipped = [Update(entries, {"w": torch.tensor(v)}, 1.0, c) for c, v in enumerate([[1.0, 0.0], [0.0, 1.0], [0.3, 0.4]])]
    assert torch.allclose(state["w"], coordinate_rule(glob, clipped, "median")["w"]) and torch.allclose(state["w"], torch.tensor([0.3, 0.4]))

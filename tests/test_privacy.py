"""Client-level differential privacy of nested updates (issue 52): DP-FedAvg's noisy mean with
fixed per-element denominators, the documented noise, the accountant's epsilon in the round
records, and a bit-identical resume."""

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import RdpAccountant

from nefl_zoo.fl.aggregation.nefedavg import Update
from nefl_zoo.fl.aggregation.rules import AggregationConfig, PrivacyConfig, aggregate_updates
from nefl_zoo.fl.engine import Engine
from nefl_zoo.fl.aggregation.privacy import epsilon, noise_generator, private_mean
from nefl_zoo.slim import SliceEntry

from .conftest import crash_in_round, records, same_tensors, tiny

torch.set_num_threads(1)


def prefix(n):
    """Slice entries of the first ``n`` elements of ``w``."""
    return {"w": SliceEntry("w", (slice(0, n),), (n,), "weight", True)}


def test_the_noisy_mean_has_fixed_denominators_per_element():
    """Three clients assigned (widths 4, 4, 2), two reply: every element moves by the sum of its
    holders' deltas plus the noise, over the clients assigned a submodel holding it."""
    glob = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0, 5.0]), "n": torch.tensor([3], dtype=torch.int64)}
    updates = [Update(prefix(4), {"w": torch.tensor([2.0, 3.0, 1.0, 1.0])}, 7.0, "a"),  # the weight is ignored
               Update(prefix(2), {"w": torch.tensor([4.0, 1.0])}, 1.0, "c")]
    assigned = [prefix(4), prefix(4), prefix(2)]
    new = private_mean(glob, updates, assigned, clip=2.0, noise_multiplier=0.5, generator=noise_generator(3, 2))
    noise = torch.randn(5, generator=noise_generator(3, 2)) * 1.0
    expected = torch.tensor([1 + (1 + 3 + noise[0].item()) / 3, 1 + (2 + noise[1].item()) / 3, 1 + noise[2].item() / 2,
                             1 + noise[3].item() / 2, 5.0])
    assert torch.allclose(new["w"], expected) and new["w"][4] == 5.0  # no one holds the last element: unchanged
    assert new["n"] is glob["n"]


def test_the_noise_std_is_z_clip_over_the_holders_of_each_element():
    """Zero updates: what is left is noise, std z * C / D_e (D_e clients hold element e)."""
    n = 20_000
    glob = {"w": torch.zeros(n)}
    assigned = [prefix(n // 2)] * 3 + [prefix(n)]  # the first half: 4 holders, the second half: 1
    new = private_mean(glob, [], assigned, clip=0.5, noise_multiplier=2.0, generator=noise_generator(0, 1))["w"]
    shared, wide = new[: n // 2], new[n // 2:]
    assert abs(float(shared.std()) / (2.0 * 0.5 / 4) - 1) < 0.03 and abs(float(wide.std()) / (2.0 * 0.5) - 1) < 0.03
    assert abs(float(shared.mean())) < 4 * 0.25 / (n / 2) ** 0.5 and abs(float(wide.mean())) < 4 / (n / 2) ** 0.5


def test_noise_is_seeded_by_run_seed_and_round():
    draw = [torch.randn(4, generator=noise_generator(s, r)) for s, r in ((0, 1), (0, 1), (0, 2), (1, 1))]
    assert torch.equal(draw[0], draw[1]) and not torch.equal(draw[0], draw[2]) and not torch.equal(draw[0], draw[3])


def test_clients_are_clipped_before_the_noise():
    glob = {"w": torch.zeros(2)}
    big = Update(prefix(2), {"w": torch.tensor([30.0, 40.0])}, 1.0, "big")
    config = AggregationConfig(clip=1.0, dp=PrivacyConfig(noise_multiplier=1e-9))
    state, rejected, metrics = aggregate_updates(glob, [big], config, assigned=[prefix(2)] * 2, seed=0, server_round=1, rate=0.5)
    assert torch.allclose(state["w"], torch.tensor([0.3, 0.4])) and metrics["clipped"] == 1 and not rejected  # (0.6, 0.8) / 2
    message = (r"^aggregation\.dp: needs the round's assigned clients \(the denominators\), the sampling rate, the run seed "
               r"and the round$")
    given = {"assigned": [prefix(2)] * 2, "seed": 0, "server_round": 1, "rate": 0.5}
    for missing in given:  # the noise comes from the run seed and round, epsilon from the rate and round: no defaults
        with pytest.raises(ValueError, match=message):
            aggregate_updates(glob, [big], config, **{k: v for k, v in given.items() if k != missing})


def test_the_noise_of_an_aggregation_is_seeded_by_run_seed_and_round():
    glob = {"w": torch.zeros(3)}
    update = Update(prefix(3), {"w": torch.tensor([0.1, 0.2, 0.3])}, 1.0, 0)
    config = AggregationConfig(clip=1.0, dp=PrivacyConfig(noise_multiplier=1.0))

    def noisy(seed, server_round):
        torch.manual_seed(123)  # the global RNG must not matter
        return aggregate_updates(glob, [update], config, assigned=[prefix(3)], seed=seed, server_round=server_round, rate=0.5)[0]["w"]

    first = noisy(0, 1)
    torch.manual_seed(7)
    assert torch.equal(first, noisy(0, 1))
    assert not torch.equal(first, noisy(0, 2)) and not torch.equal(first, noisy(1, 1))
    expected = torch.tensor([0.1, 0.2, 0.3]) + torch.randn(3, generator=noise_generator(0, 1))  # z C / D = 1
    assert torch.allclose(first, expected, atol=1e-6)


def direct_epsilon(rate, z, rounds, delta):
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z)), rounds)
    return accountant.get_epsilon(delta)


def test_epsilon_is_the_accountants():
    assert epsilon(0.1, 1.1, 50, 1e-5) == direct_epsilon(0.1, 1.1, 50, 1e-5)
    assert epsilon(0.1, 1.1, 50, 1e-5) < epsilon(0.1, 1.1, 100, 1e-5) and epsilon(0.1, 2.0, 50, 1e-5) < epsilon(0.1, 1.1, 50, 1e-5)


def test_a_private_run_reports_epsilon_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    config = tiny(rounds=2, checkpoint_every=1, eval__every=2, clients__fraction=0.75, train__local_epochs=1, data__max_test_samples=16,
                  aggregation={"clip": 1.0, "dp": {"noise_multiplier": 0.8, "delta": 1e-4}})
    Engine(config, tmp_path / "straight").run()
    crash_in_round(config, tmp_path / "resumed", monkeypatch, 1)
    Engine(config, tmp_path / "resumed").run(resume=True)
    assert same_tensors(tmp_path / "straight", tmp_path / "resumed")
    straight = records(tmp_path / "straight")
    assert records(tmp_path / "resumed") == straight
    assert [r["epsilon"] for r in straight] == [direct_epsilon(0.75, 0.8, r, 1e-4) for r in (1, 2)]
    assert all(r["clients"] == 3 and r["rejected"] == 0 for r in straight)

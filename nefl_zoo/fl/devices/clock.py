"""The virtual clock: simulated time of a run whose clients are devices (``devices:``, :mod:`.population`).

A client's round time is its local compute, ``local_epochs x its samples x the tier's training
MACs per image / its speed this round``, plus its transfer, ``the tier's bytes / downlink +
the tier's bytes / uplink``. A tier's training MACs per image are 3x the forward MACs the method
counts (:meth:`~nefl_zoo.fl.methods.common.Nested.client_macs`; backward adds about twice the forward), its
bytes 4 per element it sends (:attr:`~nefl_zoo.fl.strategy.MethodInfo.numel`), its memory the weights,
gradients and optimizer state (3 x its bytes) plus ``train.batch_size`` x the activations one
image keeps for the backward pass (every leaf module's output).

A round ends at the deadline or when every client has returned (``policy: deadline``), or when
every client still online has returned (``wait_all``). Who misses is decided before training,
from the same numbers, so a client whose update would be dropped is not trained: ``late`` (past
the deadline), ``lost`` (offline before it finishes) or ``memory`` (its tier does not fit). The
state is one integer, the simulated microseconds so far (:attr:`VirtualClock.time_us`, saved in a
checkpoint's totals); everything else derives from the run seed, the round and the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from torch import nn

from ...slim import compile_spec
from ..strategy.base import ClientInfo, Strategy
from .population import DevicesConfig, Population

BYTES_PER_ELEMENT = 4  # float32
TRAIN_MACS_FACTOR = 3  # forward + backward (about twice the forward)


def activation_bytes(module: nn.Module, input_size: tuple[int, ...]) -> int:
    """Bytes of every leaf module's output on one input of ``input_size``: what a training step
    keeps per image for the backward pass."""
    from ...profile import leaf_tensor_bytes

    return sum(output for _, output in leaf_tensor_bytes(module, input_size))


@dataclass(frozen=True)
class TierCosts:
    """Per tier of the run's spec, smallest first: training MACs per image, bytes sent each way,
    and training memory (bytes) at ``train.batch_size``."""

    names: tuple[str, ...]
    train_macs: np.ndarray
    bytes: np.ndarray
    memory: np.ndarray

    @classmethod
    def of(cls, strategy: Strategy, batch_size: int) -> "TierCosts":
        """The costs of every tier of the strategy's run spec, with the method's own MACs and
        sizes for the levels it trains; ``ValueError`` when it trains levels that are not tiers."""
        from ...profile import macs_signature, tier_macs  # fvcore: imported only when counted

        spec = strategy.run.spec
        compiled = compile_spec(spec)
        info = strategy.info
        unknown = [level for level in info.levels if level not in compiled.tiers]
        if unknown:
            raise ValueError(f"devices: {strategy.name} trains levels {unknown} that are not tiers of the spec")
        rows = []
        for name, tier in compiled.tiers.items():
            numel = info.numel.get(name, tier.slice_map.numel())
            if name in info.levels and hasattr(strategy, "client_macs"):
                macs = strategy.client_macs(name)
            else:
                macs = tier_macs(macs_signature(spec, tier.tier, compiled.input_size), tier.build)
            size = BYTES_PER_ELEMENT * numel
            rows.append((tier.slice_map.numel(), name, TRAIN_MACS_FACTOR * macs, size,
                         3 * size + batch_size * activation_bytes(tier.build(), compiled.input_size)))
        rows.sort(key=lambda r: r[0])  # by size: the last that fits is the largest
        return cls(tuple(r[1] for r in rows), *(np.array([r[i] for r in rows], dtype=np.float64) for i in (2, 3, 4)))


@dataclass
class RoundTiming:
    """One round on the clock: each client's status (``arrived``, ``late``, ``lost`` or ``memory``),
    round time (s) and level, how many clients were online at its start, its start and length (µs)."""

    start_us: int
    duration_us: int
    online: int
    status: dict[int, str]
    seconds: dict[int, float]
    levels: dict[int, str]

    def record(self, order: Sequence[str]) -> dict:
        """The round record's clock fields: simulated time at the round's end and the round's
        length (s), clients online, dropped (late or out of memory) and lost, and the
        participation (updates arrived) per tier in ``order``."""
        statuses = list(self.status.values())
        arrived = [self.levels[c] for c, s in self.status.items() if s == "arrived"]
        return {"sim_time_s": (self.start_us + self.duration_us) / 1e6, "sim_round_s": self.duration_us / 1e6, "online": self.online,
                "dropped": statuses.count("late") + statuses.count("memory"), "lost": statuses.count("lost"),
                "participation": {t: arrived.count(t) for t in order if t in arrived}}


class VirtualClock:
    """Simulated time of a run (see the module docstring).

    Args:
        devices: the ``devices`` section.
        costs: the run spec's tier costs (:meth:`TierCosts.of`).
        samples: training images each client processes in a round (``local_epochs`` x its samples).
        seed: the run seed.
    """

    def __init__(self, devices: DevicesConfig, costs: TierCosts, samples: Sequence[int], seed: int):
        self.devices, self.costs = devices, costs
        self.population = Population(devices, len(samples), seed)
        self.samples = np.asarray(samples, dtype=np.float64)
        self.index = {name: i for i, name in enumerate(costs.names)}
        #: simulated microseconds so far: the clock's whole state
        self.time_us = 0
        self._view: tuple[tuple[int, int], np.ndarray, np.ndarray] | None = None
        if self.population.memory_bytes.max() < costs.memory.min():
            raise ValueError(f"devices.classes: no device has the memory to train the smallest tier "
                             f"({costs.names[0]}: {costs.memory.min() / 2**20:,.1f} MiB)")

    @property
    def time_s(self) -> float:
        """Simulated seconds so far."""
        return self.time_us / 1e6

    def _speeds_until(self, round_index: int) -> tuple[np.ndarray, np.ndarray]:
        """This round's speeds and when each client's online interval ends (``-inf``: offline)."""
        key = (round_index, self.time_us)
        if self._view is None or self._view[0] != key:
            self._view = (key, self.population.speeds(round_index), self.population.online_until(self.time_s))
        return self._view[1], self._view[2]

    def seconds(self, cids: np.ndarray, tiers: np.ndarray, speeds: np.ndarray) -> np.ndarray:
        """Round time (s) of clients ``cids`` training ``tiers`` (indices into the costs; the two
        broadcast, e.g. ``cids[:, None]`` and ``tiers[None, :]`` for a table) at ``speeds`` (of
        every client)."""
        c, p = self.costs, self.population
        compute = self.samples[cids] * c.train_macs[tiers] / speeds[cids]
        return compute + c.bytes[tiers] / p.down_bytes_per_s[cids] + c.bytes[tiers] / p.up_bytes_per_s[cids]

    def median_fit(self) -> np.ndarray:
        """``(clients, tiers)``: whether each tier fits each client's memory and finishes within the
        deadline at its class's median speed (``macs_per_s``, no fluctuation)."""
        cids, tiers = np.arange(len(self.samples))[:, None], np.arange(len(self.costs.names))[None, :]
        return (self.population.memory_bytes[cids] >= self.costs.memory[tiers]) & (
            self.seconds(cids, tiers, self.population.macs_per_s) <= self.devices.deadline_s)

    def available(self, round_index: int, clients: Sequence[ClientInfo]) -> list[ClientInfo]:
        """The clients online now; with ``tiers: resources``, each with one level, the largest
        tier that fits its memory and finishes within the deadline this round (clients that fit
        none are left out); with ``environment``, their own levels."""
        speeds, until = self._speeds_until(round_index)
        online = np.flatnonzero(until > self.time_s)
        if self.devices.tiers == "environment":
            return [clients[c] for c in online]
        tiers = np.arange(len(self.costs.names))[None, :]
        fit = (self.population.memory_bytes[online][:, None] >= self.costs.memory[tiers]) & (
            self.seconds(online[:, None], tiers, speeds) <= self.devices.deadline_s)
        best = fit.shape[1] - 1 - np.argmax(fit[:, ::-1], axis=1)
        names = self.costs.names
        return [ClientInfo(int(c), (names[b],)) for c, b, ok in zip(online, best, fit.any(axis=1)) if ok]

    def run_round(self, round_index: int, levels: Mapping[int, str]) -> RoundTiming:
        """Time a round whose clients train ``levels`` (client -> tier), decide who arrives and
        move the clock to the round's end."""
        speeds, until = self._speeds_until(round_index)
        start, deadline, wait_all = self.time_s, self.devices.deadline_s, self.devices.policy == "wait_all"
        cids = np.fromiter(levels, dtype=np.int64, count=len(levels))
        tiers = np.array([self.index[t] for t in levels.values()], dtype=np.int64)
        seconds = self.seconds(cids, tiers, speeds)
        offline_after = until[cids] - start
        memory = self.population.memory_bytes[cids] < self.costs.memory[tiers]
        lost = ~memory & (offline_after < (seconds if wait_all else np.minimum(seconds, deadline)))
        late = ~memory & ~lost & (seconds > (np.inf if wait_all else deadline))
        arrived = ~(memory | lost | late)
        if wait_all:
            waited = np.concatenate([seconds[arrived], offline_after[lost]])
        else:
            waited = np.concatenate([seconds[arrived], [deadline] if (lost | late).any() else []])
        duration_us = round(waited.max() * 1e6) if waited.size else round(deadline * 1e6)
        status = np.select([arrived, late, lost], ["arrived", "late", "lost"], "memory")
        timing = RoundTiming(self.time_us, duration_us, int((until > start).sum()), dict(zip(cids.tolist(), status.tolist())),
                             dict(zip(cids.tolist(), seconds.tolist())), dict(levels))
        self.time_us += duration_us
        return timing

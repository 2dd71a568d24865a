"""Device populations: the ``devices:`` section of a training config (who the clients are in time).

Every client is a device of one class (``classes``; each class takes ``share`` of the clients,
dealt by a seeded shuffle). A class has a training speed (``macs_per_s``, multiply-adds per second,
multiplied each round by a seeded log-normal factor ``exp(speed_jitter * z)``, z ~ N(0, 1), drawn
per client and round, as a device's load changes), memory (``memory_mb``), bandwidth
(``uplink_mbps``, ``downlink_mbps``, megabits per second) and availability: ``always`` or
``periodic`` (online ``online_s`` seconds of every ``period_s``, each client at its own seeded
phase). ``trace`` (a CSV file, relative to the config) replaces the availability of every client it
names::

    client,start_s,end_s
    0,0,3600
    0,7200,10800
    17,600,900

One row per online interval, in seconds of simulated time (``start_s < end_s``); a client is
online in ``[start_s, end_s)`` of each of its rows and offline after its last one.

A class may say what data its clients hold (``data``, used with ``data.partition: devices``,
:mod:`nefl_zoo.data.device_partition`): ``samples`` images per client (quantity skew between classes), the class's
label mix ``labels`` (a weight per label of the dataset; none: the training set's own mix) and
``alpha``, each client's label proportions drawn from Dirichlet(alpha x the class mix) (none: every
client holds the class mix)::

    data: {samples: 50, labels: [1, 1, 1, 1, 1, 1, 1, 1, 1, 0]}   # never a 9

``deadline_s`` is the round's target time. ``tiers: resources`` gives each client the largest
tier of the spec that fits its memory and finishes within the deadline on this round's speed and
bandwidth; ``tiers: environment`` keeps the ``clients`` section's groups (the clock only times
them). ``policy: deadline`` ends a round at the deadline (late updates are dropped) or when all
return; ``wait_all`` waits for every client still online. With nobody able to take part, the
server waits ``deadline_s``. The clock itself is :mod:`.clock`.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Annotated, Literal, Union

import numpy as np
from pydantic import Field, field_validator, model_validator

from ...data.config import ClassData
from ...data.device_partition import device_kinds
from ...userfiles import Strict, field_error


class Always(Strict):
    """Online all the time."""

    kind: Literal["always"] = "always"


class Periodic(Strict):
    """Online ``online_s`` seconds of every ``period_s`` (a daily charging window), each client
    starting at its own seeded phase."""

    kind: Literal["periodic"]
    period_s: float = Field(gt=0)
    online_s: float = Field(gt=0)

    @model_validator(mode="after")
    def _within_period(self) -> "Periodic":
        if self.online_s > self.period_s:
            raise field_error("online_s", f"{self.online_s} is longer than period_s {self.period_s}")
        return self


class DeviceClass(Strict):
    """One kind of device and its share of the clients."""

    name: str = Field(min_length=1)
    share: float = Field(gt=0, le=1, description="share of the clients of this class")
    macs_per_s: float = Field(gt=0, description="training speed: multiply-adds per second")
    speed_jitter: float = Field(0.0, ge=0, le=3, description="sigma of the log-normal speed factor drawn per client and round")
    memory_mb: float = Field(gt=0, description="memory for training (MiB)")
    uplink_mbps: float = Field(gt=0, description="upload bandwidth (megabits per second)")
    downlink_mbps: float = Field(gt=0, description="download bandwidth (megabits per second)")
    availability: Annotated[Union[Always, Periodic], Field(discriminator="kind")] = Field(default_factory=Always)
    data: ClassData | None = Field(None, description="what this class's clients hold (data.partition: devices)")


class DevicesConfig(Strict):
    """The device population and the round policy of the virtual clock (see the module docstring)."""

    classes: list[DeviceClass] = Field(min_length=1)
    trace: str | None = Field(None, description="CSV of online intervals (client,start_s,end_s) replacing the availability of the clients it names")
    deadline_s: float = Field(gt=0, description="the round's target time (tier choice, the deadline, an idle round)")
    policy: Literal["deadline", "wait_all"] = "deadline"
    tiers: Literal["resources", "environment"] = Field(
        "resources", description="resources: the largest tier that fits; environment: the clients section's groups")

    @field_validator("classes")
    @classmethod
    def _shares(cls, classes: list[DeviceClass]) -> list[DeviceClass]:
        total = sum(c.share for c in classes)
        if abs(total - 1) > 1e-6:
            raise ValueError(f"shares sum to {total:g}, expected 1")
        names = [c.name for c in classes]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"class name {duplicate!r} appears twice")
        return classes


def read_trace(path: str | Path, num_clients: int) -> dict[int, list[tuple[float, float]]]:
    """The online intervals of a trace CSV per client (sorted); ``ValueError`` naming the line of
    a malformed row or of a client that is not one of the ``num_clients`` clients."""
    intervals: dict[int, list[tuple[float, float]]] = {}
    try:
        with open(path, newline="") as f:
            rows = csv.reader(f)
            header = next(rows, None)
            if header is None or [h.strip() for h in header] != ["client", "start_s", "end_s"]:
                raise ValueError(f"{path}: line 1: expected the header client,start_s,end_s")
            for line, row in enumerate(rows, start=2):
                try:
                    cid, start, end = int(row[0]), float(row[1]), float(row[2])
                except (ValueError, IndexError):
                    raise ValueError(f"{path}: line {line}: expected CLIENT,START_S,END_S, got {','.join(row)!r}") from None
                if not 0 <= cid < num_clients:
                    raise ValueError(f"{path}: line {line}: client {cid} is not one of the {num_clients} clients (0..{num_clients - 1})")
                if not 0 <= start < end < float("inf"):
                    raise ValueError(f"{path}: line {line}: expected 0 <= start_s < end_s, got {start:g}, {end:g}")
                intervals.setdefault(cid, []).append((start, end))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    return {cid: sorted(v) for cid, v in intervals.items()}


class Population:
    """Every client's device, as arrays over client ids (see the module docstring).

    Args:
        devices: the ``devices`` section (``trace`` already resolved to a path).
        num_clients: clients of the run.
        seed: the run seed (classes, phases and speed factors derive from it).
    """

    def __init__(self, devices: DevicesConfig, num_clients: int, seed: int):
        self.devices, self.seed = devices, seed
        classes = devices.classes
        #: the class index of every client
        self.kind = device_kinds(classes, num_clients, seed)

        def per_client(values) -> np.ndarray:
            return np.asarray(values, dtype=np.float64)[self.kind]

        self.macs_per_s = per_client([c.macs_per_s for c in classes])
        self.jitter = per_client([c.speed_jitter for c in classes])
        self.memory_bytes = per_client([c.memory_mb * 2**20 for c in classes])
        self.up_bytes_per_s = per_client([c.uplink_mbps * 1e6 / 8 for c in classes])
        self.down_bytes_per_s = per_client([c.downlink_mbps * 1e6 / 8 for c in classes])
        periodic = [c.availability if isinstance(c.availability, Periodic) else None for c in classes]
        self.period = per_client([p.period_s if p else np.inf for p in periodic])
        self.online_s = per_client([p.online_s if p else np.inf for p in periodic])
        periodic_client = np.isfinite(self.period)
        self.phase = np.random.default_rng([seed, 2]).random(num_clients) * np.where(periodic_client, self.period, 0.0)
        trace = read_trace(devices.trace, num_clients) if devices.trace is not None else {}
        self.traced = np.zeros(num_clients, dtype=bool)
        self.traced[list(trace)] = True
        self.trace_client = np.array([c for c, v in trace.items() for _ in v], dtype=np.int64)
        self.trace_start = np.array([s for v in trace.values() for s, _ in v], dtype=np.float64)
        self.trace_end = np.array([e for v in trace.values() for _, e in v], dtype=np.float64)

    def speeds(self, round_index: int) -> np.ndarray:
        """Every client's training speed (MACs per second) in round ``round_index``."""
        z = np.random.default_rng([self.seed, 3, round_index]).standard_normal(len(self.kind))
        return self.macs_per_s * np.exp(self.jitter * z)

    def online_until(self, t: float) -> np.ndarray:
        """For every client, when its current online interval ends (``inf``: never; ``-inf``:
        offline at time ``t``)."""
        periodic = np.isfinite(self.period)
        into = np.mod(t - self.phase, np.where(periodic, self.period, 1.0))
        end = np.where(periodic, np.where(into < self.online_s, t - into + self.online_s, -np.inf), np.inf)
        if self.traced.any():
            end[self.traced] = -np.inf
            now = (self.trace_start <= t) & (t < self.trace_end)
            np.maximum.at(end, self.trace_client[now], self.trace_end[now])
        return end

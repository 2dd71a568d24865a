"""The in-process engine: it only calls a method's hooks, round after round.

Each round: :meth:`~nefl_zoo.fl.strategy.Strategy.configure_train` picks clients and their
instructions, :meth:`~nefl_zoo.fl.strategy.Strategy.train` runs on each client's data (with
its persistent client state), :meth:`~nefl_zoo.fl.strategy.Strategy.aggregate_train` merges
the replies, and every ``eval.every`` rounds :meth:`~nefl_zoo.fl.strategy.Strategy.evaluate`
scores the global state. Files, checkpoints and RNG state belong to the
:class:`~nefl_zoo.runs.store.RunStore`; progress display belongs to the caller (an observer).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..data.device_partition import PartitionError
from ..data.loading import FederatedData, load_data
from ..runs.store import Checkpoint, RunExistsError, RunStore, saved_config
from .config import ConfigError, RunConfig, parse_config
from .devices.classes import DeviceClasses
from .devices.clock import TierCosts, VirtualClock
from .strategy.base import Aggregate, ClientInfo, Instruction, Reply, Strategy
from .training.client import learning_rate
from .training.device import Placement, placed
from .training.parallel import train_clients

__all__ = ["Engine", "RunExistsError", "RunObserver", "RunResult", "client_groups", "resume_config", "train"]


def client_groups(config: RunConfig, levels: list[str]) -> list[list[str]]:
    """Allowed resource levels per client group (see :class:`~nefl_zoo.fl.config.ClientsConfig`)."""
    if config.clients.groups is not None:
        return [list(g) for g in config.clients.groups]
    if config.clients.environment == "fixed":
        return [[t] for t in levels]
    n = len(levels)
    return [levels[max(0, i - 2): min(n, i + 3)] for i in range(n)]


def _nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass
class RunResult:
    """The end of a run: final accuracies per submodel; the worst case (the accuracy of the
    smallest submodel, ``worst_case``, as in the NeFL paper; the minimum where the method names no
    such submodel, ``worst_case`` None), the average and the minimum over submodels; bytes moved;
    the further metrics of the last evaluation (``TREATMENT/NAME``, see :meth:`Strategy.evaluate`).

    Attributes:
        acc: the final accuracy of each submodel.
        worst: the worst case's accuracy.
        avg: the mean over the submodels.
        min: the lowest accuracy of any submodel.
        worst_case: the submodel ``worst`` is of, or ``None``.
        bytes_down: bytes sent to the clients over the run.
        bytes_up: bytes the clients sent back.
        rounds: the rounds trained.
        extra: the further metrics of the last evaluation.
    """

    acc: dict[str, float]
    worst: float
    avg: float
    min: float
    worst_case: str | None
    bytes_down: int
    bytes_up: int
    rounds: int
    extra: dict[str, float] = field(default_factory=dict)


class RunObserver(Protocol):
    """Follows a run (e.g. a progress bar): called at the start, after every round, at the end."""

    def start(self, engine: "Engine") -> None: ...

    def round(self, record: dict, last_eval: dict) -> None: ...

    def end(self, engine: "Engine", result: RunResult) -> None: ...


class Engine:
    """Runs one training configuration into ``out_dir``, in this process.

    Args:
        config: the run configuration.
        out_dir: the run directory (created).
    """

    #: whether :meth:`exchange` runs SecAgg+ (Flower's); in process the server sees every update
    secure_transport = False

    def __init__(self, config: RunConfig, out_dir: str | Path):
        if config.secure_aggregation is not None and not self.secure_transport:
            raise ConfigError(config._source, "secure_aggregation", "runs on Flower's SecAgg+: add --engine flower "
                              "(the in-process engine sees every update), or remove the section")
        self.config = config
        #: where clients train and models are evaluated (the global state stays on the CPU)
        self.placement: Placement = config.placement()
        self.strategy: Strategy = config.build_strategy()
        info = self.strategy.info
        levels = [t.name for t in config.submodel_spec().tiers]
        groups = client_groups(config, levels)
        m = config.clients.num_clients
        self.clients = [ClientInfo(c, tuple(groups[c * len(groups) // m])) for c in range(m)]
        try:
            self.data: FederatedData = load_data(config.data, config.data_root(), info.input_size, m, config.seed, config.devices)
        except PartitionError as exc:
            raise ConfigError(config._source, exc.field, exc.message) from None
        if info.num_classes != self.data.num_classes:
            raise ValueError(
                f"{config.data.dataset} has {self.data.num_classes} classes but the model outputs "
                f"{info.num_classes} (set spec model_args.num_classes)"
            )
        #: simulated time of the clients' devices (``devices:``, :mod:`.devices.clock`); none: rounds without time
        self.clock: VirtualClock | None = None
        if config.devices is not None:
            samples = [config.train.local_epochs * len(p) for p in self.data.partitions]
            self.clock = VirtualClock(config.devices, TierCosts.of(self.strategy, config.train.batch_size), samples, config.seed)
        #: what each device class gets (``eval.device_classes``, :mod:`.devices.classes`)
        self.device_classes: DeviceClasses | None = None
        if config.eval.device_classes:
            try:
                self.device_classes = DeviceClasses(self.strategy, self.clock, self.clients, self.data)
            except ValueError as exc:
                raise ConfigError(config._source, "eval.device_classes", str(exc).removeprefix("eval.device_classes: ")) from None
        timed = ["sim_time_s", "online", "dropped", "lost"] if self.clock else []
        classes = ["worst_device_class", "device_class_spread"] if self.device_classes else []
        columns = ["round", "lr", "clients", "rejected", "train_loss", "bytes_down", "bytes_up", "cum_bytes", "time_s", *timed,
                   "worst", "avg", "min", *classes, *(f"acc_{t}" for t in info.eval_names)]
        self.store = RunStore(out_dir, columns)
        self.state: dict[str, torch.Tensor] = {}
        self.client_states: dict[int, dict[str, torch.Tensor]] = {}
        self.round = 0
        self.totals = {"bytes_down": 0, "bytes_up": 0, **({"sim_time_us": 0} if self.clock else {})}
        self.last_eval: dict = {}

    @property
    def out(self) -> Path:
        return self.store.out

    # -- one round ---------------------------------------------------------------------
    def run_round(self, round_index: int) -> dict:
        """Configure, train and aggregate round ``round_index`` (0-based).

        Args:
            round_index: the round, from 0.

        Returns:
            The round's record, as ``metrics.jsonl`` holds it.
        """
        server_round = round_index + 1
        start = time.perf_counter()
        clients = self.available_clients()
        instructions = self.strategy.configure_train(server_round, self.state, clients) if clients else {}
        timing = self.clock.run_round(round_index, {c: i.level for c, i in instructions.items()}) if self.clock else None
        training = instructions if timing is None else {c: i for c, i in instructions.items() if timing.status[c] == "arrived"}
        with placed(self.placement):  # clients' training and server-side training (FedGH's header)
            replies = self.exchange("train", training)
            result = self.strategy.aggregate_train(server_round, self.state, replies) if replies or not timing else Aggregate(self.state, 0)
        self.state = result.state
        if timing is not None:
            self.totals["sim_time_us"] = self.clock.time_us
        down = sum(_nbytes(i.arrays) for i in instructions.values())
        up = sum(_nbytes(r.arrays) for r in replies.values())
        self.totals["bytes_down"] += down
        self.totals["bytes_up"] += up
        tiers = [i.level for i in instructions.values() if i.level is not None]
        losses = [float(r.loss) for r in replies.values() if r.loss is not None]
        order = {t: i for i, t in enumerate(self.strategy.info.levels)}
        return {
            "round": server_round,
            "lr": learning_rate(self.config.train, round_index, self.config.rounds),
            "clients": result.accepted,
            "rejected": len(result.rejected),
            "tiers": {t: tiers.count(t) for t in sorted(set(tiers), key=lambda t: (order.get(t, len(order)), t))},
            "train_loss": float(np.mean(losses)) if losses else float("nan"),
            "bytes_down": down,
            "bytes_up": up,
            "bytes_down_per_client": down // max(1, len(replies)),
            "bytes_up_per_client": up // max(1, len(replies)),
            "cum_bytes": self.totals["bytes_down"] + self.totals["bytes_up"],
            "per_client": {
                str(cid): {"tier": i.level, "bytes_down": _nbytes(i.arrays),
                           "bytes_up": _nbytes(replies[cid].arrays) if cid in replies else 0,
                           **({"status": timing.status[cid], "sim_s": timing.seconds[cid]} if timing else {})}
                for cid, i in instructions.items()
            },
            "time_s": round(time.perf_counter() - start, 4),
            **({"compile_s": round(sum(float(r.metrics.get("compile_s", 0.0)) for r in replies.values()), 4)}
               if self.placement.compile else {}),
            **(timing.record(self.strategy.info.levels) if timing else {}),
            **({"device_classes": self.device_classes.participation(instructions, timing)} if self.device_classes else {}),
            **result.metrics,  # the aggregation's (epsilon, clipped)
        }

    def evaluate(self) -> dict[str, float]:
        """Accuracy per submodel: the method's server-side :meth:`~Strategy.evaluate`, plus its
        clients' evaluations on their own test splits where it configures any.

        Returns:
            Each evaluation name's accuracy.
        """
        with placed(self.placement):
            acc = self.strategy.evaluate(self.round, self.state, self.data)
            instructions = self.strategy.configure_evaluate(self.round, self.state, self.available_clients())
            if instructions:
                acc.update(self.strategy.aggregate_evaluate(self.round, self.exchange("evaluate", instructions)))
        return acc

    def evaluate_device_classes(self) -> dict:
        """Each device class's accuracy on its clients' own test splits (``eval.device_classes``).

        Returns:
            ``device_accuracy``, ``worst_device_class`` and ``device_class_spread`` of the global
            state (:meth:`~.devices.classes.DeviceClasses.evaluate`); empty without
            ``eval.device_classes``.
        """
        if self.device_classes is None:
            return {}
        with placed(self.placement):
            return self.device_classes.evaluate(self.state, self.data)

    # -- the transport: what another engine (Flower) replaces ---------------------------------
    def available_clients(self) -> list[ClientInfo]:
        """The clients that can be reached now (in process: every configured client; with
        ``devices:``, those online at the simulated time, with the levels that fit them this
        round, :meth:`~.devices.clock.VirtualClock.available`).

        Returns:
            The clients, with the levels each may train.
        """
        return self.clients if self.clock is None else self.clock.available(self.round, self.clients)

    def exchange(self, kind: str, instructions: dict[int, Instruction]) -> dict[int, Reply]:
        """Deliver each client its instruction and collect the replies, in instruction order:
        ``kind`` ``"train"`` runs :meth:`~Strategy.train` (with the client's persistent state),
        ``"evaluate"`` runs :meth:`~Strategy.evaluate_client` on the client's own test split.
        With ``train.parallel_clients`` > 1, clients that can train together do
        (:func:`~nefl_zoo.fl.training.parallel.train_clients`).

        Args:
            kind: ``train`` or ``evaluate``.
            instructions: each client's instruction, by client id.

        Returns:
            Each client's reply, by client id.
        """
        if kind == "train" and self.config.train.parallel_clients > 1:
            return train_clients(self.strategy, instructions, self.data.client_dataset, lambda cid: self.strategy.train(
                instructions[cid], self.data.client_dataset(cid), self.client_states.setdefault(cid, {})), self.config.train.parallel_clients)
        replies: dict[int, Reply] = {}
        for cid, instruction in instructions.items():
            if kind == "train":
                replies[cid] = self.strategy.train(instruction, self.data.client_dataset(cid), self.client_states.setdefault(cid, {}))
            else:
                replies[cid] = self.strategy.evaluate_client(instruction, self.data.client_test(cid), self.client_states.get(cid, {}))
        return replies

    # -- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Write the run's state through the run store."""
        clients = {cid: s for cid, s in self.client_states.items() if s}
        checkpoint = Checkpoint(self.round, self.state, clients, self.strategy.server_state(), self.totals, self.last_eval)
        self.store.save(checkpoint, self.config.to_dict())

    def _restore(self) -> None:
        template = self.strategy.init_global_state()  # the keys, shapes and dtypes a checkpoint must have
        checkpoint = self.store.read_checkpoint(template, self.config.rounds)  # verified; changes nothing
        self.strategy.load_server_state(checkpoint.server_state)
        self.store.resume(checkpoint)  # metrics files replaced and RNG states restored, every check passed
        self.round, self.state, self.totals, self.last_eval = checkpoint.round, checkpoint.state, checkpoint.totals, checkpoint.last_eval
        self.client_states = checkpoint.client_states
        if self.clock is not None:
            self.clock.time_us = self.totals["sim_time_us"]

    # -- the loop ------------------------------------------------------------------------
    def run(self, resume: bool = False, overwrite: bool = False, observer: RunObserver | None = None) -> RunResult:
        """Train ``config.rounds`` rounds (continuing from the checkpoint when ``resume``).

        A fresh run refuses a directory that already holds one unless ``overwrite``. The run
        directory's lock is held until the run ends (another process gets a one-line error).

        Args:
            resume: continue from the run directory's committed checkpoint.
            overwrite: replace a run the directory already holds.
            observer: follows the run (a progress bar), or ``None``.

        Returns:
            The final accuracies and bytes moved.

        Raises:
            RunExistsError: the directory holds a run already (without ``overwrite``).
            CheckpointError: a checkpoint to resume that fails its checks.
            LockedError: another process is using the run directory.
        """
        self.store.open(create=not resume, overwrite=overwrite)
        try:
            return self._run(resume, overwrite, observer)
        finally:
            self.store.close()

    def _run(self, resume: bool, overwrite: bool, observer: RunObserver | None) -> RunResult:
        cfg = self.config
        if resume:
            self._restore()
        else:
            spec = self.strategy.info.spec.model_dump(mode="json", exclude_none=True)
            self.store.create(cfg.to_dict(), spec, overwrite)
            torch.manual_seed(cfg.seed)
            self.state = self.strategy.init_global_state()
        if observer:
            observer.start(self)
        while self.round < cfg.rounds:
            record = self.run_round(self.round)
            self.round += 1
            if self.round % cfg.eval.every == 0 or self.round == cfg.rounds:
                acc = self.evaluate()
                submodels = {k: v for k, v in acc.items() if "/" not in k}
                extra = {k: v for k, v in acc.items() if "/" in k}
                self.last_eval = {"acc": submodels, **self.strategy.info.summary(submodels), **({"extra": extra} if extra else {}),
                                  **self.evaluate_device_classes()}
                record.update(self.last_eval)
            self.store.log(record)
            if self.round % cfg.checkpoint_every == 0 or self.round == cfg.rounds:
                self.save_checkpoint()
            if observer:
                observer.round(record, self.last_eval)
        last = self.last_eval
        result = RunResult(last["acc"], last["worst"], last["avg"], last["min"], self.strategy.info.worst_case,
                           self.totals["bytes_down"], self.totals["bytes_up"], self.round, last.get("extra", {}))
        self.store.write_summary(asdict(result))
        if observer:
            observer.end(self, result)
        return result


def resume_config(run_dir: str | Path) -> RunConfig:
    """The configuration saved in a run directory's checkpoint."""
    config, source = saved_config(run_dir)
    return parse_config(config, source)


def train(config: RunConfig, out_dir: str | Path, overwrite: bool = False, observer: RunObserver | None = None) -> RunResult:
    """Run one configuration into ``out_dir``: what ``nefl-zoo train`` does.

    Args:
        config: the run's configuration (:func:`~nefl_zoo.fl.load_config`).
        out_dir: the run directory.
        overwrite: replace a run the directory already holds.
        observer: follows the run (a progress bar), or ``None``.

    Returns:
        The final accuracies and bytes moved; the run directory holds the rest.
    """
    return Engine(config, out_dir).run(overwrite=overwrite, observer=observer)

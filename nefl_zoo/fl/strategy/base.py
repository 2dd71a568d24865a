"""The one extension interface of every FL method, shaped like Flower's ``Strategy``.

A method is a :class:`Strategy`: five hooks it must write, the server-side
:meth:`~Strategy.init_global_state`, :meth:`~Strategy.configure_train`,
:meth:`~Strategy.aggregate_train` and :meth:`~Strategy.evaluate`, and the client-side
:meth:`~Strategy.train`; optional hooks for client-side evaluation and server state have
defaults. An engine only calls the hooks (the in-process :class:`~nefl_zoo.fl.engine.Engine`;
under Flower the same engine with Flower as its transport). Its constructor takes the run
(:class:`Run`) and its own settings and sets :attr:`Strategy.info` (what the engine needs to
know); it calls no overridable method. Shared pieces (sampling, nested submodels, evaluation
under each BN treatment, ...) are plain functions and one composable strategy in
:mod:`nefl_zoo.fl.methods.common`; the registry is :mod:`.registry`.

Messages are plain data: :class:`Instruction` and :class:`Reply` hold tensors keyed by name, a
flat dict of scalars (Flower's ``ArrayRecord`` plus ``ConfigRecord``/``MetricRecord``) and
typed fields for what the engine reads (the level a client trains, its sample count and loss).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Mapping, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from ...data.config import DataConfig
from ...spec import SubmodelSpec
from ..aggregation.rules import AggregationConfig
from .sections import EvalConfig, TrainConfig

if TYPE_CHECKING:
    from .local_model import LocalModel

Scalar = Union[int, float, str, bool]
ConfigValue = Union[Scalar, list[str], list[int], list[float]]
State = dict[str, torch.Tensor]


@dataclass
class Instruction:
    """What the server sends one client: tensors, a flat config (``round``, ``lr``,
    ``local_epochs``, ``seed``, ...; scalars or lists of them) and the resource level (tier)
    the client trains or evaluates at (``None``: the method has no levels).

    Attributes:
        arrays: the tensors, by name.
        config: the flat config.
        level: the tier the client trains or evaluates at.
    """

    arrays: State
    config: dict[str, ConfigValue] = field(default_factory=dict)
    level: str | None = None


@dataclass
class Reply:
    """What a client returns: tensors, flat method-specific metrics, its sample count, mean
    training loss (``None``: it did not train) and level. ``error`` is set when the client
    failed; the server skips such replies.

    Attributes:
        arrays: the tensors, by name.
        metrics: flat, method-specific metrics.
        num_samples: the client's training samples.
        loss: its mean training loss, or ``None``.
        level: the tier it trained.
        error: why it failed, or ``None``.
    """

    arrays: State
    metrics: dict[str, ConfigValue] = field(default_factory=dict)
    num_samples: int = 0
    loss: float | None = None
    level: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class ClientInfo:
    """A client the engine can reach: its id and the resource levels (tiers of the run's spec)
    its environment allows this round.

    Attributes:
        cid: the client's id.
        levels: the tiers it may train this round, smallest first.
    """

    cid: int
    levels: tuple[str, ...]


@dataclass
class Aggregate:
    """The result of :meth:`Strategy.aggregate_train`: the new global state, how many replies
    were used, which were rejected (client, reason) and the round's aggregation metrics (e.g.
    ``epsilon``, ``clipped``: :func:`~nefl_zoo.fl.aggregation.aggregate_updates`), merged into its record."""

    state: State
    accepted: int
    rejected: list[tuple[int | str, str]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """What every method gets from the run configuration: the spec (its tiers are the
    environment's resource levels), local training, the seed, the total rounds (learning-rate
    schedule), the share of clients sampled per round, the evaluation settings and the data
    section, its ``root`` resolved (FedLPS pre-trains its backbone on its held-out
    ``public_fraction``), and the server's aggregation options (``aggregation:``).

    Attributes:
        spec: the run's spec.
        train: local training settings.
        seed: the run's seed.
        rounds: the total rounds.
        fraction: the share of clients sampled each round.
        eval: evaluation settings.
        data: the data section, its ``root`` resolved.
        aggregation: the server's aggregation options.
    """

    spec: SubmodelSpec
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    rounds: int = 1
    fraction: float = 1.0
    eval: EvalConfig = field(default_factory=EvalConfig)
    data: DataConfig = field(default_factory=DataConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)


@dataclass(frozen=True)
class MethodInfo:
    """What the engine needs to know about a method, set by its constructor.

    Args:
        spec: the spec of the global state (the run directory's ``spec.yaml``).
        input_size: the model input (C, H, W).
        num_classes: classes the models predict (checked against the dataset's).
        levels: the resource levels clients train at (the order of a round record's ``tiers``).
        eval_names: the accuracies :meth:`Strategy.evaluate` reports by plain name (the CSV
            columns ``acc_NAME``; the average and the minimum are over them).
        numel: elements a client receives for each name of ``levels`` and ``eval_names``.
        worst_case: the name of ``eval_names`` that is the worst-case submodel, the smallest (the
            NeFL paper's "Worst"); ``None`` where the names are not submodels of one model (FedLPS's
            tasks): then the worst case is the minimum.
    """

    spec: SubmodelSpec
    input_size: tuple[int, int, int]
    num_classes: int
    levels: tuple[str, ...]
    eval_names: tuple[str, ...]
    numel: Mapping[str, int] = field(default_factory=dict)
    worst_case: str | None = field(kw_only=True)

    def __post_init__(self):
        if self.worst_case is not None and self.worst_case not in self.eval_names:
            raise ValueError(f"worst_case {self.worst_case!r} is not one of eval_names {list(self.eval_names)}")

    def summary(self, acc: Mapping[str, float]) -> dict[str, float]:
        """``worst`` (the worst-case submodel's accuracy, NaN when it was not evaluated), ``avg``
        and ``min`` of the accuracies ``acc`` by plain name.

        Args:
            acc: the accuracy of each evaluation name.

        Returns:
            ``{"worst": ..., "avg": ..., "min": ...}``.
        """
        values = list(acc.values())
        worst = min(values) if self.worst_case is None else acc.get(self.worst_case, float("nan"))
        return {"worst": worst, "avg": float(np.mean(values)), "min": min(values)}


class MethodSettings(BaseModel):
    """Base of a method's own settings (``method_args``); unknown keys and NaN/inf are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Strategy(abc.ABC):
    """Abstract base of every method.

    Args:
        run: the run (:class:`Run`).
        settings: this method's own settings (an instance of its ``Settings`` model; default:
            the model's defaults).

    A subclass's constructor sets :attr:`info`. ``server_round`` is 1-based, as in Flower.
    ``name``, ``label`` and ``Settings`` are set by :func:`~nefl_zoo.fl.strategy.registry.register_method`.
    A method whose :meth:`aggregate_train` applies ``run.aggregation`` sets ``robust_aggregation``;
    the others refuse any but the default.
    """

    name: ClassVar[str]
    label: ClassVar[str]
    Settings: ClassVar[type[MethodSettings]] = MethodSettings
    robust_aggregation: ClassVar[bool] = False
    info: MethodInfo

    def __init__(self, run: Run, settings: MethodSettings | None = None):
        if not (self.robust_aggregation or run.aggregation.plain):
            name = getattr(self, "name", type(self).__name__)
            raise ValueError(f"aggregation: {name} does not average nested updates, so robust rules, clipping and dp cannot apply; "
                             "remove the section")
        self.run = run
        self.settings = settings if settings is not None else self.Settings()

    # -- server side ---------------------------------------------------------------------
    @abc.abstractmethod
    def init_global_state(self) -> State:
        """The initial global state (the caller seeds torch's RNG).

        Returns:
            The global state.
        """

    @abc.abstractmethod
    def configure_train(self, server_round: int, global_state: Mapping[str, torch.Tensor], clients: list[ClientInfo]) -> dict[int, Instruction]:
        """Choose this round's clients and the instruction each receives.

        Args:
            server_round: the round, from 1.
            global_state: the current global state.
            clients: the clients the engine can reach.

        Returns:
            Each chosen client's instruction, by client id.
        """

    @abc.abstractmethod
    def aggregate_train(self, server_round: int, global_state: Mapping[str, torch.Tensor], replies: Mapping[int, Reply]) -> Aggregate:
        """Merge the clients' replies into a new global state.

        The previous state is an argument (not remembered between hooks) because elements no
        reply holds keep their value.

        Args:
            server_round: the round, from 1.
            global_state: the previous global state.
            replies: each client's reply, by client id.

        Returns:
            The new global state, the replies used and rejected, and the round's metrics.
        """

    @abc.abstractmethod
    def evaluate(self, server_round: int, global_state: Mapping[str, torch.Tensor], data) -> dict[str, float]:
        """Server-side evaluation on ``data`` (:class:`~nefl_zoo.data.loading.FederatedData`):
        accuracy per name of ``info.eval_names``.

        Keys holding ``/`` are further metrics (not in worst/avg): e.g. ``recompute/g0.2``, a
        submodel under one BN treatment, or ``running/ensemble``.

        Args:
            server_round: the round, from 1.
            global_state: the global state to evaluate.
            data: the run's data.

        Returns:
            The accuracy of each name.
        """

    def configure_evaluate(self, server_round: int, global_state: Mapping[str, torch.Tensor], clients: list[ClientInfo]) -> dict[int, Instruction]:
        """Clients that evaluate on their own test split, and their instructions (none by default).

        Args:
            server_round: the round, from 1.
            global_state: the current global state.
            clients: the clients the engine can reach.

        Returns:
            Each chosen client's instruction, by client id.
        """
        return {}

    def aggregate_evaluate(self, server_round: int, replies: Mapping[int, Reply]) -> dict[str, float]:
        """Accuracy per name from the clients' evaluation replies.

        Args:
            server_round: the round, from 1.
            replies: each client's evaluation reply, by client id.

        Returns:
            The accuracy of each name.
        """
        return {}

    # -- client side ---------------------------------------------------------------------
    @abc.abstractmethod
    def train(self, instruction: Instruction, data: torch.utils.data.Dataset, client_state: State) -> Reply:
        """Train on the client's ``data``. ``client_state`` persists between this client's
        rounds (the engine keeps and checkpoints it); mutate it in place to keep tensors.

        Args:
            instruction: what the server sent.
            data: the client's training data.
            client_state: the client's own tensors.

        Returns:
            The client's reply.
        """

    def local_model(self, instruction: Instruction) -> "LocalModel | None":
        """The model :meth:`train` would fit for ``instruction`` when it does nothing else
        (:func:`~nefl_zoo.fl.training.client.fit`, no client state, the reply from the fit), so an engine
        may train several such clients together (``train.parallel_clients``); ``None`` (the
        default): clients train only through :meth:`train`.

        Args:
            instruction: what the server sent.

        Returns:
            The model to fit, or ``None``.
        """
        return None

    def evaluate_client(self, instruction: Instruction, data: torch.utils.data.Dataset, client_state: State) -> Reply:
        """Evaluate on the client's own held-out ``data`` (for :meth:`configure_evaluate`);
        ``client_state`` is read, not changed.

        Args:
            instruction: what the server sent.
            data: the client's test split.
            client_state: the client's own tensors.

        Returns:
            The client's reply, its metrics the accuracies.

        Raises:
            NotImplementedError: the method does not evaluate on clients.
        """
        raise NotImplementedError(f"{self.name} does not evaluate on clients")

    # -- persistent server state (e.g. a server optimizer) --------------------------------
    def server_state(self) -> State:
        """Tensors the server keeps between rounds besides the global state (checkpointed).

        Returns:
            The tensors, by name (none by default).
        """
        return {}

    def load_server_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`server_state` from a checkpoint.

        Args:
            state: the tensors :meth:`server_state` returned.

        Raises:
            ValueError: tensors for a method that keeps none.
        """
        if state:
            raise ValueError(f"{self.name}: keeps no server state, got {sorted(state)[:3]}")

    def submodel_numel(self, name: str) -> int:
        """Elements a client of ``name`` receives (``info.numel``; for summaries).

        Args:
            name: a level or evaluation name.

        Returns:
            The number of elements.
        """
        return self.info.numel[name]

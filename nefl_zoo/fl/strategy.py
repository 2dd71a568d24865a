"""The strategy interface of every FL method, shaped like Flower's, and the method registry.

A method is a :class:`Strategy`: server-side hooks (:meth:`~Strategy.configure_train`,
:meth:`~Strategy.aggregate_train`, :meth:`~Strategy.evaluate`) and one client-side hook
(:meth:`~Strategy.train`). An engine only calls the hooks (the in-process
:class:`~nefl_zoo.fl.engine.Engine`; a Flower adapter maps them 1:1 onto Flower's
``Strategy``/``ClientApp``). Messages are plain data: :class:`Instruction` and :class:`Reply`
hold tensors keyed by name plus a flat dict of scalars, i.e. Flower's ``ArrayRecord`` plus
``ConfigRecord``/``MetricRecord``, without importing Flower.

Methods register themselves with :func:`register_method` (name, table label, settings model);
their own settings come from ``method_args`` in the run config.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, TypeVar, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from ..spec import SubmodelSpec
from .bn import BN_TREATMENTS, recompute_batches, recompute_bn

if TYPE_CHECKING:
    from ..slim import CompiledSpec
from .settings import TrainConfig

Scalar = Union[int, float, str, bool]
ConfigValue = Union[Scalar, list[str], list[int], list[float]]
State = dict[str, torch.Tensor]


@dataclass
class Instruction:
    """What the server sends one client: tensors (its submodel) and a flat config
    (``round``, ``tier``, ``lr``, ``local_epochs``, ``seed``, ... ; scalars or lists of them)."""

    arrays: State
    config: dict[str, ConfigValue]


@dataclass
class Reply:
    """What a client returns: trained tensors and flat metrics (``num_samples``, ``loss``,
    ``tier``, ...). ``error`` is set when the client failed; the server skips such replies."""

    arrays: State
    metrics: dict[str, ConfigValue]
    error: str | None = None


@dataclass(frozen=True)
class ClientInfo:
    """A client the engine can reach: its id and the resource levels (tiers of the run's spec)
    its environment allows this round."""

    cid: int
    levels: tuple[str, ...]


@dataclass
class Aggregate:
    """The result of :meth:`Strategy.aggregate_train`: the new global state, how many replies
    were used and which were rejected (client, reason)."""

    state: State
    accepted: int
    rejected: list[tuple[int | str, str]] = field(default_factory=list)


class MethodSettings(BaseModel):
    """Base of a method's own settings (``method_args``); unknown keys and NaN/inf are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Strategy(abc.ABC):
    """Abstract base of every method.

    Args:
        spec: the run's submodel spec; its tiers are the environment's resource levels.
        train: local training settings shared by all methods.
        settings: this method's own settings (an instance of its ``Settings`` model).
        seed: the run seed (client sampling, per-client seeds, initial weights).
        rounds: total rounds (learning-rate schedule).
        fraction: share of clients sampled per round.
        eval_batch_size: batch size of evaluation.
        eval_per_client: evaluate on the clients' own test splits instead of the server's test set.
        eval_bn: BN statistics of the reported accuracies, ``running`` or ``recompute`` (:mod:`.bn`).
        eval_bn_batches: training batches for ``recompute``.
        eval_bn_both: also evaluate the other treatment (see :meth:`evaluate`).

    Subclasses implement the hooks; ``server_round`` is 1-based, as in Flower.
    """

    name: ClassVar[str]
    label: ClassVar[str]
    Settings: ClassVar[type[MethodSettings]] = MethodSettings

    def __init__(
        self,
        spec: SubmodelSpec,
        train: TrainConfig,
        settings: MethodSettings | None = None,
        *,
        seed: int = 0,
        rounds: int = 1,
        fraction: float = 1.0,
        eval_batch_size: int = 256,
        eval_per_client: bool = False,
        eval_bn: str = "running",
        eval_bn_batches: int = 20,
        eval_bn_both: bool = False,
    ):
        self.run_spec = spec
        self.train_config = train
        self.settings = settings if settings is not None else self.Settings()
        self.seed, self.rounds, self.fraction = seed, rounds, fraction
        self.eval_batch_size, self.eval_per_client = eval_batch_size, eval_per_client
        #: the BN treatments evaluated, the reported one first
        self.eval_bn: tuple[str, ...] = (eval_bn, *(t for t in BN_TREATMENTS if t != eval_bn and eval_bn_both))
        self.eval_bn_batches = eval_bn_batches

    # -- what the engine needs to know -------------------------------------------------------
    @property
    @abc.abstractmethod
    def tier_names(self) -> list[str]:
        """The submodels this method trains and evaluates."""

    @property
    @abc.abstractmethod
    def global_spec(self) -> SubmodelSpec:
        """The spec of the global state (written to the run directory's ``spec.yaml``)."""

    @property
    @abc.abstractmethod
    def input_size(self) -> tuple[int, int, int]:
        """The model input (C, H, W)."""

    @property
    @abc.abstractmethod
    def num_classes(self) -> int:
        """Classes the models predict."""

    # -- server side ---------------------------------------------------------------------

    @abc.abstractmethod
    def init_global_state(self) -> State:
        """The initial global state (the caller seeds torch's RNG)."""

    @abc.abstractmethod
    def configure_train(self, server_round: int, global_state: Mapping[str, torch.Tensor], clients: list[ClientInfo]) -> dict[int, Instruction]:
        """Choose this round's clients and the instruction each receives."""

    @abc.abstractmethod
    def aggregate_train(self, server_round: int, global_state: Mapping[str, torch.Tensor], replies: Mapping[int, Reply]) -> Aggregate:
        """Merge the clients' replies into a new global state.

        The previous state is an argument (not remembered between hooks) because elements no
        reply holds keep their value; the hook is a pure function of its inputs."""

    @abc.abstractmethod
    def evaluate(self, server_round: int, global_state: Mapping[str, torch.Tensor], data) -> dict[str, float]:
        """Server-side evaluation: accuracy per submodel name on ``data``
        (:class:`~nefl_zoo.fl.data.FederatedData`).

        Keys holding ``/`` are further metrics, not submodels (not in worst/avg): e.g.
        ``recompute/g0.2``, a submodel under one BN treatment, or ``running/ensemble``."""

    def configure_evaluate(self, server_round: int, global_state: Mapping[str, torch.Tensor], clients: list[ClientInfo]) -> dict[int, Instruction]:
        """Clients to evaluate on their own held-out data, and what each receives
        (none by default: :meth:`evaluate` scores the global state on the server)."""
        return {}

    def aggregate_evaluate(self, server_round: int, replies: Mapping[int, Reply]) -> dict[str, float]:
        """Accuracy per submodel name from the clients' evaluation replies."""
        return {}

    @abc.abstractmethod
    def submodel_numel(self, tier: str) -> int:
        """Elements a client training ``tier`` receives (for summaries)."""

    # -- client side ---------------------------------------------------------------------
    @abc.abstractmethod
    def train(self, instruction: Instruction, data: torch.utils.data.Dataset, client_state: State) -> Reply:
        """Train on the client's ``data``. ``client_state`` persists between this client's
        rounds (the engine keeps and checkpoints it); mutate it in place to keep tensors."""

    def evaluate_client(self, instruction: Instruction, data: torch.utils.data.Dataset, client_state: State) -> Reply:
        """Evaluate on the client's own held-out ``data`` (for :meth:`configure_evaluate`);
        ``client_state`` is read, not changed."""
        raise NotImplementedError(f"{self.name} does not evaluate on clients")

    # -- persistent server state (e.g. a server optimizer) --------------------------------
    def server_state(self) -> State:
        """Tensors the server keeps between rounds besides the global state (checkpointed)."""
        return {}

    def load_server_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`server_state` from a checkpoint."""
        if state:
            raise ValueError(f"{self.name}: keeps no server state, got {sorted(state)[:3]}")

    # -- shared machinery for subclasses -------------------------------------------------
    def sample(self, server_round: int, clients: list[ClientInfo]) -> list[ClientInfo]:
        """This round's clients: ``round(fraction * n)`` (at least one), seeded by run seed and
        round, in the order of ``clients``."""
        rng = random.Random(f"{self.seed}:sample:{server_round - 1}")
        picked = sorted(rng.sample(range(len(clients)), max(1, round(self.fraction * len(clients)))))
        return [clients[i] for i in picked]

    def client_seed(self, server_round: int, cid: int) -> int:
        """The seed of one client's local training in one round."""
        return int(np.random.SeedSequence([self.seed, server_round - 1, cid]).generate_state(1)[0])

    def train_config_for(self, server_round: int, cid: int) -> dict[str, ConfigValue]:
        """The instruction config of local training: round, client, seed, lr and the
        :class:`~nefl_zoo.fl.settings.TrainConfig` fields a client needs."""
        from .client import learning_rate

        cfg = self.train_config
        out: dict[str, ConfigValue] = {
            "round": server_round, "client": cid, "seed": self.client_seed(server_round, cid),
            "lr": learning_rate(cfg, server_round - 1, self.rounds), "local_epochs": cfg.local_epochs,
            "batch_size": cfg.batch_size, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
        }
        if cfg.grad_clip is not None:
            out["grad_clip"] = cfg.grad_clip
        return out

    def with_bn(self, model: torch.nn.Module, treatment: str, data) -> torch.nn.Module:
        """``model`` in eval mode with the BN statistics of ``treatment`` (``recompute``: on
        ``data.train_eval`` batches of the run seed, :func:`~nefl_zoo.fl.bn.recompute_bn`)."""
        if treatment == "recompute":
            batches = recompute_batches(data.train_eval, self.train_config.batch_size, self.seed, self.eval_bn_batches)
            recompute_bn(model, batches)
        return model.eval()

    def reply_weight(self, reply: Reply) -> float:
        """A reply's aggregation weight: 1 per client (the paper) or its sample count."""
        return 1.0 if self.train_config.weighting == "clients" else float(reply.metrics["num_samples"])


class CompiledStrategy(Strategy):
    """A strategy whose submodels are the tiers of a compiled spec, ``self.compiled``
    (:class:`~nefl_zoo.slim.CompiledSpec`, set by the subclass's ``__init__``)."""

    compiled: "CompiledSpec"

    @property
    def tier_names(self) -> list[str]:
        return list(self.compiled.tiers)

    @property
    def global_spec(self) -> SubmodelSpec:
        return self.compiled.spec

    @property
    def input_size(self) -> tuple[int, int, int]:
        return self.compiled.input_size

    @property
    def num_classes(self) -> int:
        return self.compiled.num_classes


# -- the registry ----------------------------------------------------------------------------
_METHODS: dict[str, type[Strategy]] = {}
S = TypeVar("S", bound=type[Strategy])


def register_method(name: str, label: str, settings: type[MethodSettings] = MethodSettings) -> Callable[[S], S]:
    """Class decorator: register a :class:`Strategy` under ``name`` with a table ``label`` and
    its settings model (validated from ``method_args``)."""

    def wrap(cls: S) -> S:
        if name in _METHODS:
            raise ValueError(f"method {name!r} is registered twice ({_METHODS[name].__qualname__}, {cls.__qualname__})")
        cls.name, cls.label, cls.Settings = name, label, settings
        _METHODS[name] = cls
        return cls

    return wrap


def registered_methods() -> dict[str, type[Strategy]]:
    """Every registered method by name (importing the built-in ones)."""
    from . import methods as _builtin  # noqa: F401  (registers nefl, heterofl, ...)

    return dict(_METHODS)


def get_method(name: str) -> type[Strategy]:
    """The method registered as ``name``; ``KeyError`` with the known names otherwise."""
    known = registered_methods()
    if name not in known:
        raise KeyError(f"unknown method {name!r}; one of {', '.join(known)}")
    return known[name]


def parse_settings(name: str, args: Mapping[str, Any]) -> MethodSettings:
    """Validate ``method_args`` for method ``name`` (pydantic ``ValidationError`` on a problem)."""
    return get_method(name).Settings.model_validate(dict(args))

"""Nested federated training: the run config, the engines and the methods, in parts.

Lowest first: :mod:`.aggregation` (NeFedAvg, :func:`nefedavg`, and the rules of the
``aggregation:`` section), :mod:`.strategy` (what a method is: the Flower-shaped
:class:`Strategy` hooks, the registry), :mod:`.training` (a client's local training,
:func:`fit`), :mod:`.devices` (clients as devices, the virtual clock), :mod:`.methods` (the
built-in methods and the pieces they share); then :mod:`.config` (:class:`RunConfig`),
:mod:`.engine` (:class:`Engine` runs the hooks in-process) and :mod:`.compare`. The engine on
Flower is :mod:`.flower`; the data is :mod:`nefl_zoo.data`, the run directory
:mod:`nefl_zoo.runs`.
"""

from .aggregation.nefedavg import Sums, Update, accumulate, check_update, nefedavg, weighted_mean
from .config import ConfigError, RunConfig, load_config, parse_config
from .engine import Engine, RunResult, train
from .strategy.base import ClientInfo, Instruction, MethodInfo, MethodSettings, Reply, Run, Strategy
from .strategy.registry import get_method, register_method, registered_methods
from .training.client import ClientResult, evaluate, fit, learning_rate

__all__ = [
    "ClientInfo", "ClientResult", "ConfigError", "Engine", "Instruction", "MethodInfo", "MethodSettings", "Reply", "Run", "RunConfig",
    "RunResult", "Strategy", "Sums", "Update", "accumulate", "check_update", "evaluate", "fit", "get_method", "learning_rate", "load_config",
    "nefedavg", "parse_config", "register_method", "registered_methods", "train", "weighted_mean",
]

"""Nested federated training: config, data, the strategy interface, methods and engines.

Every method is a :class:`Strategy` (Flower-shaped hooks, registered by name in
:mod:`.registry`; shared pieces in :mod:`.strategy_utils`); client training
(:func:`fit`) and server aggregation (:func:`nefedavg`) are plain functions; :class:`Engine`
runs the hooks in-process and a :class:`~.store.RunStore` owns the run directory.
"""

from .aggregation.nefedavg import Sums, Update, accumulate, check_update, nefedavg, weighted_mean
from .training.client import ClientResult, evaluate, fit, learning_rate
from .config import ConfigError, RunConfig, load_config, parse_config
from .engine import Engine, RunResult, train
from .strategy.registry import get_method, register_method, registered_methods
from .strategy.base import ClientInfo, Instruction, MethodInfo, MethodSettings, Reply, Run, Strategy

__all__ = [
    "ClientInfo", "ClientResult", "ConfigError", "Engine", "Instruction", "MethodInfo", "MethodSettings", "Reply", "Run", "RunConfig",
    "RunResult", "Strategy", "Sums", "Update", "accumulate", "check_update", "evaluate", "fit", "get_method", "learning_rate", "load_config",
    "nefedavg", "parse_config", "register_method", "registered_methods", "train", "weighted_mean",
]

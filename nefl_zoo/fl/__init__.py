"""Nested federated training: config, data, client training, NeFedAvg, methods and the engine.

Client training (:func:`fit`) and server aggregation (:func:`nefedavg`) are plain functions over
state dicts and slice maps; :class:`Engine` runs them in-process, methods (``nefl``,
``heterofl``, ``fjord``, ``depthfl``, ``fedavg*``) are strategy objects in :mod:`.methods`.
"""

from .aggregate import Update, check_update, nefedavg
from .client import ClientResult, evaluate, fit, learning_rate
from .config import ConfigError, RunConfig, load_config, parse_config
from .engine import Engine, RunResult, train
from .methods import METHODS, Method, build_method

__all__ = [
    "METHODS", "ClientResult", "ConfigError", "Engine", "Method", "RunConfig", "RunResult", "Update",
    "build_method", "check_update", "evaluate", "fit", "learning_rate", "load_config", "nefedavg",
    "parse_config", "train",
]

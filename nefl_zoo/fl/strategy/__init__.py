"""What a method is: the :class:`Strategy` interface, shaped like Flower's, with its messages
and the run it sees (:mod:`.base`), the ``train:`` and ``eval:`` sections of that run
(:mod:`.sections`), the model it hands a client to train (:mod:`.local_model`) and the registry
of methods by name (:mod:`.registry`). The built-in methods and the pieces they share are
:mod:`nefl_zoo.fl.methods`."""

from .base import Aggregate, ClientInfo, ConfigValue, Instruction, MethodInfo, MethodSettings, Reply, Run, Scalar, State, Strategy
from .local_model import LocalModel, SubmodelLocal
from .registry import get_method, register_method, registered_methods
from .sections import EvalConfig, TrainConfig

__all__ = ["Aggregate", "ClientInfo", "ConfigValue", "EvalConfig", "Instruction", "LocalModel", "MethodInfo", "MethodSettings",
           "Reply", "Run", "Scalar", "State", "Strategy", "SubmodelLocal", "TrainConfig", "get_method", "register_method",
           "registered_methods"]

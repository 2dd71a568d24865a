"""Methods as strategy objects over the shared engine (see :class:`~.base.Method`)."""

from __future__ import annotations

from ...spec import SubmodelSpec
from ..config import RunConfig
from .base import Assignment, LocalModel, Method, SubmodelLocal
from .depthfl import DepthFL
from .fedavg import FedAvg, FedAvgFull, FedAvgMin
from .fjord import FjORD
from .heterofl import HeteroFL
from .nefl import NeFL

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (NeFL, HeteroFL, FjORD, DepthFL, FedAvg, FedAvgMin, FedAvgFull)
}


def build_method(config: RunConfig, spec: SubmodelSpec | None = None) -> Method:
    """The strategy object for ``config.method``."""
    return METHODS[config.method](spec or config.submodel_spec(), config)


__all__ = ["Assignment", "LocalModel", "Method", "SubmodelLocal", "METHODS", "build_method"]

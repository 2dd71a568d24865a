"""The built-in methods, each a small :class:`~nefl_zoo.fl.strategy.Strategy` registered by
name (importing this package registers them, in this order)."""

from .nefl import Assignment, NeFL  # isort: skip
from .heterofl import HeteroFL  # isort: skip
from .fjord import FjORD  # isort: skip
from .depthfl import DepthFL  # isort: skip
from .fedavg import FedAvg, FedAvgFull, FedAvgMin  # isort: skip
from .fedprox import FedProx  # isort: skip
from .fedgh import FedGH  # isort: skip
from .fedlps import FedLPS  # isort: skip

__all__ = ["Assignment", "DepthFL", "FedAvg", "FedAvgFull", "FedAvgMin", "FedGH", "FedLPS", "FedProx", "FjORD", "HeteroFL", "NeFL"]

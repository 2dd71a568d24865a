"""Deprecated: this module moved to :mod:`nefl_zoo.fl.strategy.registry`; the old path works until the next release."""

import warnings

from .strategy.registry import *  # noqa: F401,F403

warnings.warn("nefl_zoo.fl.registry is deprecated: import nefl_zoo.fl.strategy.registry (the old path goes in the next release)", DeprecationWarning, stacklevel=2)

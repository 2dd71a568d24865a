"""Deprecated: this module moved to :mod:`nefl_zoo.fl.methods.common`; the old path works until the next release."""

import warnings

from .methods.common import *  # noqa: F401,F403

warnings.warn("nefl_zoo.fl.strategy_utils is deprecated: import nefl_zoo.fl.methods.common (the old path goes in the next release)", DeprecationWarning, stacklevel=2)

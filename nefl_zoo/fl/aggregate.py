"""Deprecated: this module moved to :mod:`nefl_zoo.fl.aggregation.nefedavg`; the old path works until the next release."""

import warnings

from .aggregation.nefedavg import *  # noqa: F401,F403

warnings.warn("nefl_zoo.fl.aggregate is deprecated: import nefl_zoo.fl.aggregation.nefedavg (the old path goes in the next release)", DeprecationWarning, stacklevel=2)

"""Deprecated: this module moved to :mod:`nefl_zoo.fl.training.client`; the old path works until the next release."""

import warnings

from .training.client import *  # noqa: F401,F403

warnings.warn("nefl_zoo.fl.client is deprecated: import nefl_zoo.fl.training.client (the old path goes in the next release)", DeprecationWarning, stacklevel=2)

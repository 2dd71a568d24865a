"""Deprecated: this module moved to :mod:`nefl_zoo.runs.store`; the old path works until the next release."""

import warnings

from ..runs.store import *  # noqa: F401,F403

warnings.warn("nefl_zoo.fl.store is deprecated: import nefl_zoo.runs.store (the old path goes in the next release)", DeprecationWarning, stacklevel=2)

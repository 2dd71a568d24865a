"""Deprecated: this module moved to :mod:`nefl_zoo.data.datasets`; the old path works until the next release."""

import warnings

from .data.datasets import *  # noqa: F401,F403

warnings.warn("nefl_zoo.datasets is deprecated: import nefl_zoo.data.datasets (the old path goes in the next release)", DeprecationWarning, stacklevel=2)

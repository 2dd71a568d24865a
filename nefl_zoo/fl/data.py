"""Deprecated: this module moved to :mod:`nefl_zoo.data.loading`; the old path works until the next release."""

import warnings

from ..data.loading import *  # noqa: F401,F403

warnings.warn("nefl_zoo.fl.data is deprecated: import nefl_zoo.data.loading (the old path goes in the next release)", DeprecationWarning, stacklevel=2)

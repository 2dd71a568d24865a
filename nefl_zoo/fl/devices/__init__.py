"""Clients as devices: the ``devices:`` section and who is online (:mod:`.population`), the
virtual clock of a round (:mod:`.clock`), the time to a target accuracy
(:mod:`.time_to_accuracy`) and what each device class gets (:mod:`.classes` scores it,
:mod:`.report` reports it)."""

from .clock import VirtualClock
from .population import DevicesConfig, Population

__all__ = ["DevicesConfig", "Population", "VirtualClock"]

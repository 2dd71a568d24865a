"""Where clients train and models are evaluated: ``train.device`` and ``train.precision`` (and
how local training computes there: ``train.compile``, ``train.memory_format``).

:func:`resolve_device` turns the config's name into a ``torch.device`` (the one place that does),
refusing an absent one. A :class:`Placement` (device and precision) is set for a block of code
with :func:`placed` by whoever runs the hooks of a method (the engine, a Flower ``ClientApp``,
a standalone trainer) and read with :func:`placement` by the code that computes (local
training, evaluation, BN recompute, server-side training); outside any block it is the CPU in
fp32. Models and batches move to the device for the computation only: what a client returns
and what the server keeps are CPU tensors, so results and checkpoints do not depend on where
clients ran.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class DeviceError(ValueError):
    """``train.device`` names a device this machine does not have (one line)."""


def _accelerator() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else None


def resolve_device(name: str) -> torch.device:
    """The device of ``train.device``: ``auto`` is CUDA, else MPS, else the CPU; ``cuda``,
    ``cuda:N`` and ``mps`` must exist (:class:`DeviceError` otherwise)."""
    if name == "auto":
        return torch.device(_accelerator() or "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"{name} asked for, but this machine has no CUDA GPU (use auto or cpu)")
        if device.index is not None and device.index >= count:
            raise DeviceError(f"{name} asked for, but this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    if device.type == "mps" and _accelerator() != "mps":
        raise DeviceError(f"{name} asked for, but Apple's MPS is not available on this machine (use auto or cpu)")
    return device


@dataclass(frozen=True)
class Placement:
    """A device and a precision (``fp32``, ``bf16``, ``fp16``), and how local training runs
    there: compiled or not, in a memory format (``contiguous``, ``channels_last``)."""

    device: torch.device = torch.device("cpu")
    precision: str = "fp32"
    compile: bool = False
    memory_format: str = "contiguous"

    @classmethod
    def of(cls, train) -> "Placement":
        """The placement of a :class:`~nefl_zoo.fl.strategy.sections.TrainConfig` (its device resolved)."""
        return cls(resolve_device(train.device), train.precision, train.compile, train.memory_format)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast to the precision on the device (nothing for fp32)."""
        dtype = DTYPES[self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def scaler(self) -> "torch.amp.GradScaler | None":
        """A gradient scaler for fp16 training, else ``None``."""
        return torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None


_CURRENT: ContextVar[Placement] = ContextVar("nefl_zoo_placement", default=Placement())


def placement() -> Placement:
    """The placement set by the innermost :func:`placed` (default: CPU, fp32)."""
    return _CURRENT.get()


@contextlib.contextmanager
def placed(where: Placement) -> Iterator[Placement]:
    """Compute on ``where`` inside the block."""
    token = _CURRENT.set(where)
    try:
        yield where
    finally:
        _CURRENT.reset(token)


def gpu_share(device_type: str, gpus: int, at_once: int) -> float:
    """Flower's ``client_resources.num_gpus`` of a simulated client: on CUDA, the ``gpus``
    shared evenly by the ``at_once`` clients that train at the same time (at most one each);
    else 0."""
    return min(1.0, gpus / max(1, at_once)) if device_type == "cuda" and gpus else 0.0


def to_cpu(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every tensor on the CPU (tensors already there are kept, not copied)."""
    return {k: v.cpu() for k, v in state.items()}

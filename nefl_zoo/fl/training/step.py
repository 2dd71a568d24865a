"""The forward pass of local training (:func:`~nefl_zoo.fl.training.client.fit`): eager, or compiled once
per submodel structure (``train.compile``), in the memory format of ``train.memory_format``.

``train.compile``: ``torch.compile`` (inductor) of a client model's ``loss``, forward and
backward. One compiled function per *structure* (the client model's class, the name, shape,
dtype and ``requires_grad`` of every parameter and buffer, the placement and the batch's shape
and dtype) is kept for the process and reused by every client and round of that structure: a
client's own module is an argument of the compiled function, so nothing is copied, and
TorchDynamo's guards check whatever else the graph read (a module that differs there compiles
again). Each structure compiles its own copy of the
function, so TorchDynamo's per-function recompilation limit is never reached by the number of
structures. Only batches of the configured ``batch_size`` run compiled; an epoch's short (or
merged) last batch runs eagerly on the same module, so no batch size compiles a second graph. A
structure's first step is timed (its compilation and that one step): ``compile_s`` of the
client's metrics and of the round record. Clients whose loss is not a pure function of their
tensors and batch (:func:`~nefl_zoo.fl.strategy.local_model.impure_reason`) train eagerly, said once in a log line.

``train.memory_format: channels_last`` keeps the model's 4-D weights and the images in NHWC
layout during local training (the layout oneDNN's CPU convolutions and cuDNN's tensor cores
prefer); the model is returned to the contiguous layout before its state is read.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Callable

import torch

from ..strategy.local_model import LocalModel, impure_reason
from .device import Placement

log = logging.getLogger(__name__)
_said: set[str] = set()

MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


@dataclass
class CompileStats:
    """What ``train.compile`` did in this process: the structures it compiled a function for."""

    structures: int = 0


#: this process's compilations (read by tests and benchmarks)
compile_stats = CompileStats()
_compiled: dict[tuple, Callable] = {}


def _loss_of(local: LocalModel, x: torch.Tensor, y: torch.Tensor):
    return local.loss(x, y)


#: torch.compile's backend for compiled training (a name or a callable; tests count graphs with one)
BACKEND: str | Callable = "inductor"


def _structure(local: LocalModel, x: torch.Tensor, where: Placement) -> tuple:
    """The key of ``local``'s compiled loss on batches like ``x`` on ``where``."""
    tensors = (*local.named_parameters(), *local.named_buffers())
    return (type(local), where, tuple(x.shape), x.dtype,
            tuple((k, tuple(v.shape), v.dtype, v.requires_grad) for k, v in tensors))


def _compiled_loss() -> Callable:
    """A new structure's compiled loss: a copy of :func:`_loss_of` with a code object of its own
    (TorchDynamo keeps compiled code, and counts recompilations, per code object)."""
    copy = types.FunctionType(_loss_of.__code__.replace(), _loss_of.__globals__, _loss_of.__name__)
    compile_stats.structures += 1
    return torch.compile(copy, backend=BACKEND, dynamic=False)


def clear_compiled() -> None:
    """Forget this process's compiled steps (the next client of every structure compiles again)."""
    _compiled.clear()


class LocalForward:
    """``(loss, logits)`` of one batch of ``local``'s training, compiled or eager as ``where``
    says; :meth:`compiles` tells whether a batch compiles a new structure and ``compile_s`` sums
    the first steps of the structures this client compiled."""

    def __init__(self, local: LocalModel, where: Placement, batch_size: int):
        self.local, self.where, self.batch_size = local, where, batch_size
        self.channels_last = where.memory_format == "channels_last"
        self.compile_s = 0.0
        self._key: tuple | None = None
        self.compiled = where.compile and self._compilable()

    def _compilable(self) -> bool:
        reason = impure_reason(self.local)
        if reason is not None and reason not in _said:
            _said.add(reason)
            log.warning("train.compile: clients train eagerly, not compiled: %s", reason)
        return reason is None

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the memory format local training uses."""
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x

    def _runs_compiled(self, x: torch.Tensor) -> bool:
        if not self.compiled or len(x) != self.batch_size:
            return False
        if self._key is None:
            self._key = _structure(self.local, x, self.where)
        return True

    def compiles(self, x: torch.Tensor) -> bool:
        """Whether the step of batch ``x`` (prepared) compiles: a full batch of a structure this
        process has not compiled."""
        return self._runs_compiled(x) and self._key not in _compiled

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._runs_compiled(x):
            return self.local.loss(x, y)
        step = _compiled.get(self._key)
        if step is None:
            step = _compiled[self._key] = _compiled_loss()
        try:
            return step(self.local, x, y)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            _compiled.pop(self._key, None)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RuntimeError(f"train.compile: torch.compile failed for {type(self.local).__name__} ({first}); on the CPU it "
                               "needs a C++ compiler (gcc or clang); set train.compile: false to train eagerly") from exc

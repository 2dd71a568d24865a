"""FedLPS's tasks: label maps of the dataset's labels, each with its own predictor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch


@dataclass(frozen=True)
class Task:
    """A labelling of the dataset's images: its class count (given the dataset's) and label map."""

    description: str
    classes: Callable[[int], int]
    labels: Callable[[torch.Tensor], torch.Tensor]


TASKS: dict[str, Task] = {
    "class": Task("the dataset's label", lambda n: n, lambda y: y),
    "parity": Task("label even/odd", lambda n: 2, lambda y: y % 2),
    "mod3": Task("label modulo 3", lambda n: 3, lambda y: y % 3),
    "ge5": Task("label >= 5", lambda n: 2, lambda y: (y >= 5).long()),
}
TaskName = Literal["class", "parity", "mod3", "ge5"]

"""FedLPS's tasks: disjoint groups of the dataset's labels, so each task has its own images
(the bundled digits split into class groups; several datasets from folders, each a task, with
``data.dataset: tasks``), and the routing of a batch's images to their task's predictor."""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.utils.data import Dataset, Subset

REMOVED = ("removed: the relabelling tasks (class, parity, mod3, ge5) shared images; a task is now "
           "{name, labels}, a group of the dataset's labels with its own images (specs/train/digits-fedlps.yaml)")


class TaskSpec(BaseModel):
    """One task: its name and the dataset labels it owns (its images are those with these labels;
    its classes are numbered in this order)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_-]+$")
    labels: list[int] = Field(min_length=2)


DIGIT_GROUPS = [TaskSpec(name="digits0-4", labels=[0, 1, 2, 3, 4]), TaskSpec(name="digits5-9", labels=[5, 6, 7, 8, 9])]


def check_tasks(tasks: list) -> list:
    """``ValueError`` for the removed relabelling tasks, repeated names or shared labels."""
    if any(isinstance(t, str) for t in tasks):
        raise ValueError(REMOVED)
    names = [t["name"] if isinstance(t, dict) else t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names must be distinct, got {names}")
    labels = [y for t in tasks for y in (t["labels"] if isinstance(t, dict) else t.labels)]
    if len(set(labels)) != len(labels):
        raise ValueError("a label belongs to two tasks (tasks must not share images)")
    return tasks


class TaskSet:
    """The tasks of a run over a dataset of ``num_classes`` labels, which they must cover."""

    def __init__(self, tasks: list[TaskSpec], num_classes: int):
        covered = sorted(y for t in tasks for y in t.labels)
        if covered != list(range(num_classes)):
            raise ValueError(f"fedlps: the tasks' labels {covered} must be the dataset's labels 0..{num_classes - 1}, each in one task")
        self.names = [t.name for t in tasks]
        self.classes = {t.name: len(t.labels) for t in tasks}
        self.task_of = torch.empty(num_classes, dtype=torch.long)
        self.local_of = torch.empty(num_classes, dtype=torch.long)
        for i, t in enumerate(tasks):
            self.task_of[t.labels] = i
            self.local_of[t.labels] = torch.arange(len(t.labels))
        self.labels = {t.name: torch.tensor(t.labels) for t in tasks}

    def route(self, y: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per task present in ``y`` (dataset labels): its rows and their task-local labels."""
        task = self.task_of.to(y.device)[y]
        out = {}
        for i, name in enumerate(self.names):
            rows = torch.nonzero(task == i).flatten()
            if len(rows):
                out[name] = (rows, self.local_of.to(y.device)[y[rows]])
        return out

    def counts(self, labels: np.ndarray) -> dict[str, int]:
        """Images per task among ``labels`` (dataset labels)."""
        task = self.task_of[torch.as_tensor(labels, dtype=torch.long)]
        return {name: int((task == i).sum()) for i, name in enumerate(self.names)}


def dataset_labels(dataset: Dataset) -> np.ndarray:
    """The labels of ``dataset`` without loading its images (subsets, in-memory tensors,
    torchvision datasets and their transformed wrappers)."""
    if isinstance(dataset, Subset):
        return dataset_labels(dataset.dataset)[np.asarray(dataset.indices, dtype=np.int64)]
    for attr in ("labels", "targets"):
        if hasattr(dataset, attr):
            return np.asarray(getattr(dataset, attr))
    if hasattr(dataset, "base"):
        return dataset_labels(dataset.base)
    return np.asarray([int(y) for _, y in dataset])

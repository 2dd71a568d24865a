"""The data a run trains on, as its config says: the ``data:`` section (dataset, preprocessing,
partition over clients) and what the clients of one device class hold (``devices.classes[].data``,
read with ``data.partition: devices``, :mod:`.device_partition`).

Plain pydantic models (no torch): the run config (:mod:`nefl_zoo.fl.config`) assembles them with
its other sections, and the exporter reads a run's ``data:`` to load its images.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator

from ..userfiles import Strict

TaskSource = Literal["mnist", "fashionmnist", "svhn", "cifar10"]  # datasets ``dataset: tasks`` reads (:mod:`.multidata`)


class DataConfig(Strict):
    """Dataset, preprocessing and partition over clients."""

    dataset: Literal["digits", "mnist", "fashionmnist", "kmnist", "emnist", "cifar10", "cifar100", "svhn", "cinic10",
                     "imagefolder", "tasks"] = "digits"
    emnist_split: Literal["byclass", "bymerge", "balanced", "letters", "digits", "mnist"] = Field(
        "balanced", description="dataset: emnist: which of EMNIST's splits (classes: 62, 47, 47, 26, 10, 10)")
    task_datasets: list[TaskSource] = Field(
        list(get_args(TaskSource)), min_length=1,
        description="dataset: tasks: these datasets from root as one, labels numbered one after another (FedLPS's tasks)")
    public_fraction: float = Field(0.0, ge=0, lt=1, description="share of the training images held out (stratified) "
                                   "before partitioning, held by no client (FedLPS pre-trains its backbone on it)")
    root: str = Field("data", description="folder holding the dataset files (not used by digits)")
    download: bool = Field(False, description="let torchvision download the dataset (needs a network)")
    augment: bool = Field(True, description="NeFL-appendix augmentation (random crop, flip/jitter)")
    partition: Literal["iid", "dirichlet", "shards", "devices"] = Field(
        "iid", description="iid, dirichlet (label skew), shards (label shards) or devices (each device class's data: "
        "devices.classes[].data)")
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (partition: dirichlet)")
    shards_per_client: int = Field(2, ge=1, description="label shards per client (partition: shards)")
    test_fraction: float = Field(0.25, gt=0, lt=1, description="digits only: held-out test share")
    max_test_samples: int | None = Field(None, ge=1, description="evaluate on the first N test samples")
    local_split: tuple[float, float, float] | None = Field(
        None, description="split each client's data train/val/test, e.g. [0.8, 0.1, 0.1] (FedGH's "
        "personalised evaluation on the client's own test split); none = all for training"
    )

    @field_validator("local_split")
    @classmethod
    def _fractions(cls, v: tuple[float, float, float] | None) -> tuple[float, float, float] | None:
        if v is not None and (min(v) < 0 or v[0] <= 0 or v[2] <= 0 or abs(sum(v) - 1) > 1e-6):
            raise ValueError("expected [train, val, test] fractions summing to 1, train and test > 0")
        return v


class ClassData(Strict):
    """What the clients of one device class hold (``data.partition: devices``, :mod:`.device_data`)."""

    samples: int = Field(ge=1, description="images per client of this class (before data.local_split holds some out)")
    labels: list[float] | None = Field(
        None, min_length=2, description="the class's label mix: one weight per label of the dataset (normalised); none: the training set's own mix")
    alpha: float | None = Field(
        None, gt=0, description="each client's label proportions drawn from Dirichlet(alpha x the class mix); none: every client the class mix")

    @field_validator("labels")
    @classmethod
    def _weights(cls, labels: list[float] | None) -> list[float] | None:
        if labels is not None and (min(labels) < 0 or sum(labels) <= 0):
            raise ValueError("expected weights >= 0 with a positive sum, one per label")
        return labels

"""Several image datasets read from one folder as one dataset (``data.dataset: tasks``), each
dataset's labels numbered after the previous one's: FedLPS's tasks as separate datasets.

MNIST, FashionMNIST, SVHN and CIFAR-10 are read with torchvision's loaders from ``root`` in
their standard layouts (never downloaded), resized to the model's input and converted to its
channel count (grey images repeated to three channels, colour ones averaged to one), each
normalised with its own statistics. Training augmentation: a random crop (padding 2; CIFAR-10:
padding 4 and a horizontal flip).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .datasets import NORMALIZATION, per_channel
from .mnist import open_split

EXPECTED = {
    "svhn": "train_32x32.mat and test_32x32.mat",
    "cifar10": "cifar-10-batches-py/data_batch_1..5 and test_batch",
}
STATS = {  # per-channel mean and std of each training set
    "mnist": NORMALIZATION["mnist"],
    "fashionmnist": NORMALIZATION["fashionmnist"],
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),  # NORMALIZATION's, rounded (FedLPS runs keep them)
    "cifar10": NORMALIZATION["cifar10"],
}


def _read(name: str, root: Path, train: bool):
    """torchvision's dataset ``name`` (one split) from ``root``; ``FileNotFoundError`` naming the
    expected files when it is missing (the MNIST family's reader is :mod:`.mnist`'s)."""
    from torchvision import datasets

    if name in ("mnist", "fashionmnist"):
        return open_split(name, root, train, download=None)
    try:
        if name == "svhn":
            return datasets.SVHN(root, split="train" if train else "test", download=False)
        return datasets.CIFAR10(root, train=train, download=False)
    except RuntimeError as exc:  # torchvision: "Dataset not found ..."
        raise FileNotFoundError(f"{name} not found in {root}: expected {EXPECTED[name]} ({exc})") from None


def _transform(name: str, input_size: tuple[int, int, int], augment: bool):
    from torchvision.transforms import v2

    channels, h, w = input_size
    mean, std = per_channel(STATS[name], channels)
    steps = [v2.ToImage(), v2.Resize((h, w), antialias=True), v2.ToDtype(torch.float32, scale=True)]
    steps.append(v2.Lambda(lambda x: x.expand(channels, -1, -1) if x.shape[0] == 1 else (x if channels == 3 else x.mean(0, keepdim=True))))
    if augment:
        steps.append(v2.RandomCrop((h, w), padding=4 if name == "cifar10" else 2))
        if name == "cifar10":
            steps.append(v2.RandomHorizontalFlip())
    return v2.Compose([*steps, v2.Normalize(mean, std)])


class Concatenated(Dataset):
    """Datasets one after another, each with its transform and its labels shifted by the
    classes of the datasets before it; ``targets`` holds every label."""

    def __init__(self, parts: list[tuple[Dataset, object, int]]):
        self.parts = parts  # (dataset, transform, label offset)
        self.starts = np.cumsum([0] + [len(d) for d, _, _ in parts])
        self.targets = np.concatenate([np.asarray(_labels(d)) + off for d, _, off in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int):
        p = int(np.searchsorted(self.starts, i, side="right")) - 1
        dataset, transform, _ = self.parts[p]
        x, _ = dataset[i - int(self.starts[p])]
        return transform(x), int(self.targets[i])


def _labels(dataset) -> np.ndarray:
    return np.asarray(dataset.labels if hasattr(dataset, "labels") else dataset.targets)


def load_sources(names: list[str], root: Path, input_size: tuple[int, int, int], augment: bool):
    """``(train, train_eval, test, targets, num_classes)`` of the datasets ``names`` (of
    :data:`~nefl_zoo.data.config.TaskSource`, 10 classes each) read from ``root`` as one, labels numbered in order."""
    train, train_eval, test = [], [], []
    for k, name in enumerate(names):
        tr, te = _read(name, root, True), _read(name, root, False)
        plain = _transform(name, input_size, False)
        train.append((tr, _transform(name, input_size, augment), 10 * k))
        train_eval.append((tr, plain, 10 * k))
        test.append((te, plain, 10 * k))
    train_set = Concatenated(train)
    return train_set, Concatenated(train_eval), Concatenated(test), train_set.targets, 10 * len(names)

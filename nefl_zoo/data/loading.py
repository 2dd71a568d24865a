"""Datasets and their partition over clients.

``digits`` (scikit-learn's 1,797 real 8x8 digit images, bundled, so it works offline) is resized
to the model's input; so is the MNIST family (MNIST, FashionMNIST, KMNIST, EMNIST, :mod:`.mnist`)
read from ``root`` in torchvision's layout; both are held in memory. CIFAR-10/100 and SVHN are
read from ``root`` in their standard formats with torchvision's loaders, CINIC-10 and any
``imagefolder`` from ``root/train`` and ``root/test`` class folders. Training augmentation and
normalisation follow the NeFL appendix: random crop (padding 4; SVHN 2) and horizontal flip
(SVHN: colour jitter instead, digits and the MNIST family: crop only). Partitions (IID,
Dirichlet label skew, label shards, and data shaped by each client's device class,
:mod:`.device_partition`) are seeded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from .config import DataConfig
from .datasets import MNIST_FAMILY, NORMALIZATION, DatasetNotFoundError

if TYPE_CHECKING:
    from .device_partition import DeviceClass

EXPECTED_FILES = {
    "cifar10": "cifar-10-batches-py/data_batch_1..5 and test_batch",
    "cifar100": "cifar-100-python/train and test",
    "svhn": "train_32x32.mat and test_32x32.mat",
    "cinic10": "train/<class>/*.png and test/<class>/*.png",
    "imagefolder": "train/<class>/<images> and test/<class>/<images> (or val/)",
}


class Devices(Protocol):
    """What loading reads of the ``devices:`` section
    (:class:`nefl_zoo.fl.devices.population.DevicesConfig`): its classes."""

    classes: Sequence["DeviceClass"]


@dataclass
class FederatedData:
    """Train/test sets and each client's training indices."""

    train: Dataset  # with training augmentation
    train_eval: Dataset  # the same images without augmentation (static BN statistics)
    test: Dataset
    targets: np.ndarray  # training labels
    num_classes: int
    partitions: list[np.ndarray]

    holdout: list[tuple[np.ndarray, np.ndarray]] | None = None  # per client (val, test) indices
    public: np.ndarray | None = None  # training indices held out before partitioning (data.public_fraction)

    def client_dataset(self, client: int) -> Subset:
        """The training samples of one client."""
        return Subset(self.train, self.partitions[client].tolist())

    def client_test(self, client: int) -> Subset:
        """One client's own held-out test samples, without augmentation (``data.local_split``)."""
        if self.holdout is None:
            raise ValueError("this method evaluates on each client's own test split: set data.local_split, e.g. [0.8, 0.1, 0.1]")
        return Subset(self.train_eval, self.holdout[client][1].tolist())


def local_split(parts: list[np.ndarray], fractions: tuple[float, float, float], seed: int):
    """Split every client's indices into train / val / test by ``fractions`` (seeded per client);
    returns ``(train_parts, [(val, test), ...])``; every split keeps at least one sample for
    train and test."""
    train_parts, holdout = [], []
    for client, part in enumerate(parts):
        if len(part) < 2:
            raise ValueError(f"client {client} has {len(part)} sample(s): too few to hold out a test split")
        order = np.random.default_rng([seed, client]).permutation(part)
        n_test = max(1, round(fractions[2] * len(part)))
        n_val = min(round(fractions[1] * len(part)), len(part) - n_test - 1)
        test, val, train = np.split(order, [n_test, n_test + n_val])
        train_parts.append(np.sort(train))
        holdout.append((np.sort(val), np.sort(test)))
    return train_parts, holdout


class TensorImages(Dataset):
    """Images held in memory as a float tensor ``(N, C, H, W)`` with an optional transform."""

    def __init__(self, images: torch.Tensor, labels: np.ndarray, transform=None):
        self.images, self.labels, self.transform = images, torch.as_tensor(labels), transform
        self._resident: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def resident(self, device: torch.device, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The images (zero-padded by ``pad`` on each side) and labels on ``device``, copied there
        once and kept (:mod:`nefl_zoo.fl.training.batches` crops and batches them there)."""
        key = (str(device), pad)
        if key not in self._resident:
            images = torch.nn.functional.pad(self.images, (pad,) * 4) if pad else self.images
            self._resident[key] = images.to(device), self.labels.to(device)
        return self._resident[key]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i]
        return (self.transform(x) if self.transform else x), self.labels[i]


class _Transformed(Dataset):
    """A dataset (torchvision's) with a transform applied to its images."""

    def __init__(self, base: Dataset, transform):
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return self.transform(x), y


@functools.cache
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``(images (1797, 8, 8), labels)``, parsed once per process and
    read-only (every run and export of a process shares them)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    for array in (bunch.images, bunch.target):
        array.flags.writeable = False
    return bunch.images, bunch.target


def _digits(input_size: tuple[int, int, int], test_fraction: float, augment: bool):
    import torch.nn.functional as F
    from sklearn.model_selection import train_test_split

    channels, h, w = input_size
    digit_images, labels = _digits_arrays()
    images = torch.tensor(digit_images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(h, w), mode="bilinear", align_corners=False)
    images = images.expand(-1, channels, -1, -1).contiguous()
    idx_train, idx_test = train_test_split(
        np.arange(len(images)), test_size=test_fraction, stratify=labels, random_state=0
    )
    mean, std = images[idx_train].mean(), images[idx_train].std()
    images = (images - mean) / std
    return _in_memory(images[idx_train], labels[idx_train], images[idx_test], labels[idx_test], 10,
                      max(1, h // 8) if augment else 0)


def _in_memory(train: torch.Tensor, targets: np.ndarray, test: torch.Tensor, test_labels: np.ndarray, classes: int, crop_padding: int):
    """``(train, train_eval, test, targets, num_classes)`` of images held as tensors; training
    images randomly cropped with ``crop_padding`` (0: none)."""
    crop = None
    if crop_padding:
        from torchvision.transforms import v2  # a second of imports: only where it crops

        crop = v2.RandomCrop(tuple(train.shape[-2:]), padding=crop_padding)
    return TensorImages(train, targets, crop), TensorImages(train, targets), TensorImages(test, test_labels), targets, classes


def _transforms(name: str, input_size: tuple[int, int, int], augment: bool):
    from torchvision.transforms import v2

    _, h, w = input_size
    mean, std = NORMALIZATION[name]
    base = [v2.ToImage(), v2.Resize((h, w), antialias=True)]
    tail = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    aug: list = []
    if augment and name == "svhn":
        aug = [v2.RandomCrop((h, w), padding=2), v2.ColorJitter(brightness=63 / 255, saturation=(0.5, 1.5), contrast=(0.2, 1.8))]
    elif augment:
        aug = [v2.RandomCrop((h, w), padding=4), v2.RandomHorizontalFlip()]
    return v2.Compose(base + aug + tail), v2.Compose(base + tail)


def _missing(name: str, root: Path) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"{name} not found in {root}: expected {EXPECTED_FILES[name]}"
        + ("" if name in ("cinic10", "imagefolder") else " (or set data.download: true with a network)")
    )


def _torchvision(name: str, root: Path, download: bool):
    from torchvision import datasets

    try:
        if name == "cifar10":
            return datasets.CIFAR10(root, train=True, download=download), datasets.CIFAR10(root, train=False, download=download), 10
        if name == "cifar100":
            return datasets.CIFAR100(root, train=True, download=download), datasets.CIFAR100(root, train=False, download=download), 100
        if name == "svhn":
            return datasets.SVHN(root, split="train", download=download), datasets.SVHN(root, split="test", download=download), 10
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
        if "not found" in str(exc).lower() or "corrupt" in str(exc).lower():
            raise _missing(name, root) from None
        raise
    except OSError as exc:  # download without a network
        raise DatasetNotFoundError(f"{name}: cannot download into {root} ({exc})") from None
    test_dir = root / "test" if (root / "test").is_dir() else root / "val"
    if not (root / "train").is_dir() or not test_dir.is_dir():
        raise _missing(name, root)
    try:
        train, test = datasets.ImageFolder(root / "train"), datasets.ImageFolder(test_dir)
    except FileNotFoundError as exc:
        raise DatasetNotFoundError(f"{name} in {root}: {str(exc).splitlines()[0]}") from None
    if train.classes != test.classes:
        raise DatasetNotFoundError(f"{name} in {root}: train and {test_dir.name} have different class folders")
    return train, test, len(train.classes)


def _targets(dataset) -> np.ndarray:
    for attr in ("targets", "labels"):
        if hasattr(dataset, attr):
            return np.asarray(getattr(dataset, attr))
    raise TypeError(f"{type(dataset).__name__} has no targets")


def partition(
    targets: np.ndarray, num_clients: int, scheme: str, seed: int, alpha: float = 0.5, shards_per_client: int = 2
) -> list[np.ndarray]:
    """Split sample indices over clients: ``iid``, ``dirichlet`` (label skew) or ``shards``."""
    rng = np.random.default_rng(seed)
    n = len(targets)
    if num_clients > n:
        raise ValueError(f"{num_clients} clients but only {n} training samples")
    if scheme == "iid":
        return [np.sort(p) for p in np.array_split(rng.permutation(n), num_clients)]
    if scheme == "shards":
        num_shards = num_clients * shards_per_client
        if num_shards > n:
            raise ValueError(f"{num_shards} shards but only {n} training samples")
        order = np.argsort(targets, kind="stable")
        shards = np.array_split(order, num_shards)
        pick = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
        return [np.sort(np.concatenate([shards[s] for s in row])) for row in pick]
    if scheme == "dirichlet":
        return _dirichlet(targets, num_clients, alpha, rng)
    raise ValueError(f"unknown partition {scheme!r}")


def _dirichlet(targets: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class, shares over clients drawn from Dir(alpha); redrawn until no client is tiny."""
    n = len(targets)
    min_size = max(1, min(10, n // (2 * num_clients)))
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for label in np.unique(targets):
            idx = rng.permutation(np.flatnonzero(targets == label))
            shares = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(f"Dirichlet(alpha={alpha}) left a client with fewer than {min_size} samples; use fewer clients")


def public_split(targets: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(public, rest)``: ``round(fraction * n)`` training indices of every label held out
    (seeded), and the others; both sorted."""
    rng = np.random.default_rng([seed, 7])
    public = [rng.permutation(np.flatnonzero(targets == y))[: round(fraction * int((targets == y).sum()))] for y in np.unique(targets)]
    held = np.sort(np.concatenate(public))
    return held, np.setdiff1d(np.arange(len(targets)), held)


def load_data(cfg: DataConfig, root: Path, input_size: tuple[int, int, int], num_clients: int, seed: int,
              devices: Devices | None = None) -> FederatedData:
    """Load ``cfg.dataset`` for a model with ``input_size`` (C, H, W) and partition it
    (``partition: devices`` by the device classes of ``devices``, :mod:`.device_partition`)."""
    channels = input_size[0]
    if cfg.dataset == "digits":
        train, train_eval, test, targets, num_classes = _digits(input_size, cfg.test_fraction, cfg.augment)
    elif cfg.dataset in MNIST_FAMILY:
        from .mnist import read_mnist_family

        *arrays, num_classes = read_mnist_family(cfg.dataset, Path(root), input_size, cfg.download, cfg.emnist_split)
        train, train_eval, test, targets, num_classes = _in_memory(*arrays, num_classes, 2 if cfg.augment else 0)
    elif cfg.dataset == "tasks":
        from .multidata import load_sources

        try:
            train, train_eval, test, targets, num_classes = load_sources(cfg.task_datasets, Path(root), input_size, cfg.augment)
        except FileNotFoundError as exc:
            raise DatasetNotFoundError(str(exc)) from None
    else:
        if channels != 3:
            raise ValueError(f"{cfg.dataset} images have 3 channels but the model takes {channels} (spec model_args.in_chans)")
        base_train, base_test, num_classes = _torchvision(cfg.dataset, Path(root), cfg.download)
        t_train, t_plain = _transforms(cfg.dataset, input_size, cfg.augment)
        train, train_eval, test = _Transformed(base_train, t_train), _Transformed(base_train, t_plain), _Transformed(base_test, t_plain)
        targets = _targets(base_train)
    if cfg.max_test_samples is not None and cfg.max_test_samples < len(test):
        test = Subset(test, list(range(cfg.max_test_samples)))
    def split(labels: np.ndarray) -> list[np.ndarray]:
        if cfg.partition != "devices":
            return partition(labels, num_clients, cfg.partition, seed, cfg.alpha, cfg.shards_per_client)
        if devices is None:
            raise ValueError("data.partition: devices needs the devices section (its classes' data)")
        from .device_partition import device_kinds, device_partition

        return device_partition(labels, num_classes, device_kinds(devices.classes, num_clients, seed), devices.classes, seed)

    public = None
    if cfg.public_fraction:  # held out first: the clients share the rest
        public, pool = public_split(targets, cfg.public_fraction, seed)
        parts = [pool[p] for p in split(targets[pool])]
    else:
        parts = split(targets)
    holdout = None
    if cfg.local_split is not None:
        parts, holdout = local_split(parts, cfg.local_split, seed)
    return FederatedData(train, train_eval, test, targets, num_classes, parts, holdout, public)

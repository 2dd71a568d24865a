"""What is known about each image dataset, without loading any: normalisation, class names and
the error for a missing one.

A leaf module (standard library only), shared by training (:mod:`nefl_zoo.data.loading`) and the
exporter (:mod:`nefl_zoo.export`), so that exporting does not import the training engine.
"""

from __future__ import annotations

Stats = tuple[tuple[float, ...], tuple[float, ...]]  # (mean, std), one value per channel

# (mean, std) per channel of pixels scaled to [0, 1], from each training set; SVHN's are the
# NeFL appendix's. Grey datasets have one channel (:func:`normalization` adapts the count).
NORMALIZATION: dict[str, Stats] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4376821, 0.4437697, 0.47280442), (0.19803012, 0.20101562, 0.19703614)),
    "cinic10": ((0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashionmnist": ((0.2860,), (0.3530,)),
    "kmnist": ((0.1918,), (0.3483,)),
    "emnist": ((0.1751,), (0.3332,)),  # the balanced split's; the other splits' differ by < 0.01
}


class DatasetNotFoundError(FileNotFoundError):
    """A dataset is missing from its folder; the message names the folder and expected files."""


# the MNIST family: 28x28 grey images in torchvision's raw idx layout, read into memory
MNIST_FAMILY = ("mnist", "fashionmnist", "kmnist", "emnist")

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
DIGITS = tuple(str(d) for d in range(10))
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "cifar10": CIFAR10_CLASSES,
    "cinic10": CIFAR10_CLASSES,
    "svhn": DIGITS,
    "mnist": DIGITS,
    "fashionmnist": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
    "kmnist": ("o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo"),
}


def per_channel(stats: Stats, channels: int) -> Stats:
    """``(mean, std)`` for a model taking ``channels`` channels: a grey dataset's value repeated
    for a colour model, a colour dataset's mean over its channels for a grey one."""
    mean, std = stats
    if len(mean) != channels:
        mean, std = (sum(mean) / len(mean),) * channels, (sum(std) / len(std),) * channels
    return mean, std


def normalization(name: str, channels: int) -> Stats | None:
    """``(mean, std)`` of dataset ``name`` for a model taking ``channels`` channels
    (:func:`per_channel`); ``None`` for a dataset without a known normalisation."""
    return per_channel(NORMALIZATION[name], channels) if name in NORMALIZATION else None


__all__ = ["CIFAR10_CLASSES", "CLASS_NAMES", "DatasetNotFoundError", "MNIST_FAMILY", "NORMALIZATION", "normalization", "per_channel"]

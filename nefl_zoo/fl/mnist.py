"""The MNIST family: MNIST, FashionMNIST, KMNIST and EMNIST, held in memory.

Each is read with torchvision's loader from ``root`` in torchvision's layout
(``root/MNIST/raw/train-images-idx3-ubyte`` and the other three idx files; ``FashionMNIST``,
``KMNIST``, ``EMNIST`` likewise, EMNIST's files named by split), downloaded there only with
``download``. The 28x28 grey images become one float tensor, resized to the model's input
(bilinear with antialiasing, as torchvision's ``Resize``), repeated to three channels for a
colour model, and normalised with the training set's statistics; so they train through the
engine's on-device batching, like digits. EMNIST's stored images are transposed; they are
turned upright, and the ``letters`` split's labels 1..26 become 0..25. Augmentation: a random
crop with padding 2 (no flip: digits and letters are not mirror-symmetric), padding with the
normalised zero (:mod:`.data` wraps the tensors).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..datasets import DatasetNotFoundError, normalization

FOLDERS = {"mnist": "MNIST", "fashionmnist": "FashionMNIST", "kmnist": "KMNIST", "emnist": "EMNIST"}


def expected_files(name: str, split: str = "balanced") -> str:
    """The files torchvision reads for ``name``, relative to ``root``."""
    stem = f"emnist-{split}-" if name == "emnist" else ""
    return f"{FOLDERS[name]}/raw/{stem}{{train,{'test' if name == 'emnist' else 't10k'}}}-{{images-idx3,labels-idx1}}-ubyte"


def open_split(name: str, root: Path, train: bool, download: bool | None = False, split: str = "balanced"):
    """torchvision's dataset ``name`` (one of :data:`~nefl_zoo.datasets.MNIST_FAMILY`), its
    training or test split, read from ``root`` (``download``: fetched there first when missing;
    ``None``: never, and the error does not offer it); :class:`DatasetNotFoundError` naming the
    expected files when they are missing."""
    from torchvision import datasets

    kinds = {"mnist": datasets.MNIST, "fashionmnist": datasets.FashionMNIST, "kmnist": datasets.KMNIST}
    try:
        if name == "emnist":
            return datasets.EMNIST(root, split=split, train=train, download=bool(download))
        return kinds[name](root, train=train, download=bool(download))
    except RuntimeError as exc:  # torchvision: "Dataset not found. You can use download=True to download it"
        hint = " (or set data.download: true with a network)" if download is False else ""
        raise DatasetNotFoundError(f"{name} not found in {root}: expected {expected_files(name, split)}{hint}") from exc
    except OSError as exc:  # a download without a network
        raise DatasetNotFoundError(f"{name}: cannot download into {root} ({str(exc).splitlines()[0]})") from None


def _images(dataset, name: str, split: str) -> tuple[torch.Tensor, np.ndarray, int]:
    """``(uint8 images (N, 28, 28), labels, classes)`` of a torchvision MNIST-family dataset."""
    images, labels = dataset.data, np.asarray(dataset.targets, dtype=np.int64)
    classes = len(dataset.classes)
    if name == "emnist":
        images = images.transpose(1, 2)  # stored column by column
        if split == "letters":  # torchvision keeps the raw 1..26 (class 0 is "N/A")
            labels, classes = labels - 1, classes - 1
    return images, labels, classes


def to_model_input(images: torch.Tensor, name: str, input_size: tuple[int, int, int]) -> torch.Tensor:
    """uint8 ``(N, 28, 28)`` images as the model's normalised float ``(N, C, H, W)`` input."""
    import torch.nn.functional as F

    channels, h, w = input_size
    x = images.unsqueeze(1).to(torch.float32) / 255
    if x.shape[-2:] != (h, w):
        x = F.interpolate(x, size=(h, w), mode="bilinear", antialias=True, align_corners=False).clamp_(0, 1)
    mean, std = normalization(name, channels)
    x = x.expand(-1, channels, -1, -1)
    return ((x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)).contiguous()


def read_mnist_family(name: str, root: Path, input_size: tuple[int, int, int], download: bool = False,
                      split: str = "balanced") -> tuple[torch.Tensor, np.ndarray, torch.Tensor, np.ndarray, int]:
    """``(train images, train labels, test images, test labels, classes)`` of ``name``, the
    images as the normalised input of a model taking ``input_size`` (C, H, W)."""
    train_images, targets, classes = _images(open_split(name, root, True, download, split), name, split)
    test_images, test_labels, _ = _images(open_split(name, root, False, download, split), name, split)
    return to_model_input(train_images, name, input_size), targets, to_model_input(test_images, name, input_size), test_labels, classes

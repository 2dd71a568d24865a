"""The MNIST family: MNIST, FashionMNIST, KMNIST and EMNIST, held in memory.

Each is read from ``root`` in torchvision's raw layout (``root/MNIST/raw/train-images-idx3-ubyte``
and the other three idx files; ``FashionMNIST``, ``KMNIST``, ``EMNIST`` likewise, EMNIST's files
named by split) by the strict idx reader below, downloaded there with torchvision's downloader only
with ``download``. Every declared size is checked against the file before a byte of data is read:
a wrong magic number (a label file where images belong, or the reverse; a ``.gz`` not extracted),
a truncated or overlong file, image and label counts that differ, or labels outside the classes is
one line naming the file (:class:`IdxFileError`). torchvision's legacy ``processed/*.pt`` files
are never read (nothing here unpickles). A download lands in a scratch folder beside the data and
each checked file is renamed into place, so a failed or interrupted one leaves nothing that stops
the same command from running again.

The 28x28 grey images become one float tensor, resized to the model's input (bilinear with
antialiasing, as torchvision's ``Resize``), repeated to three channels for a colour model, and
normalised with the training set's statistics; so they train through the engine's on-device
batching, like digits. EMNIST's stored images are transposed; they are turned upright, and the
``letters`` split's labels 1..26 become 0..25. Augmentation: a random crop with padding 2 (no
flip: digits and letters are not mirror-symmetric), padding with the normalised zero (:mod:`.loading`
wraps the tensors).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .datasets import DatasetNotFoundError, normalization

FOLDERS = {"mnist": "MNIST", "fashionmnist": "FashionMNIST", "kmnist": "KMNIST", "emnist": "EMNIST"}
EMNIST_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}
SIDE = 28  # every image of the family is 28x28
MAGIC = {"images": (2051, 3), "labels": (2049, 1)}  # idx: 0x0000, type 0x08 (uint8), number of dimensions


class IdxFileError(ValueError):
    """An idx file that is not what its name promises: one line naming the file, what is wrong
    and the fix."""


def expected_files(name: str, split: str = "balanced") -> str:
    """The files read for ``name``, relative to ``root``."""
    stem = f"emnist-{split}-" if name == "emnist" else ""
    return f"{FOLDERS[name]}/raw/{stem}{{train,{'test' if name == 'emnist' else 't10k'}}}-{{images-idx3,labels-idx1}}-ubyte"


def split_files(name: str, train: bool, split: str = "balanced") -> dict[str, str]:
    """``{"images": FILE, "labels": FILE}`` of one split, file names in the raw folder."""
    prefix = f"emnist-{split}-{'train' if train else 'test'}" if name == "emnist" else ("train" if train else "t10k")
    return {"images": f"{prefix}-images-idx3-ubyte", "labels": f"{prefix}-labels-idx1-ubyte"}


def label_range(name: str, split: str = "balanced") -> tuple[int, int]:
    """The least and greatest label stored in ``name``'s files (EMNIST ``letters``: 1..26)."""
    if name != "emnist":
        return 0, 9
    return (1, 26) if split == "letters" else (0, EMNIST_CLASSES[split] - 1)


def read_idx(path: Path, kind: str) -> np.ndarray:
    """The uint8 ``images`` (N, 28, 28) or ``labels`` (N,) of the idx file ``path``: its magic
    number, its dimensions and its size checked before its data is read."""
    magic, ndim = MAGIC[kind]
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(4 + 4 * ndim)
        if len(head) >= 2 and head[:2] == b"\x1f\x8b":
            raise IdxFileError(f"{path}: a gzip archive, not an idx file; extract it (gunzip) under this name")
        if len(head) < 4:
            raise IdxFileError(f"{path}: truncated: {size} bytes, shorter than the idx header; delete it and fetch it again")
        found = int.from_bytes(head[:4], "big")
        if found != magic:
            other = {2049: "an idx1 label file", 2051: "an idx3 image file"}.get(found)
            why = (f"{other} where the {kind} belong ({magic}); are the image and label files swapped?" if other
                   else f"expected {magic} (idx {kind}): not an MNIST-family {kind} file")
            raise IdxFileError(f"{path}: magic number {found} (0x{found:08x}), {why}")
        if len(head) < 4 + 4 * ndim:
            raise IdxFileError(f"{path}: truncated: {size} bytes, shorter than the idx header; delete it and fetch it again")
        dims = struct.unpack(f">{ndim}I", head[4:])
        if kind == "images" and dims[1:] != (SIDE, SIDE):
            raise IdxFileError(f"{path}: dimensions {'x'.join(map(str, dims))}, expected 28x28 images")
        expected = len(head) + int(np.prod(dims, dtype=object))
        if size != expected:
            what = "truncated" if size < expected else "longer than declared"
            raise IdxFileError(f"{path}: {what}: its header declares {dims[0]:,} {kind} ({expected:,} bytes) but the "
                               f"file holds {size:,} bytes; delete it and fetch it again")
        data = np.fromfile(f, dtype=np.uint8)
    if len(data) != expected - len(head):  # the file changed while it was read
        raise IdxFileError(f"{path}: changed while it was read; read it again")
    return data.reshape(dims)


class IdxSplit(Dataset):
    """One split of an MNIST-family dataset as torchvision's class holds it: ``data`` (uint8
    (N, 28, 28), as stored), ``targets`` (int64, as stored); items are ``(PIL image, label)``."""

    def __init__(self, data: torch.Tensor, targets: torch.Tensor):
        self.data, self.targets = data, targets

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        from PIL import Image

        return Image.fromarray(self.data[i].numpy()), int(self.targets[i])


def read_split(name: str, raw: Path, train: bool, split: str = "balanced") -> IdxSplit:
    """One split of ``name`` from its raw folder ``raw``: both files checked on their own, then
    against each other (counts) and the dataset (label range)."""
    files = {kind: raw / file for kind, file in split_files(name, train, split).items()}
    try:
        images, labels = read_idx(files["images"], "images"), read_idx(files["labels"], "labels")
    except FileNotFoundError:
        raise
    except OSError as exc:  # a directory, no permission, an I/O error
        raise IdxFileError(f"{exc.filename or raw}: cannot read it ({exc.strerror or exc}); check its permissions") from None
    if len(images) != len(labels):
        raise IdxFileError(f"{files['labels']}: {len(labels):,} labels but {files['images'].name} holds {len(images):,} "
                           "images; both files must come from the same release")
    lo, hi = label_range(name, split)
    bad = np.flatnonzero((labels < lo) | (labels > hi))
    if len(bad):
        what = f"{name} {split}" if name == "emnist" else name
        raise IdxFileError(f"{files['labels']}: label {labels[bad[0]]} at position {bad[0]:,} is outside {lo}..{hi} "
                           f"({what}); the file is corrupt or belongs to another dataset")
    return IdxSplit(torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64)))


def _download(name: str, root: Path, train: bool, split: str) -> None:
    """Fetch ``name`` with torchvision's downloader into a scratch folder beside the data, check
    each idx file it extracted and rename it into the raw folder (files already there are kept):
    an interrupted download leaves no partial file where the reader looks."""
    from torchvision import datasets

    kinds = {"mnist": datasets.MNIST, "fashionmnist": datasets.FashionMNIST, "kmnist": datasets.KMNIST, "emnist": datasets.EMNIST}
    raw = root / FOLDERS[name] / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=raw.parent))
    try:
        fetcher = kinds[name].__new__(kinds[name])  # its downloader only: its constructor would read processed/*.pt
        fetcher.root, fetcher.train, fetcher.split = str(scratch), train, split
        fetcher.download()
        fetched = scratch / FOLDERS[name] / "raw"
        for file in sorted(fetched.glob("*-ubyte")):
            if not (raw / file.name).exists():
                read_idx(file, "labels" if "-labels-" in file.name else "images")
                os.replace(file, raw / file.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def open_split(name: str, root: Path, train: bool, download: bool | None = False, split: str = "balanced") -> IdxSplit:
    """The training or test split of ``name`` (one of :data:`~nefl_zoo.data.datasets.MNIST_FAMILY`)
    read from ``root`` (``download``: fetched there first when missing; ``None``: never, and the
    error does not offer it); :class:`DatasetNotFoundError` naming the expected files when they
    are missing, :class:`IdxFileError` naming the file that is not what it should be."""
    root = Path(root)
    raw = root / FOLDERS[name] / "raw"
    if download and not all((raw / file).exists() for file in split_files(name, train, split).values()):
        try:
            _download(name, root, train, split)
        except (RuntimeError, OSError, IdxFileError) as exc:  # no network, a checksum torchvision refused, a damaged file
            lines = str(exc).strip().splitlines()
            raise DatasetNotFoundError(f"{name}: cannot download into {root} ({lines[0] if lines else type(exc).__name__})") from None
    try:
        return read_split(name, raw, train, split)
    except FileNotFoundError:
        hint = " (or set data.download: true with a network)" if download is False else ""
        legacy = root / FOLDERS[name] / "processed"
        if any(legacy.glob("*.pt")):
            hint += f"; {legacy}/*.pt (torchvision's legacy pickled layout) is never read"
        raise DatasetNotFoundError(f"{name} not found in {root}: expected {expected_files(name, split)}{hint}") from None


def _images(dataset: IdxSplit, name: str, split: str) -> tuple[torch.Tensor, np.ndarray, int]:
    """``(uint8 images (N, 28, 28), labels, classes)`` of one split."""
    images, labels = dataset.data, dataset.targets.numpy()
    classes = EMNIST_CLASSES[split] if name == "emnist" else 10
    if name == "emnist":
        images = images.transpose(1, 2)  # stored column by column
        if split == "letters":  # stored as 1..26
            labels = labels - 1
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

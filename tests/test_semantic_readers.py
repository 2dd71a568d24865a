"""The MNIST-family readers at their edges: an idx image file whose height, width or both are not
28 is refused (also one of 14x56, which holds as many bytes per image), every EMNIST split's
label range exact at both ends, and the tasks reader's evaluation transforms and missing files
(TESTING.md, "Semantic mistakes"). Files are written here, 6 images each."""

import struct
from pathlib import Path

import numpy as np
import pytest

from nefl_zoo.data.loading import DatasetNotFoundError
from nefl_zoo.data.mnist import IdxFileError, read_mnist_family, read_split

N = 6
# the EMNIST paper's splits (Cohen et al., 2017): classes, and the least and greatest label its files store
EMNIST = {"byclass": (62, 0, 61), "bymerge": (47, 0, 46), "balanced": (47, 0, 46), "letters": (26, 1, 26), "digits": (10, 0, 9),
          "mnist": (10, 0, 9)}


def write(raw: Path, prefix: str, labels, height: int = 28, width: int = 28) -> None:
    """``PREFIX-images-idx3-ubyte`` (N images of ``height`` x ``width``, sized as declared) and
    ``PREFIX-labels-idx1-ubyte`` in ``raw``."""
    raw.mkdir(parents=True, exist_ok=True)
    pixels = (np.arange(N * height * width) % 251).astype(np.uint8)
    (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, N, height, width) + pixels.tobytes())
    (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, N) + np.asarray(labels, np.uint8).tobytes())


@pytest.mark.parametrize("height, width", [(27, 28), (28, 27), (27, 27), (14, 56), (56, 14), (28, 29)])
def test_an_idx_file_of_another_height_or_width_is_refused(tmp_path, height, width):
    """Each dimension alone, both, and shapes of 784 pixels other than 28x28. Broken by hand:
    only the height (``dims[1]``) or only the width checked, or only their product, fails here."""
    write(tmp_path, "t10k", range(N), height, width)
    with pytest.raises(IdxFileError) as info:
        read_split("mnist", tmp_path, train=False)
    assert str(info.value) == f"{tmp_path / 't10k-images-idx3-ubyte'}: dimensions {N}x{height}x{width}, expected 28x28 images"


@pytest.mark.parametrize("split", list(EMNIST))
def test_each_emnist_splits_label_range_is_exact_at_both_ends(tmp_path, split):
    """Labels at the split's least and greatest value load, with the split's class count (letters
    shifted to 0..25); one below the least (where there is one) or above the greatest is refused,
    naming the split. Broken by hand: any class count or range one off (``byclass: 61``,
    letters 0..25 or 1..27) fails here."""
    classes, lo, hi = EMNIST[split]
    raw = tmp_path / "EMNIST" / "raw"
    ends = [lo, hi, lo, hi, lo, hi]
    for part in ("train", "test"):
        write(raw, f"emnist-{split}-{part}", ends)
    _, train_labels, _, test_labels, found = read_mnist_family("emnist", tmp_path, (1, 28, 28), split=split)
    shift = 1 if split == "letters" else 0
    assert found == classes and train_labels.tolist() == test_labels.tolist() == [v - shift for v in ends]
    assert max(train_labels) == classes - 1
    for bad in [v for v in (lo - 1, hi + 1) if v >= 0]:
        write(raw, f"emnist-{split}-train", [lo, hi, bad, lo, hi, lo])
        with pytest.raises(IdxFileError, match=rf"label {bad} at position 2 is outside {lo}..{hi} \(emnist {split}\); "):
            read_mnist_family("emnist", tmp_path, (1, 28, 28), split=split)


def test_the_tasks_reader_evaluates_without_augmentation_and_never_offers_a_download(tmp_path):
    """``dataset: tasks`` with augmentation: the training set's transform crops, the copy the
    run evaluates training accuracy on and the test set do not; a missing dataset is named with
    its files and no ``data.download`` advice (the tasks reader never downloads). Broken by hand:
    the augmenting transform given to ``train_eval`` or ``download=False`` for ``None`` in
    ``multidata._read`` fails here."""
    from torchvision.transforms import v2

    from nefl_zoo.data.multidata import load_sources

    for prefix in ("train", "t10k"):
        write(tmp_path / "MNIST" / "raw", prefix, range(N))
    train, train_eval, test, targets, classes = load_sources(["mnist"], tmp_path, (1, 28, 28), augment=True)
    crops = [[isinstance(s, v2.RandomCrop) for s in dataset.parts[0][1].transforms] for dataset in (train, train_eval, test)]
    assert [any(c) for c in crops] == [True, False, False] and classes == 10 and targets.tolist() == list(range(N))
    with pytest.raises(DatasetNotFoundError) as info:
        load_sources(["mnist", "fashionmnist"], tmp_path, (1, 28, 28), augment=False)
    assert "fashionmnist not found in" in str(info.value) and "download" not in str(info.value)

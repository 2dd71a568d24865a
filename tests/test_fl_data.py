"""Datasets and partitions: digits resizing, folder datasets, missing-data errors, seeded splits."""

import numpy as np
import pytest
import torch

from nefl_zoo.fl.config import DataConfig
from nefl_zoo.fl.data import NORMALIZATION, DatasetNotFoundError, load_data, partition

TARGETS = np.repeat(np.arange(10), 30)


def _check_cover(parts, n):
    joined = np.concatenate(parts)
    assert len(joined) == n and len(np.unique(joined)) == n


def test_iid_partition_is_balanced_disjoint_and_seeded():
    parts = partition(TARGETS, 7, "iid", seed=1)
    _check_cover(parts, len(TARGETS))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition(TARGETS, 7, "iid", seed=1)))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, partition(TARGETS, 7, "iid", seed=2)))


def test_dirichlet_partition_skews_labels():
    parts = partition(TARGETS, 5, "dirichlet", seed=0, alpha=0.1)
    _check_cover(parts, len(TARGETS))
    iid = partition(TARGETS, 5, "iid", seed=0)
    skew = lambda ps: np.mean([np.bincount(TARGETS[p], minlength=10).max() / len(p) for p in ps])  # noqa: E731
    assert skew(parts) > skew(iid) + 0.2


def test_shards_partition_limits_labels_per_client():
    parts = partition(TARGETS, 10, "shards", seed=0, shards_per_client=2)
    _check_cover(parts, len(TARGETS))
    assert all(len(np.unique(TARGETS[p])) <= 2 for p in parts)


def test_partition_errors():
    with pytest.raises(ValueError, match="clients but only"):
        partition(TARGETS[:3], 5, "iid", seed=0)


@pytest.mark.parametrize("size", [(1, 8, 8), (3, 16, 16)])
def test_digits_are_resized_to_the_model_input(size):
    data = load_data(DataConfig(), None, size, num_clients=4, seed=0)
    x, y = data.train[0]
    assert tuple(x.shape) == size and x.dtype == torch.float32
    assert len(data.train) + len(data.test) == 1797 and data.num_classes == 10
    _check_cover(data.partitions, len(data.train))
    assert abs(float(data.train_eval.images.mean())) < 1e-4  # normalised with training statistics


def test_imagefolder_from_tiny_png_files(tmp_path):
    from PIL import Image

    for split in ("train", "test"):
        for label in ("cat", "dog"):
            (tmp_path / split / label).mkdir(parents=True)
            for i in range(3):
                Image.fromarray(np.full((12, 12, 3), 40 * i, dtype=np.uint8)).save(tmp_path / split / label / f"{i}.png")
    cfg = DataConfig(dataset="imagefolder", root=str(tmp_path))
    data = load_data(cfg, tmp_path, (3, 8, 8), num_clients=2, seed=0)
    x, y = data.train[0]
    assert tuple(x.shape) == (3, 8, 8) and data.num_classes == 2 and len(data.test) == 6
    assert sorted(np.concatenate(data.partitions).tolist()) == list(range(6))


@pytest.mark.parametrize("dataset, expected", [
    ("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python"), ("svhn", "train_32x32.mat"),
    ("cinic10", "train/<class>"), ("imagefolder", "train/<class>"),
])
def test_missing_dataset_names_folder_and_files(tmp_path, dataset, expected):
    folder = tmp_path / "nothing-here"
    with pytest.raises(DatasetNotFoundError) as info:
        load_data(DataConfig(dataset=dataset), folder, (3, 32, 32), num_clients=2, seed=0)
    message = str(info.value)
    assert str(folder) in message and expected in message and "\n" not in message


def test_channel_mismatch_is_reported(tmp_path):
    with pytest.raises(ValueError, match="3 channels"):
        load_data(DataConfig(dataset="cifar10"), tmp_path, (1, 32, 32), num_clients=2, seed=0)


def test_cifar10_from_batches_the_test_writes(tmp_path, monkeypatch):
    """The real torchvision CIFAR-10 path on tiny files in the official pickle format (the md5
    check of the official archive is the only thing bypassed)."""
    import pickle

    import torchvision

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [*((f"data_batch_{i}", 4) for i in range(1, 6)), ("test_batch", 5)]:
        data = rng.integers(0, 256, size=(n, 3 * 32 * 32), dtype=np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": [int(v) for v in rng.integers(0, 10, n)]}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: True)
    data = load_data(DataConfig(dataset="cifar10", root=str(tmp_path)), tmp_path, (3, 32, 32), num_clients=4, seed=0)
    assert len(data.train) == 20 and len(data.test) == 5 and data.num_classes == 10
    x, y = data.test[0]
    raw = torch.tensor(pickle.load(open(folder / "test_batch", "rb"))["data"][0], dtype=torch.float32)
    mean = torch.tensor(NORMALIZATION["cifar10"][0]).view(3, 1, 1)
    std = torch.tensor(NORMALIZATION["cifar10"][1]).view(3, 1, 1)
    torch.testing.assert_close(x, (raw.view(3, 32, 32) / 255 - mean) / std)  # no augmentation at test time
    _check_cover(data.partitions, 20)

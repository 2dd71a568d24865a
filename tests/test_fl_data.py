"""Datasets and partitions: digits resizing, folder datasets, missing-data errors, seeded splits."""

import numpy as np
import pytest
import torch

from nefl_zoo.fl.config import DataConfig
from nefl_zoo.data.loading import NORMALIZATION, DatasetNotFoundError, load_data, partition

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


def test_the_digits_test_split_is_fixed_whatever_the_run_seed():
    """The held-out quarter is the same stratified split in every run (sklearn, random_state 0):
    runs of different seeds are evaluated on the same images."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    a = load_data(DataConfig(), None, (1, 8, 8), num_clients=4, seed=0)
    b = load_data(DataConfig(), None, (1, 8, 8), num_clients=4, seed=5)
    assert torch.equal(a.test.images, b.test.images) and torch.equal(a.test.labels, b.test.labels)
    target = load_digits().target
    _, test = train_test_split(np.arange(len(target)), test_size=0.25, stratify=target, random_state=0)
    assert a.test.labels.tolist() == target[test].tolist()


def test_digits_are_read_once_and_a_run_that_changes_its_images_leaves_the_next_run_alone():
    """The digits are parsed once per process into read-only arrays; each run gets its own
    tensors, so one run writing into its images cannot reach another's, and without augmentation
    no transform is made."""
    from sklearn.datasets import load_digits

    from nefl_zoo.data.loading import _digits_arrays

    images, labels = _digits_arrays()
    assert _digits_arrays()[0] is images and not images.flags.writeable and not labels.flags.writeable
    assert np.array_equal(images, load_digits().images) and np.array_equal(labels, load_digits().target)
    first = load_data(DataConfig(augment=False), None, (1, 8, 8), num_clients=4, seed=0)
    kept = first.train.images.clone()
    first.train.images.add_(100.0)
    second = load_data(DataConfig(augment=False), None, (1, 8, 8), num_clients=4, seed=0)
    assert torch.equal(second.train.images, kept) and second.train.transform is None
    with pytest.raises(ValueError, match="read-only"):
        images[0, 0, 0] = 1.0


def test_digits_without_augmentation_load_in_a_fresh_process_without_torchvisions_transforms():
    """A second of imports a Flower node or a Ray worker does not pay: torchvision's transforms
    are imported only where a run crops."""
    import subprocess
    import sys

    code = ("import sys; from nefl_zoo.data.config import DataConfig; from nefl_zoo.data.loading import load_data\n"
            "load_data(DataConfig(augment=False), None, (1, 8, 8), num_clients=2, seed=0)\n"
            "print('torchvision.transforms' in sys.modules)\n"
            "load_data(DataConfig(augment=True), None, (1, 8, 8), num_clients=2, seed=0)\n"
            "print('torchvision.transforms' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]


def test_partitions_follow_the_configs_alpha_and_shards():
    for cfg in (DataConfig(partition="dirichlet", alpha=0.1, shards_per_client=3),
                DataConfig(partition="shards", alpha=0.1, shards_per_client=3)):
        data = load_data(cfg, None, (1, 8, 8), num_clients=6, seed=2)
        expected = partition(data.targets, 6, cfg.partition, 2, 0.1, 3)
        assert all(np.array_equal(p, q) for p, q in zip(data.partitions, expected, strict=True))


def test_an_image_folder_may_name_its_test_split_val(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for label in ("a", "b"):
            (tmp_path / split / label).mkdir(parents=True)
            Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(tmp_path / split / label / "0.png")
    data = load_data(DataConfig(dataset="imagefolder"), tmp_path, (3, 4, 4), num_clients=1, seed=0)
    assert len(data.test) == 2 and data.num_classes == 2


def test_download_is_asked_of_torchvision_for_both_splits(tmp_path, monkeypatch):
    from torchvision import datasets

    calls = []

    def svhn(root, split, download=False):
        calls.append((split, download))
        return datasets.FakeData(size=2, image_size=(3, 8, 8), num_classes=10)

    monkeypatch.setattr(datasets, "SVHN", svhn)
    monkeypatch.setattr(datasets.FakeData, "targets", [0, 1], raising=False)
    load_data(DataConfig(dataset="svhn", download=True), tmp_path, (3, 8, 8), num_clients=1, seed=0)
    assert calls == [("train", True), ("test", True)]


def test_the_appendix_augmentations_are_svhns_jitter_and_the_others_flip():
    """NeFL's appendix: SVHN random crop (padding 2) and colour jitter (brightness 63/255,
    saturation 0.5-1.5, contrast 0.2-1.8); CIFAR-10/100 and CINIC-10 random crop (padding 4) and
    horizontal flip; evaluation: resize and normalise only."""
    from torchvision.transforms import v2

    from nefl_zoo.data.loading import _transforms

    train, plain = _transforms("svhn", (3, 32, 32), True)
    crop, jitter = train.transforms[2], train.transforms[3]
    assert isinstance(crop, v2.RandomCrop) and crop.padding == [2, 2, 2, 2]
    assert isinstance(jitter, v2.ColorJitter) and jitter.brightness == pytest.approx((1 - 63 / 255, 1 + 63 / 255))
    assert jitter.saturation == (0.5, 1.5) and jitter.contrast == (0.2, 1.8) and jitter.hue is None
    train, _ = _transforms("cifar10", (3, 32, 32), True)
    assert [type(t) for t in train.transforms[2:4]] == [v2.RandomCrop, v2.RandomHorizontalFlip] and train.transforms[2].padding == [4, 4, 4, 4]
    assert [type(t) for t in plain.transforms] == [v2.ToImage, v2.Resize, v2.ToDtype, v2.Normalize]
    assert [type(t) for t in _transforms("svhn", (3, 32, 32), False)[0].transforms] == [v2.ToImage, v2.Resize, v2.ToDtype, v2.Normalize]


def test_normalisation_per_channel_for_grey_and_colour_models():
    from nefl_zoo.data.datasets import normalization, per_channel

    assert per_channel(((0.1, 0.2, 0.6), (0.2, 0.4, 0.3)), 1) == (pytest.approx((0.3,)), pytest.approx((0.3,)))
    assert per_channel(((0.5,), (0.25,)), 3) == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert per_channel(((0.1, 0.2, 0.6), (0.2, 0.4, 0.3)), 3) == ((0.1, 0.2, 0.6), (0.2, 0.4, 0.3))  # its own
    assert normalization("cifar10", 3) == NORMALIZATION["cifar10"] and normalization("digits", 1) is None


def test_each_clients_data_is_split_train_val_test_seeded_per_client():
    from nefl_zoo.data.loading import local_split

    parts = [np.arange(10), np.arange(10, 13), np.arange(20, 22)]
    train, holdout = local_split(parts, (0.6, 0.2, 0.2), seed=1)
    assert [(len(t), len(v), len(s)) for t, (v, s) in zip(train, holdout)] == [(6, 2, 2), (1, 1, 1), (1, 0, 1)]
    for part, t, (v, s) in zip(parts, train, holdout):  # disjoint, complete, sorted
        assert sorted([*t, *v, *s]) == part.tolist() and all(list(a) == sorted(a) for a in (t, v, s))
    order = np.random.default_rng([1, 0]).permutation(parts[0])  # client 0's own stream: test first, then val
    assert holdout[0][1].tolist() == sorted(order[:2]) and holdout[0][0].tolist() == sorted(order[2:4])
    again, _ = local_split(parts, (0.6, 0.2, 0.2), seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(train, again))
    with pytest.raises(ValueError) as too_few:
        local_split([np.arange(4), np.arange(1)], (0.6, 0.2, 0.2), seed=1)
    assert str(too_few.value) == "client 1 has 1 sample(s): too few to hold out a test split"

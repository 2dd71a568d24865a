"""The images an export calibrates INT8 tiers on and checks every file with
(nefl_zoo/export/data.py): a run's own training subset and test split, the user's images with
every fourth held out, or seeded random inputs; a run whose data cannot be loaded is a warning."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from nefl_zoo.export import data as export_data
from nefl_zoo.export.data import export_images, load_run_images

DIGITS = {"dataset": "digits", "augment": True, "partition": "dirichlet"}  # as a run's config holds it
SIZE = (1, 8, 8)


def digits_split():
    """scikit-learn's digits split as the data module makes it (stratified, 25 % test, seed 0)."""
    bunch = load_digits()
    train, test = train_test_split(np.arange(len(bunch.target)), test_size=0.25, stratify=bunch.target, random_state=0)
    return train, bunch.target[test]


def test_a_runs_images_are_a_seeded_training_subset_and_the_whole_labelled_test_split():
    train_index, test_labels = digits_split()
    run = load_run_images(DIGITS, SIZE, 50, seed=3)
    assert run.dataset == "digits" and run.train.shape == (50, *SIZE) and run.train.dtype == np.float32
    assert run.test.shape == (len(test_labels), *SIZE) and run.test.dtype == np.float32
    assert np.array_equal(run.labels, test_labels)
    again, other = load_run_images(DIGITS, SIZE, 50, seed=3), load_run_images(DIGITS, SIZE, 50, seed=4)
    assert np.array_equal(again.train, run.train) and not np.array_equal(other.train, run.train)
    whole = load_run_images(DIGITS, SIZE, 10**6)  # more than there are: every training image once
    distinct = len(np.unique(load_digits().images[train_index].reshape(len(train_index), -1), axis=0))
    assert len(whole.train) == len(train_index) and len(np.unique(whole.train.reshape(len(train_index), -1), axis=0)) == distinct
    assert np.array_equal(whole.train, load_run_images(DIGITS, SIZE, 10**6, seed=9).train)  # in their order, whatever the seed


def test_export_images_of_a_run_calibrate_on_its_seed_0_subset_and_check_on_its_test_split():
    images = export_images(DIGITS, SIZE, calibration=None, calibration_source="", train_images=40, warn=pytest.fail)
    run = load_run_images(DIGITS, SIZE, 40, seed=0)
    assert np.array_equal(images.calibration, run.train) and np.array_equal(images.test, run.test)
    assert np.array_equal(images.labels, digits_split()[1])
    assert images.calibration_source == "digits training images without augmentation (seeded subset)"
    assert images.test_source == f"digits test split ({len(run.test)} images)"
    mine = np.zeros((5, *SIZE), np.float32)
    given = export_images(DIGITS, SIZE, calibration=mine, calibration_source="mine.npy", train_images=40, warn=pytest.fail)
    assert given.calibration is mine and given.calibration_source == "mine.npy" and np.array_equal(given.labels, images.labels)


def test_user_images_without_a_run_hold_out_every_fourth_for_the_check():
    calibration = np.arange(9, dtype=np.float32).reshape(9, 1, 1, 1) * np.ones((1, *SIZE), np.float32)
    images = export_images(None, SIZE, calibration=calibration, calibration_source="cal.npy", train_images=40, warn=pytest.fail)
    assert [int(x[0, 0, 0]) for x in images.test] == [3, 7] and images.labels is None
    assert [int(x[0, 0, 0]) for x in images.calibration] == [0, 1, 2, 4, 5, 6, 8]
    assert images.test_source == "every 4th of cal.npy (2 images, held out)" and images.calibration_source == "cal.npy"
    with pytest.raises(ValueError, match=r"^cal\.npy: 3 images; give at least 4$"):
        export_images(None, SIZE, calibration=calibration[:3], calibration_source="cal.npy", train_images=40, warn=pytest.fail)


def test_without_any_images_the_check_uses_64_normal_inputs_of_seed_0():
    images = export_images(None, SIZE, calibration=None, calibration_source="none", train_images=40, warn=pytest.fail)
    assert np.array_equal(images.test, np.random.default_rng(0).standard_normal((64, *SIZE), dtype=np.float32))
    assert images.calibration is None and images.labels is None and images.test_source == "64 random normal inputs (seed 0)"


@pytest.mark.parametrize("error, shown", [(FileNotFoundError("no cifar-10-batches-py in data\nsecond line"), "no cifar-10-batches-py in data"),
                                          (OSError(), "OSError")])
def test_a_run_whose_data_cannot_be_loaded_is_one_warning_and_the_user_images_serve(monkeypatch, error, shown):
    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(export_data, "load_run_images", refuse)
    warnings = []
    images = export_images({"dataset": "cifar10"}, SIZE, calibration=None, calibration_source="none", train_images=40,
                           warn=warnings.append)
    assert warnings == [f"the run's data cannot be loaded ({shown}); accuracy is the run's record"]
    assert images.test_source == "64 random normal inputs (seed 0)"


def test_a_real_load_failure_is_the_warning(tmp_path):
    warnings = []
    export_images({"dataset": "cifar10", "root": str(tmp_path)}, (3, 32, 32), calibration=None, calibration_source="none",
                  train_images=10, warn=warnings.append)
    assert warnings == [f"the run's data cannot be loaded (cifar10 not found in {tmp_path}: expected cifar-10-batches-py/"
                        "data_batch_1..5 and test_batch (or set data.download: true with a network)); accuracy is the run's record"]

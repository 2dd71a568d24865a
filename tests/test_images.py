"""Image files as model input (``nefl_zoo.images``): exact pixels, the channel order, the
normalisation, and a one-line refusal for each bad file or folder."""

import numpy as np
import pytest
from PIL import Image

from nefl_zoo import images


def write(path, array, mode):
    Image.fromarray(np.asarray(array, dtype=np.uint8), mode=mode).save(path)
    return path


def test_a_grey_image_is_one_channel_of_pixels_over_255(tmp_path):
    pixels = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20  # 3 rows, 4 columns
    got = images.load_image(write(tmp_path / "g.png", pixels, "L"), (1, 3, 4))
    assert got.dtype == np.float32 and got.shape == (1, 3, 4)
    np.testing.assert_array_equal(got[0], pixels.astype(np.float32) / 255.0)


def test_a_colour_image_is_channels_first(tmp_path):
    pixels = np.zeros((2, 3, 3), dtype=np.uint8)
    pixels[..., 0], pixels[..., 1], pixels[..., 2] = 10, 20, 30
    pixels[1, 2] = (200, 100, 50)
    got = images.load_image(write(tmp_path / "c.png", pixels, "RGB"), (3, 2, 3))
    assert got.shape == (3, 2, 3)
    np.testing.assert_array_equal(got, pixels.transpose(2, 0, 1).astype(np.float32) / 255.0)


def test_a_wrong_size_or_mode_names_both_and_the_fix(tmp_path):
    grey = write(tmp_path / "g.png", np.zeros((3, 4)), "L")
    with pytest.raises(ValueError) as wrong_size:
        images.load_image(grey, (1, 4, 3))
    assert str(wrong_size.value) == f"{grey}: image is 4x3 L; the model takes 3x4 L (resize/convert it first)"
    with pytest.raises(ValueError) as wrong_mode:
        images.load_image(grey, (3, 3, 4))
    assert str(wrong_mode.value) == f"{grey}: image is 4x3 L; the model takes 4x3 RGB (resize/convert it first)"
    with pytest.raises(ValueError) as no_mode:
        images.load_image(grey, (2, 3, 4))
    assert str(no_mode.value) == f"{grey}: image is 4x3 L; the model takes 4x3 2-channel (resize/convert it first)"


def test_a_file_that_is_no_image_is_one_line(tmp_path):
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    with pytest.raises(ValueError) as refused:
        images.load_image(text, (1, 3, 4))
    assert str(refused.value) == f"{text}: not a readable image (UnidentifiedImageError)"
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(write(tmp_path / "whole.png", np.full((40, 40), 7), "L").read_bytes()[:60])
    with pytest.raises(ValueError, match=r"cut.png: not a readable image \((OSError|SyntaxError)\)$"):
        images.load_image(truncated, (1, 40, 40))


@pytest.mark.parametrize("limit", [10, 5])  # over the limit (PIL warns) and over twice the limit (PIL refuses)
def test_an_image_declaring_too_many_pixels_is_refused_unread(tmp_path, monkeypatch, limit):
    big = write(tmp_path / "big.png", np.zeros((3, 4)), "L")  # 12 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    with pytest.raises(ValueError) as refused:
        images.load_image(big, (1, 3, 4))
    assert str(refused.value) == f"{big}: image declares more pixels than PIL decodes safely; the model takes 4x3"


def test_load_images_stacks_and_normalises_per_channel(tmp_path):
    a = write(tmp_path / "a.png", np.full((2, 2, 3), (51, 102, 153)), "RGB")
    b = write(tmp_path / "b.png", np.full((2, 2, 3), (0, 255, 255)), "RGB")
    raw = images.load_images([a, b], (3, 2, 2), None, None)
    assert raw.dtype == np.float32 and raw.shape == (2, 3, 2, 2)
    np.testing.assert_allclose(raw[:, :, 0, 0], [[0.2, 0.4, 0.6], [0.0, 1.0, 1.0]], rtol=1e-6)
    normalised = images.load_images([a, b], (3, 2, 2), [0.2, 0.5, 0.0], [0.5, 0.25, 2.0])
    assert normalised.dtype == np.float32
    np.testing.assert_allclose(normalised[:, :, 1, 1], [[0.0, -0.4, 0.3], [-0.4, 2.0, 0.5]], rtol=1e-5, atol=1e-6)
    assert images.load_images([a], (3, 2, 2), [0.5, 0.5, 0.5], None)[0, 0, 0, 0] == pytest.approx(0.2)  # std missing: raw


def test_image_files_are_the_images_of_a_folder_sorted(tmp_path):
    for name in ("b.PNG", "a.jpg", "c.webp", "notes.txt", "d.tiff"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "e.png").mkdir()  # a folder named like an image is not one
    assert [p.name for p in images.image_files(tmp_path)] == ["a.jpg", "b.PNG", "c.webp", "d.tiff"]


def test_image_files_refuses_a_file_or_a_folder_without_images(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError) as empty:
        images.image_files(tmp_path)
    assert str(empty.value) == f"{tmp_path}: no image files (.png, .jpg, .jpeg, .bmp, .gif, .tif, .tiff, .webp)"
    with pytest.raises(ValueError) as not_a_folder:
        images.image_files(tmp_path / "notes.txt")
    assert str(not_a_folder.value) == f"{tmp_path / 'notes.txt'}: not a folder (give a folder of image files)"


def test_normalisation_is_float32_arithmetic_as_in_training(tmp_path):
    """``(x - mean) / std`` in float32 throughout, as torch normalises the training images: the
    same bits, not a float64 result rounded once at the end."""
    pixels = np.arange(256, dtype=np.uint8).reshape(16, 16)
    path = write(tmp_path / "ramp.png", pixels, "L")
    got = images.load_images([path], (1, 16, 16), [0.1], [0.3])
    raw = pixels.astype(np.float32) / np.float32(255.0)
    np.testing.assert_array_equal(got[0, 0], (raw - np.float32(0.1)) / np.float32(0.3))

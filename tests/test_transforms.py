"""MONAI image pipelines (fedweigh.data.transforms): file decoding, resizing, intensity, augmentation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from fedweigh.data.transforms import (
    AntialiasedResize,
    Augmentation,
    augment_images,
    file_pipeline,
    load_image_files,
)
from fedweigh.train import augment_batch


def _pil_reference(path, size: int) -> np.ndarray:
    """What the CheXpert loader decoded before the MONAI pipeline: PIL draft + grey + bilinear, / 255."""
    with Image.open(path) as img:
        if img.format == "JPEG":
            img.draft("L", (2 * size, 2 * size))
        grey = img.convert("L").resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(grey, dtype=np.float32) / np.float32(255.0)


def _write_images(tmp_path, suffix: str) -> list:
    """Three 40 x 30 (W x H) images: a horizontal ramp, a vertical ramp, a bright top-left block (RGB)."""
    yy, xx = np.mgrid[0:30, 0:40]
    arrays = [
        (xx * 6).astype(np.uint8),
        (yy * 8).astype(np.uint8),
        np.stack([np.where((yy < 10) & (xx < 15), 220, 30).astype(np.uint8)] * 3, -1),
    ]
    paths = []
    for i, a in enumerate(arrays):
        path = tmp_path / f"img{i}{suffix}"
        Image.fromarray(a).save(path, **({"quality": 95} if suffix == ".jpg" else {}))
        paths.append(path)
    return paths


@pytest.mark.parametrize(("suffix", "tolerance"), [(".png", 0.02), (".jpg", 0.04)])
def test_file_pipeline_matches_the_pil_loader(tmp_path, suffix, tolerance):
    paths = _write_images(tmp_path, suffix)
    images = load_image_files(paths, 16)
    assert images.shape == (3, 1, 16, 16) and images.dtype == np.float32
    assert images.min() >= 0.0 and images.max() <= 1.0
    for image, path in zip(images, paths, strict=True):
        reference = _pil_reference(path, 16)
        assert np.abs(image[0] - reference).max() < tolerance, path.name
    # row-major like PIL: the horizontal ramp grows along the last axis, the block sits top-left
    assert np.all(np.diff(images[0, 0].mean(axis=0)) > 0)
    assert np.allclose(np.diff(images[0, 0].mean(axis=1)), 0, atol=1e-6)
    assert images[2, 0, :3, :3].mean() > images[2, 0, -3:, -3:].mean() + 0.5


def test_cached_dataset_gives_the_same_images(tmp_path):
    paths = _write_images(tmp_path, ".png")
    np.testing.assert_array_equal(load_image_files(paths, 8), load_image_files(paths, 8, cache=True))


def test_minmax_intensity_spans_each_image(tmp_path):
    paths = _write_images(tmp_path, ".png")
    images = load_image_files(paths, 8, intensity="minmax")
    assert np.allclose(images.reshape(3, -1).min(axis=1), 0.0) and np.allclose(
        images.reshape(3, -1).max(axis=1), 1.0
    )


def test_unreadable_file_is_named(tmp_path):
    paths = _write_images(tmp_path, ".png")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    with pytest.raises(OSError, match=r"broken\.png: cannot read image"):
        load_image_files([*paths, tmp_path / "broken.png"], 8)
    with pytest.raises(ValueError, match="intensity must be one of"):
        file_pipeline(8, "percent")


def test_resize_keeps_a_uniform_image_uniform():
    """MONAI's Resize(anti_aliasing=True) would darken the border rows (its Gaussian pads with zeros)."""
    out = AntialiasedResize(8)(torch.full((1, 64, 48), 0.5))
    assert out.shape == (1, 8, 8)
    torch.testing.assert_close(out, torch.full((1, 8, 8), 0.5))


def _previous_augment_batch(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The hand-written augmentation the MONAI spatial transformer replaced."""
    n = x.shape[0]
    shift = (torch.rand(n, 2, generator=generator) * 2 - 1) / 8
    a = 0.9 + 0.2 * torch.rand(n, generator=generator)
    b = -0.05 + 0.1 * torch.rand(n, generator=generator)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = 1.0
    theta[:, 1, 1] = 1.0
    theta[:, :, 2] = shift
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    moved = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return (a.view(n, 1, 1, 1) * moved + b.view(n, 1, 1, 1)).clamp(0.0, 1.0)


def test_default_augmentation_is_the_previous_one():
    x = torch.rand(6, 1, 20, 24, generator=torch.Generator().manual_seed(3))
    got = augment_batch(x, torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        got, _previous_augment_batch(x, torch.Generator().manual_seed(0)), rtol=0, atol=1e-6
    )
    assert not torch.allclose(got, x)  # it does change the images


def test_augmentation_options():
    x = torch.rand(4, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    none = Augmentation(translate=0.0, scale=0.0, shift=0.0)
    torch.testing.assert_close(
        augment_images(x, torch.Generator().manual_seed(0), none), x, rtol=0, atol=1e-6
    )
    flip = Augmentation(translate=0.0, scale=0.0, shift=0.0, flip_prob=1.0)
    torch.testing.assert_close(
        augment_images(x, torch.Generator().manual_seed(0), flip), x.flip(-1), rtol=0, atol=1e-6
    )
    turned = augment_images(x, torch.Generator().manual_seed(0), Augmentation(translate=0.0, rotate_deg=30.0))
    assert not torch.allclose(turned, augment_images(x, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=r"Augmentation.flip_prob must be a number in \[0, 1\], got 2"):
        Augmentation(flip_prob=2)


def test_worker_processes_give_the_same_images(tmp_path):
    paths = _write_images(tmp_path, ".jpg")
    np.testing.assert_array_equal(load_image_files(paths, 8, workers=1), load_image_files(paths, 8))

"""MONAI image pipelines: loading, grey conversion, resizing, intensity scaling and augmentation.

The file loaders (CheXpert, a folder of images with a CSV) read through :func:`file_pipeline` and
:func:`load_image_files` (a MONAI ``Dataset`` or ``CacheDataset`` with ``DataLoader`` workers);
training augmentation (:func:`augment_images`, the ``augment`` client option) shifts (and, when
asked, rotates and flips) each image with MONAI's batched spatial transformer and scales and offsets
its intensity.

Images come out as float32 (1, size, size) in [0, 1], row-major like PIL's ``np.asarray`` (MONAI's
image readers put the first pixel axis first; the pipeline swaps it back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

__all__ = [
    "INTENSITIES",
    "AntialiasedResize",
    "Augmentation",
    "GreyDraft",
    "augment_images",
    "file_pipeline",
    "load_image_files",
]

Intensity = Literal["uint8", "minmax"]
INTENSITIES: tuple[str, ...] = ("uint8", "minmax")


class GreyDraft:
    """PIL converter for MONAI's ``PILReader``: JPEG DCT-domain down-scaling to about 2 x ``size``
    (much faster decoding of large radiographs), then one grey channel (``L``)."""

    def __init__(self, size: int) -> None:
        self.size = int(size)

    def __call__(self, image):
        if getattr(image, "format", None) == "JPEG":
            image.draft("L", (2 * self.size, 2 * self.size))
        return image.convert("L") if image.mode not in ("L", "I", "I;16", "F") else image


class AntialiasedResize:
    """Bilinear resize to ``size`` x ``size`` with antialiasing (``torch`` ``interpolate(antialias=True)``,
    the triangle filter widened when down-sampling, as PIL's bilinear resize does) of a (C, H, W) or
    (N, C, H, W) tensor. Used instead of MONAI's ``Resize(anti_aliasing=True)``, whose Gaussian
    pre-filter pads with zeros and darkens the border rows of every image."""

    def __init__(self, size: int) -> None:
        self.size = int(size)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        x = torch.as_tensor(image, dtype=torch.float32)
        if tuple(x.shape[-2:]) == (self.size, self.size):
            return x
        batched = x if x.dim() == 4 else x[None]
        out = F.interpolate(
            batched, size=(self.size, self.size), mode="bilinear", align_corners=False, antialias=True
        )
        return out if x.dim() == 4 else out[0]


def _grey(image: torch.Tensor) -> torch.Tensor:
    """Average the channels of a channel-first image to one."""
    return image.mean(dim=0, keepdim=True) if image.shape[0] > 1 else image


def _row_major(image: torch.Tensor) -> torch.Tensor:
    return image.transpose(-1, -2)


def file_pipeline(size: int, intensity: Intensity = "uint8", *, dicom: bool = False):
    """MONAI transforms from an image file to float32 (1, size, size) in [0, 1].

    ``LoadImage`` (PIL with JPEG draft decoding; pydicom for DICOM), ``EnsureChannelFirst``, grey,
    :class:`AntialiasedResize`, then ``intensity``: ``"uint8"`` maps 0..255 to 0..1 (8-bit
    PNG / JPEG, the values PIL gives / 255), ``"minmax"`` scales each image's own range to 0..1
    (DICOM and 16-bit images).
    """
    from monai.data import PILReader
    from monai.transforms import (
        Compose,
        EnsureChannelFirst,
        EnsureType,
        Lambda,
        LoadImage,
        ScaleIntensity,
        ScaleIntensityRange,
    )

    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive number of pixels, got {size!r}")
    if intensity not in INTENSITIES:
        raise ValueError(f"intensity must be one of {INTENSITIES}, got {intensity!r}")
    reader = None if dicom else PILReader(converter=GreyDraft(size))
    scale = (
        ScaleIntensityRange(a_min=0.0, a_max=255.0, b_min=0.0, b_max=1.0, clip=True)
        if intensity == "uint8"
        else ScaleIntensity(minv=0.0, maxv=1.0)
    )
    return Compose(
        [
            LoadImage(reader=reader, image_only=True, dtype=np.float32),
            EnsureChannelFirst(),
            Lambda(_grey),
            Lambda(AntialiasedResize(size)),
            scale,
            Lambda(_row_major),
            EnsureType(data_type="tensor", dtype=torch.float32, track_meta=False),
        ]
    )


def load_image_files(
    paths: Sequence[str | Path],
    size: int,
    *,
    intensity: Intensity = "uint8",
    workers: int = 0,
    cache: bool = False,
    batch_size: int = 64,
) -> np.ndarray:
    """Read image files through :func:`file_pipeline` into float32 (N, 1, size, size).

    A MONAI ``Dataset`` (``cache=True``: ``CacheDataset``, which keeps the decoded images for a
    second pass) read by a MONAI ``DataLoader`` with ``workers`` processes. Raises ``OSError``
    naming the first file that could not be read.
    """
    from monai.data import CacheDataset, DataLoader, Dataset

    paths = [str(p) for p in paths]
    if not paths:
        return np.zeros((0, 1, size, size), np.float32)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be an integer >= 0, got {workers!r}")
    dicom = any(Path(p).suffix.lower() in (".dcm", ".dicom") for p in paths)
    transform = file_pipeline(size, intensity, dicom=dicom)
    dataset = (
        CacheDataset(data=paths, transform=transform, num_workers=workers or None, progress=False)
        if cache
        else Dataset(data=paths, transform=transform)
    )
    out = np.empty((len(paths), 1, size, size), np.float32)
    done = 0
    try:
        for batch in DataLoader(dataset, batch_size=batch_size, num_workers=workers):
            array = np.asarray(batch.detach().cpu().numpy(), np.float32)
            out[done : done + len(array)] = array
            done += len(array)
    except Exception as e:  # find and name the file of the failed batch the pipeline cannot read
        for path in paths[done : done + batch_size]:
            try:
                transform(path)
            except Exception as inner:
                raise OSError(f"{path}: cannot read image ({_root_cause(inner)})") from e
        raise OSError(f"{paths[min(done, len(paths) - 1)]}: cannot read image ({_root_cause(e)})") from e
    return out


def _root_cause(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class Augmentation:
    """Label-preserving training augmentation of a batch, drawn per image.

    translate: largest shift as a fraction of the side (border pixels replicated).
    rotate_deg: largest rotation in degrees (0: none).
    scale, shift: intensity ``x' = clip(a * x + b, 0, 1)`` with a ~ U(1 - scale, 1 + scale),
        b ~ U(-shift, shift).
    flip_prob: probability of a left/right flip (default 0: laterality matters on chest X-rays).
    """

    translate: float = 1 / 16
    rotate_deg: float = 0.0
    scale: float = 0.1
    shift: float = 0.05
    flip_prob: float = 0.0

    def __post_init__(self) -> None:
        for name, value, high in (
            ("translate", self.translate, 0.5),
            ("rotate_deg", self.rotate_deg, 180.0),
            ("scale", self.scale, 1.0),
            ("shift", self.shift, 1.0),
            ("flip_prob", self.flip_prob, 1.0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
                raise ValueError(f"Augmentation.{name} must be a number in [0, {high:g}], got {value!r}")


def augment_images(
    x: torch.Tensor, generator: torch.Generator, augmentation: Augmentation | None = None
) -> torch.Tensor:
    """``augmentation`` (default :class:`Augmentation`) applied to a batch (N, C, H, W) in [0, 1].

    The geometric part runs as one batched resampling by MONAI's spatial-transformer layer
    (``monai.networks.layers.AffineTransform``, bilinear, border padding), which is far faster than
    per-image ``RandAffine`` on training batches. All random draws come from ``generator`` (CPU), so
    a seeded generator repeats the same augmented batches.
    """
    from monai.networks.layers import AffineTransform

    aug = augmentation or Augmentation()
    n = x.shape[0]
    # normalised coordinates span 2 per side: a shift of f * side is 2 f
    shift = (torch.rand(n, 2, generator=generator) * 2 - 1) * (2 * aug.translate)
    a = (1 - aug.scale) + 2 * aug.scale * torch.rand(n, generator=generator)
    b = -aug.shift + 2 * aug.shift * torch.rand(n, generator=generator)
    theta = torch.zeros(n, 2, 3)
    if aug.rotate_deg > 0:
        angle = torch.deg2rad((torch.rand(n, generator=generator) * 2 - 1) * aug.rotate_deg)
        theta[:, 0, 0], theta[:, 0, 1] = torch.cos(angle), -torch.sin(angle)
        theta[:, 1, 0], theta[:, 1, 1] = torch.sin(angle), torch.cos(angle)
    else:
        theta[:, 0, 0] = 1.0
        theta[:, 1, 1] = 1.0
    theta[:, :, 2] = shift
    resample = AffineTransform(
        normalized=True, mode="bilinear", padding_mode="border", align_corners=False, reverse_indexing=False
    )
    moved = resample(x, theta.to(device=x.device, dtype=x.dtype))
    if aug.flip_prob > 0:
        flip = (torch.rand(n, generator=generator) < aug.flip_prob).to(x.device)
        moved = torch.where(flip.view(n, 1, 1, 1), moved.flip(-1), moved)
    a = a.to(device=x.device, dtype=x.dtype).view(n, 1, 1, 1)
    b = b.to(device=x.device, dtype=x.dtype).view(n, 1, 1, 1)
    return (a * moved + b).clamp(0.0, 1.0)

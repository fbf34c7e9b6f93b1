"""ChestMNIST and the other 2-D MedMNIST / MedMNIST+ sets, read from their ``.npz`` files.

The MedMNIST format (Yang et al., "MedMNIST v2", Scientific Data 2023) is one ``.npz`` archive with
the keys ``train_images``, ``train_labels``, ``val_images``, ``val_labels``, ``test_images`` and
``test_labels``. Images are ``uint8`` of shape (N, H, W) (grey) or (N, H, W, 3) (colour), at
28, 64, 128 or 224 pixels (MedMNIST+ ships ``chestmnist_64.npz`` etc.). Labels are ``uint8``: (N, 14)
0/1 for ChestMNIST (multi-label, the 14 ChestX-ray14 findings) and (N, 1) class indices for the
multi-class sets. Nothing is downloaded: the user points at a file already on disk.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from fedweigh.data.base import CHEST_FINDINGS, LabeledImages, Task
from fedweigh.errors import DatasetFormatError

SPLITS: tuple[str, ...] = ("train", "val", "test")

#: ITU-R BT.601 luma weights, used to turn colour MedMNIST images into one grey channel.
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)

#: Images converted per step, which bounds the float32 working memory at large resolutions.
_CHUNK = 4096


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """Resize float32 (N, C, H, W) images to (N, C, size, size), bilinear with antialiasing, in [0, 1].

    The resize of the file loaders' MONAI pipeline (:class:`fedweigh.data.transforms.AntialiasedResize`,
    ``torch.nn.functional.interpolate(mode="bilinear", antialias=True)``); antialiasing low-pass
    filters before down-sampling so that 224 -> 32 px does not alias.
    """
    if size <= 0:
        raise ValueError(f"size must be a positive number of pixels, got {size}")
    if images.shape[-2:] == (size, size):
        return np.ascontiguousarray(images, dtype=np.float32)
    import torch

    from fedweigh.data.transforms import AntialiasedResize

    with torch.no_grad():
        out = AntialiasedResize(size)(torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)))
    return np.clip(out.numpy(), 0.0, 1.0).astype(np.float32, copy=False)


def _check_images(raw: np.ndarray, where: str) -> tuple[bool, float]:
    """Validate one split's images; returns (is colour, divisor that maps values to [0, 1])."""
    if raw.ndim == 4 and raw.shape[-1] == 3:
        colour = True
    elif raw.ndim == 3:
        colour = False
    else:
        raise DatasetFormatError(
            f"{where}: images must have shape (N, H, W) or (N, H, W, 3), got {raw.shape} "
            "(3-D MedMNIST volumes are not supported)"
        )
    if raw.dtype == np.uint8:
        return colour, 255.0
    if np.issubdtype(raw.dtype, np.floating):
        if raw.size and (np.isnan(raw).any() or raw.min() < 0.0 or raw.max() > 1.0):
            raise DatasetFormatError(f"{where}: floating-point images must lie in [0, 1]")
        return colour, 1.0
    raise DatasetFormatError(f"{where}: images must be uint8 (or float in [0, 1]), got dtype {raw.dtype}")


def _images_to_float(raw: np.ndarray, size: int | None, colour: bool, divisor: float) -> np.ndarray:
    """uint8 (N, H, W) or (N, H, W, 3) -> float32 (N, 1, H', W') in [0, 1], converted in chunks."""
    n, h, w = raw.shape[0], raw.shape[1], raw.shape[2]
    out_h, out_w = (h, w) if size is None else (size, size)
    out = np.empty((n, 1, out_h, out_w), dtype=np.float32)
    for start in range(0, n, _CHUNK):
        chunk = raw[start : start + _CHUNK].astype(np.float32) / np.float32(divisor)
        chunk = (chunk @ _LUMA)[:, None] if colour else chunk[:, None]
        out[start : start + _CHUNK] = chunk if size is None else resize_images(chunk, size)
    return out


def _infer_task(labels: dict[str, np.ndarray]) -> Task:
    """Multi-label when labels are (N, C) with C > 1, multi-class when (N,) or (N, 1)."""
    first = next(iter(labels.values()))
    return "multilabel" if first.ndim == 2 and first.shape[1] > 1 else "multiclass"


def _check_labels(raw: np.ndarray, task: Task, where: str) -> np.ndarray:
    """Validate one split's labels and convert them to the LabeledImages convention."""
    if not (np.issubdtype(raw.dtype, np.integer) or np.issubdtype(raw.dtype, np.floating)):
        raise DatasetFormatError(f"{where}: labels must be numeric, got dtype {raw.dtype}")
    if raw.size and np.issubdtype(raw.dtype, np.floating) and not np.isfinite(raw).all():
        raise DatasetFormatError(f"{where}: labels contain NaN or infinite values")
    if task == "multiclass":
        if not (raw.ndim == 1 or (raw.ndim == 2 and raw.shape[1] == 1)):
            raise DatasetFormatError(
                f"{where}: multi-class labels must have shape (N,) or (N, 1), got {raw.shape}"
            )
        flat = raw.reshape(-1)
        if flat.size and (flat.min() < 0 or not np.array_equal(flat, np.round(flat))):
            raise DatasetFormatError(f"{where}: multi-class labels must be non-negative integers")
        return flat.astype(np.int64)
    if raw.ndim == 1:
        raw = raw[:, None]
    if raw.ndim != 2:
        raise DatasetFormatError(f"{where}: multi-label labels must have shape (N, C), got {raw.shape}")
    if raw.size and not np.isin(raw, (0, 1)).all():
        raise DatasetFormatError(f"{where}: multi-label labels must be 0 or 1")
    return raw.astype(np.float32)


def _read_archive(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(images, labels) per split of the MedMNIST archive ``path``, read without pickle."""
    if not path.is_file():
        raise FileNotFoundError(f"MedMNIST file not found: {path}")
    with open(path, "rb") as fh:
        head = fh.read(6)
    if not head.startswith((b"PK", b"\x93NUMPY")):  # a zip (.npz) or an .npy; numpy would call it pickle
        raise DatasetFormatError(
            f"{path}: not an .npz archive (a zip file starts with 'PK', this one with {head[:2]!r}): the "
            "file is corrupt or of another format; copy or download the MedMNIST .npz again"
        )
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise DatasetFormatError(
            f"{path}: a damaged .npz archive ({exc}); copy or download the MedMNIST .npz again"
        ) from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DatasetFormatError(
            f"{path}: is a single .npy array, expected an .npz archive with MedMNIST keys"
        )
    with archive:
        expected = [f"{s}_{kind}" for s in SPLITS for kind in ("images", "labels")]
        missing = [k for k in expected if k not in archive.files]
        if missing:
            raise DatasetFormatError(
                f"{path}: missing keys {missing} (found {sorted(archive.files)}); a MedMNIST archive has "
                f"{expected}"
            )
        try:
            raw_labels = {s: archive[f"{s}_labels"] for s in SPLITS}
            raw_images = {s: archive[f"{s}_images"] for s in SPLITS}
        except ValueError as exc:  # object arrays need pickle, which we refuse
            raise DatasetFormatError(f"{path}: cannot read arrays ({exc})") from exc
    return raw_images, raw_labels


def _class_names(
    path: Path, labels: dict[str, np.ndarray], task: Task, class_names: tuple[str, ...] | None
) -> tuple[str, ...]:
    """``class_names``, or the default names (module docstring), checked against the number of classes."""
    if task == "multilabel":
        num_classes = labels["train"].shape[1]
        if num_classes == len(CHEST_FINDINGS):
            default = CHEST_FINDINGS
        else:
            default = tuple(f"finding_{i}" for i in range(num_classes))
    else:
        num_classes = 1 + max((int(labels[s].max()) for s in SPLITS if labels[s].size), default=0)
        default = tuple(str(i) for i in range(num_classes))
    names = tuple(class_names) if class_names is not None else default
    if len(names) != num_classes:
        raise ValueError(f"{path}: {len(names)} class names given for {num_classes} classes")
    return names


def load_medmnist_npz(
    path: str | Path,
    size: int | None = None,
    task: Task | None = None,
    class_names: tuple[str, ...] | None = None,
) -> dict[str, LabeledImages]:
    """Read a MedMNIST / MedMNIST+ ``.npz`` into {"train", "val", "test"} LabeledImages.

    Images become grey float32 (N, 1, H, W) = uint8 / 255 (colour sets: BT.601 luma), optionally
    resized to ``size`` x ``size``. ``task`` is inferred from the label shape unless given: (N, C > 1)
    is multi-label (ChestMNIST), (N,) / (N, 1) multi-class. ``class_names`` defaults to the 14
    ChestMNIST findings for 14-column multi-label files, else "0", "1", ... (multi-class, one per
    class up to the largest label in any split) or "finding_0", ... (multi-label).

    Raises FileNotFoundError for a missing file and DatasetFormatError (a ValueError) naming the file
    and the problem for anything that is not a MedMNIST-layout archive.
    """
    path = Path(path)
    raw_images, raw_labels = _read_archive(path)
    for s in SPLITS:
        if raw_images[s].shape[0] != raw_labels[s].shape[0]:
            raise DatasetFormatError(
                f"{path}: {s}_images has {raw_images[s].shape[0]} rows but {s}_labels has "
                f"{raw_labels[s].shape[0]}"
            )
    if task is None:
        task = _infer_task(raw_labels)
    elif task not in ("multilabel", "multiclass"):
        raise ValueError(f"task must be 'multilabel' or 'multiclass', got {task!r}")
    labels = {s: _check_labels(raw_labels[s], task, f"{path} [{s}_labels]") for s in SPLITS}
    widths = {labels[s].shape[1] for s in SPLITS} if task == "multilabel" else set()
    if len(widths) > 1:
        raise DatasetFormatError(f"{path}: splits disagree on the number of label columns: {sorted(widths)}")

    names = _class_names(path, labels, task, class_names)
    formats = {s: _check_images(raw_images[s], f"{path} [{s}_images]") for s in SPLITS}
    shapes = {raw_images[s].shape[1:] for s in SPLITS}
    if len(shapes) > 1:
        raise DatasetFormatError(f"{path}: splits disagree on the image shape: {sorted(shapes)}")
    out: dict[str, LabeledImages] = {}
    for s in SPLITS:
        images = _images_to_float(raw_images[s], size, *formats[s])
        out[s] = LabeledImages(
            images=images,
            labels=labels[s],
            class_names=names,
            task=task,
            meta={"source": str(path), "split": s},
        )
    return out

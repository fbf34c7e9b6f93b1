"""A folder of images (PNG, JPEG, DICOM) with a CSV of labels, read through MONAI's image pipeline.

The dataset ``images_csv``: ``data_path`` names the CSV file; each row names one image (a path
relative to the CSV's folder, or to ``image_root``) and its labels. Loader options:

* ``label_columns`` (required): the label columns. With ``task="multilabel"`` (default) each is one
  finding with entries 1/0 (blank = 0); with ``task="multiclass"`` give one column holding the class
  index (0..K-1) and ``class_names`` (the K names).
* ``image_column`` (default ``"path"``): the column with the image paths.
* ``split_column`` (optional): rows whose entry is ``test`` form the global test set; without it, a
  stratified-by-seed ``test_fraction`` (default 0.2) of the rows is held out.
* ``image_root``: the folder the image paths are relative to (default: the CSV's folder).
* ``workers`` (default 0): processes decoding images (MONAI ``DataLoader`` workers).

MONAI's image pipeline (:func:`fedweigh.data.transforms.file_pipeline`) loads each image (PIL for
PNG/JPEG, as grey; pydicom for DICOM: ``pip install fedweigh[dicom]``), puts its channel first,
resizes it to ``size`` x ``size`` (bilinear, antialiased) and scales each image's own intensity range
to [0, 1]. A site names the dataset in its ``local/fedweigh_site.json``::

    {"dataset": "images_csv", "data_path": "/data/cxr/labels.csv", "size": 64,
     "loader_options": {"label_columns": ["Effusion", "Edema"], "split_column": "split"}}
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedweigh.data.base import LabeledImages
from fedweigh.data.transforms import load_image_files
from fedweigh.errors import FolderFormatError

DATASET = "images_csv"
DICOM_SUFFIXES = (".dcm", ".dicom")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", *DICOM_SUFFIXES)
LOADER_OPTIONS = (
    "label_columns",
    "task",
    "class_names",
    "image_column",
    "split_column",
    "test_fraction",
    "image_root",
    "workers",
)


def check_options(options: dict, source: str) -> None:
    """Check the loader options of ``images_csv`` (raises :class:`fedweigh.checks.ConfigError`)."""
    from fedweigh.errors import ConfigError

    unknown = sorted(set(options) - set(LOADER_OPTIONS))
    if unknown:
        raise ConfigError(source, "loader_options", options, f"{DATASET} takes {', '.join(LOADER_OPTIONS)}")
    cols = options.get("label_columns")
    if not isinstance(cols, list) or not cols or not all(isinstance(c, str) and c for c in cols):
        raise ConfigError(
            source, "loader_options.label_columns", cols, "a non-empty list of the CSV's label column names"
        )
    task = options.get("task", "multilabel")
    if task not in ("multilabel", "multiclass"):
        raise ConfigError(source, "loader_options.task", task, "choose one of multilabel, multiclass")
    if task == "multiclass":
        names = options.get("class_names")
        if len(cols) != 1:
            raise ConfigError(source, "loader_options.label_columns", cols, "multiclass reads one column")
        if not isinstance(names, list) or len(names) < 2:
            raise ConfigError(source, "loader_options.class_names", names, "a list of 2 or more class names")
    fraction = options.get("test_fraction", 0.2)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError(source, "loader_options.test_fraction", fraction, "a number in (0, 1)")
    workers = options.get("workers", 0)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(source, "loader_options.workers", workers, "an integer >= 0")


def class_names_of(options: dict) -> tuple[str, ...]:
    """The class names the options define (label columns, or ``class_names`` for multiclass)."""
    if options.get("task", "multilabel") == "multiclass":
        return tuple(options.get("class_names") or ())
    return tuple(options.get("label_columns") or ())


def _read_rows(csv_path: Path, columns: Sequence[str]) -> list[dict[str, str]]:
    if not csv_path.is_file():
        raise FolderFormatError(f"{csv_path}: no such CSV file")
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in columns if c not in header]
        if missing:
            raise FolderFormatError(f"{csv_path}: column(s) {missing} not found; the CSV has {header}")
        rows = list(reader)
    if not rows:
        raise FolderFormatError(f"{csv_path}: no data rows")
    return rows


def _label(csv_path: Path, line: int, column: str, text: str) -> float:
    text = (text or "").strip()
    if text == "":
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise FolderFormatError(
            f"{csv_path}, line {line}, column {column!r}: label {text!r} is not a number"
        ) from None
    if not math.isfinite(value):
        raise FolderFormatError(f"{csv_path}, line {line}, column {column!r}: label {text!r} is not finite")
    return value


def _decode_all(paths: list[Path], size: int, workers: int) -> np.ndarray:
    try:
        return load_image_files(paths, size, intensity="minmax", workers=workers)
    except OSError as e:  # names the image MONAI could not read
        raise FolderFormatError(f"MONAI could not read an image: {e}") from e


def _image_path(csv_path: Path, line: int, root: Path, image_column: str, row: dict) -> Path:
    """The image file of one CSV row: it exists and is a PNG, JPEG or DICOM file (pydicom installed)."""
    rel = (row[image_column] or "").strip()
    path = root / rel
    if not rel or not path.is_file():
        raise FolderFormatError(
            f"{csv_path}, line {line}, column {image_column!r}: image {str(path)!r} not found"
        )
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise FolderFormatError(
            f"{csv_path}, line {line}: {path.name} is not a PNG, JPEG or DICOM file ({', '.join(IMAGE_SUFFIXES)})"
        )
    if path.suffix.lower() in DICOM_SUFFIXES:
        try:
            import pydicom  # noqa: F401
        except ImportError:
            raise FolderFormatError(
                f"{csv_path}, line {line}: {path.name} is DICOM; install pydicom (pip install fedweigh[dicom])"
            ) from None
    return path


def _checked_labels(
    csv_path: Path,
    y: np.ndarray,
    task: str,
    label_columns: Sequence[str],
    class_names: Sequence[str] | None,
) -> tuple[np.ndarray, tuple[str, ...]]:
    """(labels, class names): class indices 0..K-1 (multi-class, first label column) or 0/1 per column
    (multi-label); FolderFormatError naming the line and column of the first bad label."""
    if task == "multiclass":
        k = len(class_names or ())
        bad = np.flatnonzero((y[:, 0] != np.round(y[:, 0])) | (y[:, 0] < 0) | (y[:, 0] >= k))
        if bad.size:
            raise FolderFormatError(
                f"{csv_path}, line {int(bad[0]) + 2}, column {label_columns[0]!r}: class {y[bad[0], 0]:g} "
                f"is not an index 0..{k - 1}"
            )
        return y[:, 0].astype(np.int64), tuple(class_names or ())
    bad = np.argwhere((y != 0) & (y != 1))
    if bad.size:
        r, c = bad[0]
        raise FolderFormatError(
            f"{csv_path}, line {int(r) + 2}, column {label_columns[c]!r}: label {y[r, c]:g} is not 0 or 1"
        )
    return y, tuple(label_columns)


def _test_rows(
    csv_path: Path, rows: list[dict], split_column: str | None, test_fraction: float, seed: int
) -> np.ndarray:
    """Which rows are test rows: ``split_column`` says ``test``, or a seeded draw of ``test_fraction``
    of them; FolderFormatError when no training or no test row is left."""
    if split_column:
        is_test = np.array([(row[split_column] or "").strip().lower() == "test" for row in rows])
    else:
        rng = np.random.default_rng([seed, 7])
        is_test = np.zeros(len(rows), bool)
        is_test[rng.permutation(len(rows))[: max(1, int(round(test_fraction * len(rows))))]] = True
    if is_test.all() or not is_test.any():
        raise FolderFormatError(f"{csv_path}: the split leaves no training or no test rows")
    return is_test


def load_images_csv(
    csv_path: str | Path,
    size: int = 32,
    seed: int = 0,
    num_images: int | None = None,
    *,
    label_columns: Sequence[str],
    task: str = "multilabel",
    class_names: Sequence[str] | None = None,
    image_column: str = "path",
    split_column: str | None = None,
    test_fraction: float = 0.2,
    image_root: str | None = None,
    workers: int = 0,
) -> tuple[LabeledImages, LabeledImages]:
    """(training pool, test set) from a CSV of image paths and labels (module docstring)."""
    csv_path = Path(csv_path)
    options = {
        "label_columns": list(label_columns),
        "task": task,
        "test_fraction": test_fraction,
        "workers": workers,
    }
    if class_names is not None:
        options["class_names"] = list(class_names)
    check_options(options, f"{DATASET} loader options for {csv_path}")
    columns = [image_column, *label_columns] + ([split_column] if split_column else [])
    rows = _read_rows(csv_path, columns)
    root = Path(image_root) if image_root else csv_path.parent
    paths: list[Path] = []
    labels: list[list[float]] = []
    for line, row in enumerate(rows, start=2):
        paths.append(_image_path(csv_path, line, root, image_column, row))
        labels.append([_label(csv_path, line, c, row[c]) for c in label_columns])
    y = np.asarray(labels, dtype=np.float32)
    y_out, names = _checked_labels(csv_path, y, task, label_columns, class_names)
    is_test = _test_rows(csv_path, rows, split_column, test_fraction, seed)
    train_rows = np.flatnonzero(~is_test)
    if num_images is not None:
        train_rows = np.sort(np.random.default_rng([seed, 5]).permutation(train_rows)[:num_images])
    rows_needed = np.concatenate([train_rows, np.flatnonzero(is_test)])
    images = _decode_all([paths[i] for i in rows_needed], size, workers)
    n = len(train_rows)
    meta = {"source": str(csv_path)}

    def part(index: np.ndarray, imgs: np.ndarray) -> LabeledImages:
        return LabeledImages(images=imgs, labels=y_out[index], class_names=names, task=task, meta=dict(meta))

    return part(train_rows, images[:n]), part(np.flatnonzero(is_test), images[n:])

"""The dataset registry: each dataset's facts and its training pool plus global test set.

Datasets: ``synthcxr`` (embedded, generated), ``chestmnist`` (a MedMNIST ``.npz``), ``chexpert``
(csv + images) and ``digits`` (scikit-learn). :func:`load_pool` returns a dataset's training pool
(what the scenarios partition, :mod:`fedweigh.data.scenarios`) and its global test set.
"""

from __future__ import annotations

import difflib
import inspect
import re
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.model_selection import train_test_split

from fedweigh.data.base import CHEST_FINDINGS, LabeledImages
from fedweigh.data.chestmnist import load_medmnist_npz
from fedweigh.data.chexpert import CHEXPERT_FINDINGS, load_chexpert
from fedweigh.data.digits import DIGIT_CLASSES, load_digits_dataset
from fedweigh.data.synthcxr import load_synthcxr
from fedweigh.errors import ConfigError

#: Known dataset names, in the order the CLI lists them.
DATASETS: tuple[str, ...] = ("synthcxr", "chestmnist", "chexpert", "digits", "images_csv")

#: SynthCXR pool size when ``num_images`` is not given; its test set has a fifth as many images.
SYNTHCXR_DEFAULT_IMAGES = 20_000

#: The fraction of scikit-learn's digits held out (stratified) as the global test set.
DIGITS_TEST_FRACTION = 0.2

_INFO: dict[str, dict[str, Any]] = {
    "synthcxr": {
        "task": "multilabel",
        "class_names": CHEST_FINDINGS,
        "needs_data_path": False,
        "description": "embedded synthetic chest radiographs, 14 ChestMNIST findings (docs/synthcxr.md)",
    },
    "chestmnist": {
        "task": "multilabel",
        "class_names": CHEST_FINDINGS,
        "needs_data_path": True,
        "description": "ChestMNIST / MedMNIST+ .npz (train+val pooled for the sites, test split as test)",
    },
    "chexpert": {
        "task": "multilabel",
        "class_names": CHEXPERT_FINDINGS,
        "needs_data_path": True,
        "description": "CheXpert train.csv for the sites, valid.csv as test (U-Ones by default)",
    },
    "digits": {
        "task": "multiclass",
        "class_names": DIGIT_CLASSES,
        "needs_data_path": False,
        "description": "scikit-learn digits (1797 images, 8x8 up-sampled), 20% stratified test hold-out",
    },
    "images_csv": {
        "task": "multilabel",
        "class_names": (),
        "needs_data_path": True,
        "description": "your folder of PNG/JPEG/DICOM images with a CSV of labels (MONAI transforms); "
        "classes from loader_options.label_columns",
    },
}

_DATA_PATH_HINT = {
    "images_csv": "the CSV file naming the images and their labels",
    "chestmnist": "the ChestMNIST .npz file (e.g. chestmnist_64.npz) or the folder holding it",
    "chexpert": "the CheXpert folder holding train.csv and valid.csv (e.g. .../CheXpert-v1.0-small)",
}


def _check_dataset(name: str) -> None:
    if name not in _INFO:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")


def dataset_info(name: str) -> dict[str, Any]:
    """Task, class names and whether a data path is needed, for dataset ``name``.

    For ``chestmnist`` this describes ChestMNIST itself; another MedMNIST file gets its task and
    classes from the file (see :func:`load_medmnist_npz`).
    """
    _check_dataset(name)
    info = dict(_INFO[name])
    info["name"] = name
    info["num_classes"] = len(info["class_names"])
    return info


def dataset_classes(name: str, loader_options: dict | None = None) -> tuple[str, ...]:
    """The class names of ``name`` as loaded with ``loader_options`` (``images_csv``: from its options)."""
    if name == "images_csv":
        from fedweigh.data.folder import class_names_of

        return class_names_of(loader_options or {})
    return tuple(dataset_info(name)["class_names"])


def find_medmnist_file(path: str | Path, size: int, stem: str = "chestmnist") -> Path:
    """``path`` itself if it is a file; in a folder, the ``{stem}[_RES].npz`` whose resolution
    (28 when unsuffixed) equals ``size``, else the smallest above it, else the largest."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"MedMNIST file or folder not found: {path}")
    found: dict[int, Path] = {}
    for f in sorted(path.glob(f"{stem}*.npz")):
        match = re.fullmatch(rf"{re.escape(stem)}(?:_(\d+))?\.npz", f.name)
        if match:
            found[int(match.group(1) or 28)] = f
    if not found:
        raise FileNotFoundError(f"no {stem}.npz or {stem}_<size>.npz in folder {path}")
    above = [r for r in found if r >= size]
    return found[min(above)] if above else found[max(found)]


def _subsample(data: LabeledImages, count: int | None, rng: np.random.Generator) -> LabeledImages:
    if count is None or count >= len(data):
        return data
    return data.subset(np.sort(rng.choice(len(data), size=count, replace=False)))


def _rows(data: LabeledImages, rows: slice) -> LabeledImages:
    """A contiguous block of rows as views (no copy)."""
    return LabeledImages(
        images=data.images[rows],
        labels=data.labels[rows],
        class_names=data.class_names,
        task=data.task,
        domain=None if data.domain is None else data.domain[rows],
        meta=dict(data.meta),
    )


def _concat(a: LabeledImages, b: LabeledImages) -> LabeledImages:
    return LabeledImages(
        images=np.concatenate([a.images, b.images]),
        labels=np.concatenate([a.labels, b.labels]),
        class_names=a.class_names,
        task=a.task,
        meta={**a.meta, "split": "train+val"},
    )


#: Each loader's arguments that :func:`load_pool` sets itself (the rest are its ``loader_options``).
_SET_BY_POOL = {
    "synthcxr": (load_synthcxr, {"n", "size", "seed"}),
    "chestmnist": (load_medmnist_npz, {"path", "size"}),
    "chexpert": (load_chexpert, {"root", "split", "size", "max_images"}),
    "digits": (load_digits_dataset, {"size"}),
}


def loader_option_names(dataset: str) -> tuple[str, ...]:
    """The ``loader_options`` keys dataset ``dataset``'s loader takes (its keyword parameters that
    :func:`load_pool` does not set itself)."""
    _check_dataset(dataset)
    if dataset == "images_csv":
        from fedweigh.data.folder import LOADER_OPTIONS

        return tuple(LOADER_OPTIONS)
    loader, set_by_pool = _SET_BY_POOL[dataset]
    return tuple(p for p in inspect.signature(loader).parameters if p not in set_by_pool)


def check_loader_option_names(dataset: str, options: dict, source: str = "data loader") -> None:
    """A :class:`ConfigError` naming the first key of ``options`` that ``dataset``'s loader does not
    take, with the keys it does take (and the closest one)."""
    if dataset == "images_csv":  # its own check names its required options too
        from fedweigh.data.folder import check_options

        check_options(options, source)
        return
    allowed = loader_option_names(dataset)
    for key in options:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            takes = ", ".join(allowed) if allowed else "no options"
            raise ConfigError(
                source, f"loader_options.{key}", options[key], f"{hint}{dataset}'s loader takes {takes}"
            )


def load_pool(
    dataset: str,
    data_path: str | Path | None = None,
    size: int = 32,
    seed: int = 0,
    num_images: int | None = None,
    test_images: int | None = None,
    **options: Any,
) -> tuple[LabeledImages, LabeledImages]:
    """(training pool, global test set) of ``dataset`` at ``size`` x ``size`` pixels.

    * synthcxr: ``load_synthcxr(n + m, size, seed)`` (n = ``num_images``, default 20,000; m =
      ``test_images``, default n // 5); the first n rows are the pool, the remaining m (other
      patients) the test set. The first n rows do not depend on m, so the pool is the same for any m.
    * chestmnist: train + val of the npz pooled; the test split is the test set (when ``num_images``
      is given, the pool is subsampled to it by ``seed`` and the test to num_images // 5, the same
      rows for every seed).
    * chexpert: train.csv (its first ``num_images`` rows) is the pool, valid.csv the test set.
    * digits: a stratified 80 / 20 split by ``seed``; the pool is subsampled to ``num_images``.

    The loaded datasets' test sets are fixed: ``test_images`` m keeps m of their rows (the same rows
    for every seed) and is an error when the test set has fewer.

    ``options`` go to the loader (synthcxr: cache_dir; chestmnist: task, class_names; chexpert:
    uncertainty, frontal_only, findings).
    """
    _check_dataset(dataset)
    check_loader_option_names(dataset, options)
    if num_images is not None and num_images <= 0:
        raise ValueError(f"num_images must be positive, got {num_images}")
    if test_images is not None and (
        isinstance(test_images, bool) or int(test_images) != test_images or test_images < 1
    ):
        raise ValueError(f"test_images must be a positive integer, got {test_images!r}")
    pool, test = _load_pool(dataset, data_path, size, seed, num_images, test_images, **options)
    if test_images is None or dataset == "synthcxr":
        return pool, test
    if test_images > len(test):
        raise ValueError(
            f"test_images={test_images}: dataset {dataset!r} has only {len(test)} test images here; ask for at "
            f"most {len(test)} (only synthcxr generates its test images, so any number is possible)"
        )
    return pool, _subsample(test, test_images, np.random.default_rng([0, 7]))


def _load_pool(
    dataset: str,
    data_path: str | Path | None,
    size: int,
    seed: int,
    num_images: int | None,
    test_images: int | None,
    **options: Any,
) -> tuple[LabeledImages, LabeledImages]:
    """:func:`load_pool` before ``test_images`` is applied to a loaded dataset's test set."""
    if _INFO[dataset]["needs_data_path"] and data_path is None:
        raise ValueError(
            f"dataset {dataset!r} needs a data path: pass --data-path (data_path=) pointing to "
            f"{_DATA_PATH_HINT[dataset]}; nothing is downloaded"
        )
    if dataset == "synthcxr":
        n = SYNTHCXR_DEFAULT_IMAGES if num_images is None else int(num_images)
        full = load_synthcxr(n + (n // 5 if test_images is None else int(test_images)), size, seed, **options)
        return _rows(full, slice(0, n)), _rows(full, slice(n, None))
    if dataset == "chestmnist":
        splits = load_medmnist_npz(find_medmnist_file(data_path, size), size=size, **options)
        pool = _subsample(
            _concat(splits["train"], splits["val"]), num_images, np.random.default_rng([seed, 5])
        )
        cap = None if num_images is None or test_images is not None else max(1, num_images // 5)
        return pool, _subsample(splits["test"], cap, np.random.default_rng([0, 6]))
    if dataset == "images_csv":
        from fedweigh.data.folder import load_images_csv

        return load_images_csv(data_path, size=size, seed=seed, num_images=num_images, **options)
    if dataset == "chexpert":
        pool = load_chexpert(data_path, "train", size=size, max_images=num_images, **options)
        return pool, load_chexpert(data_path, "valid", size=size, **options)
    full = load_digits_dataset(size)
    train_rows, test_rows = train_test_split(
        np.arange(len(full)), test_size=DIGITS_TEST_FRACTION, stratify=full.labels, random_state=seed
    )
    pool = _subsample(full.subset(np.sort(train_rows)), num_images, np.random.default_rng([seed, 5]))
    return pool, full.subset(np.sort(test_rows))

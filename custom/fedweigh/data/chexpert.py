"""CheXpert (Irvin et al., AAAI 2019) read from its ``train.csv`` / ``valid.csv`` and image folder.

The csv has a ``Path`` column (e.g. ``CheXpert-v1.0-small/train/patient00001/study1/view1_frontal.jpg``),
``Frontal/Lateral`` and 14 label columns whose entries are 1 (positive), 0 (negative), -1 (uncertain)
or blank (not mentioned, read as 0). Uncertain labels follow one of the paper's policies:

* ``"ones"``   (U-Ones):   -1 -> 1
* ``"zeros"``  (U-Zeros):  -1 -> 0
* ``"ignore"`` (U-Ignore): -1 -> NaN; training and evaluation mask NaN entries out.

Images go through MONAI's image pipeline (:func:`fedweigh.data.transforms.file_pipeline`): PIL
decoding as grey (JPEG with DCT-domain down-scaling), ``Resize`` (bilinear, antialiased, without
keeping the aspect ratio) to ``size`` x ``size`` and 0..255 -> 0..1, read by a MONAI ``DataLoader``
with ``workers`` processes. Nothing is downloaded: the user points at the folder of the dataset on disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from fedweigh.data.base import LabeledImages
from fedweigh.data.transforms import load_image_files
from fedweigh.errors import DatasetFormatError

if TYPE_CHECKING:  # pandas is imported where used
    import pandas as pd

#: The 14 label columns of the CheXpert csv files, in file order.
CHEXPERT_LABELS: tuple[str, ...] = (
    "No Finding",
    "Enlarged Cardiomediastinum",
    "Cardiomegaly",
    "Lung Opacity",
    "Lung Lesion",
    "Edema",
    "Consolidation",
    "Pneumonia",
    "Atelectasis",
    "Pneumothorax",
    "Pleural Effusion",
    "Pleural Other",
    "Fracture",
    "Support Devices",
)

#: The 13 pathology / device observations: every label column except "No Finding".
CHEXPERT_PATHOLOGIES: tuple[str, ...] = CHEXPERT_LABELS[1:]

#: Default findings: the five competition tasks of the CheXpert paper. They are the only ones with
#: enough positives in ``valid.csv`` (the global test set) for a per-finding AUC to be meaningful.
CHEXPERT_FINDINGS: tuple[str, ...] = (
    "Atelectasis",
    "Cardiomegaly",
    "Consolidation",
    "Edema",
    "Pleural Effusion",
)

Uncertainty = Literal["ones", "zeros", "ignore"]
_UNCERTAIN_VALUE = {"ones": 1.0, "zeros": 0.0, "ignore": np.nan}

#: Folder names the official archives unpack to; a root above them is accepted too.
_RELEASE_DIRS: tuple[str, ...] = ("CheXpert-v1.0-small", "CheXpert-v1.0")


def find_chexpert_csv(root: str | Path, split: str) -> Path:
    """Locate ``{split}.csv`` in ``root`` or in a ``CheXpert-v1.0[-small]`` folder inside it."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"CheXpert folder not found: {root}")
    candidates = [root / f"{split}.csv", *(root / d / f"{split}.csv" for d in _RELEASE_DIRS)]
    for c in candidates:
        if c.is_file():
            return c
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"CheXpert {split}.csv not found; looked for {tried}")


def resolve_image_path(csv_dir: Path, root: Path, rel: str) -> tuple[Path | None, list[Path]]:
    """Find the image a csv ``Path`` entry refers to; returns (path or None, candidates tried).

    Entries start with the release folder (``CheXpert-v1.0-small/train/...``), so they resolve
    against the csv folder's parent. We also try the csv folder itself, the csv folder with the
    entry's first component dropped (a renamed release folder), and ``root``; absolute entries are
    used as they are.
    """
    p = Path(rel)
    if p.is_absolute():
        candidates = [p]
    else:
        candidates = [csv_dir.parent / p, csv_dir / p]
        if len(p.parts) > 1:
            candidates.append(csv_dir / Path(*p.parts[1:]))
        candidates.append(root / p)
    seen: list[Path] = []
    for c in candidates:
        if c in seen:
            continue
        seen.append(c)
        if c.is_file():
            return c, seen
    return None, seen


def _selected_rows(
    csv: Path, findings: tuple[str, ...], frontal_only: bool, max_images: int | None
) -> pd.DataFrame:
    """The rows of ``csv`` to read (frontal only, the first ``max_images``), each with its file line in
    ``_line``; DatasetFormatError for an unreadable csv, missing columns or no row left."""
    import pandas as pd

    try:
        frame = pd.read_csv(csv)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise DatasetFormatError(f"{csv}: not a readable csv ({exc})") from exc
    needed = ["Path", *findings, *(["Frontal/Lateral"] if frontal_only else [])]
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise DatasetFormatError(f"{csv}: missing columns {missing} (found {list(frame.columns)})")

    frame = frame.reset_index(drop=True)
    frame["_line"] = np.arange(len(frame)) + 2  # line in the file, counting the header as line 1
    if frontal_only:
        frame = frame[frame["Frontal/Lateral"].astype(str).str.strip().str.lower() == "frontal"]
    if max_images is not None:
        frame = frame.iloc[:max_images]
    if frame.empty:
        raise DatasetFormatError(f"{csv}: no rows left to read (frontal_only={frontal_only})")
    return frame


def _label_matrix(
    csv: Path, frame: pd.DataFrame, findings: tuple[str, ...], uncertainty: Uncertainty
) -> np.ndarray:
    """The (N, F) labels of ``findings``: blank -> 0, -1 -> the ``uncertainty`` value; DatasetFormatError
    naming the csv line of a value that is not 1, 0, -1 or blank."""
    import pandas as pd

    labels = np.empty((len(frame), len(findings)), dtype=np.float32)
    for j, col in enumerate(findings):
        values = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=np.float64)
        bad = ~(np.isnan(values) | np.isin(values, (1.0, 0.0, -1.0)))
        bad |= np.isnan(values) & frame[col].notna().to_numpy()  # text that is not a number
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            shown = frame[col].iloc[i]
            shown = shown.item() if isinstance(shown, np.generic) else shown
            raise DatasetFormatError(
                f"{csv} line {int(frame['_line'].iloc[i])}: column {col!r} has {shown!r}; "
                "expected 1, 0, -1 or blank"
            )
        values = np.where(np.isnan(values), 0.0, values)
        labels[:, j] = np.where(values == -1.0, _UNCERTAIN_VALUE[uncertainty], values)
    return labels


def _image_paths(csv: Path, root: Path, frame: pd.DataFrame) -> list[Path]:
    """The image file of every row (:func:`resolve_image_path`); DatasetFormatError naming the line of a
    missing one."""
    paths: list[Path] = []
    for rel, line in zip(frame["Path"].astype(str), frame["_line"], strict=True):
        path, tried = resolve_image_path(csv.parent, root, rel)
        if path is None:
            raise DatasetFormatError(
                f"{csv} line {int(line)}: image {rel!r} not found (tried {', '.join(map(str, tried))})"
            )
        paths.append(path)
    return paths


def load_chexpert(
    root: str | Path,
    split: Literal["train", "valid"] = "train",
    size: int = 32,
    uncertainty: Uncertainty = "ones",
    frontal_only: bool = False,
    findings: Sequence[str] = CHEXPERT_FINDINGS,
    max_images: int | None = None,
    workers: int = 0,
) -> LabeledImages:
    """Read one CheXpert split as multi-label LabeledImages (images (N, 1, size, size), labels (N, F)).

    ``root`` is the folder holding ``train.csv`` / ``valid.csv`` (or a folder above
    ``CheXpert-v1.0-small``). ``findings`` picks and orders the label columns (default: the five
    competition tasks; ``CHEXPERT_PATHOLOGIES`` gives all 13). ``frontal_only`` keeps rows whose
    ``Frontal/Lateral`` is "Frontal". ``max_images`` keeps the first rows (after filtering) in csv
    order, which keeps patients whole. Blank labels are 0; -1 follows ``uncertainty`` (see module doc).
    ``workers``: processes decoding images (0: in this process).

    Raises FileNotFoundError (folder / csv), DatasetFormatError naming the csv and the missing columns,
    the bad value, or the image path and csv line that could not be read.
    """

    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
    if uncertainty not in _UNCERTAIN_VALUE:
        raise ValueError(f"uncertainty must be one of {sorted(_UNCERTAIN_VALUE)}, got {uncertainty!r}")
    if max_images is not None and max_images <= 0:
        raise ValueError(f"max_images must be positive, got {max_images}")
    findings = tuple(findings)
    if not findings:
        raise ValueError("findings must name at least one label column")
    root = Path(root)
    csv = find_chexpert_csv(root, split)
    frame = _selected_rows(csv, findings, frontal_only, max_images)
    labels = _label_matrix(csv, frame, findings, uncertainty)
    paths = _image_paths(csv, root, frame)
    try:
        images = load_image_files(paths, size, intensity="uint8", workers=workers)
    except OSError as exc:  # names the file; add its csv line
        bad = next((i for i, p in enumerate(paths) if str(exc).startswith(f"{p}:")), 0)
        raise DatasetFormatError(
            f"{csv} line {int(frame['_line'].iloc[bad])}: cannot read image {paths[bad]} ({exc})"
        ) from exc
    return LabeledImages(
        images=images,
        labels=labels,
        class_names=findings,
        task="multilabel",
        meta={"source": str(csv), "split": split, "uncertainty": uncertainty},
    )

"""Builders of tiny dataset files in the real on-disk formats (MedMNIST npz, CheXpert csv tree)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: CheXpert csv columns, in the order of the official files.
CHEXPERT_COLUMNS: tuple[str, ...] = (
    "Path",
    "Sex",
    "Age",
    "Frontal/Lateral",
    "AP/PA",
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


def write_medmnist_npz(
    path: Path,
    sizes: tuple[int, int, int] = (12, 4, 6),
    resolution: int = 28,
    num_labels: int = 14,
    multiclass: int | None = None,
    rgb: bool = False,
    seed: int = 0,
    **overrides: np.ndarray,
) -> dict[str, np.ndarray]:
    """Write a MedMNIST-layout npz (np.savez_compressed, uint8 arrays, as the official files).

    Multi-label (N, num_labels) 0/1 labels by default; ``multiclass=C`` writes (N, 1) labels in 0..C-1.
    ``overrides`` replace or add keys (e.g. a wrong dtype); returns the arrays written.
    """
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for split, n in zip(("train", "val", "test"), sizes, strict=True):
        shape = (n, resolution, resolution, 3) if rgb else (n, resolution, resolution)
        arrays[f"{split}_images"] = rng.integers(0, 256, size=shape, dtype=np.uint8)
        if multiclass is None:
            arrays[f"{split}_labels"] = rng.integers(0, 2, size=(n, num_labels), dtype=np.uint8)
        else:
            labels = np.arange(n) % multiclass  # every class present in every split
            arrays[f"{split}_labels"] = labels.astype(np.uint8)[:, None]
    arrays.update(overrides)
    np.savez_compressed(path, **arrays)
    return arrays


def chexpert_row(path: str, view: str = "Frontal", **labels: float | str) -> dict[str, object]:
    """One csv row; label columns not given are blank (not mentioned)."""
    row: dict[str, object] = {c: "" for c in CHEXPERT_COLUMNS}
    row.update({"Path": path, "Sex": "Female", "Age": 60, "Frontal/Lateral": view, "AP/PA": "AP"})
    row.update(labels)
    return row


def write_csv(path: Path, rows: list[dict[str, object]], columns: tuple[str, ...] = CHEXPERT_COLUMNS) -> None:
    """Write rows as CheXpert writes them: header line, comma-separated, blank for missing."""
    lines = [",".join(columns)]
    for r in rows:
        lines.append(",".join(str(r.get(c, "")) for c in columns))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def write_image(path: Path, grey: int, shape: tuple[int, int] = (24, 20)) -> None:
    """A constant grey image (height, width) as JPEG or PNG by suffix."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full(shape, grey, dtype=np.uint8), mode="L").save(path)


def write_chexpert_tree(
    base: Path, train_rows: list[dict[str, object]], valid_rows: list[dict[str, object]]
) -> Path:
    """Write ``base/CheXpert-v1.0-small/{train,valid}.csv`` and one image per row at the row's Path
    (relative to ``base``). Image i of a csv has grey value 10 * (i + 1) (mod 250); returns the
    release folder."""
    release = base / "CheXpert-v1.0-small"
    for name, rows in (("train", train_rows), ("valid", valid_rows)):
        write_csv(release / f"{name}.csv", rows)
        for i, r in enumerate(rows):
            write_image(base / str(r["Path"]), grey=(10 * (i + 1)) % 250)
    return release


def simple_chexpert(base: Path, n_train: int = 16, n_valid: int = 6, suffix: str = ".png") -> Path:
    """A CheXpert tree with n_train / n_valid rows alternating frontal and lateral views, labels drawn
    from {1, 0, -1, blank} for every column; returns the release folder."""
    rng = np.random.default_rng(1)
    choices = np.array(["1.0", "0.0", "-1.0", ""], dtype=object)

    def rows(split: str, n: int) -> list[dict[str, object]]:
        out = []
        for i in range(n):
            view = "Frontal" if i % 2 == 0 else "Lateral"
            name = f"view1_{view.lower()}{suffix}"
            labels = {c: rng.choice(choices) for c in CHEXPERT_COLUMNS[5:]}
            if split == "valid":  # valid.csv has no uncertain labels
                labels = {c: ("1.0" if v == "1.0" else "0.0") for c, v in labels.items()}
            out.append(
                chexpert_row(f"CheXpert-v1.0-small/{split}/patient{i:05d}/study1/{name}", view, **labels)
            )
        return out

    return write_chexpert_tree(base, rows("train", n_train), rows("valid", n_valid))

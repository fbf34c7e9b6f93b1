"""How the benchmark stores its cells: one finished cell = ``OUT/cells/KEY.npz`` + ``KEY.json``.

``KEY.npz`` holds the final model(s)' test predictions and is written first; ``KEY.json`` (the
record, with the cell's settings hash) is written last, atomically, and marks the cell finished, so
a rerun skips finished cells and an interrupted one is run again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from fedweigh.io import atomic_write_npz, atomic_write_text

__all__ = ["CELLS_DIR", "cell_key", "load_cell", "load_cell_scores", "store_cell"]

CELLS_DIR = "cells"


def cell_key(scenario: str, method: str, seed: int) -> str:
    """File-name stem of a cell: ``SCENARIO__METHOD__sSEED`` (characters outside [A-Za-z0-9._=-] -> _)."""
    safe = re.sub(r"[^A-Za-z0-9._=-]", "_", method)
    return f"{scenario}__{safe}__s{seed}"


def load_cell(cells_dir: Path, key: str) -> dict | None:
    """The stored record of cell ``key``, or None if it is missing or unreadable."""
    path = cells_dir / f"{key}.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def load_cell_scores(cells_dir: Path, key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(scores (S, N, C), labels) of a stored cell's final global model(s) on the test set."""
    path = cells_dir / f"{key}.npz"
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        return z["scores"], z["labels"]


def store_cell(cells_dir: Path, record: dict, scores: np.ndarray, labels: np.ndarray) -> str:
    """Store a cell (predictions first, the JSON record last); returns its key."""
    key = record["key"]
    atomic_write_npz(cells_dir / f"{key}.npz", scores=scores.astype(np.float32), labels=labels)
    atomic_write_text(cells_dir / f"{key}.json", json.dumps(record, indent=1, default=float))
    return key

"""How the benchmark stores its cells: one finished cell = ``OUT/cells/KEY.npz`` + ``KEY.json``.

``KEY.npz`` holds the final model(s)' test predictions and is written first; ``KEY.json`` (the
record, with the cell's settings hash) is written last, atomically, and marks the cell finished, so
a rerun skips finished cells and an interrupted one is run again. A stored cell is reused only while
its :func:`settings_hash` (a digest of everything that determines its numbers) is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np

from fedweigh.bench.config import BenchConfig, cell_args
from fedweigh.io import atomic_write_npz, atomic_write_text
from fedweigh.server.safeguards import ROBUST_OPTIONS

__all__ = ["CELLS_DIR", "cell_key", "is_done", "load_cell", "load_cell_scores", "settings_hash", "store_cell"]

logger = logging.getLogger("fedweigh.bench")

CELLS_DIR = "cells"

#: ClientArgs fields that do not change a cell's numbers (left out of its settings hash).
_NOT_HASHED = ("threads", "eval_test", "compile")
#: Settings added after cells were stored: in the digest only when not at this default, so stored
#: cells stay valid.
_HASHED_WHEN_CHANGED: dict[str, object] = {
    "augment": False,
    "pretrained": None,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "test_images": None,
    "he_precision_bits": None,
}


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


def settings_hash(config: BenchConfig, scenario: str, method: str, seed: int) -> str:
    """A digest of everything that determines a cell's numbers (a stored cell is reused only if equal)."""
    spec = config.spec(method)
    args = {
        k: v
        for k, v in asdict(cell_args(config, scenario, seed, spec)).items()
        if k not in _NOT_HASHED and not (k in _HASHED_WHEN_CHANGED and v == _HASHED_WHEN_CHANGED[k])
    }
    guards = config.safeguards
    payload = {
        "client": args,
        "rounds": config.rounds,
        "sites": list(config.sites) if config.sites else None,
        "min_clients": guards.min_clients,
        "threshold": config.threshold,
        "eval_every": config.eval_every,
        "safeguards": [guards.max_share, guards.update_norm_bound, guards.min_update_cosine],
        # the robust options only when one is on, so that cells stored before them stay valid
        **({"robust": [getattr(guards, n) for n in ROBUST_OPTIONS]} if guards.robust else {}),
        "method": spec.as_dict(),
    }
    # FedNova reads step counts: the floor on them (ResultLimits.min_step_ratio) may change its weights
    if spec.as_dict().get("scheme") == "fednova":
        payload["min_step_ratio"] = guards.limits.min_step_ratio
    # the sites' statistics release when a site policy noises it (the default); cells stored with exact
    # statistics (before that default, or with --exact-statistics) keep their digest
    if args.get("stats_dp_epsilon") is None and config.statistics_epsilon() is not None:
        payload["statistics_epsilon"] = config.statistics_epsilon()
    if any(sc.name == scenario for sc in config.scenario_defs):  # a file's scenario: its definition
        # shortfall (error or warn) changes no partition: left out, so stored cells stay valid
        payload["scenario"] = {k: v for k, v in asdict(config.scenario(scenario)).items() if k != "shortfall"}
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def is_done(cells_dir: Path, config: BenchConfig, scenario: str, method: str, seed: int) -> bool:
    """Whether the cell is stored with the same settings (and its predictions file exists)."""
    key = cell_key(scenario, method, seed)
    record = load_cell(cells_dir, key)
    if record is None or not (cells_dir / f"{key}.npz").is_file():
        return False
    if record.get("settings_hash") != settings_hash(config, scenario, method, seed):
        logger.warning("%s: stored with other settings; running it again", key)
        return False
    return True

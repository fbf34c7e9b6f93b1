"""Tuning before the reported cells (``--tune``, :class:`fedweigh.bench.config.Tuning`).

Every method with a grid runs each grid point on a tuning cell (the tuning's scenario and seed: a
seed no reported cell uses), with the test set removed from its federation, and keeps the point with
the best validation AUC (the mean over the sites' validation splits of the final global model;
centralized: the pooled validation split). The reported cells then run with the chosen options;
``summary.json`` records the grid, the validation AUCs and the choice under ``tuning``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from fedweigh.bench.cells import cell_key, load_cell, settings_hash
from fedweigh.bench.config import BenchConfig
from fedweigh.bench.modes import run_cell
from fedweigh.errors import BenchError
from fedweigh.io import atomic_write_text

__all__ = ["TUNING_DIR", "tune_methods"]

logger = logging.getLogger("fedweigh.bench")

#: Where the tuning cells' records are kept (no test predictions: they never score the test set).
TUNING_DIR = "tuning"


def _tuning_label(method: str, point: dict) -> str:
    """The label of a tuning cell: the method's label with the grid point's options appended."""
    opts = ",".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in point.items())
    return f"{method}{',' if ':' in method else ':'}{opts}"


def _tuned_point(config: BenchConfig, method: str, point: dict, tuning_dir: Path) -> dict:
    """One grid point's tuning cell, run unless stored with the same settings: its options, final
    validation AUC and key."""
    assert config.tuning is not None
    scenario, seed = str(config.tuning.scenario), int(config.tuning.seed or 0)
    probe = replace(config, tuned={method: point})
    key = cell_key(scenario, _tuning_label(method, point), seed)
    digest = settings_hash(probe, scenario, method, seed)
    stored = load_cell(tuning_dir, key)
    if stored is None or stored.get("settings_hash") != digest:
        try:
            stored, _, _ = run_cell(probe, scenario, method, seed, validation_only=True)
        except Exception as e:
            raise BenchError(f"tuning cell {key} failed: {type(e).__name__}: {e}") from e
        stored["key"] = key
        atomic_write_text(tuning_dir / f"{key}.json", json.dumps(stored, indent=1, default=float))
    val_auc = float(stored["rows"][-1].get("val_auc", float("nan")))
    return {"options": point, "val_auc": val_auc, "key": key}


def tune_methods(config: BenchConfig, out_dir: Path, progress: bool = False) -> tuple[dict, dict]:
    """Run the tuning cells of ``config.tuning``; returns (label -> chosen options, tuning record).

    Each grid point of a method runs once on the tuning's scenario with its seed, the test set
    removed (:func:`fedweigh.bench.federations.without_test`); the point with the largest final
    validation AUC wins (the first listed on a tie; a NaN AUC never wins). Finished tuning cells are
    kept in ``out_dir/tuning/`` and reused when their settings are unchanged.
    """
    tuning_dir = out_dir / TUNING_DIR
    tuning_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(m, point) for m in config.methods for point in config.tune_grid(m)]
    chosen: dict[str, dict] = {}
    record: dict[str, dict] = {}
    bar = tqdm(total=len(jobs), desc="bench tuning", unit="cell", disable=not progress or not jobs)
    try:
        for method in config.methods:
            points = []
            for point in config.tune_grid(method):
                points.append(_tuned_point(config, method, point, tuning_dir))
                bar.update(1)
            if not points:
                continue
            finite = [p for p in points if np.isfinite(p["val_auc"])]
            best = max(finite, key=lambda p: p["val_auc"]) if finite else points[0]
            chosen[method] = dict(best["options"])
            assert config.tuning is not None
            scenario, seed = config.tuning.scenario, int(config.tuning.seed or 0)
            record[method] = {
                "scenario": scenario,
                "seed": seed,
                "selected_by": "val_auc",
                "grid": points,
                "chosen": chosen[method],
            }
            logger.warning("tuning %s on %s, seed %d: chose %s", method, scenario, seed, chosen[method])
    finally:
        bar.close()
    return chosen, record

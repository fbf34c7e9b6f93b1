"""What the server's safeguards cost a federation without attacker: the same cells run with each
setting, paired against the same cells with the safeguards off.

For a setting s and the reference (``off``), every cell (scenario, method, seed) was run twice with
the same data, model and seed. The effect is mean over cells of AUC_s - AUC_off on the full test sets,
with a paired bootstrap interval over the test images (:func:`fedweigh.bench.effects.paired_effect`:
both runs of a cell are scored on the same resamples, the per-cell differences averaged per
resample, the 2.5th and 97.5th percentiles taken). Next to it, from each cell's record
(:func:`fedweigh.bench.modes.safeguard_audit`): the honest site-rounds the setting left out, those it
bounded (scaled, clipped or arrays left out) and the training rounds that left the global model
unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedweigh.bench.cells import cell_key, load_cell, load_cell_scores
from fedweigh.bench.effects import CONFIDENCE, bootstrap_aucs, paired_effect

__all__ = ["REFERENCE_SETTING", "honest_cost"]

#: The setting every other is compared with.
REFERENCE_SETTING = "off"


def _scored(cells_dir: Path, key: str, seed: int, n_resamples: int) -> tuple[float, np.ndarray]:
    stored = load_cell_scores(cells_dir, key)
    if stored is None:
        raise FileNotFoundError(f"{cells_dir}: cell {key} has no stored predictions")
    scores, labels = stored
    return bootstrap_aucs(scores, labels, seed, n_resamples)


def cell_interval(diffs: Sequence[float], confidence: float = CONFIDENCE) -> dict | None:
    """The mean of the per-cell paired differences with its t-interval over the cells: the cells are
    the scenarios x seeds, so the interval holds the training noise between seeds (None under two
    finite differences)."""
    from scipy import stats

    d = np.asarray([x for x in diffs if np.isfinite(x)], dtype=np.float64)
    if d.size < 2:
        return None
    half = float(stats.t.ppf(0.5 + confidence / 2.0, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size))
    mean = float(d.mean())
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "cells": int(d.size)}


def honest_cost(
    cells_dirs: Mapping[str, Path],
    cells: Sequence[tuple[str, str, int]],
    n_resamples: int = 1000,
    confidence: float = CONFIDENCE,
) -> dict[str, dict]:
    """Per setting (``cells_dirs``: setting -> its ``cells/`` folder; one must be ``off``): the paired
    AUC effect against ``off`` over ``cells`` (scenario, method, seed), overall and per method, and
    the safeguards' audit summed over the cells."""
    if REFERENCE_SETTING not in cells_dirs:
        raise ValueError(f"honest_cost needs the {REFERENCE_SETTING!r} setting as its reference")
    scored = {
        name: {cell: _scored(Path(folder), cell_key(*cell), cell[2], n_resamples) for cell in cells}
        for name, folder in cells_dirs.items()
    }
    out: dict[str, dict] = {}
    for name, folder in cells_dirs.items():
        audit = {"site_rounds_left_out": 0, "site_rounds_bounded": 0, "rounds_unchanged": 0, "cells": 0}
        per_cell = []
        for cell in cells:
            record = load_cell(Path(folder), cell_key(*cell)) or {}
            guards = record.get("safeguards", {})
            audit["site_rounds_left_out"] += int(guards.get("site_rounds_left_out", 0))
            audit["site_rounds_bounded"] += int(guards.get("site_rounds_bounded", 0))
            audit["rounds_unchanged"] += len(guards.get("rounds_unchanged", []))
            audit["cells"] += 1
            per_cell.append(
                {
                    "scenario": cell[0],
                    "method": cell[1],
                    "seed": cell[2],
                    "auc": round(scored[name][cell][0], 4),
                    "auc_off": round(scored[REFERENCE_SETTING][cell][0], 4),
                    **{
                        k: guards.get(k)
                        for k in ("site_rounds_left_out", "site_rounds_bounded", "rounds_unchanged")
                    },
                }
            )
        entry: dict = {"audit": audit, "cells": per_cell}
        if name != REFERENCE_SETTING:
            pairs = [(scored[name][c], scored[REFERENCE_SETTING][c]) for c in cells]
            effect = paired_effect([p[0] for p in pairs], [p[1] for p in pairs], confidence)
            entry["effect"] = effect.as_dict() if effect else None
            entry["effect_cells"] = cell_interval(
                [scored[name][c][0] - scored[REFERENCE_SETTING][c][0] for c in cells], confidence
            )
            entry["by_method"] = {}
            for method in dict.fromkeys(c[1] for c in cells):
                mine = [c for c in cells if c[1] == method]
                e = paired_effect(
                    [scored[name][c] for c in mine], [scored[REFERENCE_SETTING][c] for c in mine], confidence
                )
                entry["by_method"][method] = e.as_dict() if e else None
        out[name] = entry
    return out

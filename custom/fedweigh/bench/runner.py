"""The benchmark runner: every scenario x method x seed cell, each a whole federated (or reference) run
in one process, then the report.

:func:`run_bench` runs the tuning first when the configuration asks for it
(:mod:`fedweigh.bench.tuning`), then every cell not yet stored with the same settings
(:mod:`fedweigh.bench.cells`), here, in a process pool or on a Dask cluster
(:mod:`fedweigh.bench.cluster`); a cell is :func:`fedweigh.bench.modes.run_cell`. Its outputs are
written by :mod:`fedweigh.bench.report`. The configuration is :mod:`fedweigh.bench.config`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from fedweigh.bench.cells import CELLS_DIR, cell_key, is_done, load_cell, load_cell_scores
from fedweigh.bench.cluster import run_cells
from fedweigh.bench.config import BenchConfig
from fedweigh.bench.federations import federation_for
from fedweigh.bench.modes import site_outcomes
from fedweigh.bench.report import SUMMARY_JSON, write_outputs
from fedweigh.bench.tuning import tune_methods
from fedweigh.errors import BenchError
from fedweigh.io import atomic_write_text
from fedweigh.kernels import KERNEL_SWITCH, PINNED_KERNELS, pin_cpu_kernels

__all__ = ["CONFIG_JSON", "BenchResult", "engine_layout", "run_bench"]

logger = logging.getLogger("fedweigh.bench")

CONFIG_JSON = "config.json"


@dataclass
class BenchResult:
    """What :func:`run_bench` did: the summary, how many cells it trained and skipped, the output folder."""

    summary: dict
    trained: int
    skipped: int
    out_dir: Path


def engine_layout(cells: int, cores: int | None = None) -> tuple[int, int]:
    """(cell processes, site processes per cell) that keep ``cores`` busy with one torch thread each.

    As many cells in parallel as there are cores; when there are fewer cells than cores, the spare
    cores train each cell's sites in parallel (measured on 2 cores: two single-thread workers move
    about 3x the images of one two-thread worker, docs/bench.md "Engine").
    """
    cores = max(1, cores or os.cpu_count() or 1)
    jobs = max(1, min(cores, cells))
    return jobs, max(1, cores // jobs)


def _with_site_outcomes(config: BenchConfig, record: dict, cells_dir: Path) -> dict:
    """A cell stored before per-hospital outcomes existed gets them from its stored test predictions
    and its rebuilt federation (the cell file is rewritten with them; its settings are unchanged)."""
    if "site_auc" in record or record.get("task") is None:
        return record
    stored = load_cell_scores(cells_dir, record["key"])
    if stored is None or not stored[0].size:
        return record
    scenario, seed = record["scenario"], int(record["seed"])
    fed = federation_for(config, scenario, seed)
    if len(fed.test) != stored[0].shape[1]:
        return record
    record = {**record, **site_outcomes(fed, config.scenario(scenario).site_names, stored[0])}
    atomic_write_text(cells_dir / f"{record['key']}.json", json.dumps(record, indent=1, default=float))
    return record


def run_bench(
    config: BenchConfig,
    out_dir: str | Path,
    jobs: int = 1,
    progress: bool = True,
    cluster: str | None = None,
) -> BenchResult:
    """Run every cell of ``config`` not yet stored in ``out_dir/cells``, then write the outputs.

    jobs > 1 runs cells in a process pool (torch uses one thread per worker); ``cluster`` (a Dask
    scheduler address, e.g. ``tcp://10.0.0.5:8786``) runs them on an existing cluster instead.
    Outputs: ``results.csv``, ``summary.json``, ``report.md`` and ``plots/`` (see
    :mod:`fedweigh.bench.report`). Raises :class:`BenchError` naming the failed cells after the
    others have finished. The CPU kernels are pinned first (:mod:`fedweigh.kernels`), for this
    process if it has computed nothing yet and for every worker it starts.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    state = pin_cpu_kernels()
    wanted = os.environ.get("ATEN_CPU_CAPABILITY", "")
    if os.environ.get(KERNEL_SWITCH, "").lower() != "native" and state["cpu_capability"].lower() != wanted:
        logger.warning(
            "CPU kernels: this process already computes with %s (torch fixed it before the pin to %s); "
            "cells run here may differ in the last bits from pinned runs (workers started now are pinned)",
            state["cpu_capability"],
            wanted or PINNED_KERNELS["ATEN_CPU_CAPABILITY"],
        )
    start = time.perf_counter()
    out = Path(out_dir)
    cells_dir = out / CELLS_DIR
    cells_dir.mkdir(parents=True, exist_ok=True)
    tuning: dict = {}
    if config.tuning:
        chosen, tuning = tune_methods(config, out, progress)
        config = replace(config, tuned=chosen)
    atomic_write_text(out / CONFIG_JSON, json.dumps(config.as_dict(), indent=1, default=str))
    cells = config.cells()
    todo = [c for c in cells if not is_done(cells_dir, config, *c)]
    bar = tqdm(total=len(todo), desc=f"bench {config.profile}", unit="cell", disable=not progress or not todo)
    try:
        failures = run_cells(config, todo, cells_dir, bar, jobs=jobs, cluster=cluster)
    finally:
        bar.close()
    if failures:
        lines = "\n".join(f"  {k}: {v}" for k, v in sorted(failures.items()))
        raise BenchError(f"{len(failures)} of {len(cells)} cell(s) failed (rerun to retry them):\n{lines}")
    records = []
    for scenario, method, seed in cells:
        record = load_cell(cells_dir, cell_key(scenario, method, seed))
        if record is None:
            raise BenchError(f"cell {cell_key(scenario, method, seed)} is missing from {cells_dir}")
        records.append(_with_site_outcomes(config, record, cells_dir))
    summary = write_outputs(config, records, out, start, jobs=jobs)
    if tuning:
        summary["tuning"] = tuning
        atomic_write_text(out / SUMMARY_JSON, json.dumps(summary, indent=1, default=float))
    return BenchResult(summary=summary, trained=len(todo), skipped=len(cells) - len(todo), out_dir=out)

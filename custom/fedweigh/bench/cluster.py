"""Where a benchmark's cells run: one after the other in this process, in a pool of worker processes,
or on an existing Dask cluster (``fedweigh[cluster]``). Every finished cell is stored here
(:mod:`fedweigh.bench.cells`); a failed cell is logged and named in ``failures``, and the others go on.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

from fedweigh.bench.cells import cell_key, store_cell
from fedweigh.bench.config import BenchConfig
from fedweigh.bench.modes import run_cell
from fedweigh.errors import BenchError

__all__ = ["run_and_store_cell", "run_cells"]

logger = logging.getLogger("fedweigh.bench")


def run_and_store_cell(config: BenchConfig, scenario: str, method: str, seed: int, cells_dir: str) -> str:
    """Run one cell and store it in ``cells_dir`` (predictions first, the JSON record last); returns its key."""
    record, scores, labels = run_cell(config, scenario, method, seed)
    return store_cell(Path(cells_dir), record, scores, labels)


def _worker_init() -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)


def run_cells(
    config: BenchConfig,
    todo: list[tuple[str, str, int]],
    cells_dir: Path,
    bar,
    jobs: int = 1,
    cluster: str | None = None,
) -> dict[str, str]:
    """Run and store the cells ``todo`` (scenario, method, seed); returns the failed cells' errors by
    key. ``jobs`` > 1: in a process pool (one torch thread per worker); ``cluster``: on that Dask
    scheduler instead. ``bar``: the progress bar, advanced per cell."""
    failures: dict[str, str] = {}
    if cluster and todo:
        _run_on_cluster(config, todo, cluster, cells_dir, bar, failures)
    elif jobs == 1 or len(todo) <= 1:
        for scenario, method, seed in todo:
            bar.set_postfix_str(cell_key(scenario, method, seed))
            try:
                run_and_store_cell(config, scenario, method, seed, str(cells_dir))
            except Exception as e:  # keep going: the other cells are still worth storing
                logger.exception("cell %s failed", cell_key(scenario, method, seed))
                failures[cell_key(scenario, method, seed)] = f"{type(e).__name__}: {e}"
            bar.update(1)
    else:
        _run_in_processes(config, todo, jobs, cells_dir, bar, failures)
    return failures


def _run_in_processes(
    config: BenchConfig, todo: list[tuple[str, str, int]], jobs: int, cells_dir: Path, bar, failures: dict
) -> None:
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init) as pool:
        futures = {
            pool.submit(run_and_store_cell, config, sc, m, s, str(cells_dir)): cell_key(sc, m, s)
            for sc, m, s in todo
        }
        try:
            for fut in as_completed(futures):
                key = futures[fut]
                try:
                    fut.result()
                except Exception as e:
                    logger.error("cell %s failed: %s", key, e)
                    failures[key] = f"{type(e).__name__}: {e}"
                bar.set_postfix_str(key)
                bar.update(1)
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _run_on_cluster(
    config: BenchConfig, todo: list[tuple[str, str, int]], address: str, cells_dir: Path, bar, failures: dict
) -> None:
    """Run the cells on an existing Dask cluster (``fedweigh[cluster]``); results are stored here."""
    try:
        from distributed import Client
        from distributed import as_completed as dask_completed
    except ImportError:
        raise BenchError(
            "--cluster needs Dask's distributed scheduler: pip install 'fedweigh[cluster]' here and on the workers"
        ) from None
    with Client(address, set_as_default=False) as client:
        futures = {
            client.submit(run_cell, config, sc, m, s, pure=False): cell_key(sc, m, s) for sc, m, s in todo
        }
        for fut in dask_completed(list(futures), loop=client.loop):
            key = futures[fut]
            try:
                record, scores, labels = fut.result()
                store_cell(cells_dir, record, scores, labels)
            except Exception as e:
                logger.error("cell %s failed: %s", key, e)
                failures[key] = f"{type(e).__name__}: {e}"
            bar.set_postfix_str(key)
            bar.update(1)

"""The federation engine before and after: the same cell on the landed engine and on the new one.

One cell (same scenario, method, seed, rounds and local steps) is run:

1. **landed**: on the engine of an earlier commit (``--baseline-rev``, default the last commit before
   the fast engine), checked out into a temporary git worktree and run in a child process as
   ``fedweigh bench`` ran cells there: one process, one torch thread, contiguous tensors, a
   DataLoader, every round scored. A sweep ran its cells one after the other: cells/hour old =
   3600 / its seconds.
2. **same arithmetic**: on the new engine with the landed arithmetic (contiguous tensors, every
   round scored): its final metrics must equal the landed ones to 1e-6, which shows that batching
   from memory changes no number (site processes are compared with in-process sites in the tests).
3. **new, sweep layout**: the new engine's defaults (channels_last, scored every ``--eval-every``
   rounds) in its layout for a sweep of many cells: as many cells at once as there are cores, one
   torch thread each: one copy of the cell per core, at once; cells/hour new = copies x 3600 / the
   slowest copy's seconds (like the landed figure, without building the federation).
4. **new, one cell**: the same settings with the cell's sites spread over the cores (the layout
   for a single cell): the wall time of one cell.

Its final AUC differs from the landed one only by floating-point summation order (printed). The
engine speedup is cells/hour new / cells/hour old. The data are generated once and cached; the
site processes of step 4 are started once per sweep and their start-up is printed separately.
The last line reads ``engine speedup: X.XXx (cells/hour old N, new M)``.

    PYTHONPATH=custom .venv/bin/python benchmarks/bench_engine.py --out docs/results/engine/bench_engine.json
    PYTHONPATH=custom .venv/bin/python benchmarks/bench_engine.py --rounds 3 --max-steps 4   # a quick look
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from fedweigh.bench import make_config, run_cell
from fedweigh.bench.runner import engine_layout
from fedweigh.bench.sites import site_pool

ROOT = Path(__file__).resolve().parents[1]
#: The last commit before the fast engine (the one-round-step renovation).
DEFAULT_BASELINE = "869be99"

_LANDED = """
import json, sys
from dataclasses import replace
import torch
torch.set_num_threads(1)
from fedweigh.bench import make_config, run_cell
a = json.loads(sys.argv[1])
config = make_config("smoke", "synthcxr", methods=[a["method"]], scenarios=[a["scenario"]], seeds=[a["seed"]],
                     rounds=a["rounds"], num_images=a["images"], size=a["size"], batch_size=a["batch_size"], threads=1)
config = replace(config, client=replace(config.client, max_steps=a["max_steps"]))
record, _, _ = run_cell(config, a["scenario"], a["method"], a["seed"])
final = record["rows"][-1]
print("RESULT " + json.dumps({"seconds": record["seconds"], "test_auc": final["test_auc"], "test_loss": final["test_loss"]}))
"""


def run_landed(rev: str, cell: dict) -> dict:
    """The cell on the engine of commit ``rev`` (a temporary worktree, a child process)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "landed"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True
        )
        try:
            env = {**os.environ, "PYTHONPATH": str(tree / "custom"), "OMP_NUM_THREADS": "1"}
            out = subprocess.run(
                [sys.executable, "-c", _LANDED, json.dumps(cell)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def run_new(
    cell: dict, *, channels_last: bool, eval_every: int, site_workers: int, compile_model: bool = False
) -> dict:
    """The cell on this checkout's engine."""
    config = make_config(
        "smoke",
        "synthcxr",
        methods=[cell["method"]],
        scenarios=[cell["scenario"]],
        seeds=[cell["seed"]],
        rounds=cell["rounds"],
        num_images=cell["images"],
        size=cell["size"],
        batch_size=cell["batch_size"],
        threads=1,
        channels_last=channels_last,
        eval_every=eval_every,
        site_workers=site_workers,
        compile=compile_model,
        # the server's safeguards of a later commit change the aggregation; the engine is compared
        # on the schemes alone, as the landed commit ran them
        safeguards="off",
    )
    config = replace(config, client=replace(config.client, max_steps=cell["max_steps"]))
    record, _, _ = run_cell(config, cell["scenario"], cell["method"], cell["seed"])
    final = record["rows"][-1]
    return {"seconds": record["seconds"], "test_auc": final["test_auc"], "test_loss": final["test_loss"]}


def _cell_in_worker(cell: dict) -> dict:
    torch.set_num_threads(1)
    return run_new(cell, channels_last=True, eval_every=cell["eval_every"], site_workers=1)


def run_sweep_layout(cell: dict, copies: int) -> tuple[float, list[dict]]:
    """``copies`` copies of the cell at once, one process and one thread each; (wall seconds, results)."""
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=copies, mp_context=ctx) as pool:
        list(pool.map(_warm, range(copies)))  # processes started and imports done before the clock runs
        t0 = time.perf_counter()
        results = list(pool.map(_cell_in_worker, [cell] * copies))
        return time.perf_counter() - t0, results


def _warm(_: int) -> int:
    torch.set_num_threads(1)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--images", type=int, default=2400)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-steps", type=int, default=None, help="local step cap (default: a full local epoch)")
    p.add_argument("--scenario", default="quantity-shift")
    p.add_argument("--method", default="fedavg")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--baseline-rev", default=DEFAULT_BASELINE)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time the new engine with torch.compile and report its cost",
    )
    args = p.parse_args()
    cell = {
        "rounds": args.rounds,
        "images": args.images,
        "size": args.size,
        "batch_size": args.batch_size,
        "max_steps": args.max_steps,
        "scenario": args.scenario,
        "method": args.method,
        "seed": args.seed,
    }
    _, workers = engine_layout(1)
    print(
        f"cell: {json.dumps(cell)}; {os.cpu_count()} core(s), new engine: {workers} site process(es)",
        flush=True,
    )
    landed = run_landed(args.baseline_rev, cell)
    print(
        f"landed engine ({args.baseline_rev}): {landed['seconds']:.1f} s per cell, final test AUC {landed['test_auc']:.6f}",
        flush=True,
    )
    same = run_new(cell, channels_last=False, eval_every=1, site_workers=1)
    diff = abs(same["test_auc"] - landed["test_auc"])
    print(
        f"new engine, landed arithmetic: {same['seconds']:.1f} s, final test AUC {same['test_auc']:.6f} "
        f"(|diff| {diff:.2e}, {'agrees' if diff <= 1e-6 else 'DIFFERS'})",
        flush=True,
    )
    copies = max(1, os.cpu_count() or 1)
    wall, swept = run_sweep_layout({**cell, "eval_every": args.eval_every}, copies)
    new = swept[0]
    # like the landed figure, the cells' own seconds (building the federation is not counted)
    busy = max(r["seconds"] for r in swept)
    print(
        f"new engine, sweep layout: {copies} cell(s) at once, {busy:.1f} s each ({wall:.1f} s wall with the "
        f"federations built), final test AUC {new['test_auc']:.6f} "
        f"(|diff| to landed {abs(new['test_auc'] - landed['test_auc']):.4f}: channels_last summation order)",
        flush=True,
    )
    t0 = time.perf_counter()
    site_pool(workers)  # started once per sweep (or bench process) and reused by every cell
    started = time.perf_counter() - t0
    print(f"site processes started in {started:.1f} s (once per sweep, not per cell)", flush=True)
    single = run_new(cell, channels_last=True, eval_every=args.eval_every, site_workers=workers)
    print(f"new engine, one cell, sites in {workers} processes: {single['seconds']:.1f} s", flush=True)
    figures = {
        "cell": cell,
        "cores": os.cpu_count(),
        "eval_every": args.eval_every,
        "landed": landed,
        "same_arithmetic": same,
        "sweep": {"cells": copies, "cell_seconds": busy, "wall_seconds": wall, "results": swept},
        "site_processes_start_seconds": started,
        "one_cell_site_processes": single,
    }
    if args.compile:
        compiled = run_new(
            cell, channels_last=True, eval_every=args.eval_every, site_workers=workers, compile_model=True
        )
        extra = compiled["seconds"] - single["seconds"]
        print(
            f"new engine + torch.compile, one cell: {compiled['seconds']:.1f} s ({extra:+.1f} s against eager: the "
            "one-off compilation in every site process minus what the compiled steps save)",
            flush=True,
        )
        figures["compiled"] = compiled
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    if diff > 1e-6:
        raise SystemExit(
            "the new engine with the landed arithmetic does not reproduce the landed final metrics"
        )
    old_rate, new_rate = 3600 / landed["seconds"], copies * 3600 / busy
    print(f"engine speedup: {new_rate / old_rate:.2f}x (cells/hour old {old_rate:.0f}, new {new_rate:.0f})")


if __name__ == "__main__":
    main()

"""Scoring a run's stored cells against FedAvg, before and after: the same cells, three ways.

The effects against FedAvg (paired bootstrap over the test images, GM at 0.5; ``against_fedavg`` in
``fedweigh.bench.effects``) are computed from a finished run's ``cells/``:

1. **landed**: with the code of an earlier commit (``--baseline-rev``), checked out into a temporary
   git worktree, in a child process, one process (the grouped ``reduceat`` AUC);
2. **new, one process**: with this tree's code (negatives sorted once per finding, ``searchsorted``
   for every positive, one cumulative sum per resample row);
3. **new, N processes**: the same with ``jobs=N`` (cells scored in parallel, as ``fedweigh bench``
   does with its ``--jobs``).

Each is timed in a fresh child process (imports excluded) and must give the same effects, Wilcoxon
p-values and GM at 0.5 to the last bit (whole-number resample counts make every sum exact). The last
line reads ``effects speedup: X.XXx one process, Y.YYx with N processes (landed S s)``.

    PYTHONPATH=custom .venv/bin/python benchmarks/bench_effects.py --run results/standard-synthcxr \\
        --out docs/results/engine/bench_effects.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the last commit before the searchsorted AUC and the parallel scoring
BASELINE_REV = "295e020"

_CHILD = r"""
import json, sys, time
from pathlib import Path
from fedweigh.bench.cells import CELLS_DIR, cell_key, load_cell
from fedweigh.bench.effects import against_fedavg
run, jobs = Path(sys.argv[1]), int(sys.argv[2])
config = json.loads((run / "config.json").read_text())
methods, scenarios, seeds = config["methods"], config["scenarios"], config["seeds"]
records = [load_cell(run / CELLS_DIR, cell_key(sc, m, s)) for s in seeds for sc in scenarios for m in methods]
kwargs = {"jobs": jobs} if jobs > 1 else {}
t0 = time.perf_counter()
got = against_fedavg(methods, scenarios, seeds, records, run / CELLS_DIR, **kwargs)
seconds = time.perf_counter() - t0
effects = {m: {sc: (e.as_dict() if e else None) for sc, e in by.items()} for m, by in (got.effects or {}).items()}
print(json.dumps({
    "seconds": seconds, "cells": len(records), "effects": effects, "wilcoxon": got.wilcoxon_holm_p,
    "gm_05": {"/".join(map(str, k)): v for k, v in got.gm_05.items()},
}))
"""


def _timed(custom: Path, run: Path, jobs: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(custom)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(run), str(jobs)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a fedweigh bench output folder with its cells/")
    parser.add_argument("--baseline-rev", default=BASELINE_REV, help="the landed code (a git revision)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes of step 3")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    run = Path(args.run).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "landed"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.baseline_rev],
            check=True,
            capture_output=True,
        )
        try:
            landed = _timed(tree / "custom", run, 1)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    print(f"landed ({args.baseline_rev}): {landed['seconds']:.1f} s for {landed['cells']} cells")
    one = _timed(ROOT / "custom", run, 1)
    print(f"new, one process: {one['seconds']:.1f} s")
    many = _timed(ROOT / "custom", run, args.jobs)
    print(f"new, {args.jobs} processes: {many['seconds']:.1f} s")
    keys = ("effects", "wilcoxon", "gm_05")
    same = all(landed[k] == one[k] == many[k] for k in keys)
    print(f"effects, Wilcoxon p and GM at 0.5 identical to the last bit: {'yes' if same else 'NO'}")
    result = {
        "run": str(Path(args.run)),
        "cells": landed["cells"],
        "baseline_rev": args.baseline_rev,
        "landed_seconds": landed["seconds"],
        "new_seconds_one_process": one["seconds"],
        "new_seconds_jobs": many["seconds"],
        "jobs": args.jobs,
        "identical": same,
        "speedup_one_process": landed["seconds"] / one["seconds"],
        "speedup_jobs": landed["seconds"] / many["seconds"],
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"effects speedup: {result['speedup_one_process']:.2f}x one process, "
        f"{result['speedup_jobs']:.2f}x with {args.jobs} processes (landed {landed['seconds']:.0f} s)"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

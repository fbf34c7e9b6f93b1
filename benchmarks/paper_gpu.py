"""The `paper` profile on one GPU within a device-time budget: the papers' backbone and scale on the
scenarios and methods the papers' claims are about, as far as the budget goes.

Settings (the `paper` profile: DenseNet121, SynthCXR at 64 px with 20,000 images, 50 rounds of one
local epoch, batch 32, scored every 5 rounds; ``--device cuda``): scenarios ``label-a0.5`` and
``quantity-shift``; FedAvg, FedDRAW, FedBB as its paper runs it and DAFL; seed 0 first, then 1 and 2.
The cells run in that order (all methods of one seed before the next seed), ``--jobs`` at a time on
the one GPU, each in its own process. The bench is stopped when ``--budget-s`` runs out; the cells
finished by then are in its cell cache, so rerunning the same command continues where it stopped and
ends with the bench's report once every cell is done. Nothing is downloaded (SynthCXR is generated).

    python benchmarks/paper_gpu.py --out runs/paper-gpu [--budget-s 540] [--jobs 8] [--seeds 0 1 2]
    python benchmarks/paper_gpu.py --out runs/paper-gpu --print   # the commands only

Prints each bench command, the cells finished, and writes ``<out>/paper_gpu.json`` (commands, budget,
wall time, cells finished, whether the bench ended).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

SCENARIOS = ("label-a0.5", "quantity-shift")
METHODS = ("fedavg", "feddraw", "fedbb-paper", "dafl")
DEFAULT_BUDGET_S = 540  # 9 minutes of a 10-minute device allowance: start-up and copying back need the rest


def bench_command(out: Path, seed: int, jobs: int, device: str, extra: list[str]) -> list[str]:
    """The ``fedweigh bench`` command for one seed of the grid (its own output folder per seed)."""
    return [
        sys.executable,
        "-m",
        "fedweigh.cli",
        "bench",
        "--profile",
        "paper",
        "--dataset",
        "synthcxr",
        "--scenarios",
        *SCENARIOS,
        "--methods",
        *METHODS,
        "--seeds",
        str(seed),
        "--device",
        device,
        "--jobs",
        str(jobs),
        "--no-progress",
        *extra,
        "--out",
        str(out / f"seed-{seed}"),
    ]


def cells_done(folder: Path) -> int:
    cells = folder / "cells"
    return len(list(cells.glob("*.json"))) if cells.is_dir() else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="device seconds for the bench runs"
    )
    ap.add_argument("--jobs", type=int, default=8, help="cells at once on the GPU (default 8)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--device", default="cuda", help="default cuda; cpu only to try the script")
    ap.add_argument("--print", action="store_true", help="print the commands and exit")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more `fedweigh bench` options")
    args = ap.parse_args(argv)
    if args.budget_s <= 0 or args.jobs < 1:
        ap.error("--budget-s must be > 0 and --jobs >= 1")
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    commands = [bench_command(args.out, s, args.jobs, args.device, extra) for s in args.seeds]
    if args.print:
        for cmd in commands:
            print(shlex.join(cmd))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device here; this script is for a GPU machine (--device cpu to try it)")
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, ["custom", os.environ.get("PYTHONPATH")])),
    }
    start, record = time.monotonic(), {"budget_s": args.budget_s, "seeds": {}}
    ended = True
    for seed, cmd in zip(args.seeds, commands, strict=True):
        left = args.budget_s - (time.monotonic() - start)
        if left <= 0:
            ended = False
            break
        print(f"$ {shlex.join(cmd)}   (budget left {left:.0f} s)", flush=True)
        # its own process group, so that a spent budget ends the bench's cell workers with it
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc, ended = None, False
        folder = args.out / f"seed-{seed}"
        record["seeds"][str(seed)] = {
            "command": shlex.join(cmd),
            "returncode": rc,
            "cells_done": cells_done(folder),
        }
        print(f"seed {seed}: {cells_done(folder)} cells done" + ("" if rc == 0 else f" (stopped: rc {rc})"))
        if rc != 0:
            ended = False
            break
    record["wall_s"] = round(time.monotonic() - start, 1)
    record["ended"] = ended
    (args.out / "paper_gpu.json").write_text(json.dumps(record, indent=2) + "\n")
    if not ended:
        print("budget spent or a run stopped: rerun the same command to continue from the cell cache")
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

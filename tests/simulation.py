"""Helpers that export a recipe and run it with `nvflare simulator`, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fedweigh.cli import find_server_app_dir
from fedweigh.flare.recorder import load_rows
from fedweigh.site import ClientArgs

#: The tiny SynthCXR setting of the simulator tests: iid-4 over 400 images gives every site 90 training
#: images; max_steps fixes 4 local steps; one torch thread per site keeps runs reproducible.
TINY_CLIENT = ClientArgs(
    dataset="synthcxr", scenario="iid-4", num_images=400, max_steps=4, batch_size=16, threads=1
)
TINY_ROUNDS = 3


#: Runs shared by tests in one session, by key (see :func:`cached_run`).
_RUNS: dict[str, tuple[list[dict], Path]] = {}


def cached_run(key: str, make_recipe, root: Path, n_clients: int) -> tuple[list[dict], Path]:
    """Run ``make_recipe()`` in the simulator once per session per ``key`` (tests that need the same
    run, e.g. the FedAvg method check and the parity check, share it)."""
    if key not in _RUNS:
        _RUNS[key] = run_recipe_in_simulator(make_recipe(), root / key, n_clients)
    return _RUNS[key]


def run_recipe_in_simulator(recipe, tmp_path: Path, n_clients: int, timeout: int = 420) -> tuple[list[dict], Path]:
    """Export ``recipe`` under tmp_path/jobs, simulate it with n clients / n threads, return (rows, app dir)."""
    jobs = tmp_path / "jobs"
    recipe.export(str(jobs))
    job_dir = jobs / recipe.name
    workspace = tmp_path / "ws"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "nvflare.cli", "simulator", str(job_dir), "-w", str(workspace),
           "-n", str(n_clients), "-t", str(n_clients)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    app = find_server_app_dir(workspace)
    if proc.returncode != 0 or app is None:
        logs = "\n".join(p.read_text()[-3000:] for p in workspace.rglob("log.txt"))
        raise AssertionError(f"simulator failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}")
    return load_rows(app / "fedweigh_metrics.json"), app

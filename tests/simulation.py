"""Helpers that export a recipe and run it with `nvflare simulator`, as a user would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from fedweigh.cli import find_server_app_dir, simulator_command
from fedweigh.protocol import SITE_POLICY_ENV
from fedweigh.server.records import load_rows
from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import PERMISSIVE_DEFAULT

#: The simulated sites' policy in these tests: the simulation default with exact label statistics.
EXACT_STATISTICS = replace(PERMISSIVE_DEFAULT, statistics_epsilon=None, source="tests: exact statistics")

#: The tiny SynthCXR setting of the simulator tests: two sites of ``quantity-a0.3`` over 300 images hold 112
#: and 72 training images, so size-based weights are not 1/2; max_steps fixes 3 local steps at both; one
#: torch thread per site keeps runs reproducible. The bench parity test runs the same setting in process.
TINY_CLIENT = ClientArgs(
    dataset="synthcxr",
    scenario="quantity-a0.3",
    num_images=300,
    size=28,
    max_steps=3,
    batch_size=16,
    threads=1,
)
TINY_ROUNDS = 3


def cached_run(key: str, make_recipe, root: Path, n_clients: int) -> tuple[list[dict], Path]:
    """Run ``make_recipe()`` in the simulator once per test session per ``key`` and share the result.

    Tests that need the same run (e.g. the FedAvg method check and the parity check) share it, also
    across pytest-xdist workers: ``root`` is common to all workers, a file lock makes the first
    worker run the job while the others wait, and ``done.json`` records where the result lies.
    """
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    done = root / key / "done.json"
    with FileLock(str(root / f"{key}.lock")):
        if not done.is_file():
            rows, app = run_recipe_in_simulator(make_recipe(), root / key, n_clients)
            done.write_text(json.dumps({"app": str(app)}))
        app = Path(json.loads(done.read_text())["app"])
    return load_rows(app / "fedweigh_metrics.json"), app


def run_recipe_in_simulator(
    recipe,
    tmp_path: Path,
    n_clients: int,
    timeout: int = 420,
    client_script: Path | None = None,
    env: dict[str, str] | None = None,
    prepare: Callable[[Path], None] | None = None,
) -> tuple[list[dict], Path]:
    """Export ``recipe`` under tmp_path/jobs, simulate it with n clients / n threads, return (rows, app dir).

    ``client_script`` replaces the job's client entry script (e.g. a faulty site); ``prepare(job_dir)``
    may change the exported job before it runs; ``env`` adds environment variables for the simulator and
    its clients.
    """
    jobs = tmp_path / "jobs"
    recipe.export(str(jobs))
    job_dir = jobs / recipe.name
    if client_script is not None:
        entries = list(job_dir.glob("app*/custom/**/fedweigh_client.py"))
        assert entries, f"no client entry script in {job_dir}"
        for entry in entries:
            shutil.copyfile(client_script, entry)
    if prepare is not None:
        prepare(job_dir)
    workspace = tmp_path / "ws"
    # the sites' policy unless the caller names one: the simulation default with exact label statistics
    # (statistics_epsilon null), the configuration the plaintext references and bench parity compare with
    policy = tmp_path / "exact_statistics_policy.json"
    policy.write_text(json.dumps({**PERMISSIVE_DEFAULT.as_dict(), "statistics_epsilon": None}))
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        **({} if SITE_POLICY_ENV in os.environ else {SITE_POLICY_ENV: str(policy)}),
        **(env or {}),
    }
    cmd = simulator_command(job_dir, workspace, n_clients)
    # a session of its own: the simulator's processes end their whole process group when something
    # goes wrong, which must not take the test process with them
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path, start_new_session=True
    )
    app = find_server_app_dir(workspace)
    if proc.returncode != 0 or app is None:
        logs = "\n".join(p.read_text()[-3000:] for p in workspace.rglob("log.txt"))
        raise AssertionError(
            f"simulator failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
        )
    return load_rows(app / "fedweigh_metrics.json"), app


def saved_float_params(path: Path) -> dict[str, np.ndarray]:
    """The floating-point tensors of a model saved by NVFlare's PyTorch persistor, as NumPy arrays."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    state = state.get("model", state)
    return {k: v.numpy() for k, v in state.items() if v.is_floating_point()}


def plaintext_reference(
    scheme: str, client: ClientArgs, global_stats: bool, rounds: int, sites: int, meta: dict | None = None
):
    """(initial model, final global model, weights per round) of the plaintext path, in this process.

    The same core code the controller and the client script run (:class:`fedweigh.site.trainer.SiteTrainer` +
    :class:`fedweigh.server.rounds.RoundStep`) for ``sites`` simulated sites; with one torch thread it
    reproduces a plaintext simulator run bit for bit. ``meta`` overrides what every site reports (e.g.
    the same sample count everywhere, for FedAvg's equal weights).
    """
    from dataclasses import asdict

    from fedweigh.flare.recipes import ModelSpec
    from fedweigh.histograms import decode_sum, statistics_vector
    from fedweigh.models import FedweighNet
    from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
    from fedweigh.site.data_config import resolve_site_data
    from fedweigh.site.trainer import SiteTrainer
    from fedweigh.train import get_params
    from fedweigh.weighting import get_scheme

    g = initial = get_params(FedweighNet(**asdict(ModelSpec(seed=client.seed))))
    trainers = []
    for name in [f"site-{k + 1}" for k in range(sites)]:
        site, test, _ = resolve_site_data(name, client)
        # exact label statistics, as the simulated sites' policy (run_recipe_in_simulator)
        trainers.append(SiteTrainer(site, test, client, threads=1, policy=EXACT_STATISTICS))
    if global_stats:
        total = sum(statistics_vector(t.class_counts, len(t.site.train)) for t in trainers)
        for t in trainers:
            t.global_stats = decode_sum(total)
    step, weights = RoundStep(get_scheme(scheme), PlaintextBackend(g), num_rounds=rounds), []
    for t in range(1, rounds + 1):
        plan = step.plan(scheme, {})
        results = []
        for tr in trainers:
            out = tr.run_round(g, t - 1, plan)
            reported = {
                "num_samples": out.num_samples,
                "NUM_STEPS_CURRENT_ROUND": out.num_steps,
                "fedweigh_scalars": out.scalars,
                **(meta or {}),
            }
            results.append(ClientResult(tr.site_name, out.params, reported))
        update = step.run(t, results)
        g = update.params
        weights.append(update.weights)
    return initial, g, weights

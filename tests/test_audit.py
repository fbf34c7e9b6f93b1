"""Message audit: everything the server receives in a secure run, through the real controller.

One DAFL job (DAFL loss, so a secure label-statistics phase; size weights, ``mode="size"``, so the
plan asks the sites for no scalar at all) with homomorphically encrypted updates, 3 sites, 2 rounds, in
``nvflare simulator``. A task-result filter (tests/audit_filter.py) records every message the server
receives before the controller reads it, in every phase: statistics (collect, distribute), training
rounds, and the final evaluation; a component records every event the sites send it (the metrics
each site's tracking writer streams). The test then searches all of them for:

- any site's plaintext label histogram h_k, the global histogram H, and the statistics vector's
  N_k c_k, as numbers in any array, list, number or text;
- any scalar the plan did not ask for: DAFL's client imbalance c_k, CBR's skew, FedDisco's
  discrepancy (all computed here from the sites' true data), and any ``fedweigh_scalars`` entry;
- any floating-point model array in clear (under HE every update travels as ciphertext).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from simulation import TINY_CLIENT

from fedweigh.cli import find_server_app_dir, simulator_command
from fedweigh.server.records import load_rows

SITES = ("site-1", "site-2", "site-3")
ROUNDS = 2
AUDITED_TASKS = ["stats", "train", "validate"]


def _site_truth() -> dict[str, dict]:
    """Each simulated site's true training histogram and the scalars derived from it."""
    from fedweigh.imbalance import client_imbalance
    from fedweigh.site.data_config import load_site_from_scenario
    from fedweigh.weighting.cbr import imbalance_cv

    out = {}
    for site in SITES:
        data, _, _ = load_site_from_scenario(
            site,
            TINY_CLIENT.scenario,
            TINY_CLIENT.dataset,
            data_path=None,
            size=TINY_CLIENT.size,
            seed=TINY_CLIENT.seed,
            num_images=TINY_CLIENT.num_images,
        )
        counts = data.train.label_histogram().astype(np.float64)
        n = len(data.train)
        out[site] = {
            "counts": counts,
            "n": n,
            "imbalance": client_imbalance(counts, n),
            "skew": imbalance_cv(counts),
        }
    return out


def _export(tmp_path: Path, audit_dir: Path) -> Path:
    from fedweigh.flare.recipes import DAFLRecipe

    recipe = DAFLRecipe(
        name="audit_dafl_he",
        num_rounds=ROUNDS,
        min_clients=len(SITES),
        client=TINY_CLIENT,
        he=True,
        dafl={"mode": "size"},
    )
    jobs = tmp_path / "jobs"
    recipe.export(str(jobs))
    job = jobs / recipe.name
    server_config = next(job.glob("app*/config/config_fed_server.json"))
    config = json.loads(server_config.read_text())
    assert config["workflows"][0]["args"].get("statistics", "secure") == "secure"
    config["task_result_filters"] = [
        {
            "tasks": AUDITED_TASKS,
            "filters": [{"path": "audit_filter.AuditFilter", "args": {"out_dir": str(audit_dir)}}],
        }
    ]
    config["components"].append(
        {"id": "audit_events", "path": "audit_filter.AuditEventRecorder", "args": {"out_dir": str(audit_dir)}}
    )
    server_config.write_text(json.dumps(config, indent=2))
    shutil.copyfile(
        Path(__file__).with_name("audit_filter.py"),
        server_config.parent.parent / "custom" / "audit_filter.py",
    )
    return job


@pytest.fixture(scope="module")
def audited_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audit")
    audit_dir = tmp / "received"
    job = _export(tmp, audit_dir)
    workspace = tmp / "ws"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        simulator_command(job, workspace, len(SITES)),
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp,
    )
    app = find_server_app_dir(workspace)
    if proc.returncode != 0 or app is None:
        logs = "\n".join(p.read_text()[-3000:] for p in workspace.rglob("log.txt"))
        raise AssertionError(f"simulator failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n{logs}")
    messages = []
    for record in sorted(audit_dir.glob("*.json")):
        meta = json.loads(record.read_text())
        with np.load(record.with_suffix(".npz")) as npz:
            meta["array_values"] = dict(
                zip(meta["arrays"], (npz[f"a{i}"] for i in range(len(meta["arrays"]))), strict=True)
            )
        messages.append(meta)
    return {"rows": load_rows(app / "fedweigh_metrics.json"), "messages": messages, "truth": _site_truth()}


def _numbers(message: dict) -> tuple[list[np.ndarray], np.ndarray]:
    """(every array, flattened to float64; every scalar number, including numbers written in text)."""
    sequences = [np.asarray(a, dtype=np.float64).ravel() for a in message["array_values"].values()]
    scalars: list[float] = []
    for value in message["leaves"].values():
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            scalars.append(float(value))
        elif isinstance(value, str):
            found = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", value)]
            scalars.extend(found)
            if len(found) > 1:
                sequences.append(np.asarray(found))
    return sequences, np.asarray(scalars + [x for s in sequences for x in (s if s.size <= 64 else [])])


def _contains(sequence: np.ndarray, target: np.ndarray) -> bool:
    """Whether ``target`` occurs as a contiguous run of ``sequence`` (each entry within np.isclose's
    tolerances, atol 1e-6): the candidate starts are narrowed one entry at a time, vectorised."""
    n = target.size
    if sequence.size < n:
        return False
    starts = np.flatnonzero(np.isclose(sequence[: sequence.size - n + 1], target[0], atol=1e-6))
    for k in range(1, n):
        if not starts.size:
            break
        starts = starts[np.isclose(sequence[starts + k], target[k], atol=1e-6)]
    return bool(starts.size)


@pytest.mark.slow
def test_the_run_completes_and_every_phase_was_audited(audited_run):
    rows = {r["round"]: r for r in audited_run["rows"]}
    for t in range(1, ROUNDS + 1):
        assert rows[t]["global_updated"] and set(rows[t]["weights"]) == set(SITES), rows[t]
    assert "test_auc" in rows[ROUNDS]  # the final evaluation reached the server
    tasks = [(m["task"], m["site"]) for m in audited_run["messages"] if not m["task"].startswith("event:")]
    for site in SITES:
        assert tasks.count(("stats", site)) == 2  # collect and distribute
        assert tasks.count(("train", site)) == ROUNDS
        assert tasks.count(("validate", site)) == 1
    assert len(tasks) == len(SITES) * (2 + ROUNDS + 1)
    # and the metrics each site's tracking writer streams to the server, as events
    events = [m for m in audited_run["messages"] if m["task"] == "event:fed.analytix_log_stats"]
    assert {m["site"] for m in events} == set(SITES)
    assert any("val_auc" in json.dumps(m["leaves"]) for m in events)


@pytest.mark.slow
def test_no_message_holds_a_plaintext_histogram(audited_run):
    truth = audited_run["truth"]
    global_counts = np.sum([t["counts"] for t in truth.values()], axis=0)
    secrets = {"H": global_counts}
    for site, t in truth.items():
        secrets[f"h_{site}"] = t["counts"]
        secrets[f"v_{site}"] = np.append(t["counts"], t["n"])  # the statistics vector's head
    for message in audited_run["messages"]:
        sequences, scalars = _numbers(message)
        for name, secret in secrets.items():
            leaked = [s for s in sequences if _contains(s, secret)]
            assert not leaked, f"{name} in {message['task']} from {message['site']}"
        for site, t in truth.items():  # N_k c_k, the statistics vector's last entry
            assert not np.any(np.isclose(scalars, t["n"] * t["imbalance"], rtol=1e-9, atol=0)), (
                site,
                message["task"],
            )


@pytest.mark.slow
def test_no_message_holds_a_scalar_the_plan_did_not_ask_for(audited_run):
    from fedweigh.weighting.feddisco import kl_discrepancy

    truth = audited_run["truth"]
    global_counts = np.sum([t["counts"] for t in truth.values()], axis=0)
    forbidden = {}
    for site, t in truth.items():
        forbidden[f"imbalance {site}"] = t["imbalance"]
        forbidden[f"skew {site}"] = t["skew"]
        forbidden[f"discrepancy {site}"] = kl_discrepancy(t["counts"], global_counts)
    for message in audited_run["messages"]:
        scalar_entries = {p: v for p, v in message["leaves"].items() if "fedweigh_scalars/" in p}
        scalar_arrays = [p for p in message["arrays"] if "fedweigh_scalars" in p]
        assert not scalar_entries and not scalar_arrays, (message["task"], message["site"], scalar_entries)
        _, scalars = _numbers(message)
        for name, value in forbidden.items():
            assert not np.any(np.isclose(scalars, value, rtol=1e-9, atol=0)), (
                name,
                message["task"],
                message["site"],
            )


@pytest.mark.slow
def test_training_results_carry_the_update_only_as_ciphertext(audited_run):
    for message in audited_run["messages"]:
        if message["task"] != "train":
            continue
        for path, array in message["array_values"].items():
            assert array.dtype.kind != "f" or array.size <= 64, (path, array.dtype, array.shape)
            if "fedweigh_he_update/" not in path:  # the clear arrays under HE: integer buffers only
                assert array.dtype.kind in "iub", (path, array.dtype)

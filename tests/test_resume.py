"""A run stopped after round t and resumed from its saved state trains only rounds t+1..T, from that
state, and ends where an uninterrupted run ends.

Training is deterministic, so a rerun from scratch would also end with the uninterrupted run's model:
each test therefore also checks which rounds the resumed run trained (the server's and the sites'
logs) and, with FedAdp, that the scheme's cross-round state came back (its smoothed angles change the
weights of round 3). The HE variant resumes from the encrypted global model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from simulation import (
    TINY_CLIENT,
    TINY_ROUNDS,
    plaintext_reference,
    run_recipe_in_simulator,
    saved_float_params,
)

from fedweigh.flare.jobs import _job
from fedweigh.protocol import STATE_JSON


def trained_rounds(workspace: Path) -> dict[str, list[int]]:
    """Rounds (from 1) the server sent training tasks for, and each site trained, by the run's logs (the
    sites number a training round as the server does)."""
    server = "\n".join(p.read_text(errors="replace") for p in (workspace / "server").rglob("log.txt"))
    out = {"server": sorted({int(t) for t in re.findall(r"round (\d+)/\d+: sites", server)})}
    for site_dir in sorted(workspace.glob("site-*")):
        log = "\n".join(p.read_text(errors="replace") for p in site_dir.rglob("log.txt"))
        out[site_dir.name] = sorted(
            {int(t) for t in re.findall(rf"{site_dir.name} round (\d+): \d+ steps", log)}
        )
    return out


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.slow
def test_stopped_and_resumed_fedadp_trains_only_the_last_round_from_the_saved_state(tmp_path, method_run):
    full_rows, full_app = method_run("fedadp")  # 3 rounds without a stop
    assert trained_rounds(full_app.parents[2]) == {
        "server": [1, 2, 3],
        "site-1": [1, 2, 3],
        "site-2": [1, 2, 3],
    }

    first = _job("fedadp", TINY_CLIENT, TINY_ROUNDS, 2, stop_after=2)("fedadp_part1")
    rows1, app1 = run_recipe_in_simulator(first, tmp_path / "part1", 2)
    assert max(r["round"] for r in rows1) == 2
    state = json.loads((app1 / STATE_JSON).read_text())
    assert state["round"] == 2 and state["scheme_state"]["participations"] == {"site-1": 2, "site-2": 2}

    second = _job("fedadp", TINY_CLIENT, TINY_ROUNDS, 2, resume_from=str(app1))("fedadp_part2")
    rows2, app2 = run_recipe_in_simulator(second, tmp_path / "part2", 2)
    # the second part trained round 3 only, and carried the first part's rows over unchanged
    assert trained_rounds(tmp_path / "part2" / "ws") == {"server": [3], "site-1": [3], "site-2": [3]}
    assert [r for r in rows2 if r["round"] < 2] == [r for r in rows1 if r["round"] < 2]
    assert [r["round"] for r in rows2] == [r["round"] for r in full_rows]
    # the scheme's state came back and went on: after round 3, FedAdp's participation counts and smoothed
    # angles are the uninterrupted run's (a fresh state would count one participation and keep round 3's
    # angle alone); so are round 3's weights and the final model
    resumed_state = json.loads((app2 / STATE_JSON).read_text())["scheme_state"]
    full_state = json.loads((full_app / STATE_JSON).read_text())["scheme_state"]
    assert resumed_state["participations"] == full_state["participations"] == {"site-1": 3, "site-2": 3}
    assert resumed_state["smoothed_angle"] == pytest.approx(full_state["smoothed_angle"], abs=1e-9)
    last_full = next(r for r in full_rows if r["round"] == TINY_ROUNDS)
    last_resumed = next(r for r in rows2 if r["round"] == TINY_ROUNDS)
    assert last_resumed["weights"] == pytest.approx(last_full["weights"], abs=1e-9)
    final = saved_float_params(app2 / "FL_global_model.pt")
    assert largest_difference(final, saved_float_params(full_app / "FL_global_model.pt")) <= 1e-6
    # and the first part's model is where the second started: round 3 changed it
    assert largest_difference(final, saved_float_params(app1 / "FL_global_model.pt")) > 1e-3


@pytest.mark.slow
def test_stopped_and_resumed_he_run_continues_from_the_encrypted_state(tmp_path):
    """FedDRAW with encrypted updates, stopped after round 2 and resumed: the server restores the
    ciphertext of the global model and the sites decrypt it with the same keys (a deployment's kits; here
    one key folder for both parts, as the simulator would otherwise make new keys per run)."""
    from test_he_simulator import CLIENT, MOVED, SITES, TOL, he_recipe

    from fedweigh.flare.client import HE_SITE_MODEL_FILE
    from fedweigh.secure.contexts import CONTEXT_DIR_ENV, save_context_files

    rounds = 3
    save_context_files(tmp_path / "keys")
    env = {CONTEXT_DIR_ENV: str(tmp_path / "keys")}
    first = he_recipe("feddraw", "he_feddraw_part1", rounds=rounds, he=True, stop_after=2)
    rows1, app1 = run_recipe_in_simulator(first, tmp_path / "part1", SITES, env=env)
    assert (app1 / "fedweigh_he_global.npz").is_file() and not (app1 / "fedweigh_global.npz").exists()
    assert json.loads((app1 / STATE_JSON).read_text())["round"] == 2

    second = he_recipe("feddraw", "he_feddraw_part2", rounds=rounds, he=True, resume_from=str(app1))
    rows2, app2 = run_recipe_in_simulator(second, tmp_path / "part2", SITES, env=env)
    workspace = tmp_path / "part2" / "ws"
    assert trained_rounds(workspace) == {"server": [3], "site-1": [3], "site-2": [3]}
    assert [r for r in rows2 if r["round"] < 2] == [r for r in rows1 if r["round"] < 2]

    # the server kept no plaintext model: no persistor file, no plaintext state, only ciphertext (with full
    # encryption only the integer buffers travel in clear)
    for app in (app1, app2):
        assert not (app / "FL_global_model.pt").exists() and not (app / "fedweigh_global.npz").exists()
    with np.load(app2 / "fedweigh_he_global.npz") as npz:
        clear = [f for f in npz.files if f.startswith("clear/")]
        assert any(f.startswith("enc/") for f in npz.files)
        assert clear and all(f.endswith("num_batches_tracked") for f in clear)

    # every site decrypted the same final model, which is the plaintext path's after three rounds
    initial, reference, ref_weights = plaintext_reference("feddraw", CLIENT, False, rounds, SITES)
    site_models = []
    for k in range(SITES):
        with np.load(workspace / f"site-{k + 1}" / HE_SITE_MODEL_FILE.format(job_id="simulate_job")) as npz:
            site_models.append({f: npz[f] for f in npz.files})
    for key in site_models[0]:
        np.testing.assert_array_equal(site_models[0][key], site_models[1][key])
    assert sorted(site_models[0]) == sorted(reference)
    floats = [k for k in reference if reference[k].dtype.kind == "f"]
    he_final = {k: site_models[0][k] for k in floats}

    def distance(model: dict) -> float:
        return largest_difference(he_final, {k: model[k].astype(np.float64) for k in floats})

    assert distance(reference) < TOL
    assert distance(initial) > MOVED
    for key in (k for k in reference if k not in floats):  # integer buffers: the scheme's rule, exactly
        np.testing.assert_array_equal(site_models[0][key], reference[key])
    # each round's weights, rounds 1-2 carried over from the first part; FedDRAW's similarities moved
    # them away from FedAvg's 1/2, and the tolerance tells that apart (FedAvg's equal weights end > 2 TOL away)
    by_round = {r["round"]: r for r in rows2}
    assert sorted(by_round) == list(range(rounds + 1))
    for t in range(1, rounds + 1):
        assert by_round[t]["weights"] == pytest.approx(ref_weights[t - 1], abs=1e-5)
        assert sum(by_round[t]["weights"].values()) == pytest.approx(1.0, abs=1e-9)
    assert max(abs(w - 0.5) for r in ref_weights for w in r.values()) > 0.02
    _, equal_weights, _ = plaintext_reference("fedavg", CLIENT, False, rounds, SITES)
    assert distance(equal_weights) > 2 * TOL

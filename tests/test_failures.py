"""A federation with bad and failing sites, run in the simulator: the server leaves out every invalid
or missing result with its reason, caps an inflated site, keeps the last good global model when too
few results arrive, skips a crashed site at once and lets a site that was silent rejoin.

One 4-site FedAvg run (min_clients=2, max_share=0.4) with faults injected by ``faulty_client.py``. Every
site has started before round 1 (``started_controller.py``), so ``train_timeout`` times the rounds only.
The sites keep each global model they receive and each model they train, so the tests check the global
models themselves, not only the records:

==========  =======================================  ==========================================
round       faults                                   expected
==========  =======================================  ==========================================
1           site-2 NaN, site-3 wrong shape,          one valid result < min_clients: the global
            site-4 negative sample count             model stays the initial one
2           site-2 crashes mid-round                 left out at once (no wait for the timeout);
                                                     the round completes with the other three
3           site-3 silent past train_timeout         left out after train_timeout; the round
                                                     completes with site-1 and site-4
4           site-4 reports 1000x its sample count    capped at 0.4 of the round's weight; site-3
                                                     is back
==========  =======================================  ==========================================
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from simulation import TINY_CLIENT, run_recipe_in_simulator, saved_float_params

from fedweigh.flare.recipes import FedweighRecipe

HERE = Path(__file__).parent
FAULTS = {
    "site-2": {"1": "nan", "2": "crash"},
    "site-3": {"1": "shape", "3": "silent"},
    "site-4": {"1": "negative", "4": "inflate"},
}
TRAIN_TIMEOUT = 40  # a round takes a few seconds once the sites have started
SILENT_S = TRAIN_TIMEOUT + 10
SITES = ("site-1", "site-2", "site-3", "site-4")
#: four sites of equal size (iid-4 over 400 images: 90 training images each), 4 local steps
CLIENT = replace(TINY_CLIENT, scenario="iid-4", num_images=400, size=32, max_steps=4)


def start_every_site_first(job_dir: Path) -> None:
    """Run the job's server workflow as StartedFedweighController (one untimed task to every site first)."""
    shutil.copyfile(HERE / "started_controller.py", job_dir / "app" / "custom" / "started_controller.py")
    config_path = job_dir / "app" / "config" / "config_fed_server.json"
    config = json.loads(config_path.read_text())
    (workflow,) = config["workflows"]
    assert workflow["path"] == "fedweigh.flare.controller.FedweighController"
    workflow["path"] = "started_controller.StartedFedweighController"
    config_path.write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    recipe = FedweighRecipe(
        name="faulty_fedavg",
        scheme="fedavg",
        num_rounds=4,
        min_clients=2,
        client=CLIENT,
        train_timeout=TRAIN_TIMEOUT,
        max_share=0.4,
        # the expected aggregates below are FedAvg's with the cap: the norm bound, which trims the
        # longest honest update to the next one's, has its own tests (test_bounded_influence.py)
        update_norm_bound=None,
    )
    root = tmp_path_factory.mktemp("faulty")
    rows, app = run_recipe_in_simulator(
        recipe,
        root,
        len(SITES),
        client_script=HERE / "faulty_client.py",
        prepare=start_every_site_first,
        env={
            "FEDWEIGH_TEST_FAULTS": json.dumps(FAULTS),
            "FEDWEIGH_TEST_SILENT_S": str(SILENT_S),
            "FEDWEIGH_TEST_RECORD_DIR": str(root / "records"),
        },
        timeout=600,
    )
    return {r["round"]: r for r in rows}, app, root / "records"


def _load(records: Path, site: str, kind: str, round_index: int) -> dict[str, np.ndarray]:
    with np.load(records / site / f"{kind}_{round_index}.npz") as npz:
        return {k: npz[k] for k in npz.files}


def _aggregate(g: dict, trained: dict[str, dict], weights: dict[str, float]) -> dict[str, np.ndarray]:
    """theta_g + sum_k w_k (theta_k - theta_g) over the floating-point arrays, in float64, as FedAvg;
    BatchNorm's running statistics the median over the sites from three sites on (the round's rule)."""
    out = {}
    for key, value in g.items():
        if value.dtype.kind != "f":
            continue
        if key.rsplit(".", 1)[-1] in ("running_mean", "running_var") and len(weights) >= 3:
            stack = np.stack([trained[s][key].astype(np.float64) for s in weights])
            out[key] = np.median(stack, axis=0).astype(value.dtype)
            continue
        g64 = value.astype(np.float64)
        out[key] = (
            g64 + sum(w * (trained[s][key].astype(np.float64) - g64) for s, w in weights.items())
        ).astype(value.dtype)
    return out


def _assert_same_floats(a: dict, b: dict, atol: float = 0.0) -> None:
    keys = [k for k in b if b[k].dtype.kind == "f"]
    assert keys and all(k in a for k in keys)
    worst = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in keys)
    assert worst <= atol, f"largest difference {worst}"


@pytest.mark.slow
def test_invalid_results_are_left_out_with_the_reason_and_the_model_kept(faulty_run):
    rows, _, records = faulty_run
    first = rows[1]
    assert first["global_updated"] is False and "weights" not in first
    excluded = first["excluded"]
    assert set(excluded) == {"site-2", "site-3", "site-4"}
    assert "non-finite" in excluded["site-2"]
    assert "shape" in excluded["site-3"]
    assert "must be positive" in excluded["site-4"] and "-" in excluded["site-4"]
    # the global model of round 2 is the one of round 1, as every site received it
    for site in ("site-1", "site-3", "site-4"):
        _assert_same_floats(_load(records, site, "received", 2), _load(records, "site-1", "received", 1))


@pytest.mark.slow
def test_crashing_site_is_left_out_at_once_and_the_round_completes(faulty_run):
    rows, _, records = faulty_run
    second = rows[2]
    assert second["global_updated"] is True and set(second["excluded"]) == {"site-2"}
    assert set(second["weights"]) == {"site-1", "site-3", "site-4"}
    assert sum(second["weights"].values()) == pytest.approx(1.0)
    # its error came back at once: the round did not wait for train_timeout
    assert second["round_seconds"] < TRAIN_TIMEOUT / 2, second["round_seconds"]
    # the global model is the weighted mean of the three valid results only
    g = _load(records, "site-1", "received", 2)
    trained = {s: _load(records, s, "sent", 2) for s in second["weights"]}
    _assert_same_floats(
        _load(records, "site-1", "received", 3), _aggregate(g, trained, second["weights"]), 1e-6
    )
    assert not (records / "site-2" / "received_3.npz").exists()  # it never comes back


@pytest.mark.slow
def test_silent_site_is_left_out_and_rejoins(faulty_run):
    rows, _, records = faulty_run
    third = rows[3]
    assert third["global_updated"] is True
    assert set(third["excluded"]) == {"site-2", "site-3"} and "no result" in third["excluded"]["site-3"]
    assert set(third["weights"]) == {"site-1", "site-4"}
    assert third["weights"] == pytest.approx({"site-1": 0.5, "site-4": 0.5})  # a cap below 1/K gives 1/K
    assert third["round_seconds"] >= TRAIN_TIMEOUT  # the server waited for the silent site
    g = _load(records, "site-1", "received", 3)
    trained = {s: _load(records, s, "sent", 3) for s in third["weights"]}
    _assert_same_floats(
        _load(records, "site-1", "received", 4), _aggregate(g, trained, third["weights"]), 1e-6
    )
    assert "site-3" in rows[4]["weights"]  # back after its silent round


@pytest.mark.slow
def test_inflated_sample_count_is_capped_in_the_saved_model(faulty_run):
    rows, app, records = faulty_run
    fourth = rows[4]
    assert fourth["global_updated"] is True and set(fourth["excluded"]) == {"site-2"}
    weights = fourth["weights"]
    assert set(weights) == {"site-1", "site-3", "site-4"}
    # uncapped, site-4 would hold 1000/1002 of the weight
    assert weights["site-4"] == pytest.approx(0.4, abs=1e-9)
    for site in ("site-1", "site-3"):
        assert weights[site] == pytest.approx(0.3, abs=1e-9)
    g = _load(records, "site-1", "received", 4)
    trained = {s: _load(records, s, "sent", 4) for s in weights}
    final = saved_float_params(app / "FL_global_model.pt")
    _assert_same_floats(final, _aggregate(g, trained, weights), 1e-6)
    assert all(np.isfinite(v).all() for v in final.values())

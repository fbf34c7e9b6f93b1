"""A federation with bad and failing sites, run in the simulator: the server leaves out every invalid
or missing result with its reason, caps an inflated site, keeps the last good global model when too
few results arrive, and lets a site that was silent rejoin.

One 4-site FedAvg run (min_clients=2, max_share=0.4) with faults injected by ``faulty_client.py``:

==========  =======================================  ==========================================
round       faults                                   expected
==========  =======================================  ==========================================
1           site-2 NaN, site-3 wrong shape,          one valid result < min_clients: the global
            site-4 negative sample count             model stays the initial one
2           site-4 reports 1000x its sample count    capped at 0.4 of the round's weight
3           site-3 silent past train_timeout         left out; the round completes with three
4           site-2 crashes mid-round                 left out; site-3 is back
==========  =======================================  ==========================================
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from simulation import TINY_CLIENT, run_recipe_in_simulator, saved_float_params

from fedweigh.flare.recipes import FedweighRecipe

FAULTS = {
    "site-2": {"1": "nan", "4": "crash"},
    "site-3": {"1": "shape", "3": "silent"},
    "site-4": {"1": "negative", "2": "inflate"},
}
TRAIN_TIMEOUT = 60  # generous: round 1 includes each site's start-up (about 25 s on 2 quiet cores)
SILENT_S = TRAIN_TIMEOUT + 10


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    recipe = FedweighRecipe(
        name="faulty_fedavg",
        scheme="fedavg",
        num_rounds=4,
        min_clients=2,
        client=TINY_CLIENT,
        train_timeout=TRAIN_TIMEOUT,
        max_share=0.4,
    )
    rows, app = run_recipe_in_simulator(
        recipe,
        tmp_path_factory.mktemp("faulty"),
        4,
        client_script=Path(__file__).with_name("faulty_client.py"),
        env={"FEDWEIGH_TEST_FAULTS": json.dumps(FAULTS), "FEDWEIGH_TEST_SILENT_S": str(SILENT_S)},
        timeout=600,
    )
    return {r["round"]: r for r in rows}, app


@pytest.mark.slow
def test_invalid_results_are_left_out_with_the_reason_and_the_model_kept(faulty_run):
    rows, _ = faulty_run
    first = rows[1]
    assert first["global_updated"] is False and "weights" not in first
    excluded = first["excluded"]
    assert set(excluded) == {"site-2", "site-3", "site-4"}
    assert "non-finite" in excluded["site-2"]
    assert "shape" in excluded["site-3"]
    assert "must be positive" in excluded["site-4"] and "-" in excluded["site-4"]


@pytest.mark.slow
def test_inflated_sample_count_is_capped(faulty_run):
    rows, _ = faulty_run
    weights = rows[2]["weights"]
    assert rows[2]["global_updated"] is True and rows[2]["excluded"] == {}
    assert set(weights) == {"site-1", "site-2", "site-3", "site-4"}
    # uncapped, site-4 would hold 1000/1003 of the weight
    assert weights["site-4"] == pytest.approx(0.4, abs=1e-9)
    for site in ("site-1", "site-2", "site-3"):
        assert weights[site] == pytest.approx(0.2, abs=1e-9)


@pytest.mark.slow
def test_silent_site_is_left_out_and_rejoins(faulty_run):
    rows, _ = faulty_run
    assert rows[3]["global_updated"] is True
    assert set(rows[3]["excluded"]) == {"site-3"} and "no result" in rows[3]["excluded"]["site-3"]
    assert set(rows[3]["weights"]) == {"site-1", "site-2", "site-4"}
    assert sum(rows[3]["weights"].values()) == pytest.approx(1.0)
    assert "site-3" in rows[4]["weights"]  # back after its silent round


@pytest.mark.slow
def test_crashing_site_is_left_out_and_the_round_completes(faulty_run):
    rows, app = faulty_run
    assert rows[4]["global_updated"] is True
    assert set(rows[4]["excluded"]) == {"site-2"}
    assert set(rows[4]["weights"]) == {"site-1", "site-3", "site-4"}
    assert sum(rows[4]["weights"].values()) == pytest.approx(1.0)
    final = saved_float_params(app / "FL_global_model.pt")
    assert final and all(np.isfinite(v).all() for v in final.values())

"""Every method runs as an NVFlare simulator job (3 rounds, tiny SynthCXR) and leaves sane records."""

from __future__ import annotations

import math

import pytest
from simulation import TINY_ROUNDS

from fedweigh.flare.jobs import METHODS


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_method_runs_three_rounds_in_the_simulator(method, method_run):
    rows, app = method_run(method)
    by_round = {r["round"]: r for r in rows}
    assert sorted(by_round) == list(range(TINY_ROUNDS + 1)), rows
    for t in range(1, TINY_ROUNDS + 1):
        weights = by_round[t]["weights"]
        assert set(weights) == {"site-1", "site-2"}
        assert all(math.isfinite(w) and w >= 0 for w in weights.values())
        assert sum(weights.values()) == pytest.approx(1.0, abs=1e-6)  # FedNova's too: the round normalises
    for t in range(TINY_ROUNDS + 1):
        assert 0.0 <= by_round[t]["test_auc"] <= 1.0
        assert 0.0 <= by_round[t]["val_gm"] <= 1.0
    if method == "feddraw":  # the schedule values are recorded each round: lambda rises, beta falls to 0
        lam = [by_round[t]["lambda"] for t in range(1, TINY_ROUNDS + 1)]
        beta = [by_round[t]["beta"] for t in range(1, TINY_ROUNDS + 1)]
        assert lam == sorted(lam) and beta[-1] == pytest.approx(0.0)
    assert (app / "fedweigh_client_weights.png").stat().st_size > 1000
    assert (app / "FL_global_model.pt").is_file()
    # the controller fires NVFlare's round events, so the job's IntimeModelSelector picks a best model
    assert (app / "best_FL_global_model.pt").is_file()

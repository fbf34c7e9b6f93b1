"""Every method runs as an NVFlare simulator job (3 rounds, tiny SynthCXR) and leaves sane records."""

from __future__ import annotations

import math

import pytest

from fedweigh.flare.jobs import METHODS, _job
from fedweigh.site import ClientArgs

TINY = ClientArgs(dataset="synthcxr", scenario="label-shift", num_images=400, max_steps=4, batch_size=16)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_method_runs_three_rounds_in_the_simulator(method, tmp_path, simulator):
    recipe = _job(method, TINY, rounds=3, sites=2)(f"tiny_{method}")
    rows, app = simulator(recipe, tmp_path, n_clients=2)
    by_round = {r["round"]: r for r in rows}
    assert sorted(by_round) == [0, 1, 2, 3], rows
    for t in (1, 2, 3):
        weights = by_round[t]["weights"]
        assert set(weights) == {"site-1", "site-2"}
        assert all(math.isfinite(w) for w in weights.values())
        if method != "fednova":  # FedNova's weights act on deltas with an effective step, not a convex mix
            assert sum(weights.values()) == pytest.approx(1.0, abs=1e-6)
    for t in range(4):
        assert 0.0 <= by_round[t]["test_auc"] <= 1.0
    assert (app / "fedweigh_client_weights.png").stat().st_size > 1000
    assert (app / "FL_global_model.pt").is_file()

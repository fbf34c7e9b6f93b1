"""A run stopped after round t and resumed from its saved state equals an uninterrupted run."""

from __future__ import annotations

import numpy as np
import pytest
from simulation import TINY_CLIENT, TINY_ROUNDS, run_recipe_in_simulator, saved_float_params

from fedweigh.flare.jobs import _job


@pytest.mark.slow
def test_stopped_and_resumed_feddraw_equals_uninterrupted(tmp_path, method_run):
    full_rows, full_app = method_run("feddraw")  # 3 rounds without a stop

    first = _job("feddraw", TINY_CLIENT, TINY_ROUNDS, 2, stop_after=2)("feddraw_part1")
    rows1, app1 = run_recipe_in_simulator(first, tmp_path / "part1", 2)
    assert max(r["round"] for r in rows1) == 2 and (app1 / "fedweigh_state.json").is_file()

    second = _job("feddraw", TINY_CLIENT, TINY_ROUNDS, 2, resume_from=str(app1))("feddraw_part2")
    rows2, app2 = run_recipe_in_simulator(second, tmp_path / "part2", 2)

    # the resumed run carries the earlier rows and continues at round 3 with the same schedule values
    assert [r["round"] for r in rows2] == [r["round"] for r in full_rows]
    last_full = next(r for r in full_rows if r["round"] == TINY_ROUNDS)
    last_resumed = next(r for r in rows2 if r["round"] == TINY_ROUNDS)
    assert last_resumed["weights"] == pytest.approx(last_full["weights"], abs=1e-9)
    assert last_resumed["lambda"] == pytest.approx(last_full["lambda"])
    a, b = (
        saved_float_params(full_app / "FL_global_model.pt"),
        saved_float_params(app2 / "FL_global_model.pt"),
    )
    assert a.keys() == b.keys()
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 1e-6

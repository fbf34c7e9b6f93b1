"""The round step at its edges (``fedweigh.server.rounds``): the plaintext backend's arithmetic, what
the safeguards record of one site, and which contribution the leave-one-out search leaves out when
several would mend a failing aggregate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_round_integrity import SITES, VarScale, result  # VarScale: x / sqrt(var), NaN once var < 0

from fedweigh.server.model_check import ModelProbe
from fedweigh.server.rounds import PlaintextBackend, RoundOutcome, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.weighting import get_scheme


def global_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.normal(0, 0.1, (4, 5)).astype(np.float32),
        "b": rng.normal(0, 0.1, 5).astype(np.float32),
        "n": np.array(3, np.int64),
    }


def update(site: str, g: dict, scale: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sum(map(ord, site)))
    return {
        k: (v + scale + rng.normal(0, scale / 2, v.shape)).astype(v.dtype)
        if np.issubdtype(v.dtype, np.floating)
        else v + 2
        for k, v in g.items()
    }


# ---- PlaintextBackend --------------------------------------------------------------------------


def test_scale_update_moves_each_array_toward_the_global_model_by_its_factor_in_float64():
    g = global_model()
    backend = PlaintextBackend(g)
    rng = np.random.default_rng(1)
    sent = {
        "w": (g["w"] + rng.normal(0, 3.0, g["w"].shape)).astype(np.float32),
        "b": (g["b"] + rng.normal(0, 3.0, 5)).astype(np.float32),
        "n": np.array(9, np.int64),
    }
    factors = np.array([1.0 / 3.0, 1.0])  # the floating-point arrays in the global model's order: w, b
    out = backend.scale_update(sent, factors)
    g64, c64 = g["w"].astype(np.float64), sent["w"].astype(np.float64)
    expected = (g64 + (1.0 / 3.0) * (c64 - g64)).astype(np.float32)
    assert out["w"].dtype == np.float32
    np.testing.assert_array_equal(out["w"], expected)
    assert out["b"] is sent["b"]  # a factor of 1 leaves the array as it was sent
    assert out["n"] is sent["n"]  # integer buffers are never scaled
    assert sent["w"] is not out["w"] and not np.array_equal(sent["w"], out["w"])  # the input is not changed


def test_scale_update_takes_factors_of_any_shape_one_per_array():
    g = global_model()
    sent = update("site-1", g, scale=1.0)
    flat = PlaintextBackend(g).scale_update(sent, np.array([0.5, 0.25]))
    column = PlaintextBackend(g).scale_update(sent, np.array([[0.5], [0.25]]))
    for key in ("w", "b"):
        np.testing.assert_array_equal(flat[key], column[key])
    with pytest.raises(ValueError):
        PlaintextBackend(g).scale_update(sent, np.array([0.5]))  # one factor for two arrays


def test_aggregate_proposes_and_adopts_the_weighted_mean():
    g = global_model()
    backend = PlaintextBackend(g)
    sent = [update(s, g) for s in SITES[:2]]
    reports = [
        r
        for r, _ in (
            RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=1).validate(result(s, p))
            for s, p in zip(SITES[:2], sent, strict=True)
        )
    ]
    out = backend.aggregate(get_scheme("fedavg"), reports, sent, np.array([0.25, 0.75]))
    expected = g["w"].astype(np.float64) + sum(
        wk * (p["w"].astype(np.float64) - g["w"]) for wk, p in zip((0.25, 0.75), sent, strict=True)
    )
    np.testing.assert_allclose(out["w"], expected, rtol=1e-6)
    assert backend.task_params()["w"] is out["w"]  # adopted: the next round starts from it


# ---- what the safeguards record ----------------------------------------------------------------


def test_two_bounds_on_one_site_are_both_recorded_and_logged_as_warnings():
    g = global_model()
    logged: list[str] = []
    step = RoundStep(
        get_scheme("fedavg"),
        PlaintextBackend(g),
        num_rounds=3,
        safeguards=Safeguards(max_share=None, min_update_cosine=None),
        log=logged.append,
    )
    sent = {s: update(s, g) for s in SITES}
    sent["site-4"] = update("site-4", g, scale=1.0)  # ~100 x the others' update
    results = [result(s, p, n=100_000 if s == "site-4" else 100) for s, p in sent.items()]  # > 100 x
    outcome = step.run(1, results, list(SITES))
    assert outcome.updated
    record = outcome.bounded["site-4"]
    counts, norms = record.split("; ", 1)
    assert counts.startswith("num_samples=100000 clipped to 10000 ")
    assert norms.startswith("2 of 2 arrays above 3 x the median of the other sites' scaled down to it")
    assert [line for line in logged if "site-4" in line] == [
        f"round 1: site-4: {counts}",
        f"round 1: site-4: {norms}",
    ]


# ---- the leave-one-out search ------------------------------------------------------------------


def scale_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), VarScale(4))


def test_of_several_sites_whose_removal_mends_the_aggregate_the_largest_update_is_left_out():
    from fedweigh.train import get_params

    g = get_params(scale_model())
    sent = {}
    # two honest sites (var 1) and two that each drive var negative; without either one the mean is positive
    for site, var in (("site-1", 1.0), ("site-2", 1.0), ("site-3", -1.5), ("site-4", -1.6)):
        p = {k: v.copy() for k, v in g.items()}
        p["1.var"] = np.full(4, var, np.float32)
        sent[site] = p
    step = RoundStep(
        get_scheme("uniform"),
        PlaintextBackend(g),
        num_rounds=3,
        safeguards=Safeguards.off(),
        probe=ModelProbe(scale_model(), input_shape=(3,)),
    )
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(SITES))
    assert list(outcome.excluded) == ["site-4"]  # the larger of the two updates (var -1.6 vs -1.5)
    assert "without it, it passes" in outcome.excluded["site-4"]
    assert outcome.updated and set(outcome.weights) == {"site-1", "site-2", "site-3"}
    np.testing.assert_allclose(outcome.params["1.var"], (1.0 + 1.0 - 1.5) / 3, rtol=1e-6)


def test_an_outcome_without_params_is_not_updated():
    assert not RoundOutcome(round_index=1).updated
    assert RoundOutcome(round_index=1, params={}).updated

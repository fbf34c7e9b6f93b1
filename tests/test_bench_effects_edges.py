"""The benchmark's effect estimates at their edges (``fedweigh.bench.effects``): the pairing a paired
effect needs and its message, resamples that are undefined, and the verdict of an interval that
touches 0 or is not finite."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from fedweigh.bench.effects import (
    REFERENCE_METHOD,
    Effect,
    _effects,
    bootstrap_aucs,
    paired_effect,
    paired_noise_floor,
    verdict,
)

NEEDS_PAIRS = r"^paired_effect: one \(method, reference\) pair per seed is needed$"


def seed(full: float, resampled) -> tuple[float, np.ndarray]:
    return full, np.asarray(resampled, dtype=float)


# ---- paired_effect -----------------------------------------------------------------------------


def test_a_paired_effect_needs_one_reference_per_seed():
    method = [seed(0.7, [0.7, 0.6]), seed(0.8, [0.8, 0.7])]
    with pytest.raises(ValueError, match=NEEDS_PAIRS):
        paired_effect(method, method[:1])
    with pytest.raises(ValueError, match=NEEDS_PAIRS):
        paired_effect([], [])


def test_with_every_resample_undefined_there_is_no_effect():
    method = [seed(0.7, [np.nan, np.nan]), seed(0.8, [np.nan, np.nan])]
    reference = [seed(0.6, [0.6, 0.5]), seed(0.7, [0.7, 0.6])]
    assert paired_effect(method, reference) is None


def test_one_defined_resample_gives_an_interval_of_one_point():
    method = [seed(0.7, [0.75, np.nan]), seed(0.8, [0.85, np.nan])]
    reference = [seed(0.6, [0.65, 0.5]), seed(0.6, [0.55, 0.6])]
    effect = paired_effect(method, reference)
    assert effect == Effect(pytest.approx(0.15), pytest.approx(0.2), pytest.approx(0.2))


def test_an_undefined_full_auc_gives_no_effect():
    method = [seed(math.nan, [0.7, 0.6]), seed(0.8, [0.8, 0.7])]
    reference = [seed(0.6, [0.6, 0.5]), seed(0.7, [0.7, 0.6])]
    assert paired_effect(method, reference) is None


# ---- verdict -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "low, high, expected",
    [
        (0.01, 0.2, "better"),
        (0.0, 0.2, "no evidence"),  # an interval that touches 0 holds it
        (-0.2, -0.01, "worse"),
        (-0.2, 0.0, "no evidence"),
        (-0.1, 0.1, "no evidence"),
        (None, 0.2, "no evidence"),
        (0.01, None, "no evidence"),
        (None, None, "no evidence"),
        (0.01, math.inf, "no evidence"),  # an interval that is not finite is undefined
        (-math.inf, -0.01, "no evidence"),
        (math.nan, 0.2, "no evidence"),
    ],
)
def test_the_verdict_of_an_interval(low, high, expected):
    assert verdict(low, high) == expected


# ---- bootstrap_aucs ------------------------------------------------------------------------------


def test_the_resamples_of_a_seed_do_not_depend_on_how_many_are_drawn_after_them():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, (40, 2)).astype(float)
    scores = rng.random((40, 2))
    full_100, first = bootstrap_aucs(scores, labels, seed=1, n_resamples=100)
    full_150, more = bootstrap_aucs(scores, labels, seed=1, n_resamples=150)  # two chunks: 100 and 50
    assert full_100 == full_150 and more.shape == (150,)
    np.testing.assert_array_equal(more[:100], first)
    assert np.isfinite(more).all() and not np.array_equal(more[100:], first[:50])


# ---- paired_noise_floor and the paired effects of the cells -------------------------------------


def endpoint(rows) -> pd.Series:
    index = pd.MultiIndex.from_tuples([r[:3] for r in rows], names=["scenario", "method", "seed"])
    return pd.Series([r[3] for r in rows], index=index, dtype=np.float64)


def test_the_noise_floor_takes_a_scenario_of_two_seeds_and_none_of_one():
    ref = REFERENCE_METHOD
    scores = endpoint(
        [
            ("a", ref, 0, 0.70),
            ("a", ref, 1, 0.72),
            ("a", "m", 0, 0.71),
            ("a", "m", 1, 0.75),
            ("b", ref, 0, 0.6),
            ("b", "m", 0, 0.7),
        ]
    )
    floor = paired_noise_floor(scores, [ref, "m"], ["a"])
    assert floor == {"m": pytest.approx(np.std([0.01, 0.03], ddof=1))}
    assert paired_noise_floor(scores, [ref, "m"], ["b"]) == {"m": None}  # one paired seed: no sd


def test_a_cell_effect_pairs_only_the_seeds_both_methods_have_and_none_without_any():
    ref = REFERENCE_METHOD
    cached = {
        ("a", ref, 0): seed(0.70, [0.69, 0.71]),
        ("a", "m", 0): seed(0.75, [0.74, 0.77]),
        ("a", "m", 1): seed(0.80, [0.79, 0.81]),  # FedAvg has no seed 1 here
        ("b", ref, 0): seed(0.70, [0.69, 0.71]),
    }
    effects = _effects([ref, "m"], ["a", "b"], [0, 1], cached)
    low, high = np.percentile([0.74 - 0.69, 0.77 - 0.71], [2.5, 97.5])  # seed 0's resampled differences
    assert effects["m"]["a"] == Effect(pytest.approx(0.05), pytest.approx(low), pytest.approx(high))
    assert effects["m"]["b"] is None

"""Edge cases of the seed intervals, the random-effects pooling and the weighted AUC, each against a value
worked out by hand or by scikit-learn: equal differences, two scenarios with a closed-form DerSimonian-
Laird answer, one scenario, weights so unequal that C rounds to 0, a confidence other than 95%, a class
with one negative, a resample in which a class or every class has no AUC."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from sklearn.metrics import roc_auc_score

from fedweigh.bench.effects import endpoint_scores, seed_effects, weighted_macro_auc
from fedweigh.bench.stats import Interval, dersimonian_laird, paired_t_interval


def test_equal_differences_give_the_point_interval_with_every_field():
    assert paired_t_interval([0.25, 0.25, 0.25]) == Interval(0.25, 0.25, 0.25, 0.0, 0.0, 3, 0.0)
    assert paired_t_interval([0.0, 0.0]) == Interval(0.0, 0.0, 0.0, 0.0, 0.0, 2, 1.0)


def test_two_scenarios_pool_to_the_closed_form_dersimonian_laird_answer():
    """y = (0, 2), v = (1, 2): w = (1, 1/2), C = 3/2 - (5/4) / (3/2) = 2/3, y_FE = 2/3, Q = 4/3,
    tau^2 = (Q - 1) / C = 1/2, I^2 = (Q - 1) / Q = 1/4; w* = (2/3, 2/5), mu = (4/5) / (16/15) = 3/4,
    SE = sqrt(15/16); SE_HK^2 = (2/3 * 9/16 + 2/5 * 25/16) / (16/15) = 15/16 as well."""
    got = dersimonian_laird([0.0, 2.0], [1.0, 2.0])
    assert got.k == 2
    assert (got.tau2, got.i2, got.q) == pytest.approx((0.5, 0.25, 4 / 3), abs=1e-12)
    assert got.mean == pytest.approx(0.75, abs=1e-12) and got.se == pytest.approx(
        math.sqrt(15 / 16), abs=1e-12
    )
    half_z, half_t = stats.norm.ppf(0.975) * math.sqrt(15 / 16), stats.t.ppf(0.975, 1) * math.sqrt(15 / 16)
    assert (got.low, got.high) == pytest.approx((0.75 - half_z, 0.75 + half_z), abs=1e-12)
    assert (got.low_hk, got.high_hk) == pytest.approx((0.75 - half_t, 0.75 + half_t), abs=1e-12)


def test_identical_effects_have_no_heterogeneity():
    got = dersimonian_laird([0.1, 0.1, 0.1], [0.01, 0.02, 0.04])
    assert got.q == 0.0 and got.i2 == 0.0 and got.tau2 == 0.0 and got.mean == pytest.approx(0.1, abs=1e-15)


def test_one_scenario_has_no_between_scenario_variance_even_where_rounding_leaves_q_and_c_above_0():
    # y = 0.0558, v = 9.529543: in float64 the fixed effect is not y to the last bit, so Q > 0, and C > 0
    y, v = 0.0558, 9.529543
    w = 1.0 / np.array([v])
    assert (
        float((w * (y - (w * y).sum() / w.sum()) ** 2).sum()) > 0.0
        and float(w.sum() - (w**2).sum() / w.sum()) > 0
    )
    got = dersimonian_laird([y], [v])
    assert got.tau2 == 0.0 and got.i2 == 0.0 and got.low_hk is None and got.high_hk is None
    assert got.se == pytest.approx(math.sqrt(v), rel=1e-15)


def test_weights_so_unequal_that_c_rounds_to_zero_give_no_between_scenario_variance():
    got = dersimonian_laird([0.0, 1.0], [1e-20, 1.0])  # w = (1e20, 1): sum w - sum w^2 / sum w is 0.0
    assert got.tau2 == 0.0 and got.mean == pytest.approx(0.0, abs=1e-12)


def test_pooling_refuses_effects_and_variances_of_different_lengths():
    with pytest.raises(ValueError):
        dersimonian_laird([0.1, 0.2], [0.01])


def _scores(diffs: dict[str, list[float]]) -> pd.Series:
    rows = []
    for sc, ds in diffs.items():
        for seed, d in enumerate(ds):
            rows += [(sc, "fedavg", seed, 0.7), (sc, "m", seed, 0.7 + d)]
    index = pd.MultiIndex.from_tuples([r[:3] for r in rows], names=["scenario", "method", "seed"])
    return pd.Series([r[3] for r in rows], index=index).sort_index()


def test_seed_effects_use_the_confidence_asked_for_in_each_scenario_and_in_the_pool():
    diffs = {"a": [0.02, 0.01, 0.03, 0.0], "b": [-0.01, 0.004, 0.0, -0.02]}
    scores = _scores(diffs)
    got = seed_effects(scores, ["fedavg", "m"], ["a", "b"], confidence=0.8)["m"]
    d = scores.xs(("a", "m"), level=("scenario", "method")) - scores.xs(
        ("a", "fedavg"), level=("scenario", "method")
    )
    low, high = stats.t.interval(0.8, 3, loc=d.mean(), scale=stats.sem(d))
    assert (got["scenarios"]["a"]["ci_low"], got["scenarios"]["a"]["ci_high"]) == pytest.approx(
        (low, high), abs=1e-12
    )
    se = [got["scenarios"][s]["se"] for s in "ab"]
    pooled = dersimonian_laird(
        [got["scenarios"][s]["mean"] for s in "ab"], [x**2 for x in se], confidence=0.8
    )
    assert got["pooled"] == pooled.as_dict()


def test_one_scenario_pools_to_its_own_mean_to_the_last_bit():
    # differences whose mean the random-effects formula w* y / w* does not give back exactly
    a, b = [0.651, 0.615, 0.604], [0.716, 0.638, 0.795]
    scores = _scores({"a": [x - y for x, y in zip(a, b, strict=True)]})
    got = seed_effects(scores, ["fedavg", "m"], ["a"])["m"]
    only = got["scenarios"]["a"]
    assert dersimonian_laird([only["mean"]], [only["se"] ** 2]).mean != only["mean"]
    assert got["pooled"]["mean"] == only["mean"]


def test_a_method_without_cells_in_a_scenario_has_no_interval_there():
    scores = _scores({"a": [0.02, 0.01, 0.03]})
    scores = pd.concat(
        [
            scores,
            pd.Series(
                [0.7, 0.71],
                index=pd.MultiIndex.from_tuples(
                    [("b", "fedavg", 0), ("b", "fedavg", 1)], names=["scenario", "method", "seed"]
                ),
            ),
        ]
    ).sort_index()
    got = seed_effects(scores, ["fedavg", "m"], ["a", "b", "c"])["m"]  # c: no cell of either method
    assert got["scenarios"]["b"] is None and got["scenarios"]["c"] is None and got["pooled"]["k"] == 1


def test_an_unknown_endpoint_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown endpoint 'best'; known: final, last_k$"):
        endpoint_scores(pd.DataFrame(columns=["scenario", "method", "seed", "round", "auc"]), "best")


def test_weighted_auc_of_a_class_with_one_negative_and_after_a_class_without_both():
    labels = np.array([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1]], dtype=np.float64)  # class 0: positives only
    scores = np.array([[0.1, 0.9], [0.2, 0.4], [0.3, 0.5], [0.4, 0.5], [0.5, 0.7]])
    expected = roc_auc_score(labels[:, 1], scores[:, 1])  # one negative, a tie with it
    assert weighted_macro_auc(labels, scores, np.ones((1, 5)))[0] == pytest.approx(expected, abs=1e-12)


def test_weighted_auc_of_a_resample_with_a_single_negative_draw_equals_sklearns_weighted_auc():
    labels = np.array([[1], [0], [1], [0], [1], [0]], dtype=np.float64)
    scores = np.array([[0.9], [0.3], [0.2], [0.8], [0.6], [0.1]])
    counts = np.array([[2, 1, 1, 0, 3, 0]])  # the negatives drawn: image 1, once (W_neg = 1)
    expected = roc_auc_score(labels[:, 0], scores[:, 0], sample_weight=counts[0])
    assert weighted_macro_auc(labels, scores, counts)[0] == pytest.approx(expected, abs=1e-12)


def test_a_resample_without_an_auc_is_nan_and_warns_nothing():
    labels = np.array([[1, 0], [0, 1], [1, 1], [0, 0]], dtype=np.float64)
    scores = np.array([[0.9, 0.2], [0.1, 0.8], [0.7, 0.6], [0.3, 0.1]])
    counts = np.array(
        [[0, 2, 0, 2], [0, 0, 3, 0], [1, 1, 1, 1]]
    )  # class 0 without positives; image 2 only; all
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = weighted_macro_auc(labels, scores, counts)
    assert got[0] == pytest.approx(1.0)  # class 1 only: its positive 0.8 above its negative 0.1
    assert np.isnan(got[1])  # image 2 only: a positive of both classes, no negative
    assert got[2] == pytest.approx(np.mean([roc_auc_score(labels[:, j], scores[:, j]) for j in (0, 1)]))


def test_the_last_k_endpoint_counts_every_scored_round_after_round_0_round_1_included():
    frame = pd.DataFrame(
        [("a", "m", 0, t, auc) for t, auc in enumerate((0.5, 0.6, 0.7))],
        columns=["scenario", "method", "seed", "round", "auc"],
    )
    assert endpoint_scores(frame, "last_k", last_k=3).loc[("a", "m", 0)] == pytest.approx(0.65, abs=1e-15)

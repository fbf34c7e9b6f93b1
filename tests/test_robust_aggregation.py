"""Robust aggregation options of the round step: weighted median and trimmed mean that keep the
scheme's weights, multi-Krum, the per-array direction check, and clipping to an absolute norm."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import stats

from fedweigh.errors import ConfigError
from fedweigh.server.robust import (
    RobustAggregation,
    array_direction_outliers,
    array_grams,
    clip_factor,
    krum_scores,
    multi_krum,
    weighted_median,
    weighted_trimmed_mean,
)
from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.weighting import get_scheme
from fedweigh.weighting.base import ClientReport

SITES = ("site-1", "site-2", "site-3", "site-4")
finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)


# ------------------------------------------------------------------------------------------ the math
@settings(max_examples=60, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(1, 7), st.integers(1, 5)), elements=finite))
def test_weighted_median_with_equal_weights_is_numpys_median(x):
    np.testing.assert_allclose(
        weighted_median(x, np.ones(x.shape[0])), np.median(x, axis=0), rtol=1e-12, atol=1e-9
    )


@settings(max_examples=60, deadline=None)
@given(
    arrays(np.float64, st.tuples(st.integers(1, 7), st.integers(1, 5)), elements=finite),
    st.lists(st.floats(0.01, 10.0), min_size=7, max_size=7),
)
def test_trimmed_mean_with_trim_0_is_the_weighted_mean(x, w):
    w = np.asarray(w[: x.shape[0]])
    expected = (w[:, None] * x).sum(axis=0) / w.sum()
    np.testing.assert_allclose(weighted_trimmed_mean(x, w, 0.0), expected, rtol=1e-9, atol=1e-6)


@pytest.mark.parametrize("k, cut", [(4, 1), (5, 1), (6, 2), (8, 3)])
def test_trimmed_mean_with_equal_weights_is_scipys_trim_mean(k, cut):
    x = np.random.default_rng(k).normal(size=(k, 9))
    np.testing.assert_allclose(
        weighted_trimmed_mean(x, np.ones(k), cut / k), stats.trim_mean(x, cut / k, axis=0), rtol=1e-12
    )


def test_weighted_median_follows_the_weights():
    x = np.array([[0.0], [1.0], [10.0]])
    assert weighted_median(x, np.array([0.6, 0.2, 0.2]))[0] == 0.0  # a majority of the weight decides
    assert weighted_median(x, np.array([0.2, 0.2, 0.6]))[0] == 10.0
    assert weighted_median(x, np.array([0.25, 0.5, 0.25]))[0] == 1.0
    # zero weight: the value does not count
    assert weighted_median(np.array([[0.0], [1.0], [1e9]]), np.array([1.0, 1.0, 0.0]))[0] == 0.5


@settings(max_examples=60, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(3, 7), st.integers(1, 4)), elements=finite), finite)
def test_a_minority_of_the_weight_cannot_move_the_median_outside_the_others_range(x, forged):
    """Breakdown: one site below half of the weight, whatever it sends."""
    w = np.ones(x.shape[0])
    x = x.copy()
    x[0] = forged * 1e6
    med = weighted_median(x, w)
    assert np.all(med >= x[1:].min(axis=0) - 1e-9) and np.all(med <= x[1:].max(axis=0) + 1e-9)
    trimmed = weighted_trimmed_mean(x, w, 1.0 / x.shape[0])
    assert np.all(trimmed >= x[1:].min(axis=0) - 1e-6) and np.all(trimmed <= x[1:].max(axis=0) + 1e-6)


def test_robust_location_refuses_bad_weights_and_trims():
    x = np.zeros((3, 2))
    with pytest.raises(ValueError, match="non-negative"):
        weighted_median(x, np.array([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="positive total"):
        weighted_median(x, np.zeros(3))
    with pytest.raises(ValueError, match=r"trim must be in \[0, 0.5\)"):
        weighted_trimmed_mean(x, np.ones(3), 0.5)


def _gram(vectors: np.ndarray) -> np.ndarray:
    return vectors @ vectors.T


def test_multi_krum_keeps_the_honest_cluster():
    rng = np.random.default_rng(0)
    honest = 1.0 + 0.05 * rng.normal(size=(5, 20))
    hostile = np.vstack([-3.0 + 0.01 * rng.normal(size=(1, 20)), 5.0 + 0.01 * rng.normal(size=(1, 20))])
    vectors = np.vstack([honest[:2], hostile[:1], honest[2:], hostile[1:]])  # hostile at 2 and 6
    assert multi_krum(_gram(vectors), f=2) == [0, 1, 3, 4, 5]
    scores = krum_scores(_gram(vectors), f=2)
    assert scores[[2, 6]].min() > scores[[0, 1, 3, 4, 5]].max()
    assert multi_krum(_gram(vectors), f=2, keep=1)[0] in (0, 1, 3, 4, 5)


def test_multi_krum_with_too_few_updates_keeps_them_all():
    assert multi_krum(np.eye(2), f=1) == [0, 1]


def test_clip_factor_is_flowers_min_1_c_over_norm():
    assert clip_factor(10.0, 2.0) == 0.2
    assert clip_factor(1.0, 2.0) == 1.0
    assert clip_factor(0.0, 2.0) == 1.0
    assert clip_factor(float("inf"), 2.0) == 0.0


def test_per_array_check_flags_only_a_flipped_classifier():
    rng = np.random.default_rng(1)
    g = {"body": np.zeros(200), "head": np.zeros(14 * 8)}
    sites = []
    for _ in range(4):
        sites.append({k: 0.5 + 0.1 * rng.normal(size=v.shape) for k, v in g.items()})
    sites[3]["head"] = -2 * sites[3]["head"]  # flip the classifier only, twice as long
    flagged = array_direction_outliers(array_grams(g, sites), 0.0)
    assert flagged == {3: ["head"]}


# ------------------------------------------------------------------------------------------ in the round
def _g0() -> dict[str, np.ndarray]:
    return {
        "body": np.zeros((40, 40), np.float32),
        "head": np.zeros((14, 8), np.float32),
        "num_batches_tracked": np.array(3, np.int64),
    }


def _update(site: str, g: dict, scale: float = 0.1) -> dict:
    rng = np.random.default_rng(sum(map(ord, site)))
    return {
        k: (v + scale + scale / 4 * rng.normal(size=v.shape)).astype(v.dtype)
        if v.dtype.kind == "f"
        else v + 2
        for k, v in g.items()
    }


def _result(site: str, params: dict, n: int = 100, steps: int = 2) -> ClientResult:
    return ClientResult(
        site, params, {"num_samples": n, "NUM_STEPS_CURRENT_ROUND": steps, "fedweigh_scalars": {}}
    )


def _round(results, scheme="fedavg", **options):
    step = RoundStep(
        get_scheme(scheme), PlaintextBackend(_g0()), num_rounds=3, safeguards=Safeguards.off(**options)
    )
    return step.run(1, results, [r.site for r in results])


def test_a_layer_targeted_flip_is_caught_by_the_per_array_check_only():
    g = _g0()
    results = [_result(s, _update(s, g)) for s in SITES]
    flipped = dict(results[3].params)
    flipped["head"] = (-2.5 * flipped["head"]).astype(np.float32)  # classifier flipped, within the norm bound
    results[3] = _result("site-4", flipped)
    # the whole-update direction check misses it, and so does a norm bound of 3 x the median
    loose = Safeguards(update_norm_bound=3.0)
    whole = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3, safeguards=loose).run(
        1, results, SITES
    )
    assert not whole.excluded and not whole.bounded
    # the default bound (1 x the largest of the other sites' norms) scales its head down to an honest one's
    default = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3).run(1, results, SITES)
    assert not default.excluded and "site-4" in default.bounded
    outcome = _round(results, array_cosine=0.0)
    assert "'head'" in outcome.bounded["site-4"] and "array_cosine=0" in outcome.bounded["site-4"]
    assert set(outcome.bounded) == {"site-4"}
    honest_head = np.mean([r.params["head"] for r in results[:3]], axis=0)
    # site-4's classifier counts as Delta = 0: the head moves by 3/4 of the honest mean, never against it
    np.testing.assert_allclose(outcome.params["head"], 0.75 * honest_head, rtol=1e-5)


def test_median_aggregation_keeps_the_schemes_weights():
    g = _g0()
    results = [_result(s, _update(s, g), n=n) for s, n in zip(SITES, (10, 10, 10, 970), strict=True)]
    outcome = _round(results, aggregator="median")
    # site-4 holds 97% of FedAvg's weight: the weighted median is its value in every coordinate
    np.testing.assert_allclose(outcome.params["body"], results[3].params["body"], rtol=1e-6)
    assert outcome.params["num_batches_tracked"] == 5  # integer buffers follow the scheme's rule
    equal = _round([_result(s, _update(s, g)) for s in SITES], aggregator="median")
    np.testing.assert_allclose(
        equal.params["body"], np.median([r.params["body"] for r in results], axis=0), rtol=1e-6
    )


def test_a_huge_update_moves_the_median_and_trimmed_mean_no_further_than_the_honest_range():
    g = _g0()
    results = [_result(s, _update(s, g)) for s in SITES]
    results[3] = _result("site-4", {**results[3].params, "body": np.full((40, 40), 1e6, np.float32)})
    lo = np.min([r.params["body"] for r in results[:3]], axis=0)
    hi = np.max([r.params["body"] for r in results[:3]], axis=0)
    for options in ({"aggregator": "median"}, {"aggregator": "trimmed_mean", "trim": 0.25}):
        body = _round(results, **options).params["body"]
        assert np.all(body >= lo - 1e-6) and np.all(body <= hi + 1e-6), options
    assert np.all(_round(results).params["body"] > 1e5)  # the plain mean is captured


def test_fednova_keeps_its_total_weight_under_the_median():
    g = _g0()
    results = [_result(s, _update(s, g), steps=st_) for s, st_ in zip(SITES, (2, 4, 6, 8), strict=True)]
    mean = _round(results, "fednova")
    med = _round(results, "fednova", aggregator="median")
    total = sum(mean.weights.values())
    deltas = np.stack([r.params["body"].astype(np.float64) for r in results])
    w = np.array([mean.weights[s] for s in SITES])
    np.testing.assert_allclose(med.params["body"], total * weighted_median(deltas, w), rtol=1e-5)


def test_multi_krum_leaves_out_the_far_update_with_its_reason():
    g = _g0()
    results = [_result(s, _update(s, g)) for s in (*SITES, "site-5")]
    far = {k: (v - 2.0).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in results[4].params.items()}
    results[4] = _result("site-5", far)
    outcome = _round(results, krum_f=1)
    assert set(outcome.excluded) == {"site-5"}
    assert "multi-Krum (krum_f=1)" in outcome.excluded["site-5"]
    assert set(outcome.weights) == set(SITES)


def test_clip_norm_clips_the_whole_update_as_flower_does():
    g = _g0()
    results = [_result(s, _update(s, g)) for s in SITES]
    outcome = _round(results, clip_norm=0.5)
    for r in results:
        delta = np.concatenate([np.ravel(r.params[k]).astype(np.float64) for k in ("body", "head")])
        assert "clipped to clip_norm=0.5" in outcome.bounded[r.site]
        assert np.linalg.norm(delta) > 0.5
    mean = np.mean(
        [
            r.params["body"].astype(np.float64)
            * 0.5
            / np.linalg.norm(
                np.concatenate([np.ravel(r.params[k]).astype(np.float64) for k in ("body", "head")])
            )
            for r in results
        ],
        axis=0,
    )
    np.testing.assert_allclose(outcome.params["body"], mean, rtol=1e-5)
    assert not _round(results, clip_norm=1e6).bounded  # logged only when it really clipped


def test_robust_aggregation_of_mean_is_the_scheme_itself():
    g = _g0()
    reports = [ClientReport(s, 100, params=_update(s, g)) for s in SITES]
    scheme = get_scheme("fedavg")
    w = np.full(4, 0.25)
    a = RobustAggregation(scheme, "mean").aggregate(g, reports, w)
    b = scheme.aggregate(g, reports, w)
    assert all(np.array_equal(a[k], b[k]) for k in g)


@pytest.mark.parametrize(
    "options, field",
    [
        ({"aggregator": "mode"}, "aggregator"),
        ({"trim": 0.5}, "trim"),
        ({"krum_f": 0}, "krum_f"),
        ({"array_cosine": 2.0}, "array_cosine"),
        ({"clip_norm": 0.0}, "clip_norm"),
    ],
)
def test_bad_robust_options_name_the_option(options, field):
    with pytest.raises(ConfigError, match=f"{field} = "):
        Safeguards(**options)


def test_robust_options_are_refused_under_he():
    class Encrypted(PlaintextBackend):
        encrypted = True

    with pytest.raises(ConfigError, match="aggregator = 'median'.*plaintext updates"):
        RoundStep(
            get_scheme("fedavg"), Encrypted(_g0()), num_rounds=2, safeguards=Safeguards(aggregator="median")
        )


def test_a_recipe_passes_the_robust_options_to_the_controller(tmp_path):
    import json

    from fedweigh.flare.recipes import FedweighRecipe

    recipe = FedweighRecipe(
        name="robust",
        scheme="fedavg",
        min_clients=2,
        aggregator="trimmed_mean",
        trim=0.2,
        krum_f=1,
        array_cosine=0.0,
        clip_norm=5,
    )
    recipe.export(str(tmp_path))
    server = json.loads((tmp_path / "robust/app/config/config_fed_server.json").read_text())
    args = next(w for w in server["workflows"] if w["id"] == "controller")["args"]
    assert {k: args[k] for k in ("aggregator", "trim", "krum_f", "array_cosine", "clip_norm")} == {
        "aggregator": "trimmed_mean",
        "trim": 0.2,
        "krum_f": 1,
        "array_cosine": 0.0,
        "clip_norm": 5.0,
    }
    with pytest.raises(ConfigError, match="aggregator = 'mode'"):
        FedweighRecipe(name="bad", scheme="fedavg", min_clients=2, aggregator="mode")
    with pytest.raises(ValueError, match="need plaintext updates"):
        FedweighRecipe(name="he", scheme="fedavg", min_clients=2, he=True, aggregator="median")

"""What every weighting scheme tells about its weights, and how it refuses what it cannot use.

``last_details`` is the scheme's account of one ``weights`` call (the parts of its formula, by name);
its scalar entries become the round's ``scheme/*`` records. Each is checked here against the formula
computed independently, with the exact keys, and replaced on the next call.
"""

import logging
import math
import re

import numpy as np
import pytest

from fedweigh.weighting import ClientReport, feddisco, get_scheme
from fedweigh.weighting.base import ScalarContext
from fedweigh.weighting.fednova import momentum_normaliser

SIZES = (100, 300, 600)


def scalar_reports(key: str, values, sizes=SIZES) -> list[ClientReport]:
    return [
        ClientReport(f"site-{i + 1}", n, scalars={key: v})
        for i, (n, v) in enumerate(zip(sizes, values, strict=True))
    ]


def test_cbr_details_are_the_skews_and_both_weight_parts():
    scheme = get_scheme("cbr", gamma=0.5)
    skews = [0.5, 1.0, 2.0]
    w = scheme.weights(scalar_reports("skew", skews), None, 1, 3)
    inv = 1.0 / (np.array(skews) + 1e-6)
    omega_a = inv / inv.sum()
    omega_b = np.array(SIZES) / sum(SIZES)
    assert set(scheme.last_details) == {"skew", "omega_a", "omega_b"}
    assert scheme.last_details["skew"] == skews
    np.testing.assert_allclose(scheme.last_details["omega_a"], omega_a, rtol=1e-12)
    np.testing.assert_allclose(scheme.last_details["omega_b"], omega_b, rtol=1e-12)
    np.testing.assert_allclose(w, 0.5 * omega_a + 0.5 * omega_b, rtol=1e-12)


@pytest.mark.parametrize("mode", ["inverse_imbalance", "size_inverse_imbalance"])
def test_dafl_details_are_the_size_prior_and_the_imbalances(mode):
    scheme = get_scheme("dafl", mode=mode)
    c = [0.2, 0.4, 0.8]
    scheme.weights(scalar_reports("imbalance", c), None, 1, 3)
    assert set(scheme.last_details) == {"size_prior", "imbalance"}
    np.testing.assert_allclose(scheme.last_details["size_prior"], np.array(SIZES) / sum(SIZES), rtol=1e-12)
    assert scheme.last_details["imbalance"] == c


def test_dafl_size_mode_details_are_the_size_prior_only():
    scheme = get_scheme("dafl", mode="size")
    assert scheme.required_scalars == ()
    w = scheme.weights([ClientReport("a", 1), ClientReport("b", 3)], None, 1, 3)
    assert scheme.last_details == {"size_prior": [0.25, 0.75]}
    np.testing.assert_allclose(w, [0.25, 0.75], rtol=1e-15)


def test_feddisco_details_are_the_size_prior_and_the_raw_and_normalised_discrepancies():
    scheme = get_scheme("feddisco")
    d = [0.1, 0.3, 0.6]
    scheme.weights(scalar_reports("discrepancy", d), None, 1, 3)
    assert set(scheme.last_details) == {"size_prior", "discrepancy", "normalised"}
    np.testing.assert_allclose(scheme.last_details["size_prior"], [0.1, 0.3, 0.6], rtol=1e-12)
    assert scheme.last_details["discrepancy"] == d
    np.testing.assert_allclose(scheme.last_details["normalised"], np.array(d) / sum(d), rtol=1e-12)
    # all zero: the normalised discrepancies are 0 (no division by a zero sum), one per site
    scheme.weights(scalar_reports("discrepancy", [0.0, 0.0, 0.0]), None, 2, 3)
    assert scheme.last_details["normalised"] == [0.0, 0.0, 0.0]


def test_fednova_details_are_its_formula_parts():
    scheme = get_scheme("fednova", local_optimizer="sgd", momentum=0.5)
    reports = [
        ClientReport(f"s{i}", n, num_steps=t) for i, (n, t) in enumerate([(100, 2), (300, 5), (600, 9)])
    ]
    w = scheme.weights(reports, None, 1, 3)
    p = np.array(SIZES) / sum(SIZES)
    a = momentum_normaliser(np.array([2.0, 5.0, 9.0]), 0.5)
    assert set(scheme.last_details) == {"size_prior", "tau", "normaliser", "tau_eff"}
    assert scheme.last_details["tau"] == [2.0, 5.0, 9.0]
    np.testing.assert_allclose(scheme.last_details["normaliser"], a, rtol=1e-12)
    assert scheme.last_details["tau_eff"] == pytest.approx(float(p @ a), rel=1e-12)
    np.testing.assert_allclose(w, float(p @ a) * p / a, rtol=1e-12)


def test_ida_details_are_the_distances_to_the_mean_update():
    g = {"w": np.array([0.0])}
    reports = [
        ClientReport(f"s{i}", n, params={"w": np.array([x])})
        for i, (n, x) in enumerate([(1, 0.0), (1, 1.0), (1, 5.0)])
    ]
    scheme = get_scheme("ida")
    scheme.weights(reports, g, 1, 3)
    assert set(scheme.last_details) == {"distance"}
    np.testing.assert_allclose(scheme.last_details["distance"], [2.0, 1.0, 3.0], rtol=1e-12)


# --- refusals: each names the scheme, the site and what is missing --------------------------------

WITH_SCALARS = {"cbr": "skew", "dafl": "imbalance", "feddisco": "discrepancy"}


@pytest.mark.parametrize(("name", "key"), sorted(WITH_SCALARS.items()))
def test_a_report_without_the_schemes_scalar_is_refused_naming_it(name, key):
    scheme = get_scheme(name)
    assert scheme.required_scalars == (key,)
    reports = [
        ClientReport("site-1", 10, scalars={key: 0.5}),
        ClientReport("site-2", 10, scalars={"other": 1.0}),
    ]
    with pytest.raises(
        ValueError,
        match=rf"^{name}: client 'site-2': missing required scalar '{key}' \(reported: \['other'\]\)",
    ):
        scheme.weights(reports, None, 1, 3)


@pytest.mark.parametrize(("name", "key"), sorted(WITH_SCALARS.items()))
def test_a_negative_scalar_is_refused_naming_the_scheme_and_the_site(name, key):
    reports = [
        ClientReport("site-1", 10, scalars={key: 0.5}),
        ClientReport("site-2", 10, scalars={key: -0.25}),
    ]
    with pytest.raises(
        ValueError, match=rf"^{name}: client 'site-2': scalar '{key}' must be >= 0, got -0.25"
    ):
        get_scheme(name).weights(reports, None, 1, 3)


@pytest.mark.parametrize("name", sorted(WITH_SCALARS))
def test_a_site_without_label_counts_is_told_which_scheme_needs_them(name):
    with pytest.raises(ValueError, match=rf"^{name}: the client needs its label counts"):
        get_scheme(name).client_scalars(ScalarContext())


# --- FedDisco's class distribution ----------------------------------------------------------------


def test_class_distribution_is_float64_whatever_the_counts_type():
    for counts in (np.array([1, 3], dtype=np.float32), np.array([1, 3], dtype=np.int64), [1, 3]):
        dist = feddisco.class_distribution(counts)
        assert dist.dtype == np.float64
        np.testing.assert_array_equal(dist, [0.25, 0.75])
    # float32 input is converted before dividing: 1/3 exactly as float64 computes it
    assert feddisco.class_distribution(np.array([1, 2], dtype=np.float32))[0] == 1.0 / 3.0


def test_class_distribution_bounds_on_both_sides():
    # one class is a valid histogram, an empty or two-dimensional one is not
    np.testing.assert_array_equal(feddisco.class_distribution(np.array([5])), [1.0])
    with pytest.raises(
        ValueError, match=re.escape("class counts must be a non-empty vector, got shape (0,)")
    ):
        feddisco.class_distribution(np.array([]))
    with pytest.raises(
        ValueError, match=re.escape("class counts must be a non-empty vector, got shape (2, 2)")
    ):
        feddisco.class_distribution(np.ones((2, 2)))
    with pytest.raises(ValueError, match="^class counts hold non-finite values$"):
        feddisco.class_distribution(np.array([1.0, math.nan]))
    # negative (noised) counts are clipped to 0 before normalising
    np.testing.assert_array_equal(feddisco.class_distribution(np.array([-2.0, 1.0, 3.0])), [0.0, 0.25, 0.75])
    # a total of exactly 1 is a distribution already; a total of 0 is uniform (no division by 0)
    np.testing.assert_array_equal(feddisco.class_distribution(np.array([0.0, 1.0])), [0.0, 1.0])
    np.testing.assert_array_equal(feddisco.class_distribution(np.array([0.0, 0.0, 0.0, 0.0])), [0.25] * 4)
    np.testing.assert_array_equal(feddisco.class_distribution(np.array([-1.0, 0.0])), [0.5, 0.5])


def test_kl_discrepancy_refuses_histograms_of_different_lengths():
    with pytest.raises(ValueError, match="^local histogram has 2 classes, global has 3$"):
        feddisco.kl_discrepancy(np.array([1, 2]), np.array([1, 2, 3]))


def test_feddisco_fallback_warning_says_what_happened(caplog, monkeypatch):
    monkeypatch.setattr(feddisco, "_FALLBACK_WARNED", [])
    scheme = get_scheme("feddisco", target="global")
    with caplog.at_level(logging.WARNING, logger="fedweigh.weighting.feddisco"):
        scheme.client_scalars(ScalarContext(class_counts=np.array([1, 3]), num_samples=4))
        scheme.client_scalars(ScalarContext(class_counts=np.array([1, 3]), num_samples=4))
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "feddisco: target='global' but this site holds no global class histogram (the statistics phase gave "
        "none); its discrepancy is taken against the uniform target instead"
    ]


# --- CBR's skew scores ------------------------------------------------------------------------------


def test_cbr_scores_default_to_the_coefficient_of_variation():
    from fedweigh.weighting import cbr

    counts = np.array([1.0, 2.0, 6.0])
    assert cbr.skew_score(counts) == pytest.approx(counts.std() / counts.mean(), rel=1e-15)
    # an all-zero histogram of C categories scores as (1, 0, ..., 0): sqrt(C - 1) for cv
    assert cbr.skew_score(np.zeros(5)) == pytest.approx(2.0, rel=1e-15)
    assert cbr.empty_histogram_score(5) == pytest.approx(2.0, rel=1e-15)
    # one category is a valid (balanced) histogram; zero categories are not
    assert cbr.empty_histogram_score(1) == 0.0
    with pytest.raises(ValueError, match="^num_classes must be >= 1, got 0$"):
        cbr.empty_histogram_score(0)


@pytest.mark.parametrize("counts", [np.array([1.0, 2.0]), np.zeros(3)], ids=["counts", "all-zero"])
def test_cbr_refuses_an_unknown_skew_mode_naming_the_modes(counts):
    from fedweigh.weighting import cbr

    with pytest.raises(ValueError, match=re.escape("cbr: skew must be one of cv, code, sqdev, got 'gini'")):
        cbr.skew_score(counts, "gini")


def test_cbr_code_and_sqdev_scores_of_small_deviations():
    """Squared deviations below 1 are still deviations: (1, 2) and (1, 1, 2) by hand."""
    from fedweigh.weighting import cbr

    # code: D = (0.25, 0.25) -> sequentially (0.5, 0.25 / 0.75) -> minus their mean 5/12 -> sum of squares 1/72
    assert cbr.skew_code(np.array([1.0, 2.0])) == pytest.approx(1 / 72, rel=1e-12)
    # sqdev: D = (1/9, 1/9, 4/9), total 2/3 -> d^ = (1/6, 1/6, 2/3) -> 1/36 + 1/36 + 4/9 - 1/3 = 1/6
    assert cbr.skew_sqdev(np.array([1.0, 1.0, 2.0])) == pytest.approx(1 / 6, rel=1e-12)


# --- IDA, FedAdp and FedNova refusals and edges --------------------------------------------------------


@pytest.mark.parametrize("name", ["ida", "fedadp"])
def test_model_based_schemes_refuse_a_round_without_the_global_parameters(name):
    reports = [
        ClientReport("a", 1, params={"w": np.zeros(2)}),
        ClientReport("b", 1, params={"w": np.ones(2)}),
    ]
    with pytest.raises(ValueError, match=f"^{name}: the global parameters are required$"):
        get_scheme(name).weights(reports, None, 1, 3)


def test_ida_gives_identical_updates_uniform_weights_whatever_the_sizes():
    g = {"w": np.array([0.0, 0.0])}
    reports = [ClientReport(f"s{i}", n, params={"w": np.array([1.0, 2.0])}) for i, n in enumerate([1, 5, 50])]
    w = get_scheme("ida").weights(reports, g, 1, 3)
    np.testing.assert_array_equal(w, np.full(3, 1 / 3))


def test_fedadp_loads_a_state_without_history_as_a_fresh_scheme():
    scheme = get_scheme("fedadp")
    scheme.load_state_dict({})
    assert scheme.smoothed_angle == {} and scheme.participations == {}
    scheme.load_state_dict({"smoothed_angle": {"a": 0.5}, "participations": {"a": 2}})
    assert scheme.smoothed_angle == {"a": 0.5} and scheme.participations == {"a": 2}


def test_fedadp_refuses_a_malformed_state_naming_what_is_wrong():
    scheme = get_scheme("fedadp")
    with pytest.raises(ValueError, match="^fedadp: malformed state: could not convert string to float: 'x'$"):
        scheme.load_state_dict({"smoothed_angle": {"a": "x"}, "participations": {"a": 1}})
    with pytest.raises(
        ValueError, match="^fedadp: state 'smoothed_angle' and 'participations' name different sites$"
    ):
        scheme.load_state_dict({"smoothed_angle": {"a": 0.5}, "participations": {"b": 1}})


def test_fednova_normaliser_is_float64():
    np.testing.assert_array_equal(momentum_normaliser(np.array([3, 4]), 0.0), [3.0, 4.0])
    assert momentum_normaliser(np.array([3, 4]), 0.0).dtype == np.float64
    assert momentum_normaliser([3, 4], 0.5).dtype == np.float64
    # rho = 0.5, tau = 2: [2 - 0.5 (1 - 0.25) / 0.5] / 0.5 = (2 - 0.75) / 0.5 = 2.5 (= 1 + 1.5)
    assert momentum_normaliser(np.array([2]), 0.5)[0] == pytest.approx(2.5, rel=1e-15)


def test_fednova_normaliser_refuses_momentum_outside_zero_one():
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=re.escape(f"fednova: momentum must lie in [0, 1), got {bad!r}")):
            momentum_normaliser(np.array([2]), bad)


# --- FedDRAW: the prior-only path, its state and its helpers -----------------------------------------


def test_feddraw_without_similarity_details_its_schedules_at_their_rate():
    from fedweigh import schedules

    scheme = get_scheme(
        "feddraw", similarity="off", inner="exponential", outer="exponential", rate=2.0, rho=0.2
    )
    reports = [ClientReport("a", 1), ClientReport("b", 3)]
    w = scheme.weights(reports, None, 4, 10)
    lam = schedules.ramp("exponential", schedules.progress(4, 10), 2.0)
    beta = schedules.deferred_anneal(4, 10, 1.0, 0.2, "exponential", 2.0)
    assert lam != schedules.ramp("exponential", schedules.progress(4, 10))  # the rate matters here
    assert scheme.last_details == {
        "size_prior": [0.25, 0.75],
        "lambda": lam,
        "reputation": [0.25, 0.75],
        "beta": beta,
    }
    p = np.array([0.25, 0.75])
    np.testing.assert_allclose(w, p**beta / np.sum(p**beta), rtol=1e-12)


def test_feddraw_floors_the_reputation_at_its_eps():
    """eps is the scheme's, not the helper's default: with eps = 0.3 a prior of 0.1 counts as 0.3."""
    scheme = get_scheme("feddraw", similarity="off", eps=0.3, beta_max=1.0, rho=1.0)
    w = scheme.weights([ClientReport("a", 1), ClientReport("b", 9)], None, 1, 10)
    np.testing.assert_allclose(w, [0.25, 0.75], rtol=1e-12)


def test_feddraw_sites_report_a_similarity_only_under_encryption():
    assert get_scheme("feddraw").scalars() == ()
    assert get_scheme("feddraw").scalars(encrypted=True) == ("similarity",)


def test_feddraw_state_round_trips_and_an_empty_state_is_a_fresh_one():
    scheme = get_scheme("feddraw")
    scheme.load_state_dict({})
    assert scheme.previous_global is None and scheme.state_dict() == {}
    scheme.previous_global = {"w": np.array([1.5, -2.0])}
    state = scheme.state_dict()
    other = get_scheme("feddraw")
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.previous_global["w"], [1.5, -2.0])


def test_feddraw_state_refuses_text_that_is_not_strict_base64_or_holds_pickled_objects():
    import base64
    import io

    from fedweigh.weighting import feddraw

    good = feddraw._encode_arrays({"w": np.array([1.0])})
    assert good.isascii()
    with pytest.raises(ValueError, match="^feddraw: malformed state 'previous_global'"):
        get_scheme("feddraw").load_state_dict({"previous_global": good[:8] + "!" + good[8:]})
    buf = io.BytesIO()
    np.savez(buf, w=np.array([{"code": "x"}], dtype=object))  # an object array: loading it unpickles
    pickled = base64.b64encode(buf.getvalue()).decode("ascii")
    with pytest.raises(ValueError, match="^feddraw: malformed state 'previous_global': .*allow_pickle"):
        get_scheme("feddraw").load_state_dict({"previous_global": pickled})


def test_spread_similarity_is_float64_and_follows_its_formula():
    from fedweigh.weighting.feddraw import spread_similarity

    s = spread_similarity(np.array([0.5, 0.7, 0.6], dtype=np.float32))
    assert s.dtype == np.float64
    x = np.array([0.5, 0.7, 0.6], dtype=np.float32).astype(np.float64)
    np.testing.assert_allclose(s, (x - x.min()) / np.sum(x - x.min()), rtol=1e-15)


# --- CBR's histogram checks and its log ---------------------------------------------------------------


def test_cbr_histogram_bounds_on_both_sides():
    from fedweigh.weighting import cbr

    assert cbr.skew_score(np.array([4])) == 0.0  # one category: valid, balanced
    assert cbr.skew_score(np.array([1, 3], dtype=np.float32)) == cbr.skew_score(np.array([1.0, 3.0]))
    with pytest.raises(
        ValueError, match=re.escape("class counts must be a non-empty vector, got shape (0,)")
    ):
        cbr.skew_score(np.array([]))
    with pytest.raises(
        ValueError, match=re.escape("class counts must be a non-empty vector, got shape (1, 2)")
    ):
        cbr.skew_score(np.ones((1, 2)))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "class counts are all zero: the skew of an empty histogram is undefined (skew_score gives it the score of a maximally imbalanced site)"
        ),
    ):
        cbr.imbalance_cv(np.zeros(3))


def test_cbr_logs_an_all_zero_histogram_only(caplog):
    scheme = get_scheme("cbr")
    with caplog.at_level(logging.INFO, logger="fedweigh.weighting.cbr"):
        assert (
            scheme.client_scalars(ScalarContext(class_counts=np.array([0, 1]), num_samples=1))["skew"] == 1.0
        )
        assert caplog.records == []
        skew = scheme.client_scalars(ScalarContext(class_counts=np.array([0, 0, 0, 0, 0]), num_samples=3))[
            "skew"
        ]
    assert skew == pytest.approx(2.0)
    assert [r.getMessage() for r in caplog.records] == [
        "cbr: the site's label histogram is all zero (no positive for any finding); its skew is 2, the score "
        "of a maximally imbalanced site (all labels in one category)"
    ]


# --- IDA and FedNova options --------------------------------------------------------------------------


def test_ida_eps_bounds_on_both_sides():
    assert get_scheme("ida", eps=1e-30).eps == 1e-30
    for bad in (0.0, -1e-9, math.inf, math.nan):
        with pytest.raises(
            ValueError, match=f"^ida: eps must be a positive number, got {re.escape(repr(bad))}$"
        ):
            get_scheme("ida", eps=bad)


def test_fednova_adam_normaliser_is_the_step_count_as_float():
    a = get_scheme("fednova", local_optimizer="adam").normaliser(np.array([2, 5]))
    assert a.dtype == np.float64
    np.testing.assert_array_equal(a, [2.0, 5.0])


def test_bound_by_prior_is_float64_and_quiet_where_a_share_equals_its_prior():
    import warnings

    from fedweigh.weighting.feddraw import bound_by_prior

    share = np.array([0.5, 0.4, 0.1], dtype=np.float32)
    prior = np.array([0.5, 0.25, 0.25], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # site 1's share is its prior: nothing divides by its 0 difference
        bounded, m = bound_by_prior(share, prior, 2.0)
        bound_by_prior(np.array([0.5, 0.3, 0.2]), np.array([0.5, 0.25, 0.25]), 1.0)
    assert bounded.dtype == np.float64
    # c = 2: the third site (0.1 < 0.25 / 2) binds: 1 - m = (1 - 1/2) 0.25 / 0.15
    keep = 0.5 * float(np.float32(0.25)) / (float(np.float32(0.25)) - float(np.float32(0.1)))
    assert m == pytest.approx(1.0 - keep, rel=1e-12)


def test_feddraw_sites_compute_their_similarity_from_the_models_only_when_one_is_asked_for():
    g = {"w": np.zeros(2), "b": np.zeros(1)}
    assert get_scheme("feddraw", similarity="off").client_scalars(ScalarContext()) == {}
    assert get_scheme("feddraw", similarity="delta").client_scalars(ScalarContext()) == {}
    with pytest.raises(ValueError, match="^feddraw: the client needs its trained and the global parameters"):
        get_scheme("feddraw").client_scalars(ScalarContext())
    # the site's own check names it as the client
    with pytest.raises(ValueError, match=r"^client 'client': parameter keys differ from the global model"):
        get_scheme("feddraw").client_scalars(
            ScalarContext(params={"w": np.ones(2)}, global_params=g, previous_global=g)
        )


@pytest.mark.parametrize("skew", ["cv", "code", "sqdev"])
def test_cbr_balance_weights_compute_in_float64(skew):
    scheme = get_scheme("cbr", skew=skew)
    skews = np.array([0.1, 0.3, 0.7], dtype=np.float32)
    w = scheme.balance_weights(skews)
    exact = skews.astype(np.float64)
    inv = 1.0 / (exact + 1e-6) if skew == "cv" else 1.0 / np.maximum(exact, 1e-6)
    assert w.dtype == np.float64
    np.testing.assert_array_equal(w, inv / inv.sum())


def test_softmax_spread_defaults_to_temperature_one_in_float64():
    from fedweigh.weighting.base import softmax
    from fedweigh.weighting.feddraw import softmax_spread

    s = np.array([0.2, 0.5, 0.6], dtype=np.float32)
    x = s.astype(np.float64)
    z = (x - x.mean()) / x.std()
    spread = softmax_spread(s)
    assert spread.dtype == np.float64
    np.testing.assert_allclose(spread, softmax(z), rtol=1e-12)
    assert not np.allclose(softmax_spread(s, 2.0), spread)


# --- FedAdp ---------------------------------------------------------------------------------------------


def _fedadp_round(alpha: float = 5.0, sizes=(100, 300, 600)):
    from fedweigh.weighting.fedadp import gompertz

    g = {"w": np.zeros(3)}
    deltas = [np.array([1.0, 0.0, 0.0]), np.array([1.0, 1.0, 0.0]), np.array([0.0, 1.0, 1.0])]
    reports = [
        ClientReport(f"s{i}", n, params={"w": d}) for i, (n, d) in enumerate(zip(sizes, deltas, strict=True))
    ]
    n = np.array(sizes, dtype=np.float64)
    mean = sum((ni / n.sum()) * d for ni, d in zip(n, deltas, strict=True))
    angles = np.array([np.arccos(d @ mean / (np.linalg.norm(d) * np.linalg.norm(mean))) for d in deltas])
    f = gompertz(angles, alpha)
    return reports, g, angles, f, n


def test_fedadp_details_and_weights_follow_the_formula_at_its_alpha():
    from fedweigh.weighting.fedadp import gompertz

    reports, g, angles, f, n = _fedadp_round(alpha=2.0)
    scheme = get_scheme("fedadp", alpha=2.0)
    w = scheme.weights(reports, g, 1, 3)
    assert set(scheme.last_details) == {"angle", "smoothed_angle", "gompertz"}
    np.testing.assert_allclose(scheme.last_details["angle"], angles, rtol=1e-12)
    np.testing.assert_allclose(scheme.last_details["smoothed_angle"], angles, rtol=1e-12)
    np.testing.assert_allclose(scheme.last_details["gompertz"], f, rtol=1e-12)
    assert not np.allclose(f, gompertz(angles))  # alpha 2 is not the default 5
    np.testing.assert_allclose(w, n * np.exp(f) / np.sum(n * np.exp(f)), rtol=1e-12)


def test_fedadp_weights_stay_finite_for_huge_sample_counts():
    """The softmax subtracts the largest logit: log N_k of 10^200 samples would overflow exp otherwise."""
    reports, g, angles, f, n = _fedadp_round(sizes=(10**200, 2 * 10**200, 3 * 10**200))
    w = get_scheme("fedadp").weights(reports, g, 1, 3)
    expected = np.array([1.0, 2.0, 3.0]) * np.exp(f)
    np.testing.assert_allclose(w, expected / expected.sum(), rtol=1e-12)


def test_gompertz_is_float64():
    from fedweigh.weighting.fedadp import gompertz

    a = np.array([0.3, 1.2], dtype=np.float32)
    out = gompertz(a)
    assert out.dtype == np.float64
    x = a.astype(np.float64)
    np.testing.assert_array_equal(out, 5.0 * (1.0 - np.exp(-np.exp(-5.0 * (x - 1.0)))))


def test_fedadp_alpha_bounds_on_both_sides():
    assert get_scheme("fedadp", alpha=0.5).alpha == 0.5  # below 1 is allowed: any positive number
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(
            ValueError, match=f"^fedadp: alpha must be a positive number, got {re.escape(repr(bad))}$"
        ):
            get_scheme("fedadp", alpha=bad)


def test_feddisco_refuses_either_coefficient_infinite():
    for a, b in ((math.inf, 0.1), (0.5, math.nan), (math.inf, math.inf)):
        with pytest.raises(
            ValueError, match=re.escape(f"feddisco: a and b must be finite, got a={a!r}, b={b!r}")
        ):
            get_scheme("feddisco", a=a, b=b)


# --- the registry ---------------------------------------------------------------------------------------


def test_get_scheme_names_the_known_schemes_and_options_when_refusing():
    from fedweigh.weighting import SCHEMES

    with pytest.raises(
        KeyError, match=re.escape(f"unknown weighting scheme 'fedmax'; known: {', '.join(sorted(SCHEMES))}")
    ):
        get_scheme("fedmax")
    with pytest.raises(
        TypeError,
        match=r"^feddisco: .*unexpected keyword argument 'c'; options: a, b, integer_buffers, target$",
    ):
        get_scheme("feddisco", c=1.0)
    assert get_scheme("feddisco", a=0.25).a == 0.25

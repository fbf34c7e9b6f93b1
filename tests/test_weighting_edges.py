"""The weighting schemes' edges that a formula test at ordinary inputs does not reach: CBR's eps bound
on every side with its message, the refusal of an unknown skew as a whole sentence, and the skew
scores computed in float64 whatever the dtype of the histogram a site hands in."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from fedweigh import schedules
from fedweigh.weighting.base import ClientReport, ScalarContext
from fedweigh.weighting.cbr import CBRWeights, imbalance_cv, skew_code, skew_score, skew_sqdev
from fedweigh.weighting.feddraw import FedDRAWWeights, bound_by_prior, softmax_spread, tempered_weights
from fedweigh.weighting.geometry import model_similarity

COUNTS = [3, 7, 11, 50, 2, 9]


@pytest.mark.parametrize("eps", [0.0, -1e-6, -1.0, math.inf, -math.inf, math.nan])
def test_cbr_eps_outside_the_positive_finite_numbers_is_refused_with_its_value(eps):
    with pytest.raises(ValueError) as refused:
        CBRWeights(eps=eps)
    assert str(refused.value) == f"cbr: eps must be a positive number, got {eps!r}"


@pytest.mark.parametrize("eps", [1e-300, 1e-6, 0.5, 1e6])
def test_cbr_accepts_any_positive_finite_eps(eps):
    assert CBRWeights(eps=eps).eps == eps


def test_cbr_unknown_skew_is_refused_naming_the_modes():
    with pytest.raises(ValueError) as refused:
        CBRWeights(skew="entropy")
    assert str(refused.value) == "cbr: skew must be one of cv, code, sqdev, got 'entropy'"


@pytest.mark.parametrize("mode", ["cv", "code", "sqdev"])
def test_cbr_skew_scores_are_computed_in_float64_for_any_count_dtype(mode):
    """A site may hand in float32 counts (a torch histogram) or integers: the score is the float64 one,
    bit for bit, not a float32 computation of it."""
    by_mode = {"cv": imbalance_cv, "code": skew_code, "sqdev": skew_sqdev}
    exact = by_mode[mode](np.array(COUNTS, dtype=np.float64))
    for dtype in (np.float32, np.int64, np.int32):
        counts = np.array(COUNTS, dtype=dtype)
        assert by_mode[mode](counts) == exact, dtype
        assert skew_score(counts, mode) == exact, dtype
        scheme = CBRWeights(skew=mode)
        got = scheme.client_scalars(ScalarContext(class_counts=counts, num_samples=int(sum(COUNTS))))
        assert got == {"skew": exact}, dtype


def test_the_float32_arithmetic_of_the_cv_score_differs_from_float64():
    """Guards the test above: for these counts a float32 computation is not the float64 value."""
    as32 = np.array(COUNTS, dtype=np.float32)
    assert float(as32.std() / as32.mean()) != imbalance_cv(np.array(COUNTS, dtype=np.float64))


# --- FedDRAW: the spread's numerics, float64 throughout, the site's name and options on every path ---


def _z_softmax(values, temperature=1.0):
    """Independent softmax of the standardised values (population std)."""
    v = np.asarray(values, dtype=np.float64)
    z = (v - v.mean()) / v.std() / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def test_feddraw_softmax_spread_survives_a_tiny_span_and_a_large_offset():
    """Similarities that differ by 1e-200 (or by 2^-30 around 1024) spread as their differences say:
    the min-max step keeps the standard deviation from underflowing and the offset from swamping it."""
    expected = _z_softmax([0.0, 1.0, 3.0])
    tiny = softmax_spread(np.array([0.0, 1e-200, 3e-200]))
    assert np.all(np.isfinite(tiny)) and tiny.tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    offset = softmax_spread(1024.0 + np.array([0.0, 1.0, 3.0]) * 2.0**-30, temperature=0.5)
    assert offset.tolist() == pytest.approx(_z_softmax([0.0, 1.0, 3.0], 0.5).tolist(), rel=1e-12)


def test_feddraw_bound_by_prior_computes_in_float64_for_float32_inputs():
    share, prior = np.array([0.7, 0.2, 0.1], dtype=np.float32), np.array([0.2, 0.3, 0.5], dtype=np.float32)
    exact, mixed = bound_by_prior(share.astype(np.float64), prior.astype(np.float64), 2.0)
    assert 0.0 < mixed < 1.0  # the bound binds, so both vectors enter the result
    for s, p in ((share, prior.astype(np.float64)), (share.astype(np.float64), prior), (share, prior)):
        got, got_mixed = bound_by_prior(s, p, 2.0)
        assert got.dtype == np.float64 and got.tolist() == exact.tolist() and got_mixed == mixed


def test_feddraw_tempered_weights_compute_in_float64_and_name_an_unknown_form():
    rep = np.array([0.2, 0.3, 0.5], dtype=np.float32)
    for form in ("log", "plain"):
        got = tempered_weights(rep, 0.7, form)
        assert got.dtype == np.float64
        assert got.tolist() == tempered_weights(rep.astype(np.float64), 0.7, form).tolist()
    with pytest.raises(ValueError) as refused:
        tempered_weights(rep, 0.7, "square")
    assert str(refused.value) == "feddraw: form must be 'log' or 'plain', got 'square'"


GLOBAL = {"w": np.array([1.0, 2.0, 3.0]), "b": np.array([0.5])}


def _params(shift: float) -> dict[str, np.ndarray]:
    return {"w": GLOBAL["w"] + np.array([shift, -shift, 0.5 * shift]), "b": GLOBAL["b"] - shift}


@pytest.mark.parametrize("similarity", ["params", "layer", "direction"])
def test_feddraw_a_client_with_the_wrong_layout_is_named(similarity):
    scheme = FedDRAWWeights(similarity=similarity)
    good = [ClientReport("a", 10, params=_params(0.1)), ClientReport("b", 30, params=_params(0.2))]
    scheme.weights(good, GLOBAL, 1, 4)  # direction: the server now holds theta_g^{t-1}
    newer = {k: v + 0.05 for k, v in GLOBAL.items()}
    bad = [
        ClientReport("a", 10, params=_params(0.1)),
        ClientReport("b", 30, params={"w": np.zeros(2), "b": GLOBAL["b"]}),
    ]
    with pytest.raises(ValueError, match=re.escape("client 'b'")):
        scheme.weights(bad, newer, 2, 4)
    with pytest.raises(ValueError, match=re.escape("client 'site-7'")):
        scheme._similarity_of({"w": np.zeros(2), "b": GLOBAL["b"]}, newer, "site-7", GLOBAL)


def test_feddraw_the_servers_similarity_follows_the_mode():
    reports = [ClientReport("a", 10, params=_params(0.1)), ClientReport("b", 30, params=_params(-0.3))]
    for mode in ("params", "layer"):
        scheme = FedDRAWWeights(similarity=mode)
        scheme.weights(reports, GLOBAL, 2, 4)
        expected = [model_similarity(r.params, GLOBAL, mode) for r in reports]
        assert scheme.last_details["similarity"] == pytest.approx(expected, rel=1e-12)
    layer = [model_similarity(r.params, GLOBAL, "layer") for r in reports]
    assert layer != pytest.approx([model_similarity(r.params, GLOBAL, "params") for r in reports], rel=1e-9)


def test_feddraw_uses_a_reported_similarity_when_the_server_has_the_global_model_but_no_client_parameters():
    scheme = FedDRAWWeights(similarity="params")
    reports = [
        ClientReport("a", 10, scalars={"similarity": 0.9}),
        ClientReport("b", 30, scalars={"similarity": 0.4}),
    ]
    scheme.weights(reports, GLOBAL, 2, 4)
    assert scheme.last_details["similarity"] == [0.9, 0.4]


def test_feddraw_refusals_name_the_client_and_what_is_missing():
    delta = FedDRAWWeights(similarity="delta")
    with pytest.raises(ValueError) as refused:
        delta.weights([ClientReport("a", 10, params=_params(0.1)), ClientReport("b", 30)], GLOBAL, 2, 4)
    assert str(refused.value) == (
        "feddraw: client 'b' sent no parameters; similarity='delta' needs every client's parameters at the server"
    )
    with pytest.raises(ValueError) as refused:
        delta.weights([ClientReport("a", 10, params=_params(0.1))], None, 2, 4)
    assert str(refused.value) == "feddraw: similarity='delta' needs the global parameters"
    with pytest.raises(ValueError) as refused:
        FedDRAWWeights(similarity="params").weights([ClientReport("c", 10)], None, 2, 4)
    assert str(refused.value) == (
        "feddraw: client 'c' reported no 'similarity' scalar and the server has no plaintext parameters to compute it"
    )


def test_feddraw_keeps_its_own_copy_of_the_previous_global_model():
    scheme = FedDRAWWeights(similarity="direction")
    global_params = {k: v.copy() for k, v in GLOBAL.items()}
    scheme.weights([ClientReport("a", 10, params=_params(0.1))], global_params, 1, 4)
    for array in global_params.values():
        array += 7.0  # the caller reuses its arrays
    assert {k: v.tolist() for k, v in scheme.previous_global.items()} == {
        k: v.tolist() for k, v in GLOBAL.items()
    }


def test_feddraw_rate_and_eps_reach_the_schedules_and_the_tempering_with_similarity_on():
    reports = [
        ClientReport("a", 10, scalars={"similarity": 0.9}),
        ClientReport("b", 90, scalars={"similarity": 0.1}),
    ]
    scheme = FedDRAWWeights(
        similarity="params",
        inner="exponential",
        outer="exponential",
        rate=2.0,
        rho=0.2,
        eps=0.5,
        prior_factor=None,
    )
    w = scheme.weights(reports, None, 4, 10)
    lam = schedules.ramp("exponential", schedules.progress(4, 10), 2.0)
    beta = schedules.deferred_anneal(4, 10, 1.0, 0.2, "exponential", 2.0)
    assert lam != schedules.ramp("exponential", schedules.progress(4, 10))
    assert beta != schedules.deferred_anneal(4, 10, 1.0, 0.2, "exponential")
    details = scheme.last_details
    assert (details["lambda"], details["beta"]) == (lam, beta)
    r = np.array(details["reputation"])
    assert r.min() < 0.5  # the floor binds
    assert w.tolist() == pytest.approx(tempered_weights(r, beta, "log", 0.5).tolist(), rel=1e-12)
    assert w.tolist() != pytest.approx(tempered_weights(r, beta, "log").tolist(), rel=1e-6)


def test_feddraw_details_name_each_part_and_the_prior_bound_only_when_it_is_on():
    reports = [
        ClientReport("a", 10, scalars={"similarity": 0.9}),
        ClientReport("b", 90, scalars={"similarity": 0.1}),
    ]
    common = {"size_prior", "similarity", "spread_similarity", "lambda", "reputation", "beta"}
    bounded = FedDRAWWeights(similarity="params")
    bounded.weights(reports, None, 3, 10)
    assert set(bounded.last_details) == common | {"similarity_share", "prior_mix"}
    assert bounded.last_details["size_prior"] == [0.1, 0.9]
    share, mixed = bound_by_prior(
        np.array(bounded.last_details["spread_similarity"]), np.array([0.1, 0.9]), 2.0
    )
    assert (
        bounded.last_details["similarity_share"] == share.tolist()
        and bounded.last_details["prior_mix"] == mixed
    )
    free = FedDRAWWeights(similarity="params", prior_factor=None)
    free.weights(reports, None, 3, 10)
    assert set(free.last_details) == common


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(similarity="cos"),
            "feddraw: similarity must be one of 'params', 'delta', 'layer', 'direction', 'off', got 'cos'",
        ),
        (
            dict(inner="step"),
            "feddraw: inner schedule must be one of linear, cosine, exponential, got 'step'",
        ),
        (
            dict(outer="step"),
            "feddraw: outer schedule must be one of linear, cosine, exponential, got 'step'",
        ),
        *[
            (dict(temperature=t), f"feddraw: temperature must be a positive number, got {t!r}")
            for t in (math.inf, math.nan, True, "2", 0.0, -1.0)
        ],
        *[
            (
                dict(prior_factor=c),
                f"feddraw: prior_factor must be None (off) or a finite number >= 1, got {c!r}",
            )
            for c in (math.inf, math.nan, True, "2", 0.99)
        ],
        *[
            (dict(beta_max=b), f"feddraw: beta_max must be a finite number >= 0, got {b!r}")
            for b in (-1.0, -1e-9, math.inf)
        ],
        *[(dict(eps=e), f"feddraw: eps must be a positive number, got {e!r}") for e in (0.0, -1.0, math.inf)],
        *[
            (dict(rate=r), f"feddraw: rate must be a positive number, got {r!r}")
            for r in (0.0, -1.0, math.inf)
        ],
    ],
)
def test_feddraw_options_out_of_range_are_refused_in_a_sentence(options, message):
    with pytest.raises(ValueError) as refused:
        FedDRAWWeights(**options)
    assert str(refused.value) == message


def test_feddraw_options_at_their_bounds_are_accepted():
    scheme = FedDRAWWeights(temperature=1e-6, prior_factor=1.0, beta_max=0.0, eps=1e-300, rate=0.5)
    assert (scheme.temperature, scheme.prior_factor, scheme.beta_max, scheme.eps, scheme.rate) == (
        1e-6,
        1.0,
        0.0,
        1e-300,
        0.5,
    )
    assert FedDRAWWeights(temperature=2, prior_factor=3).prior_factor == 3  # integers are numbers too

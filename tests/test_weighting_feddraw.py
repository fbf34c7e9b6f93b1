"""FedDRAW: size prior + spread similarity under inner and deferred outer schedules (hand values)."""

import math

import numpy as np
import pytest

from fedweigh.weighting import ClientReport, FedDRAWWeights, get_scheme
from fedweigh.weighting.feddraw import spread_similarity, tempered_weights


def sim_reports(sizes, sims):
    return [
        ClientReport(f"h{i}", n, scalars={"similarity": s})
        for i, (n, s) in enumerate(zip(sizes, sims, strict=True))
    ]


SIZES = [100, 300, 600]  # p = (0.1, 0.3, 0.6)
SIMS = [0.90, 0.95, 0.99]  # min-max (0, 5/9, 1) -> / (14/9) -> (0, 5/14, 9/14)
P = np.array([0.1, 0.3, 0.6])
S_HAT = np.array([0.0, 5 / 14, 9 / 14])


def test_spread_similarity_by_hand_and_zero_spread():
    np.testing.assert_allclose(spread_similarity(np.array(SIMS)), S_HAT, rtol=1e-12)
    np.testing.assert_array_equal(spread_similarity(np.array([0.97, 0.97, 0.97, 0.97])), np.full(4, 0.25))


def test_round_one_equals_size_prior():
    scheme = FedDRAWWeights(beta_max=1.0, rho=0.6, inner="cosine")
    w = scheme.weights(sim_reports(SIZES, SIMS), None, round_index=1, num_rounds=10)
    np.testing.assert_allclose(w, P, rtol=1e-12)
    assert scheme.last_details["lambda"] == 0.0 and scheme.last_details["beta"] == 1.0


@pytest.mark.parametrize("form", ["log", "plain"])
def test_last_round_is_uniform(form):
    w = FedDRAWWeights(beta_max=3.0, rho=0.5, form=form).weights(sim_reports(SIZES, SIMS), None, 8, 8)
    np.testing.assert_allclose(w, np.full(3, 1 / 3), rtol=1e-12)


def test_middle_round_by_hand_log_form():
    # T = 5, round 3: progress 0.5, linear lambda = 0.5; rho = 0.4 -> t_d = 2, x = 1/3,
    # cosine ramp (1 - cos(pi/3)) / 2 = 0.25 -> beta = 2 * 0.75 = 1.5
    r = 0.5 * P + 0.5 * S_HAT
    expected = r**1.5 / np.sum(r**1.5)
    scheme = FedDRAWWeights(beta_max=2.0, rho=0.4, inner="linear", outer="cosine")
    w = scheme.weights(sim_reports(SIZES, SIMS), None, 3, 5)
    assert scheme.last_details["beta"] == pytest.approx(1.5)
    np.testing.assert_allclose(w, expected, rtol=1e-12)


def test_middle_round_by_hand_plain_form():
    r = 0.5 * P + 0.5 * S_HAT
    e = np.exp(1.5 * 3 * r)
    w = FedDRAWWeights(beta_max=2.0, rho=0.4, form="plain").weights(sim_reports(SIZES, SIMS), None, 3, 5)
    np.testing.assert_allclose(w, e / e.sum(), rtol=1e-12)


def test_zero_similarity_spread_gives_uniform_similarity_part():
    # T = 3, round 2: lambda = 0.5 (linear); rho = 1: beta = beta_max = 1 -> w = r = 0.5 p + 0.5 / K
    w = FedDRAWWeights(rho=1.0).weights(sim_reports(SIZES, [0.98, 0.98, 0.98]), None, 2, 3)
    np.testing.assert_allclose(w, 0.5 * P + 0.5 / 3, rtol=1e-12)


def test_zero_reputation_is_floored_not_nan():
    # T = 2, round 2, rho = 1 (no anneal), linear: lambda = 1 -> r = s_hat, whose first entry is 0
    w = FedDRAWWeights(rho=1.0, beta_max=1.0).weights(sim_reports(SIZES, SIMS), None, 2, 2)
    assert np.all(np.isfinite(w)) and w[0] < 1e-11
    np.testing.assert_allclose(w[1:], S_HAT[1:], rtol=1e-10)


def test_tempered_weights_beta_limits():
    r = np.array([0.2, 0.3, 0.5])
    np.testing.assert_allclose(tempered_weights(r, 1.0), r, rtol=1e-12)
    np.testing.assert_allclose(tempered_weights(r, 0.0), np.full(3, 1 / 3), rtol=1e-12)
    sharp = tempered_weights(r, 4.0)
    assert sharp[2] > 0.5 and sharp[0] < 0.2  # beta > 1 sharpens towards the most reputable


def test_schedule_shapes_change_lambda():
    rep = sim_reports(SIZES, SIMS)
    lam = {}
    for shape in ("linear", "cosine", "exponential"):
        s = FedDRAWWeights(inner=shape, rate=5.0)
        s.weights(rep, None, 2, 5)  # progress 0.25
        lam[shape] = s.last_details["lambda"]
    assert lam["linear"] == pytest.approx(0.25)
    assert lam["cosine"] == pytest.approx((1 - math.cos(0.25 * math.pi)) / 2)
    assert lam["exponential"] == pytest.approx((1 - math.exp(-1.25)) / (1 - math.exp(-5)))


# ----------------------------------------------------------------------------- similarity sources
def two_layer(w, b):
    return {"w": np.asarray(w, dtype=np.float64), "b": np.asarray(b, dtype=np.float64), "t": np.array(1)}


GLOBAL = two_layer([1.0, 0.0], [2.0])
CLIENTS = [two_layer([1.0, 1.0], [3.0]), two_layer([1.2, 0.1], [2.0]), two_layer([0.5, 0.5], [2.5])]


@pytest.mark.parametrize("mode", ["params", "layer"])
def test_server_side_similarity_equals_client_reported(mode):
    scheme = FedDRAWWeights(similarity=mode)
    with_scalars, params_only = [], []
    for i, c in enumerate(CLIENTS):
        sc = scheme.client_scalars(class_counts=np.ones(2), num_samples=10, params=c, global_params=GLOBAL)
        with_scalars.append(ClientReport(f"c{i}", 10 + i, scalars=sc))
        params_only.append(ClientReport(f"c{i}", 10 + i, params=c))
    w_client = scheme.weights(with_scalars, None, 3, 5)
    s_client = scheme.last_details["similarity"]
    w_server = scheme.weights(params_only, GLOBAL, 3, 5)
    assert scheme.last_details["similarity"] == s_client
    np.testing.assert_array_equal(w_client, w_server)


def test_params_similarity_value_by_hand():
    sc = FedDRAWWeights().client_scalars(
        class_counts=np.ones(2), num_samples=1, params=CLIENTS[0], global_params=GLOBAL
    )
    assert sc["similarity"] == pytest.approx(7 / math.sqrt(55))  # (1,1,3).(1,0,2) / (|.| |.|)


def test_delta_mode_by_hand_and_declarations():
    g = {"w": np.zeros(2)}
    reps = [
        ClientReport("a", 1, params={"w": np.array([1.0, 0.0])}),
        ClientReport("b", 3, params={"w": np.array([0.0, 1.0])}),
    ]
    scheme = FedDRAWWeights(similarity="delta")
    scheme.weights(reps, g, 2, 4)
    mean = np.array([0.25, 0.75])  # size-weighted mean delta
    expected = np.array([0.25, 0.75]) / np.linalg.norm(mean)
    np.testing.assert_allclose(scheme.last_details["similarity"], expected, rtol=1e-12)
    assert not scheme.he_compatible
    assert FedDRAWWeights().he_compatible
    assert scheme.client_scalars(class_counts=np.ones(2), num_samples=1, params=g, global_params=g) == {}
    with pytest.raises(ValueError, match="'b'.*no parameters"):
        scheme.weights([reps[0], ClientReport("b", 3)], g, 2, 4)


def test_missing_similarity_without_params_names_client():
    reps = [ClientReport("a", 1, scalars={"similarity": 0.9}), ClientReport("hosp-2", 1)]
    with pytest.raises(ValueError, match="'hosp-2'.*no 'similarity'"):
        FedDRAWWeights().weights(reps, None, 1, 3)


def test_option_validation():
    with pytest.raises(ValueError, match="similarity"):
        get_scheme("feddraw", similarity="euclid")
    with pytest.raises(ValueError, match="inner"):
        get_scheme("feddraw", inner="step")
    with pytest.raises(ValueError, match="rho"):
        get_scheme("feddraw", rho=1.2)
    with pytest.raises(ValueError, match="form"):
        get_scheme("feddraw", form="exp")

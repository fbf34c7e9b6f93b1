"""FedAvg, FedProx, FedNova, FedAdp, IDA and FedDisco against hand-computed values."""

import json
import logging
import math

import numpy as np
import pytest

from fedweigh.histograms import GlobalStats
from fedweigh.weighting import ClientReport, feddisco, get_scheme
from fedweigh.weighting.base import ScalarContext
from fedweigh.weighting.fedadp import gompertz
from fedweigh.weighting.feddisco import kl_discrepancy
from fedweigh.weighting.fednova import momentum_normaliser


def pooled(counts) -> GlobalStats:
    """Global statistics with the pooled histogram ``counts`` (N: their sum; DAFL's c_client unused here)."""
    return GlobalStats(np.asarray(counts), int(np.sum(counts)), 0.0)


def vec_reports(global_vec, deltas, sizes, names=None, steps=None):
    names = names or [f"c{i}" for i in range(len(deltas))]
    steps = steps or [1] * len(deltas)
    return [
        ClientReport(nm, n, num_steps=s, params={"w": global_vec + np.asarray(d, dtype=np.float64)})
        for nm, d, n, s in zip(names, deltas, sizes, steps, strict=True)
    ]


G = {"w": np.array([0.5, -1.0])}


def test_fedavg_and_fedprox():
    reps = [ClientReport("a", 1), ClientReport("b", 3)]
    np.testing.assert_allclose(get_scheme("fedavg").weights(reps, None, 1, 1), [0.25, 0.75], rtol=1e-15)
    prox = get_scheme("fedprox")
    np.testing.assert_allclose(prox.weights(reps, None, 1, 1), [0.25, 0.75], rtol=1e-15)
    assert prox.client_mu == 0.01  # chosen by validation AUC (docs/methods.md, FedProx)
    assert prox.fedprox_mu == 0.01
    with pytest.raises(ValueError, match="client_mu"):
        get_scheme("fedprox", client_mu=-1.0)


def test_fednova_closed_form():
    # p = (0.25, 0.75), tau = (10, 30): tau_eff = 25; w = (25 * 0.25 / 10, 25 * 0.75 / 30) = (0.625, 0.625)
    reps = vec_reports(G["w"], [[1.0, 0.0], [0.0, 2.0]], [100, 300], steps=[10, 30])
    scheme = get_scheme("fednova")
    w = scheme.weights(reps, G, 1, 3)
    np.testing.assert_allclose(w, [0.625, 0.625], rtol=1e-15)
    new = scheme.aggregate(G, reps, w)["w"]
    closed = G["w"] - 25 * (
        0.25 * (G["w"] - reps[0].params["w"]) / 10 + 0.75 * (G["w"] - reps[1].params["w"]) / 30
    )
    np.testing.assert_allclose(new, closed, rtol=1e-15)
    # equal steps -> FedAvg
    reps_eq = vec_reports(G["w"], [[1.0, 0.0], [0.0, 2.0]], [100, 300], steps=[7, 7])
    np.testing.assert_allclose(scheme.weights(reps_eq, G, 1, 3), [0.25, 0.75], rtol=1e-15)


def test_fednova_momentum_sgd_normaliser_is_the_closed_form():
    """||a||_1 = [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho); tau = 10, rho = 0.9 by hand:
    (10 - 0.9 (1 - 0.9^10) / 0.1) / 0.1 = 41.3810..., checked against torch.optim.SGD's displacement
    under a constant unit gradient (the sum of the gradient coefficients)."""
    import torch

    expected = (10 - 0.9 * (1 - 0.9**10) / 0.1) / 0.1
    assert momentum_normaliser(np.array([10.0]), 0.9)[0] == pytest.approx(expected, rel=1e-14)
    assert expected == pytest.approx(41.3810596, rel=1e-8)
    for tau in (1, 4, 10, 37):
        x = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([x], lr=1.0, momentum=0.9)
        for _ in range(tau):
            opt.zero_grad()
            x.sum().backward()  # gradient 1
            opt.step()
        assert -x.item() == pytest.approx(momentum_normaliser(np.array([tau]), 0.9)[0], rel=1e-12)
    # weights: p = (0.25, 0.75), tau = (10, 30) -> a = (A10, A30), tau_eff = 0.25 A10 + 0.75 A30
    a10, a30 = momentum_normaliser(np.array([10.0, 30.0]), 0.9)
    tau_eff = 0.25 * a10 + 0.75 * a30
    reps = vec_reports(G["w"], [[1.0, 0.0], [0.0, 2.0]], [100, 300], steps=[10, 30])
    w = get_scheme("fednova", local_optimizer="sgd", momentum=0.9).weights(reps, G, 1, 3)
    np.testing.assert_allclose(w, [tau_eff * 0.25 / a10, tau_eff * 0.75 / a30], rtol=1e-14)
    # it differs from the plain-step normaliser the Adam default uses
    assert not np.allclose(w, get_scheme("fednova").weights(reps, G, 1, 3))
    # rho = 0 is plain SGD: a = tau
    np.testing.assert_allclose(
        get_scheme("fednova", local_optimizer="sgd", momentum=0.0).weights(reps, G, 1, 3), [0.625, 0.625]
    )
    with pytest.raises(ValueError, match="local_optimizer must be one of .*'rmsprop'"):
        get_scheme("fednova", local_optimizer="rmsprop")
    with pytest.raises(ValueError, match="momentum must lie in \\[0, 1\\), got 1.0"):
        get_scheme("fednova", local_optimizer="sgd", momentum=1.0)


def test_fedadp_two_rounds_of_smoothing_and_state():
    scheme = get_scheme("fedadp")
    # round 1: deltas (1, 0), (0, 1), N = (1, 3): mean delta (0.25, 0.75)
    r1 = vec_reports(G["w"], [[1.0, 0.0], [0.0, 1.0]], [1, 3])
    norm = math.sqrt(0.25**2 + 0.75**2)
    a1 = np.array([math.acos(0.25 / norm), math.acos(0.75 / norm)])
    w1 = scheme.weights(r1, G, 1, 5)
    e1 = np.array([1, 3]) * np.exp(gompertz(a1))
    np.testing.assert_allclose(w1, e1 / e1.sum(), rtol=1e-12)
    # Gompertz by hand at angle 1: 5 (1 - e^{-1})
    assert gompertz(np.array([1.0]))[0] == pytest.approx(5 * (1 - math.exp(-1)))
    saved = json.loads(json.dumps(scheme.state_dict()))
    # round 2: identical deltas -> angles 0; smoothed = (1/2) a1 + 0 / 2
    r2 = vec_reports(G["w"], [[1.0, 1.0], [1.0, 1.0]], [1, 3])
    w2 = scheme.weights(r2, G, 2, 5)
    e2 = np.array([1, 3]) * np.exp(gompertz(a1 / 2))
    np.testing.assert_allclose(w2, e2 / e2.sum(), rtol=1e-12)
    np.testing.assert_allclose(scheme.last_details["smoothed_angle"], a1 / 2, rtol=1e-12)
    # restored state gives the same round-2 weights
    other = get_scheme("fedadp")
    other.load_state_dict(saved)
    np.testing.assert_array_equal(other.weights(r2, G, 2, 5), w2)


def test_fedadp_late_joiner_starts_from_its_own_angle():
    scheme = get_scheme("fedadp")
    scheme.weights(vec_reports(G["w"], [[1.0, 0.0], [0.0, 1.0]], [1, 1], names=["a", "b"]), G, 1, 3)
    scheme.weights(vec_reports(G["w"], [[1.0, 0.0], [0.0, 1.0]], [1, 1], names=["a", "late"]), G, 2, 3)
    assert scheme.participations == {"a": 2, "b": 1, "late": 1}
    assert scheme.smoothed_angle["late"] == pytest.approx(math.pi / 4)
    assert scheme.smoothed_angle["a"] == pytest.approx(math.pi / 4)


def test_ida_by_hand_and_guards():
    # deltas 0, 1, 5 (1-D): mean 2 -> distances (2, 1, 3) -> inverse (1/2, 1, 1/3) / (11/6)
    g = {"w": np.array([0.7])}
    reps = vec_reports(g["w"], [[0.0], [1.0], [5.0]], [10, 20, 30])
    np.testing.assert_allclose(get_scheme("ida").weights(reps, g, 1, 2), [3 / 11, 6 / 11, 2 / 11], rtol=1e-12)
    same = vec_reports(g["w"], [[1.0], [1.0]], [10, 90])
    np.testing.assert_allclose(get_scheme("ida").weights(same, g, 1, 2), [0.5, 0.5], rtol=1e-15)


def test_feddisco_uniform_target_by_hand():
    """Default target (the authors' code): d_k = KL(D_k || uniform) = sum_j D_kj log(C D_kj)."""
    scheme = get_scheme("feddisco")
    assert scheme.target == "uniform" and scheme.needs_global_histogram is False
    # D_k = (0.25, 0.75), C = 2: 0.25 log 0.5 + 0.75 log 1.5; the global histogram is ignored
    sc = scheme.client_scalars(
        ScalarContext(class_counts=np.array([1, 3]), num_samples=4, global_stats=pooled([9, 1]))
    )
    assert sc["discrepancy"] == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))
    # C = 3, D_k = (0.5, 0.5, 0): 2 * 0.5 log(1.5) = log 1.5 (a missing class contributes 0)
    sc3 = scheme.client_scalars(ScalarContext(class_counts=np.array([2, 2, 0]), num_samples=4))
    assert sc3["discrepancy"] == pytest.approx(math.log(1.5))
    # against a skewed pooled histogram the "global" target gives a different number
    glob = get_scheme("feddisco", target="global").client_scalars(
        ScalarContext(class_counts=np.array([2, 2, 0]), num_samples=4, global_stats=pooled([8, 1, 1]))
    )
    assert glob["discrepancy"] == pytest.approx(0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.1))
    with pytest.raises(ValueError, match="target must be one of .*'pooled'"):
        get_scheme("feddisco", target="pooled")


def test_feddisco_global_target_by_hand():
    scheme = get_scheme("feddisco", target="global")
    assert scheme.needs_global_histogram is True
    sc = scheme.client_scalars(
        ScalarContext(class_counts=np.array([1, 3]), num_samples=4, global_stats=pooled([2, 2]))
    )
    assert sc["discrepancy"] == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))
    # a site missing a class: D_k = (0, 1), D_glob = (0.5, 0.5) -> log 2, no NaN
    sc0 = scheme.client_scalars(
        ScalarContext(class_counts=np.array([0, 4]), num_samples=4, global_stats=pooled([4, 4]))
    )
    assert sc0["discrepancy"] == pytest.approx(math.log(2))
    assert kl_discrepancy(np.array([2, 2]), np.array([5, 5])) == 0.0


def test_feddisco_global_target_without_global_histogram_falls_back_to_uniform(caplog, monkeypatch):
    """A site that got no global histogram (the statistics phase summed nothing, or it refused the sum)
    still answers: its discrepancy against the uniform target, with a warning, instead of no result."""
    scheme = get_scheme("feddisco", target="global")
    monkeypatch.setattr(feddisco, "_FALLBACK_WARNED", [])
    with caplog.at_level(logging.WARNING, logger="fedweigh.weighting.feddisco"):
        sc = scheme.client_scalars(ScalarContext(class_counts=np.array([1, 3]), num_samples=4))
    assert sc["discrepancy"] == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))
    assert "uniform target instead" in caplog.text


def test_feddisco_weights_by_hand():
    reps = [
        ClientReport("a", 100, scalars={"discrepancy": 0.2}),
        ClientReport("b", 300, scalars={"discrepancy": 0.6}),
    ]
    # p = (0.25, 0.75), d~ = (0.25, 0.75): raw = (0.25 - 0.125 + 0.1, 0.75 - 0.375 + 0.1) = (0.225, 0.475)
    np.testing.assert_allclose(
        get_scheme("feddisco").weights(reps, None, 1, 2), [0.225 / 0.7, 0.475 / 0.7], rtol=1e-14
    )
    # ReLU clips a client: a = 2, b = 0 -> raw = (0.25 - 0.5, 0.75 - 1.5) -> all zero -> size weights
    np.testing.assert_allclose(get_scheme("feddisco", a=2.0, b=0.0).weights(reps, None, 1, 2), [0.25, 0.75])
    # a = 1, b = 0.05: raw = (0.25 - 0.25 + 0.05, 0.75 - 0.75 + 0.05) = (0.05, 0.05)
    np.testing.assert_allclose(get_scheme("feddisco", a=1.0, b=0.05).weights(reps, None, 1, 2), [0.5, 0.5])
    # all discrepancies zero -> (p + b) / sum
    zero = [
        ClientReport("a", 100, scalars={"discrepancy": 0.0}),
        ClientReport("b", 300, scalars={"discrepancy": 0.0}),
    ]
    np.testing.assert_allclose(
        get_scheme("feddisco").weights(zero, None, 1, 2), [0.35 / 1.2, 0.85 / 1.2], rtol=1e-14
    )
    with pytest.raises(ValueError, match="'b'.*'discrepancy' must be >= 0"):
        get_scheme("feddisco").weights(
            [zero[0], ClientReport("b", 3, scalars={"discrepancy": -0.1})], None, 1, 2
        )


def test_fedprox_accepts_mu_zero_and_refuses_any_negative_mu():
    """client_mu = 0 is FedAvg's local objective (allowed); the bound is mu >= 0 exactly."""
    assert get_scheme("fedprox", client_mu=0.0).fedprox_mu == 0.0
    with pytest.raises(ValueError, match="client_mu must be a finite number >= 0"):
        get_scheme("fedprox", client_mu=-1e-12)

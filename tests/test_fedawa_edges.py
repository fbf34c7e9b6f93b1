"""FedAWA's edges: each bound of its settings on both sides, the state it loads, the details it reports,
and a round whose site sits at the mix (e_k = 0, the objective's non-differentiable point)."""

import math
import re
import warnings

import numpy as np
import pytest
from test_weighting_fedawa import make_round

from fedweigh.weighting import FedAWAWeights
from fedweigh.weighting.fedawa import fedawa_objective_and_grad
from fedweigh.weighting.geometry import delta_gram


def _round():
    return make_round(np.random.default_rng(0), ["a", "b", "c"], [10, 30, 60])


@pytest.mark.parametrize("betas", [(0.0, 0.999), (0.5, 0.0), (0.0, 0.0), (0.999, 0.9999)])
def test_betas_take_zero_and_values_just_below_one(betas):
    scheme = FedAWAWeights(betas=betas, server_iters=2)
    g, reps = _round()
    lam = scheme.weights(reps, g, 1, 2)
    assert np.isfinite(lam).all() and lam.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("betas", [(1.0, 0.9), (0.5, 1.0), (0.5, 1.5), (-0.1, 0.9), (0.5, -0.1)])
def test_betas_at_or_beyond_one_or_below_zero_are_refused(betas):
    with pytest.raises(
        ValueError, match=r"fedawa: betas must lie in \[0, 1\), got " + re.escape(repr(betas))
    ):
        FedAWAWeights(betas=betas)


@pytest.mark.parametrize("eps", [0.0, -1e-8, math.inf, math.nan])
def test_adam_eps_not_positive_or_not_finite_is_refused_by_name(eps):
    with pytest.raises(
        ValueError, match=r"^fedawa: adam_eps must be a positive number, got " + re.escape(repr(eps))
    ):
        FedAWAWeights(adam_eps=eps)


def test_a_tiny_positive_adam_eps_is_accepted():
    assert FedAWAWeights(adam_eps=1e-300).adam_eps == 1e-300


@pytest.mark.parametrize("iters", [2.5, 1.0, "3", True])
def test_server_iters_must_be_an_integer(iters):
    with pytest.raises(
        ValueError, match=r"fedawa: server_iters must be an integer >= 1, got " + re.escape(repr(iters))
    ):
        FedAWAWeights(server_iters=iters)


def test_one_server_iteration_is_accepted_and_runs_once():
    scheme = FedAWAWeights(server_iters=1)
    g, reps = _round()
    scheme.weights(reps, g, 1, 2)
    assert scheme.steps == {"a": 1, "b": 1, "c": 1}


def test_a_round_without_the_global_parameters_is_refused_by_name():
    g, reps = _round()
    with pytest.raises(ValueError, match=r"^fedawa: the global parameters are required$"):
        FedAWAWeights().weights(reps, None, 1, 2)


def test_the_details_name_the_objective_at_the_first_and_last_iteration_and_both_lambdas():
    scheme = FedAWAWeights(server_iters=3)
    g, reps = _round()
    lam = scheme.weights(reps, g, 1, 2)
    details = scheme.last_details
    assert set(details) == {"objective_first", "objective_last", "lambda_first", "lambda"}
    gram = delta_gram(g, [r.params for r in reps], [r.name for r in reps])
    first, _ = fedawa_objective_and_grad(np.log(np.array([10, 30, 60]) / 100.0), gram)
    assert isinstance(details["objective_first"], float) and details["objective_first"] == pytest.approx(
        first
    )
    assert isinstance(details["objective_last"], float)
    last, _ = fedawa_objective_and_grad(np.log(np.asarray(details["lambda"])), gram)  # softmax(log lam) = lam
    assert details["objective_last"] == pytest.approx(last, rel=1e-12)
    assert details["lambda"] == lam.tolist()


def test_an_empty_state_loads_as_a_fresh_scheme():
    scheme = FedAWAWeights()
    g, reps = _round()
    scheme.weights(reps, g, 1, 2)
    scheme.load_state_dict({})
    assert (
        scheme.state_dict()
        == FedAWAWeights().state_dict()
        == {"logits": {}, "exp_avg": {}, "exp_avg_sq": {}, "steps": {}}
    )


@pytest.mark.parametrize("missing", ["logits", "exp_avg", "exp_avg_sq", "steps"])
def test_a_state_missing_one_entry_names_the_mismatch(missing):
    scheme = FedAWAWeights()
    g, reps = _round()
    scheme.weights(reps, g, 1, 2)
    state = scheme.state_dict()
    del state[missing]
    with pytest.raises(ValueError, match=r"^fedawa: state entries name different sites$"):
        FedAWAWeights().load_state_dict(state)


@pytest.mark.parametrize("k", [1, 2])
def test_sites_at_the_mix_give_a_zero_gradient_without_a_division_by_zero(k):
    """One site alone, or two that send the same update: every e_k = ||tau_k - sum_j lambda_j tau_j|| is
    exactly 0, where the objective is not differentiable and its e-terms drop (their factor
    G_ki - (G lambda)_i is 0 there); nothing is divided by 0 on the way, so no warning reaches the log."""
    theta_g = np.array([1.0, 2.0, -1.0, 0.5])
    delta = np.array([0.25, -0.5, 0.125, 0.5])
    gram = delta_gram({"w": theta_g}, [{"w": theta_g + delta}] * k, list("ab"[:k]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            obj, grad = fedawa_objective_and_grad(np.zeros(k), gram)
    theta = theta_g + delta
    cos = theta_g @ theta / (np.linalg.norm(theta_g) * np.linalg.norm(theta))
    assert gram.distances_to_mix(np.full(k, 1.0 / k)).tolist() == [0.0] * k
    assert obj == pytest.approx(1.0 - cos, rel=1e-12)
    assert grad.tolist() == [0.0] * k

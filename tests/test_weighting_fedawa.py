"""FedAWA: logits init, exact gradient, and the server iterations checked against torch autograd + torch.optim.Adam."""

import math

import numpy as np
import pytest
import torch

from fedweigh.weighting import ClientReport, FedAWAWeights
from fedweigh.weighting.fedawa import fedawa_objective_and_grad
from fedweigh.weighting.geometry import delta_gram

torch.set_num_threads(1)


def make_round(rng, names, sizes, dim=6):
    g = {"w": rng.normal(size=(2, dim // 2)), "n": np.array(4, dtype=np.int64)}
    reps = [
        ClientReport(nm, n, params={"w": g["w"] + rng.normal(scale=0.3, size=g["w"].shape), "n": g["n"]})
        for nm, n in zip(names, sizes, strict=True)
    ]
    return g, reps


def torch_objective(logits, g, reps):
    theta_g = torch.tensor(g["w"].ravel())
    taus = torch.stack([torch.tensor(r.params["w"].ravel()) - theta_g for r in reps])
    lam = torch.softmax(logits, dim=0)
    cos = torch.stack(
        [torch.dot(theta_g, theta_g + t) / (theta_g.norm() * (theta_g + t).norm()) for t in taus]
    )
    mix = (lam[:, None] * taus).sum(0)
    dist = torch.linalg.vector_norm(taus - mix, dim=1)
    return (lam * (1 - cos)).sum() + (lam * dist).sum()


def test_gradient_matches_autograd():
    rng = np.random.default_rng(5)
    g, reps = make_round(rng, ["a", "b", "c", "d"], [10, 20, 30, 40])
    logits = rng.normal(size=4)
    gram = delta_gram(g, [r.params for r in reps], [r.name for r in reps])
    obj, grad = fedawa_objective_and_grad(logits, gram)
    t = torch.tensor(logits, requires_grad=True)
    ref = torch_objective(t, g, reps)
    ref.backward()
    assert obj == pytest.approx(ref.item(), rel=1e-12)
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-9, atol=1e-14)


def test_server_iterations_match_the_authors_loop_in_torch():
    """Each round: a fresh torch.optim.Adam on T, server_iters steps on the round's objective, the
    aggregation with the last iteration's pre-step softmax (ChanglongShi/FedAWA server_funct.fedawa)."""
    rng = np.random.default_rng(6)
    sizes = [10, 30, 60]
    scheme = FedAWAWeights(server_iters=4)
    t = torch.tensor(np.log(np.array(sizes) / 100.0), requires_grad=True)
    for rnd in (1, 2):
        g, reps = make_round(rng, ["a", "b", "c"], sizes)
        lam = scheme.weights(reps, g, rnd, 5)
        opt = torch.optim.Adam([t], lr=1e-3, betas=(0.5, 0.999))
        for _ in range(4):
            used = torch.softmax(t, 0).detach().numpy()
            opt.zero_grad()
            torch_objective(t, g, reps).backward()
            opt.step()
        np.testing.assert_allclose(lam, used, rtol=1e-9)
        np.testing.assert_allclose(
            [scheme.logits[n] for n in "abc"], t.detach().numpy(), rtol=1e-9, atol=1e-12
        )
        if rnd == 1:
            np.testing.assert_allclose(scheme.last_details["lambda_first"], [0.1, 0.3, 0.6], rtol=1e-12)
    assert scheme.steps == {"a": 4, "b": 4, "c": 4}  # Adam restarts every round


def test_persistent_adam_one_step_matches_torch_over_two_rounds():
    rng = np.random.default_rng(6)
    sizes = [10, 30, 60]
    scheme = FedAWAWeights(server_iters=1, adam_state="persistent")
    t = torch.tensor(np.log(np.array(sizes) / 100.0), requires_grad=True)
    opt = torch.optim.Adam([t], lr=1e-3, betas=(0.5, 0.999))
    for rnd in (1, 2):
        g, reps = make_round(rng, ["a", "b", "c"], sizes)
        lam = scheme.weights(reps, g, rnd, 5)
        np.testing.assert_allclose(lam, torch.softmax(t, 0).detach().numpy(), rtol=1e-12)
        opt.zero_grad()
        torch_objective(t, g, reps).backward()
        opt.step()
        np.testing.assert_allclose(
            [scheme.logits[n] for n in "abc"], t.detach().numpy(), rtol=1e-9, atol=1e-12
        )
    assert scheme.steps == {"a": 2, "b": 2, "c": 2}


def test_init_size_is_the_codes_softmax_of_size_weights():
    rng = np.random.default_rng(8)
    g, reps = make_round(rng, ["a", "b", "c"], [10, 30, 60])
    scheme = FedAWAWeights(init="size")
    scheme.weights(reps, g, 1, 3)
    e = np.exp([0.1, 0.3, 0.6])
    np.testing.assert_allclose(scheme.last_details["lambda_first"], e / e.sum(), rtol=1e-12)


def heterogeneous_round(rng, g, sizes):
    """Two small sites agree on one direction; the largest site's update is three times longer and
    points elsewhere (label skew), with small noise."""
    d = g["w"].size
    shared = rng.normal(size=d)
    shared /= np.linalg.norm(shared)
    outlier = rng.normal(size=d)
    outlier /= np.linalg.norm(outlier)
    deltas = [0.1 * shared, 0.1 * shared, 0.3 * outlier]
    return [
        ClientReport(
            nm, n, params={"w": g["w"] + (dk + rng.normal(scale=0.005, size=d)).reshape(g["w"].shape)}
        )
        for nm, n, dk in zip("abc", sizes, deltas, strict=True)
    ]


def test_weights_move_away_from_fedavg_on_heterogeneous_updates():
    """30 rounds of heterogeneous client vectors: with the default server iterations the weights leave
    FedAvg's (0.1, 0.3, 0.6) by more than 0.1; one Adam step per round with kept moments (the earlier
    behaviour) stays within 0.03 of FedAvg. The direction is the objective's: its distance term
    sum_k lambda_k ||tau_k - m|| is 0 at every vertex, and here it moves weight towards the site that
    already holds most of it (the large, disagreeing one), not towards the agreeing pair."""
    sizes, p = [10, 30, 60], np.array([0.1, 0.3, 0.6])
    moved = {}
    for label, scheme in (
        ("default", FedAWAWeights()),
        ("one step", FedAWAWeights(server_iters=1, adam_state="persistent")),
    ):
        rng = np.random.default_rng(9)
        g = {"w": rng.normal(size=(4, 8))}
        for rnd in range(1, 31):
            lam = scheme.weights(heterogeneous_round(rng, g, sizes), g, rnd, 30)
        moved[label] = (float(np.max(np.abs(lam - p))), lam)
    assert moved["default"][0] > 0.1
    assert moved["default"][1][2] > p[2] + 0.1
    assert moved["one step"][0] < 0.03


def test_partial_participation_keeps_absent_state_and_inits_newcomer():
    rng = np.random.default_rng(7)
    scheme = FedAWAWeights(server_iters=1, adam_state="persistent")
    g, reps = make_round(rng, ["a", "b"], [10, 30])
    scheme.weights(reps, g, 1, 4)
    b_state = (scheme.logits["b"], scheme.exp_avg["b"], scheme.exp_avg_sq["b"], scheme.steps["b"])
    a_logit = scheme.logits["a"]  # after round 1's step
    g2, reps2 = make_round(rng, ["a", "new"], [10, 40])
    lam = scheme.weights(reps2, g2, 2, 4)
    assert (scheme.logits["b"], scheme.exp_avg["b"], scheme.exp_avg_sq["b"], scheme.steps["b"]) == b_state
    assert scheme.steps["new"] == 1 and scheme.steps["a"] == 2
    # the newcomer starts at log(N_k / N) over this round's sites: log(40 / 50)
    e = np.exp([a_logit, math.log(0.8)])
    np.testing.assert_allclose(lam, e / e.sum(), rtol=1e-12)


def test_partial_participation_with_round_adam_keeps_the_absent_logit():
    rng = np.random.default_rng(7)
    scheme = FedAWAWeights()
    g, reps = make_round(rng, ["a", "b"], [10, 30])
    scheme.weights(reps, g, 1, 4)
    b_logit = scheme.logits["b"]
    g2, reps2 = make_round(rng, ["a", "new"], [10, 40])
    scheme.weights(reps2, g2, 2, 4)
    assert scheme.logits["b"] == b_logit
    assert scheme.steps == {"a": 20, "b": 20, "new": 20}


def test_validation():
    with pytest.raises(ValueError, match="lr"):
        FedAWAWeights(lr=0.0)
    with pytest.raises(ValueError, match="betas"):
        FedAWAWeights(betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="server_iters must be an integer >= 1"):
        FedAWAWeights(server_iters=0)
    with pytest.raises(ValueError, match="adam_state must be 'round' or 'persistent', got 'keep'"):
        FedAWAWeights(adam_state="keep")
    with pytest.raises(ValueError, match="init must be"):
        FedAWAWeights(init="uniform")
    with pytest.raises(ValueError, match="malformed"):
        FedAWAWeights().load_state_dict({"logits": {"a": "x"}})

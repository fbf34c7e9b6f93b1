"""FedAWA: logits init, exact gradient and Adam step checked against torch autograd + torch.optim.Adam."""

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


def test_init_and_two_adam_steps_match_torch():
    rng = np.random.default_rng(6)
    sizes = [10, 30, 60]
    scheme = FedAWAWeights()
    t = torch.tensor(np.log(np.array(sizes) / 100.0), requires_grad=True)
    opt = torch.optim.Adam([t], lr=1e-3, betas=(0.5, 0.999))
    for rnd in (1, 2):
        g, reps = make_round(rng, ["a", "b", "c"], sizes)
        lam = scheme.weights(reps, g, rnd, 5)
        # aggregation uses the pre-step lambda; round 1: lambda = N_k / N
        np.testing.assert_allclose(lam, torch.softmax(t, 0).detach().numpy(), rtol=1e-12)
        if rnd == 1:
            np.testing.assert_allclose(lam, [0.1, 0.3, 0.6], rtol=1e-12)
        opt.zero_grad()
        torch_objective(t, g, reps).backward()
        opt.step()
        np.testing.assert_allclose(
            [scheme.logits[n] for n in "abc"], t.detach().numpy(), rtol=1e-9, atol=1e-12
        )
    assert scheme.steps == {"a": 2, "b": 2, "c": 2}


def test_partial_participation_keeps_absent_state_and_inits_newcomer():
    rng = np.random.default_rng(7)
    scheme = FedAWAWeights()
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


def test_validation():
    with pytest.raises(ValueError, match="lr"):
        FedAWAWeights(lr=0.0)
    with pytest.raises(ValueError, match="betas"):
        FedAWAWeights(betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="malformed"):
        FedAWAWeights().load_state_dict({"logits": {"a": "x"}})

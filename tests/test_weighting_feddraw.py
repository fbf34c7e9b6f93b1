"""FedDRAW: size prior + spread similarity under inner and deferred outer schedules (hand values)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedweigh.weighting import ClientReport, get_scheme
from fedweigh.weighting import FedDRAWWeights as _FedDRAWWeights
from fedweigh.weighting.base import ScalarContext
from fedweigh.weighting.feddraw import bound_by_prior, softmax_spread, spread_similarity, tempered_weights

#: The abstract's literal reading, which the hand-computed cases below are written for; the defaults
#: (direction, softmax, prior_factor 2) come from the sensitivity study and are checked on their own.
LITERAL = {"similarity": "params", "spread": "minmax", "prior_factor": None}


def FedDRAWWeights(**options):  # noqa: N802 - the scheme under its own name, literal unless told
    return _FedDRAWWeights(**{**LITERAL, **options})


def test_defaults_are_the_sensitivity_studys_best_variant():
    scheme = _FedDRAWWeights()
    assert (scheme.similarity, scheme.spread, scheme.prior_factor) == ("direction", "softmax", 2.0)
    assert scheme.he_compatible  # each site can compute the direction similarity itself
    study_file = Path(__file__).parents[1] / "docs/results/feddraw-sensitivity/feddraw_sensitivity.json"
    study = json.loads(study_file.read_text())
    best = max(study["variants"], key=lambda v: study["variants"][v]["mean_auc"])
    assert best == "feddraw:similarity=direction,spread=softmax,prior_factor=2"


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
        sc = scheme.client_scalars(ScalarContext(params=c, global_params=GLOBAL))
        with_scalars.append(ClientReport(f"c{i}", 10 + i, scalars=sc))
        params_only.append(ClientReport(f"c{i}", 10 + i, params=c))
    w_client = scheme.weights(with_scalars, None, 3, 5)
    s_client = scheme.last_details["similarity"]
    w_server = scheme.weights(params_only, GLOBAL, 3, 5)
    assert scheme.last_details["similarity"] == s_client
    np.testing.assert_array_equal(w_client, w_server)


def test_params_similarity_value_by_hand():
    sc = FedDRAWWeights().client_scalars(
        ScalarContext(class_counts=np.ones(2), num_samples=1, params=CLIENTS[0], global_params=GLOBAL)
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
    assert scheme.client_scalars(ScalarContext(params=g, global_params=g)) == {}
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


# ----------------------------------------------------------------------------- direction, spread, bound
def test_ten_times_the_steps_in_the_same_direction_keeps_the_direction_reputation():
    g = {"w": np.array([1.0, 2.0, -1.0, 0.5])}
    previous = {"w": np.array([0.9, 2.1, -1.0, 0.4])}  # global update (0.1, -0.1, 0, 0.1)
    step = np.array([0.02, -0.01, 0.01, 0.02])  # one site's update direction
    clients = [
        {"w": g["w"] + step},  # a few local steps
        {"w": g["w"] + 10 * step},  # ten times the steps, the same direction
        {"w": g["w"] + np.array([-0.01, 0.02, 0.0, 0.01])},  # another direction
    ]
    reps = [ClientReport(f"s{i}", 100, params=c) for i, c in enumerate(clients)]
    direction = FedDRAWWeights(similarity="direction", rho=1.0)
    direction.previous_global = previous
    w = direction.weights(reps, g, 2, 2)  # lambda = 1, beta = 1: w = spread similarity
    s = direction.last_details["similarity"]
    assert s[1] == pytest.approx(s[0], rel=1e-12)
    assert w[1] == pytest.approx(w[0], rel=1e-12) and w[0] > w[2]
    # the literal reading ranks by how far a site moved: the longer update loses its similarity
    literal = FedDRAWWeights(similarity="params", rho=1.0).weights(reps, g, 2, 2)
    assert literal[1] < literal[0]


def test_direction_mode_round_one_is_uniform_and_the_state_advances():
    g1 = {"w": np.array([1.0, 0.0])}
    g2 = {"w": np.array([1.0, 1.0])}  # the global update of round 1: (0, 1)
    scheme = FedDRAWWeights(similarity="direction", rho=1.0, inner="linear")
    reps1 = [ClientReport("a", 1, params={"w": np.array([2.0, 0.0])}), ClientReport("b", 3, params=g1)]
    scheme.weights(reps1, g1, 1, 3)
    assert scheme.last_details["similarity"] == [0.0, 0.0]  # no previous update: nobody preferred
    assert scheme.last_details["spread_similarity"] == [0.5, 0.5]
    np.testing.assert_array_equal(scheme.previous_global["w"], g1["w"])
    reps2 = [
        ClientReport("a", 1, params={"w": np.array([1.0, 2.0])}),  # along the global update
        ClientReport("b", 3, params={"w": np.array([2.0, 1.0])}),  # orthogonal to it
    ]
    scheme.weights(reps2, g2, 2, 3)
    assert scheme.last_details["similarity"] == [1.0, 0.0]
    np.testing.assert_array_equal(scheme.previous_global["w"], g2["w"])


def test_client_reported_direction_similarity_equals_the_servers():
    """Under HE a site computes s_k from the global model it received in the previous round; the
    server, in plaintext, from its own state: the same number."""
    g1 = {"w": np.array([1.0, 0.0, 0.5], dtype=np.float32), "bn.running_mean": np.zeros(3, np.float32)}
    g2 = {"w": np.array([1.1, 0.2, 0.4], dtype=np.float32), "bn.running_mean": np.ones(3, np.float32)}
    clients = [
        {"w": np.array([1.3, 0.3, 0.2], dtype=np.float32), "bn.running_mean": np.full(3, 4, np.float32)},
        {"w": np.array([1.0, 0.5, 0.6], dtype=np.float32), "bn.running_mean": np.full(3, -2, np.float32)},
    ]
    server = FedDRAWWeights(similarity="direction")
    server.weights([ClientReport("a", 5, params=g1), ClientReport("b", 7, params=g1)], g1, 1, 4)
    server_w = server.weights(
        [ClientReport(f"c{i}", 5 + 2 * i, params=c) for i, c in enumerate(clients)], g2, 2, 4
    )
    server_s = server.last_details["similarity"]
    reported = []
    for i, c in enumerate(clients):
        site = get_scheme("feddraw", similarity="direction")  # as a site builds it from the plan
        assert site.needs_previous_global
        # the global model this site received in round 1 comes with its context
        ctx = ScalarContext(params=c, global_params=g2, previous_global=g1)
        reported.append(ClientReport(f"c{i}", 5 + 2 * i, scalars=site.client_scalars(ctx)))
    blind = FedDRAWWeights(similarity="direction")
    blind_w = blind.weights(reported, None, 2, 4)
    assert blind.last_details["similarity"] == server_s
    np.testing.assert_array_equal(blind_w, server_w)
    assert FedDRAWWeights(similarity="direction").he_compatible


def test_direction_state_survives_a_json_round_trip():
    g1 = {"w": np.array([1.0, 0.0], dtype=np.float32)}
    g2 = {"w": np.array([1.0, 1.0], dtype=np.float32)}
    reps = [
        ClientReport("a", 1, params={"w": np.array([1.0, 2.0], dtype=np.float32)}),
        ClientReport("b", 3, params={"w": np.array([2.0, 1.0], dtype=np.float32)}),
    ]
    running = FedDRAWWeights(similarity="direction")
    running.weights(reps, g1, 1, 3)
    state = json.loads(json.dumps(running.state_dict()))
    resumed = FedDRAWWeights(similarity="direction")
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(resumed.weights(reps, g2, 2, 3), running.weights(reps, g2, 2, 3))
    assert resumed.last_details["similarity"] == [1.0, 0.0]
    fresh = FedDRAWWeights(similarity="direction")  # without the state: no direction known
    fresh.weights(reps, g2, 2, 3)
    assert fresh.last_details["similarity"] == [0.0, 0.0]
    assert FedDRAWWeights().state_dict() == {}
    with pytest.raises(ValueError, match="malformed state 'previous_global'"):
        FedDRAWWeights(similarity="direction").load_state_dict({"previous_global": "not base64!"})


def test_softmax_spread_by_hand():
    s = np.array([0.1, 0.2, 0.6])
    std = math.sqrt((0.2**2 + 0.1**2 + 0.3**2) / 3)  # mean 0.3
    e = [math.exp((v - 0.3) / std / 0.5) for v in s]
    expected = np.array(e) / sum(e)
    np.testing.assert_allclose(softmax_spread(s, 0.5), expected, rtol=1e-12)
    np.testing.assert_allclose(softmax_spread(2 * s + 1, 0.5), expected, rtol=1e-12)  # scale-free
    np.testing.assert_array_equal(softmax_spread(np.full(4, 0.97), 0.5), np.full(4, 0.25))
    scheme = FedDRAWWeights(spread="softmax", temperature=0.5, rho=1.0)
    w = scheme.weights(sim_reports([1, 1, 1], list(s)), None, 2, 2)  # lambda = 1, beta = 1
    np.testing.assert_allclose(w, expected, rtol=1e-12)


def test_prior_factor_bounds_the_similarity_share_by_hand():
    p = np.array([0.1, 0.3, 0.6])
    s_hat = np.array([0.7, 0.3, 0.0])
    # d = (0.6, 0, -0.6): 1 - m = min((2 - 1) 0.1 / 0.6, (1 - 1/2) 0.6 / 0.6) = 1/6
    bounded, mixed = bound_by_prior(s_hat, p, 2.0)
    np.testing.assert_allclose(bounded, [0.2, 0.3, 0.5], rtol=1e-12)
    assert mixed == pytest.approx(5 / 6)
    np.testing.assert_allclose(bound_by_prior(s_hat, p, 1.0)[0], p, rtol=1e-12)
    within, none = bound_by_prior(np.array([0.15, 0.3, 0.55]), p, 2.0)
    np.testing.assert_array_equal(within, [0.15, 0.3, 0.55])
    assert none == 0.0
    # through the scheme: min-max gives the smallest site everything, the bound 2 p_k at most
    sims = [0.99, 0.95, 0.90]  # min-max: (1, 5/9, 0) / (14/9) = (9/14, 5/14, 0)
    free = FedDRAWWeights(rho=1.0).weights(sim_reports([100, 300, 600], sims), None, 2, 2)
    np.testing.assert_allclose(free, [9 / 14, 5 / 14, 0.0], atol=1e-11)
    scheme = FedDRAWWeights(rho=1.0, prior_factor=2.0)
    w = scheme.weights(sim_reports([100, 300, 600], sims), None, 2, 2)
    # 1 - m = min(0.1 / (9/14 - 0.1), 0.5 * 0.6 / 0.6) = 1.4 / 7.6
    keep = 1.4 / 7.6
    np.testing.assert_allclose(w, keep * np.array([9 / 14, 5 / 14, 0.0]) + (1 - keep) * p, rtol=1e-12)
    assert w[0] == pytest.approx(0.2) and np.all(w >= p / 2 - 1e-15) and np.all(w <= 2 * p + 1e-15)


def test_new_option_validation():
    with pytest.raises(ValueError, match="spread must be 'minmax' or 'softmax', got 'rank'"):
        get_scheme("feddraw", spread="rank")
    with pytest.raises(ValueError, match="temperature must be a positive number, got 0"):
        get_scheme("feddraw", temperature=0)
    with pytest.raises(
        ValueError, match=r"prior_factor must be None \(off\) or a finite number >= 1, got 0.5"
    ):
        get_scheme("feddraw", prior_factor=0.5)
    with pytest.raises(ValueError, match="similarity must be one of .*'direction'"):
        get_scheme("feddraw", similarity="angle")


def test_a_site_reports_its_direction_similarity_against_the_global_model_of_its_previous_round():
    """SiteTrainer keeps the global model it received and hands it to the scheme, round after round."""
    from fedweigh.data import build_federation
    from fedweigh.site.args import ClientArgs
    from fedweigh.site.trainer import SiteTrainer
    from fedweigh.train import get_params
    from fedweigh.weighting.geometry import direction_similarity, geometry_keys

    fed = build_federation("iid-4", "synthcxr", size=28, seed=0, num_images=240)
    args = ClientArgs(size=28, num_images=240, batch_size=16, max_steps=2, eval_test=False)
    trainer = SiteTrainer(fed.sites[0], fed.test, args, threads=1)
    plan = {"scheme": "feddraw", "scheme_args": {"similarity": "direction"}, "scalars": ["similarity"]}
    g1 = get_params(trainer.model)
    first = trainer.run_round(g1, 0, plan, evaluate_received=False)
    assert first.scalars == {"similarity": 0.0}  # no earlier global model: no direction yet
    g2 = {k: (v + 0.01 * np.sign(first.params[k] - v)) if v.dtype.kind == "f" else v for k, v in g1.items()}
    second = trainer.run_round(g2, 1, plan, evaluate_received=False)
    keys = geometry_keys(g2)
    assert second.scalars["similarity"] == direction_similarity(second.params, g2, g1, keys=keys)
    assert second.scalars["similarity"] != 0.0

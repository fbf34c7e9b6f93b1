"""Property-based tests (Hypothesis) of what the weighting schemes, the server's round checks, the
schedules, the label statistics and the privacy ledger claim for EVERY input, not one example:

- every scheme's weights are finite, non-negative and sum to 1 (FedNova's do not by design: its
  claim, w_k = tau_eff p_k / ||a_k||_1, is checked instead); permuting the sites permutes the weights;
  identical sites get equal weights; round 1 of FedDRAW (and FedAWA's first iteration) is FedAvg;
- the documented bounds, on both sides: FedDRAW's prior bound p_k / c <= w_k <= c p_k at beta = 1,
  the cap on one site's share, the per-array norm bound (factors <= 1, scaled norms at the bound);
- each scheme's formula at random inputs, against a transcription in numpy written here;
- schedules: monotone, in range, interior values equal their formulas;
- the statistics vector's sum decodes to the plain sums; the CKKS sum decrypts to the plain sum;
- the privacy ledger's arithmetic across budgets, against a plain dict.

docs/methods.md, docs/privacy.md and the modules' docstrings state the claims.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedweigh import schedules
from fedweigh.histograms import decode_sum, global_stats_of, statistics_vector
from fedweigh.imbalance import class_level_parameters, client_imbalance, client_level_parameter
from fedweigh.weighting import ClientReport, get_scheme
from fedweigh.weighting.feddraw import bound_by_prior, softmax_spread, spread_similarity
from fedweigh.weighting.fednova import momentum_normaliser

#: Hypothesis budgets: enough examples to reach the corners, few enough for the fast suite.
SOME = settings(max_examples=40, deadline=None)
FEW = settings(max_examples=20, deadline=None)
#: per scheme and reading (18 of them)
EACH = settings(max_examples=20, deadline=None)


def round_helpers():
    """The server round's weight cap and update checks (one import to repoint if they move)."""
    from fedweigh.server import rounds

    return rounds


# ----------------------------------------------------------------------------------- one round's reports
#: Every scheme and the readings its docs describe, as (name, options).
SCHEMES = (
    ("fedavg", {}),
    ("fedprox", {}),
    ("fednova", {}),
    ("fednova", {"local_optimizer": "sgd", "momentum": 0.9}),
    ("fedadp", {}),
    ("ida", {}),
    ("feddisco", {}),
    ("fedawa", {}),
    ("feddraw", {}),
    ("feddraw", {"similarity": "params", "spread": "minmax", "prior_factor": None}),
    ("feddraw", {"similarity": "layer", "form": "plain", "beta_max": 3.0}),
    ("feddraw", {"similarity": "delta", "prior_factor": 1.5, "inner": "cosine", "outer": "exponential"}),
    ("cbr", {}),
    ("cbr", {"skew": "code", "gamma": 0.5}),
    ("cbr", {"skew": "sqdev", "gamma": 0.0}),
    ("dafl", {}),
    ("dafl", {"mode": "size_inverse_imbalance"}),
    ("dafl", {"mode": "size"}),
)
DISTRIBUTIONS = tuple(s for s in SCHEMES if s[0] != "fednova")
SHAPE = {"w": (4, 3), "b": (3,)}


def scheme_id(spec: tuple[str, dict]) -> str:
    name, options = spec
    return name + "".join(f":{k}={v}" for k, v in options.items())


def global_model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0.0, 1.0, shape) for k, shape in SHAPE.items()}


@st.composite
def sites(draw, min_sites: int = 1, max_sites: int = 7):
    """One round: sizes N_k, steps tau_k, every scalar a scheme reads (within its range) and
    parameters theta_k = theta_g + Delta_k (Delta_k of random length and direction)."""
    k = draw(st.integers(min_sites, max_sites))
    ints = lambda lo, hi: st.lists(st.integers(lo, hi), min_size=k, max_size=k)  # noqa: E731
    floats = lambda lo, hi: st.lists(  # noqa: E731
        st.floats(lo, hi, allow_nan=False, allow_infinity=False), min_size=k, max_size=k
    )
    sizes = draw(ints(1, 100_000))
    steps = draw(ints(1, 60))
    skew = draw(floats(0.0, 4.0))
    imbalance = draw(floats(0.0, 1e4))
    discrepancy = draw(floats(0.0, 3.0))
    similarity = draw(floats(-1.0, 1.0))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    glob = global_model(seed)
    scales = 10.0 ** rng.uniform(-3, 0, size=k)
    params = [{key: glob[key] + s * rng.normal(0.0, 1.0, v.shape) for key, v in glob.items()} for s in scales]
    reports = [
        ClientReport(
            f"site-{i}",
            sizes[i],
            num_steps=steps[i],
            scalars={
                "skew": skew[i],
                "imbalance": imbalance[i],
                "discrepancy": discrepancy[i],
                "similarity": similarity[i],
            },
            params=params[i],
        )
        for i in range(k)
    ]
    return reports, glob


@st.composite
def round_of(draw, min_rounds: int = 1):
    num_rounds = draw(st.integers(min_rounds, 30))
    return draw(st.integers(1, num_rounds)), num_rounds


def weigh(spec: tuple[str, dict], reports, glob, t: int, num_rounds: int) -> np.ndarray:
    """A fresh scheme's weights for one round (fresh: the stateful schemes start from nothing)."""
    name, options = spec
    return np.asarray(get_scheme(name, **options).weights(reports, glob, t, num_rounds), dtype=np.float64)


def sizes_of(reports) -> np.ndarray:
    n = np.array([r.num_samples for r in reports], dtype=np.float64)
    return n / n.sum()


# ----------------------------------------------------------------------------------- every scheme
@pytest.mark.parametrize("spec", DISTRIBUTIONS, ids=scheme_id)
@EACH
@given(data=sites(), when=round_of())
def test_weights_are_finite_nonnegative_and_sum_to_one(spec, data, when):
    reports, glob = data
    w = weigh(spec, reports, glob, *when)
    assert w.shape == (len(reports),)
    assert np.all(np.isfinite(w)) and np.all(w >= 0.0)
    assert w.sum() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("spec", SCHEMES, ids=scheme_id)
@EACH
@given(data=sites(min_sites=2), when=round_of(), order=st.randoms(use_true_random=False))
def test_permuting_the_sites_permutes_the_weights(spec, data, when, order):
    reports, glob = data
    perm = list(range(len(reports)))
    order.shuffle(perm)
    w = weigh(spec, reports, glob, *when)
    w_perm = weigh(spec, [reports[i] for i in perm], glob, *when)
    np.testing.assert_allclose(w_perm, w[perm], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("spec", SCHEMES, ids=scheme_id)
@EACH
@given(data=sites(min_sites=1, max_sites=1), copies=st.integers(2, 6), when=round_of())
def test_identical_sites_get_equal_weights(spec, data, copies, when):
    (one,), glob = data
    reports = [
        ClientReport(f"copy-{i}", one.num_samples, one.num_steps, dict(one.scalars), one.params)
        for i in range(copies)
    ]
    w = weigh(spec, reports, glob, *when)
    # every scheme, FedNova too: equal steps make its weights FedAvg's, 1/K here. FedAWA only to 1e-3:
    # the distances of identical updates come from the Gram matrix as the square root of a difference
    # that cancels to rounding noise (~1e-8 |Delta|), and Adam's normalised step turns that noise into
    # logit moves of up to lr per iteration
    rtol = 1e-3 if spec[0] == "fedawa" else 1e-9
    np.testing.assert_allclose(w, np.full(copies, 1.0 / copies), rtol=rtol)


# ----------------------------------------------------------------------------------- FedDRAW
#: Round 1 is FedAvg in the log form (the default); the plain form softmax(beta K r) never returns r.
FEDDRAW_READINGS = (
    {},
    {"similarity": "params", "spread": "minmax", "prior_factor": None},
    {"similarity": "delta", "prior_factor": 3.0, "inner": "exponential", "beta_max": 1.0},
)


@pytest.mark.parametrize(
    "options", FEDDRAW_READINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults"
)
@SOME
@given(data=sites(), num_rounds=st.integers(2, 40), rho=st.floats(0.5, 1.0))
def test_feddraw_round_one_is_fedavg(options, data, num_rounds, rho):
    """lambda_1 = 0 and, with beta_max = 1 and the deferral point at or after round 1, beta_1 = 1:
    r = p and w = p^1 / sum p = p (docs/methods.md, "Checks that hold by construction")."""
    reports, glob = data
    w = weigh(("feddraw", {**options, "rho": rho}), reports, glob, 1, num_rounds)
    np.testing.assert_allclose(w, sizes_of(reports), rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("form", ("log", "plain"))
@SOME
@given(data=sites(), num_rounds=st.integers(1, 40), rho=st.floats(0.0, 0.99), beta_max=st.floats(0.0, 5.0))
def test_feddraw_last_round_is_uniform(form, data, num_rounds, rho, beta_max):
    """beta_T = 0 for any rho < 1, so w = 1/K in both forms (a single round is the last one too)."""
    reports, glob = data
    options = {"form": form, "rho": rho, "beta_max": beta_max}
    w = weigh(("feddraw", options), reports, glob, num_rounds, num_rounds)
    np.testing.assert_allclose(w, np.full(len(reports), 1.0 / len(reports)), rtol=1e-9)


@SOME
@given(
    data=sites(),
    factor=st.floats(1.0, 8.0),
    t=st.integers(1, 6),
    spread=st.sampled_from(("minmax", "softmax")),
    temperature=st.floats(0.05, 5.0),
)
def test_feddraw_prior_bound_holds_on_both_sides_at_beta_one(data, factor, t, spread, temperature):
    """prior_factor = c: at beta_t = 1 (rounds 1..rho T with beta_max = 1) every weight lies in
    [p_k / c, c p_k], whatever the similarities (reported here: the reports carry no parameters)."""
    reports, _ = data
    plain = [ClientReport(r.name, r.num_samples, r.num_steps, dict(r.scalars)) for r in reports]
    options = {"prior_factor": factor, "spread": spread, "temperature": temperature, "rho": 0.6}
    w = weigh(("feddraw", options), plain, None, t, 10)
    p = sizes_of(plain)
    tol = 1e-9
    assert np.all(w >= p / factor * (1 - tol)) and np.all(w <= factor * p * (1 + tol))


@SOME
@given(
    share=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=8),
    prior=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=8),
    factor=st.floats(1.0, 6.0),
)
def test_prior_bound_mixes_just_enough(share, prior, factor):
    """s~ = (1 - m) s^ + m p with the SMALLEST m in [0, 1] that puts every s~_k in [p_k / c, c p_k]:
    s~ sums to 1, keeps the order of s^, meets the bound on both sides, and, when m > 0, one
    site sits exactly on its bound (a smaller m would break it)."""
    k = min(len(share), len(prior))
    s_hat = np.asarray(share[:k]) + 1e-3
    s_hat /= s_hat.sum()
    p = np.asarray(prior[:k]) / np.sum(prior[:k])
    mixed, m = bound_by_prior(s_hat, p, factor)
    assert 0.0 <= m <= 1.0
    np.testing.assert_allclose(mixed, (1 - m) * s_hat + m * p, rtol=1e-12, atol=1e-15)
    assert mixed.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(mixed >= p / factor * (1 - 1e-9)) and np.all(mixed <= factor * p * (1 + 1e-9))
    if m > 1e-12:
        gap = np.minimum(mixed - p / factor, factor * p - mixed) / p
        assert gap.min() == pytest.approx(0.0, abs=1e-9)
    else:  # no mixing needed: s^ already within the bound
        assert np.all(s_hat >= p / factor * (1 - 1e-9)) and np.all(s_hat <= factor * p * (1 + 1e-9))


@SOME
@given(
    s=st.lists(st.floats(-1.0, 1.0), min_size=2, max_size=8),
    scale=st.floats(0.05, 1.0),
    shift=st.floats(-0.5, 0.5),
    temperature=st.floats(0.1, 5.0),
)
def test_spreads_are_scale_free_and_follow_their_formulas(s, scale, shift, temperature):
    """min-max: (s - min) / (max - min), divided by its sum; softmax: softmax(z / tau) with
    z = (s - mean) / std (population std); both unchanged by s -> a s + b (a > 0); all equal -> 1/K."""
    s = np.asarray(s)
    k = s.size
    moved = scale * s + shift
    if np.ptp(s) <= 1e-9:
        np.testing.assert_allclose(spread_similarity(np.full(k, s[0])), np.full(k, 1 / k))
        np.testing.assert_allclose(softmax_spread(np.full(k, s[0]), temperature), np.full(k, 1 / k))
        return
    scaled = (s - s.min()) / (s.max() - s.min())
    np.testing.assert_allclose(spread_similarity(s), scaled / scaled.sum(), rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(spread_similarity(moved), spread_similarity(s), rtol=1e-6, atol=1e-12)
    z = (s - s.mean()) / np.sqrt(np.mean((s - s.mean()) ** 2))
    expected = np.exp(z / temperature) / np.exp(z / temperature).sum()
    np.testing.assert_allclose(softmax_spread(s, temperature), expected, rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(softmax_spread(moved, temperature), expected, rtol=1e-6, atol=1e-300)


@FEW
@given(data=sites(min_sites=2), t=st.integers(1, 12), num_rounds=st.integers(12, 20))
def test_feddraw_weights_follow_the_formula(data, t, num_rounds):
    """w = softmax(beta_t log r), r = (1 - lambda_t) p + lambda_t s~, from the reported similarities
    (literal reading: min-max spread, no prior bound), against the formula written out here."""
    reports, _ = data
    plain = [ClientReport(r.name, r.num_samples, r.num_steps, dict(r.scalars)) for r in reports]
    w = weigh(("feddraw", {"spread": "minmax", "prior_factor": None}), plain, None, t, num_rounds)
    p = sizes_of(plain)
    s = np.array([r.scalars["similarity"] for r in plain])
    share = np.full(s.size, 1 / s.size) if np.ptp(s) <= 0 else (s - s.min()) / np.ptp(s)
    share = share / share.sum()
    lam = (t - 1) / (num_rounds - 1)  # linear inner schedule
    t_d = 0.6 * num_rounds
    beta = 1.0 if t <= t_d else 1.0 - (1 - math.cos(math.pi * (t - t_d) / (num_rounds - t_d))) / 2
    r = np.maximum((1 - lam) * p + lam * share, 1e-12)
    expected = r**beta / np.sum(r**beta)
    np.testing.assert_allclose(w, expected, rtol=1e-9, atol=1e-15)


# ----------------------------------------------------------------------------------- the other schemes
@SOME
@given(data=sites(), rho=st.floats(0.0, 0.99))
def test_fednova_weights_are_tau_eff_p_over_the_normaliser(data, rho):
    """w_k = tau_eff p_k / ||a_k||_1, tau_eff = sum_j p_j ||a_j||_1, with ||a||_1 the sum of the
    coefficients heavy-ball SGD gives its tau local gradients (sum_{i=1..tau} sum_{j<i} rho^j; tau
    under Adam): so w_k ||a_k||_1 / p_k is tau_eff for every site, and equal steps give FedAvg."""
    reports, glob = data
    p = sizes_of(reports)
    tau = np.array([r.num_steps for r in reports], dtype=np.float64)
    coefficients = np.array([sum(sum(rho**j for j in range(i)) for i in range(1, int(n) + 1)) for n in tau])
    np.testing.assert_allclose(momentum_normaliser(tau, rho), coefficients, rtol=1e-9)
    for options, a in (({"local_optimizer": "sgd", "momentum": rho}, coefficients), ({}, tau)):
        w = weigh(("fednova", options), reports, glob, 1, 3)
        assert np.all(np.isfinite(w)) and np.all(w > 0)
        np.testing.assert_allclose(w, float(p @ a) * p / a, rtol=1e-9)
    same = [ClientReport(r.name, r.num_samples, 7, r.scalars) for r in reports]
    np.testing.assert_allclose(
        weigh(("fednova", {"local_optimizer": "sgd"}), same, glob, 1, 3), p, rtol=1e-12
    )


@pytest.mark.parametrize("skew", ("cv", "code", "sqdev"))
@SOME
@given(data=sites(), gamma=st.floats(0.0, 1.0))
def test_cbr_weights_follow_the_formula(skew, data, gamma):
    """W_k = gamma omega_a + (1 - gamma) N_k / N, omega_a proportional to 1 / (I_k + eps) (cv) or
    1 / max(S_k, eps); with gamma = 1 a more skewed site never gets more weight."""
    reports, glob = data
    eps = 1e-6
    s = np.array([r.scalars["skew"] for r in reports])
    inv = 1 / (s + eps) if skew == "cv" else 1 / np.maximum(s, eps)
    expected = gamma * inv / inv.sum() + (1 - gamma) * sizes_of(reports)
    np.testing.assert_allclose(
        weigh(("cbr", {"skew": skew, "gamma": gamma}), reports, glob, 1, 2), expected, rtol=1e-9
    )
    w = weigh(("cbr", {"skew": skew}), reports, glob, 1, 2)
    order = np.argsort(s, kind="stable")
    assert np.all(np.diff(w[order]) <= 1e-15)


@pytest.mark.parametrize("mode", ("inverse_imbalance", "size_inverse_imbalance", "size"))
@SOME
@given(data=sites())
def test_dafl_weights_follow_the_formula(mode, data):
    """w proportional to (c_k + eps)^-1, times p_k in size_inverse_imbalance; p in size mode."""
    reports, glob = data
    p = sizes_of(reports)
    c = np.array([r.scalars["imbalance"] for r in reports])
    raw = {"inverse_imbalance": 1 / (c + 1e-8), "size_inverse_imbalance": p / (c + 1e-8), "size": p}[mode]
    np.testing.assert_allclose(
        weigh(("dafl", {"mode": mode}), reports, glob, 1, 2), raw / raw.sum(), rtol=1e-9
    )


@SOME
@given(data=sites(), a=st.floats(0.0, 2.0), b=st.floats(-1.0, 0.3))
def test_feddisco_weights_follow_the_formula(data, a, b):
    """w = ReLU(p - a d~ + b) / sum, d~ = d / sum d (0 if all d are 0); p when every term is 0
    (b down to -1 makes that case common)."""
    reports, glob = data
    p = sizes_of(reports)
    d = np.array([r.scalars["discrepancy"] for r in reports])
    d_norm = d / d.sum() if d.sum() > 0 else np.zeros_like(d)
    raw = np.maximum(p - a * d_norm + b, 0.0)
    expected = raw / raw.sum() if raw.sum() > 0 else p
    np.testing.assert_allclose(
        weigh(("feddisco", {"a": a, "b": b}), reports, glob, 1, 2), expected, rtol=1e-9, atol=1e-15
    )


def flat(params: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(params[k]) for k in sorted(params)])


@SOME
@given(data=sites())
def test_ida_weights_are_inverse_distances_to_the_mean_model(data):
    reports, glob = data
    thetas = np.stack([flat(r.params) for r in reports])
    dist = np.linalg.norm(thetas - thetas.mean(axis=0), axis=1)
    if np.all(dist <= 1e-12):
        expected = np.full(len(reports), 1 / len(reports))
    else:
        inv = 1 / np.maximum(dist, 1e-12)
        expected = inv / inv.sum()
    np.testing.assert_allclose(weigh(("ida", {}), reports, glob, 1, 2), expected, rtol=1e-6, atol=1e-12)


def gompertz(a: np.ndarray, alpha: float = 5.0) -> np.ndarray:
    return alpha * (1 - np.exp(-np.exp(-alpha * (a - 1))))


def angles_to_mean_update(reports, glob) -> np.ndarray:
    deltas = np.stack([flat(r.params) - flat(glob) for r in reports])
    mean = sizes_of(reports) @ deltas
    cos = deltas @ mean / (np.linalg.norm(deltas, axis=1) * np.linalg.norm(mean))
    return np.arccos(np.clip(cos, -1.0, 1.0))


@SOME
@given(first=sites(min_sites=2, max_sites=5), seed=st.integers(0, 2**16))
def test_fedadp_weights_follow_the_smoothed_gompertz_formula(first, seed):
    """w proportional to N_k exp(f(a~_k)), a~ the running mean of a site's angles to the round's
    size-weighted mean update (a~(n) = ((n - 1) / n) a~(n - 1) + a_n / n), over three rounds; a site
    that joins in round 3 starts from its own angle."""
    reports, glob = first
    rng = np.random.default_rng(seed)

    def moved(reps, scale):
        return [
            ClientReport(
                r.name,
                r.num_samples,
                r.num_steps,
                {},
                {k: v + rng.normal(0, scale, v.shape) for k, v in r.params.items()},
            )
            for r in reps
        ]

    rounds_ = [reports, moved(reports, 0.1), moved(reports, 0.3)]
    newcomer = ClientReport("late", 50, 1, {}, {k: v + rng.normal(0, 0.2, v.shape) for k, v in glob.items()})
    rounds_[2] = [*rounds_[2], newcomer]
    scheme = get_scheme("fedadp")
    history: dict[str, list[float]] = {}
    for t, reps in enumerate(rounds_, start=1):
        angles = angles_to_mean_update(reps, glob)
        for r, a in zip(reps, angles, strict=True):
            history.setdefault(r.name, []).append(a)
        smoothed = np.array([np.mean(history[r.name]) for r in reps])
        n = np.array([r.num_samples for r in reps], dtype=np.float64)
        raw = n * np.exp(gompertz(smoothed))
        np.testing.assert_allclose(scheme.weights(reps, glob, t, 3), raw / raw.sum(), rtol=1e-6, atol=1e-12)


@SOME
@given(data=sites(min_sites=2))
def test_fedawa_first_iteration_is_fedavg(data):
    """init="log_size": T_k = log p_k, so the first iteration's lambda (the one a single server
    iteration aggregates with) is FedAvg's."""
    reports, glob = data
    w = weigh(("fedawa", {"server_iters": 1}), reports, glob, 1, 5)
    np.testing.assert_allclose(w, sizes_of(reports), rtol=1e-12)


# ----------------------------------------------------------------------------------- the server's checks
shares = st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1e3)), min_size=1, max_size=9).filter(
    lambda w: sum(w) > 0
)


@SOME
@given(w=shares, max_share=st.floats(0.01, 0.99))
def test_cap_bounds_every_share_and_keeps_the_rest_in_proportion(w, max_share):
    """No share above max(max_share, 1/K); the total kept; capped sites at the cap exactly; the
    others scaled by one common factor >= 1 (so their proportions and the order of all are kept)."""
    w = np.asarray(w)
    out = round_helpers().cap_weights(w, max_share)
    total = w.sum()
    cap = max(max_share, 1 / w.size)
    shares_in, shares_out = w / total, out / total
    assert out.sum() == pytest.approx(total, rel=1e-12)
    assert np.all(out >= 0) and np.all(shares_out <= cap + 1e-12)
    if shares_in.max() <= cap + 1e-15:
        np.testing.assert_allclose(out, w, rtol=1e-12)
        return
    capped = shares_out >= cap - 1e-12
    assert capped[np.argmax(shares_in)]
    free = ~capped
    if free.any() and shares_in[free].sum() > 0:
        factor = shares_out[free].sum() / shares_in[free].sum()
        assert factor >= 1 - 1e-12
        np.testing.assert_allclose(shares_out[free], factor * shares_in[free], rtol=1e-9, atol=1e-15)
    order = np.argsort(w, kind="stable")
    assert np.all(np.diff(out[order]) >= -1e-9 * total)


@SOME
@given(w=shares, max_share=st.one_of(st.just(1.0), st.floats(1.0, 5.0), st.floats(-1.0, 0.0)))
def test_cap_outside_zero_one_changes_nothing(w, max_share):
    np.testing.assert_array_equal(round_helpers().cap_weights(np.asarray(w), max_share), np.asarray(w))


norm_tables = st.integers(1, 7).flatmap(
    lambda k: st.lists(st.lists(st.floats(0.0, 1e3), min_size=3, max_size=3), min_size=k, max_size=k)
)


@SOME
@given(norms=norm_tables, bound=st.floats(1.0, 10.0))
def test_norm_bound_factors_are_at_most_one_and_reach_the_bound_exactly(norms, bound):
    """Per update and array: factor 1 when the norm is within bound x the median of the OTHER
    updates' norms of that array; otherwise the factor that brings it to that limit exactly (0 if
    the limit is 0); one update alone is left as it is."""
    n = np.asarray(norms)
    factors = round_helpers().norm_scales(n, bound)
    assert factors.shape == n.shape and np.all(factors >= 0) and np.all(factors <= 1)
    for k in range(n.shape[0]):
        others = np.delete(n, k, axis=0)
        for j in range(n.shape[1]):
            if others.shape[0] == 0:
                assert factors[k, j] == 1.0
                continue
            limit = bound * np.median(others[:, j])
            if n[k, j] <= limit:
                assert factors[k, j] == 1.0
            elif limit > 0:
                assert factors[k, j] * n[k, j] == pytest.approx(limit, rel=1e-12)
            else:
                assert factors[k, j] == 0.0
    one_array = round_helpers().norm_scales(n[:, 0], bound)
    np.testing.assert_array_equal(one_array, factors[:, 0])


def outliers_by_definition(
    gram: np.ndarray, threshold: float, updates: np.ndarray
) -> tuple[list[int], np.ndarray]:
    """The direction check written out: (the outliers, per update the number of others it opposes).
    An outlier also pulls against the others' mean update m by at least all of it:
    <Delta_i, m> <= -||m||^2 (the rounding of an exact reversal allowed)."""
    k = gram.shape[0]
    norms = np.sqrt(np.diag(gram))
    cos = np.ones((k, k))
    for i in range(k):
        for j in range(k):
            if i != j and norms[i] > 0 and norms[j] > 0:
                cos[i, j] = gram[i, j] / (norms[i] * norms[j])
    below = cos < threshold
    expected = []
    for i in range(k):
        others = [j for j in range(k) if j != i]
        mean = updates[others].mean(axis=0)
        pull = -float(updates[i] @ mean) / float(mean @ mean) if float(mean @ mean) > 0 else 0.0
        if 2 * below[i, others].sum() > len(others) and not below[np.ix_(others, others)].any():
            if pull >= 1.0 - 1e-9:
                expected.append(i)
    return expected, below.sum(axis=1)


@SOME
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(2, 7),
    common=st.floats(0.0, 2.0),
    zero=st.booleans(),
    threshold=st.floats(-0.5, 0.5),
)
def test_direction_outliers_are_the_updates_that_oppose_an_agreeing_majority(
    seed, k, common, zero, threshold
):
    """Update k is left out iff its cosine is below the threshold with MORE than half of the others,
    and no pair of the others is below it; objecting_sites counts the others below the threshold.
    (Three dimensions and a shared component of random size: every configuration occurs.)"""
    rng = np.random.default_rng(seed)
    updates = rng.normal(size=(k, 3)) + common * rng.normal(size=3)
    if zero and k > 2:
        updates[-1] = 0.0  # a zero update points nowhere: it agrees with everything
    gram = updates @ updates.T
    expected, opposed = outliers_by_definition(gram, threshold, updates)
    helpers = round_helpers()
    assert helpers.direction_outliers(gram, threshold) == expected
    np.testing.assert_array_equal(helpers.objecting_sites(gram, threshold), opposed)


@pytest.mark.parametrize(
    ("updates", "outliers"),
    [
        ([[1, 0], [1, 0.2], [-0.2, 1]], []),  # the third opposes exactly half of the others: kept
        ([[1, 0], [1, 0.2], [-1.2, -0.1]], [2]),  # it opposes both, which agree: left out
        ([[1, 0], [1, 0.2], [-0.9, -0.1]], []),  # it opposes both, but would undo only 0.9 of their mean
        ([[1, 0], [1, 0.2], [0.9, 0.1], [-1.2, 0.3]], [3]),  # 3 of 3
        ([[1, 0], [1, 0.2], [0.9, -0.1], [-0.2, 1], [-0.3, -1]], []),  # 2 of 4 each, and they disagree
    ],
)
def test_direction_outliers_at_the_majority_boundary(updates, outliers):
    u = np.asarray(updates, dtype=np.float64)
    gram = u @ u.T
    assert outliers_by_definition(gram, 0.0, u)[0] == outliers
    assert round_helpers().direction_outliers(gram, 0.0) == outliers


# ----------------------------------------------------------------------------------- schedules
progress_values = st.floats(0.0, 1.0)


@pytest.mark.parametrize("shape", schedules.RAMP_SHAPES)
@SOME
@given(x=progress_values, y=progress_values, rate=st.floats(0.1, 20.0))
def test_ramps_rise_from_zero_to_one_along_their_formula(shape, x, y, rate):
    ramp = lambda v: schedules.ramp(shape, v, rate)  # noqa: E731
    formula = {
        "linear": lambda v: v,
        "cosine": lambda v: (1 - math.cos(math.pi * v)) / 2,
        "exponential": lambda v: (1 - math.exp(-rate * v)) / (1 - math.exp(-rate)),
    }[shape]
    assert ramp(x) == pytest.approx(formula(x), rel=1e-12, abs=1e-15)
    assert 0.0 <= ramp(x) <= 1.0
    lo, hi = sorted((x, y))
    assert ramp(lo) <= ramp(hi)
    if hi - lo > 1e-6:
        assert ramp(lo) < ramp(hi)


@SOME
@given(x=progress_values)
def test_the_exponential_ramps_default_rate_is_five(x):
    five = (1 - math.exp(-5 * x)) / (1 - math.exp(-5))
    assert schedules.exponential(x) == pytest.approx(five, rel=1e-12, abs=1e-15)
    assert schedules.ramp("exponential", x) == pytest.approx(five, rel=1e-12, abs=1e-15)


@SOME
@given(when=round_of())
def test_progress_is_the_round_fraction(when):
    t, num_rounds = when
    expected = 0.0 if num_rounds == 1 else (t - 1) / (num_rounds - 1)
    assert schedules.progress(t, num_rounds) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("shape", schedules.RAMP_SHAPES)
@SOME
@given(
    num_rounds=st.integers(1, 60),
    beta_max=st.floats(0.0, 10.0),
    rho=st.floats(0.0, 1.0),
    rate=st.floats(0.5, 10.0),
)
def test_deferred_anneal_holds_then_falls_to_zero_along_its_ramp(shape, num_rounds, beta_max, rho, rate):
    """beta_t = beta_max for t <= rho T, then beta_max (1 - ramp((t - t_d) / (T - t_d))): every
    round's value is the formula's, the schedule never rises, and the last round is 0 when rho < 1."""
    betas = [
        schedules.deferred_anneal(t, num_rounds, beta_max, rho, shape, rate) for t in range(1, num_rounds + 1)
    ]
    t_d = rho * num_rounds
    formula = {
        "linear": lambda v: v,
        "cosine": lambda v: (1 - math.cos(math.pi * v)) / 2,
        "exponential": lambda v: (1 - math.exp(-rate * v)) / (1 - math.exp(-rate)),
    }[shape]
    for t, beta in enumerate(betas, start=1):
        expected = beta_max if t <= t_d else beta_max * (1 - formula((t - t_d) / (num_rounds - t_d)))
        assert beta == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert -1e-12 <= beta <= beta_max + 1e-12
    assert all(b <= a + 1e-12 for a, b in zip(betas, betas[1:], strict=False))
    if rho < 1:
        assert betas[-1] == pytest.approx(0.0, abs=1e-12)


@SOME
@given(num_rounds=st.integers(2, 60), t=st.integers(1, 60), rho=st.floats(0.0, 1.0))
def test_deferred_anneal_defaults_to_the_cosine_ramp_with_rate_five(num_rounds, t, rho):
    assume(t <= num_rounds)
    assert schedules.deferred_anneal(t, num_rounds, 1.0, rho) == schedules.deferred_anneal(
        t, num_rounds, 1.0, rho, "cosine", 5.0
    )
    exponential = schedules.deferred_anneal(t, num_rounds, 1.0, rho, "exponential")
    assert exponential == schedules.deferred_anneal(t, num_rounds, 1.0, rho, "exponential", 5.0)


@SOME
@given(
    x=st.one_of(
        st.floats(max_value=-1e-12), st.floats(min_value=1 + 1e-12), st.just(math.nan), st.just(math.inf)
    ),
    shape=st.sampled_from(schedules.RAMP_SHAPES),
)
def test_ramps_refuse_progress_outside_zero_one(x, shape):
    with pytest.raises(ValueError, match="progress must lie in"):
        schedules.ramp(shape, x)


@pytest.mark.parametrize(("t", "num_rounds"), [(1, 0), (1, -3), (1, 2.5), (2, 2.5), (0, 5), (6, 5), (1.5, 5)])
def test_schedules_refuse_round_numbers_that_are_not_whole_and_in_range(t, num_rounds):
    with pytest.raises(ValueError, match="num_rounds|round_index"):
        schedules.progress(t, num_rounds)
    with pytest.raises(ValueError, match="num_rounds|round_index"):
        schedules.deferred_anneal(t, num_rounds, 1.0, 0.5)


def test_a_zero_beta_max_is_allowed_and_stays_zero():
    assert [schedules.deferred_anneal(t, 5, 0.0, 0.4) for t in range(1, 6)] == [0.0] * 5


# ----------------------------------------------------------------------------------- label statistics
@st.composite
def histograms(draw, task: str = "multilabel", min_sites: int = 1, max_sites: int = 6, big: bool = False):
    """Sites' (class counts, N_k): multi-label counts <= N_k; multi-class counts summing to N_k."""
    c = draw(st.integers(1 if task == "multilabel" else 2, 14))
    k = draw(st.integers(min_sites, max_sites))
    top = 1_000_000 if big else 5_000
    out = []
    for _ in range(k):
        tiny = draw(st.booleans())  # a site with fewer samples than classes, or about as many
        counts = draw(st.lists(st.integers(0, 2 if tiny else top), min_size=c, max_size=c))
        n = sum(counts) if task == "multiclass" else max(counts) + draw(st.integers(0, top))
        assume(n > 0)
        out.append((np.asarray(counts, dtype=np.int64), int(n)))
    return out


@SOME
@given(sites=histograms())
def test_the_summed_statistics_decode_to_the_plain_sums(sites):
    """decode_sum(sum_k v_k): the global counts, N and c_client = sum_k N_k c_k / N (imbalance's
    client-level parameter of the sites' c_k)."""
    stats = global_stats_of(sites)
    np.testing.assert_array_equal(stats.class_counts, np.sum([c for c, _ in sites], axis=0))
    assert stats.num_samples == sum(n for _, n in sites)
    c = [client_imbalance(counts, n) for counts, n in sites]
    expected = client_level_parameter(np.array(c), np.array([n for _, n in sites]))
    assert stats.client_level_parameter == pytest.approx(expected, rel=1e-12)
    again = decode_sum(np.sum([statistics_vector(counts, n) for counts, n in sites], axis=0))
    assert again.as_dict() == stats.as_dict()


@SOME
@given(sites=histograms(task="multiclass", max_sites=1))
def test_a_balanced_site_has_the_smallest_imbalance_and_a_missing_class_never_looks_balanced(sites):
    """Multi-class, every class held: c_k >= C - 1 (= C - 1 for equal counts). A class missing
    under missing="half": its term 2 max(N_k, C) - 1 exceeds any held class's, and c_k > C - 1."""
    ((counts, n),) = sites
    c = counts.size
    held = counts > 0
    value = client_imbalance(counts, n)
    terms = np.where(held, (n - counts) / np.maximum(counts, 1), 2 * max(n, c) - 1)
    assert value == pytest.approx(terms.mean(), rel=1e-12)
    if held.all():
        assert value >= c - 1 - 1e-9
        balanced = np.full(c, 7)
        assert client_imbalance(balanced, 7 * c) == pytest.approx(c - 1)
    else:
        assert value > c - 1
        assert np.all(2 * max(n, c) - 1 > (n - counts[held]) / counts[held])


@SOME
@given(counts=st.lists(st.integers(0, 10_000), min_size=1, max_size=14), extra=st.integers(0, 10_000))
def test_class_level_parameters_follow_the_formula(counts, extra):
    counts = np.asarray(counts)
    n = int(counts.sum() + extra)
    assume(n > 0)
    got = class_level_parameters(counts, n)
    for i, ni in enumerate(counts):
        assert got[i] == (pytest.approx((n - ni) / ni, rel=1e-12) if ni > 0 else 0.0)


# ----------------------------------------------------------------------------------- the secure sum
@pytest.fixture(scope="module")
def ckks():
    """One CKKS key pair for the module (making one takes a while): the sites' context with the
    secret key and the server's without it."""
    from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context

    ctx = make_context()
    public = context_from_bytes(serialize_context(ctx, with_secret_key=False), role="server")
    return ctx, public


@settings(max_examples=12, deadline=None)
@given(sites=histograms(big=True))
def test_the_ckks_sum_decrypts_to_the_plain_sum(ckks, sites):
    """Every site encrypts its v_k, the server adds the ciphertexts with the public context, a site
    decrypts: counts and N come back exact, N c_client within half the agreed precision's step
    (2^-17 by default, fedweigh.secure.precision; docs/privacy.md), and the
    decoded global statistics are the plaintext ones."""
    from fedweigh.histograms import PlainExchange
    from fedweigh.secure.exchange import SecureExchange

    secret, public = ckks
    vectors = [statistics_vector(counts, n) for counts, n in sites]
    length = vectors[0].size
    client = SecureExchange(lambda role: secret, min_contributions=1)
    server = SecureExchange(lambda role: public, min_contributions=1)
    payloads = {f"site-{i}": client.encode(v) for i, v in enumerate(vectors)}
    for site, payload in payloads.items():
        server.check(site, payload, length)
    total = client.decode(server.sum(payloads, length))
    plain = np.sum(vectors, axis=0)
    np.testing.assert_array_equal(total[:-1], plain[:-1])
    # N c_client: within half a rounding step (+ the CKKS noise, ~1e-9) of the exact sum, plus the
    # float64 spacing of a sum near 1e12
    exact = math.fsum(float(v[-1]) for v in vectors)
    assert abs(total[-1] - exact) <= 2.0**-17 + 1e-8 + 2 * np.spacing(exact)
    plain_exchange = PlainExchange(min_contributions=1)
    in_clear = plain_exchange.decode(
        plain_exchange.sum({s: plain_exchange.encode(v) for s, v in enumerate(vectors)}, length)
    )
    np.testing.assert_array_equal(in_clear, plain)
    assert decode_sum(total).as_dict()["class_counts"] == decode_sum(plain).as_dict()["class_counts"]


@settings(max_examples=10, deadline=None)
@given(vector=st.lists(st.integers(0, 2**40), min_size=1, max_size=8))
def test_the_ciphertext_holds_low_limbs_then_high_limbs_then_the_count(ckks, vector):
    """The slot layout, decrypted raw: [x mod 2^20 ..., floor(x / 2^20) ..., 1.0] (the encoder is
    checked against this layout, not only against its own decoder)."""
    import tenseal as ts

    from fedweigh.secure.vectors import encrypt_vector

    secret, _ = ckks
    x = np.asarray(vector, dtype=np.float64)
    slots = np.asarray(ts.ckks_vector_from(secret, encrypt_vector(secret, x)).decrypt())
    base = 2.0**20
    np.testing.assert_allclose(slots[: x.size], np.mod(x, base), atol=1e-4)
    np.testing.assert_allclose(slots[x.size : 2 * x.size], np.floor(x / base), atol=1e-4)
    assert slots.size == 2 * x.size + 1 and slots[-1] == pytest.approx(1.0, abs=1e-4)


# ----------------------------------------------------------------------------------- the privacy ledger
ledger_ops = st.lists(
    st.tuples(
        st.sampled_from(("job-a", "job-b", "job-c")),
        st.sampled_from(("dp_sgd", "statistics")),
        st.floats(0.0, 20.0),
    ),
    max_size=12,
)


@SOME
@given(
    ops=ledger_ops,
    probe=st.tuples(
        st.sampled_from(("job-a", "job-b", "job-d")),
        st.sampled_from(("dp_sgd", "statistics")),
        st.floats(0.0, 20.0),
    ),
)
def test_the_ledger_keeps_the_latest_figure_per_budget_and_mechanism(tmp_path_factory, ops, probe):
    """Entries are overwritten, not added; spent() sums them per budget and over all budgets;
    projected() is what spent() would be after recording; the file reads back the same."""
    from fedweigh.site.policy import PrivacyLedger

    path = tmp_path_factory.mktemp("ledger") / "ledger.json"
    ledger = PrivacyLedger(path)
    model: dict[str, dict[str, float]] = {}
    for budget, mechanism, epsilon in ops:
        ledger.record(budget, mechanism, epsilon)
        model.setdefault(budget, {})[mechanism] = epsilon
    total = sum(sum(v.values()) for v in model.values())
    assert ledger.spent() == pytest.approx(total, abs=1e-9)
    for budget in ("job-a", "job-b", "job-c", "job-d"):
        assert ledger.spent(budget) == pytest.approx(sum(model.get(budget, {}).values()), abs=1e-9)
    budget, mechanism, epsilon = probe
    after = {b: dict(v) for b, v in model.items()}
    after.setdefault(budget, {})[mechanism] = epsilon
    job, everything = ledger.projected(budget, mechanism, epsilon)
    assert job == pytest.approx(sum(after[budget].values()), abs=1e-9)
    assert everything == pytest.approx(sum(sum(v.values()) for v in after.values()), abs=1e-9)
    assert ledger.spent() == pytest.approx(total, abs=1e-9)  # projecting records nothing
    if ops:
        assert PrivacyLedger(path).entries == ledger.entries


@SOME
@given(
    ops=ledger_ops,
    probe=st.tuples(
        st.sampled_from(("job-a", "job-b")), st.sampled_from(("dp_sgd", "statistics")), st.floats(0.0, 20.0)
    ),
    per_job=st.one_of(st.none(), st.floats(0.5, 30.0)),
    total_cap=st.one_of(st.none(), st.floats(0.5, 80.0)),
)
def test_the_guard_refuses_exactly_what_would_pass_a_cap(ops, probe, per_job, total_cap):
    from fedweigh.errors import PolicyRefusal
    from fedweigh.site.policy import PrivacyGuard, PrivacyLedger, SitePolicy

    ledger = PrivacyLedger()
    for budget, mechanism, epsilon in ops:
        ledger.record(budget, mechanism, epsilon)
    budget, mechanism, epsilon = probe
    guard = PrivacyGuard(
        SitePolicy(max_epsilon_per_job=per_job, max_epsilon_total=total_cap), ledger, "site-1", budget
    )
    # the guard checks its own job's entry of the budget (the ops were recorded for the budget as a whole)
    job, everything = ledger.projected(budget, mechanism, epsilon, account=guard.job_id)
    over = (per_job is not None and job > per_job * (1 + 1e-9)) or (
        total_cap is not None and everything > total_cap * (1 + 1e-9)
    )
    if over:
        with pytest.raises(PolicyRefusal, match="site-1"):
            guard.check(mechanism, epsilon, delta=1e-5, num_samples=1000)
    else:
        guard.check(mechanism, epsilon, delta=1e-5, num_samples=1000)

"""Independent references for the statistics and the privacy figures: what the package computes is
compared with another implementation or a published value, not with itself.

- the paired bootstrap of the effects (fedweigh.bench.effects) against ``scipy.stats.bootstrap``
  with the same statistic on the same three seeds' test sets (the intervals agree within the
  resampling error), and its weighted AUC against scikit-learn's on the expanded test set;
- the analytic Gaussian mechanism (fedweigh.secure.gaussian) against Opacus' mu-GDP conversion
  (Dong, Roth & Su 2019; a Gaussian mechanism of sensitivity Delta and noise sigma is mu-GDP with
  mu = Delta / sigma) and against delta(epsilon) integrated numerically from its definition;
- the DP-SGD accountant (fedweigh.secure.accountant, RDP and PRV) against the exact epsilon where one
  is known: T full-batch steps compose to one Gaussian mechanism with mu = sqrt(T) / sigma, and one
  Poisson-subsampled step has a privacy profile integrated numerically here;
- the CKKS sum of statistics vectors against the plaintext sum: the raw decryption error stays far
  below the 2^-16 to which fedweigh.secure.vectors rounds by default (docs/privacy.md);
- the ranking statistics (fedweigh.bench.stats) against Demsar's (2006) published critical values,
  Friedman's textbook formula, an exact enumeration of the Wilcoxon signed-rank distribution and
  Holm's step-down rule written out.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import integrate, optimize, stats
from scipy.special import ndtr
from sklearn.metrics import roc_auc_score

from fedweigh.bench.effects import bootstrap_aucs, paired_effect, weighted_macro_auc
from fedweigh.bench.stats import friedman_p, holm, nemenyi_cd, nemenyi_q, wilcoxon_p
from fedweigh.secure.accountant import epsilon_for, extend_history
from fedweigh.secure.gaussian import analytic_gaussian_sigma, classic_gaussian_sigma, gaussian_delta


# ----------------------------------------------------------------------------------- the bootstrap
def auc_by_ranks(labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Mann-Whitney AUC per row from average ranks (ties count one half): (R+ - n+(n+ + 1)/2) / (n+ n-)."""
    ranks = stats.rankdata(scores, axis=-1)
    pos = labels == 1
    n_pos = pos.sum(axis=-1)
    n_neg = labels.shape[-1] - n_pos
    return ((ranks * pos).sum(axis=-1) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def three_seeds(n: int = 60, classes: int = 2, seed: int = 3):
    """Three seeds' test sets (balanced labels, so every resample has both labels) and two methods'
    scores, the first better than the reference by a small margin."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(3):
        labels = np.stack([rng.permutation(np.arange(n) % 2) for _ in range(classes)], axis=1).astype(
            np.float64
        )
        noise = rng.normal(size=(n, classes))
        method = np.round(labels * 1.0 + noise, 1)  # rounded: ties
        reference = np.round(labels * 0.8 + noise + rng.normal(0, 0.5, (n, classes)), 1)
        out.append((labels, method, reference))
    return out


def test_weighted_auc_is_scikit_learns_auc_of_the_expanded_test_set():
    """AUC with counts w equals roc_auc_score on the test set with image i repeated w_i times;
    an unknown (NaN) label leaves the image out of that class only."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, (50, 3)).astype(np.float64)
    labels[rng.random((50, 3)) < 0.1] = np.nan
    scores = np.round(rng.normal(size=(50, 3)), 1)
    counts = rng.multinomial(50, np.full(50, 1 / 50), size=5)
    got = weighted_macro_auc(labels, scores, counts)
    for row, c in zip(got, counts, strict=True):
        per_class = []
        for j in range(3):
            known = ~np.isnan(labels[:, j])
            y = np.repeat(labels[known, j], c[known])
            s = np.repeat(scores[known, j], c[known])
            if 0 < y.sum() < y.size:
                per_class.append(roc_auc_score(y, s))
        assert row == pytest.approx(np.mean(per_class), abs=1e-12)


def test_paired_bootstrap_interval_matches_scipy_bootstrap():
    """The effect's mean is the full-set difference; its 95% percentile interval over the three seeds'
    resamples (each seed's test set resampled on its own, method and FedAvg on the same draw) agrees
    with scipy.stats.bootstrap of the same statistic within the resampling error."""
    seeds = three_seeds()
    resamples = 4000
    ours_m = [bootstrap_aucs(m, y, seed, resamples) for seed, (y, m, _) in enumerate(seeds)]
    ours_r = [bootstrap_aucs(r, y, seed, resamples) for seed, (y, _, r) in enumerate(seeds)]
    effect = paired_effect(ours_m, ours_r)

    def difference(*indices, axis=-1):
        total = 0.0
        for (y, m, r), idx in zip(seeds, indices, strict=True):
            idx = np.asarray(idx, dtype=np.int64)
            per_class = [
                auc_by_ranks(y[idx, j], m[idx, j]) - auc_by_ranks(y[idx, j], r[idx, j])
                for j in range(y.shape[1])
            ]
            total = total + np.mean(per_class, axis=0)
        return total / len(seeds)

    data = tuple(np.arange(len(y)) for y, _, _ in seeds)
    full = difference(*data)
    assert effect.mean == pytest.approx(float(full), abs=1e-12)
    ref = stats.bootstrap(
        data,
        difference,
        n_resamples=resamples,
        paired=False,
        vectorized=True,
        method="percentile",
        confidence_level=0.95,
        rng=np.random.default_rng(11),
    ).confidence_interval
    width = ref.high - ref.low
    assert width > 0
    # the 2.5% quantile of 4000 draws moves by about 1.5% of the width between two runs
    assert effect.ci_low == pytest.approx(ref.low, abs=0.1 * width)
    assert effect.ci_high == pytest.approx(ref.high, abs=0.1 * width)


# ----------------------------------------------------------------------------------- the Gaussian mechanism
GRID = [
    (eps, delta, sens)
    for eps in (0.1, 0.5, 1.0, 2.0, 4.0, 8.0)
    for delta in (1e-3, 1e-5, 1e-8)
    for sens in (1.0, math.sqrt(15))
]


def delta_by_integration(sigma: float, epsilon: float, sensitivity: float) -> float:
    """delta(epsilon) = integral of max(0, p1(x) - e^epsilon p0(x)) dx with p0 = N(0, sigma^2) and
    p1 = N(Delta, sigma^2): the hockey-stick divergence, from its definition."""
    p0, p1 = normal_pdf(0.0, sigma), normal_pdf(sensitivity, sigma)
    # p1 > e^eps p0 exactly for x > x0 = sigma^2 eps / Delta + Delta / 2
    x0 = sigma**2 * epsilon / sensitivity + sensitivity / 2
    value, _ = integrate.quad(
        lambda x: p1(x) - math.exp(epsilon) * p0(x), x0, x0 + 40 * sigma, epsabs=0.0, epsrel=1e-11, limit=200
    )
    return value


def normal_pdf(mean: float, sd: float):
    norm = 1.0 / (sd * math.sqrt(2 * math.pi))
    return lambda x: norm * math.exp(-0.5 * ((x - mean) / sd) ** 2)


@pytest.mark.parametrize(("epsilon", "delta", "sensitivity"), GRID)
def test_analytic_sigma_is_opacus_mu_gdp_and_the_integrated_delta(epsilon, delta, sensitivity):
    """sigma is the smallest noise with delta(epsilon) <= delta: Opacus' mu-GDP dual gives back
    epsilon at mu = Delta / sigma; the delta integrated from the definition is at delta for sigma and
    above it just below sigma; the classic bound (epsilon < 1) is never smaller."""
    from opacus.accountants.analysis.gdp import eps_from_mu

    sigma = analytic_gaussian_sigma(epsilon, delta, sensitivity)
    assert eps_from_mu(mu=sensitivity / sigma, delta=delta) == pytest.approx(epsilon, rel=1e-6)
    assert delta_by_integration(sigma, epsilon, sensitivity) == pytest.approx(delta, rel=1e-5)
    assert gaussian_delta(sigma, epsilon, sensitivity) <= delta
    assert delta_by_integration(sigma * (1 - 1e-4), epsilon, sensitivity) > delta
    if epsilon < 1:
        assert classic_gaussian_sigma(epsilon, delta, sensitivity) >= sigma


@pytest.mark.parametrize("sigma", (0.5, 1.0, 3.0, 20.0))
@pytest.mark.parametrize("epsilon", (0.0, 0.3, 1.0, 5.0))
def test_gaussian_delta_is_the_integrated_hockey_stick_divergence(sigma, epsilon):
    assert gaussian_delta(sigma, epsilon, 1.3) == pytest.approx(
        delta_by_integration(sigma, epsilon, 1.3), rel=1e-6, abs=1e-15
    )


def test_analytic_sigma_is_below_the_classic_bound_by_the_documented_factor():
    """docs/privacy.md: the classic bound is 1.38x the analytic sigma at epsilon 0.5 (delta 1e-5)."""
    ratio = classic_gaussian_sigma(0.5, 1e-5, 1.0) / analytic_gaussian_sigma(0.5, 1e-5, 1.0)
    assert round(ratio, 2) == 1.38


# ----------------------------------------------------------------------------------- the accountant
def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """epsilon of a mu-GDP mechanism at delta: the root of Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) = delta."""
    f = lambda e: ndtr(-e / mu + mu / 2) - math.exp(e) * ndtr(-e / mu - mu / 2) - delta  # noqa: E731
    return optimize.brentq(f, 0.0, 200.0, xtol=1e-12)


@pytest.mark.parametrize(
    ("sigma", "steps", "delta"), [(1.0, 1, 1e-5), (2.0, 10, 1e-5), (5.0, 100, 1e-6), (0.8, 3, 1e-3)]
)
def test_full_batch_steps_compose_to_one_gaussian_mechanism(sigma, steps, delta):
    """With sample rate 1, T steps of noise multiplier sigma are one Gaussian mechanism with
    mu = sqrt(T) / sigma (exact). PRV's estimate is an upper bound within its error (0.01); RDP is an
    upper bound too, and looser."""
    exact = exact_gaussian_epsilon(math.sqrt(steps) / sigma, delta)
    prv = epsilon_for([(sigma, 1.0, steps)], delta, "prv")
    rdp = epsilon_for([(sigma, 1.0, steps)], delta, "rdp")
    assert exact - 1e-3 <= prv <= exact + 0.05
    assert rdp >= exact - 1e-9
    assert rdp <= 1.6 * exact + 0.5


def subsampled_gaussian_epsilon(sigma: float, q: float, delta: float) -> float:
    """epsilon of ONE Poisson-subsampled Gaussian step (add/remove one example), by integrating its
    two hockey-stick divergences between P = N(0, sigma^2) and Q = (1 - q) N(0, sigma^2) + q N(1, sigma^2)."""
    p, shifted = normal_pdf(0.0, sigma), normal_pdf(1.0, sigma)
    q_pdf = lambda x: (1 - q) * p(x) + q * shifted(x)  # noqa: E731

    def hockey(a, b, eps):
        f = lambda x: max(a(x) - math.exp(eps) * b(x), 0.0)  # noqa: E731
        value, _ = integrate.quad(
            f, -40 * sigma, 40 * sigma + 1, points=[0.0, 0.5, 1.0], limit=400, epsabs=1e-14
        )
        return value

    profile = lambda eps: max(hockey(q_pdf, p, eps), hockey(p, q_pdf, eps)) - delta  # noqa: E731
    return optimize.brentq(profile, 1e-6, 30.0, xtol=1e-8)


@pytest.mark.parametrize(("sigma", "q"), [(1.0, 0.1), (0.7, 0.5), (2.0, 0.01)])
def test_one_subsampled_step_against_its_integrated_privacy_profile(sigma, q):
    delta = 1e-5
    exact = subsampled_gaussian_epsilon(sigma, q, delta)
    prv = epsilon_for([(sigma, q, 1)], delta, "prv")
    rdp = epsilon_for([(sigma, q, 1)], delta, "rdp")
    assert exact - 1e-3 <= prv <= exact + 0.05
    assert rdp >= exact - 1e-6


@pytest.mark.parametrize("accountant", ("rdp", "prv"))
def test_a_history_merged_step_by_step_gives_the_epsilon_of_the_whole(accountant):
    """extend_history merges steps at the same (sigma, q) and starts a new entry otherwise; the
    epsilon of the merged history is that of all the steps taken."""
    history: list = []
    for sigma, q, steps in [
        (1.1, 0.02, 30),
        (1.1, 0.02, 20),
        (1.3, 0.02, 10),
        (1.3, 0.05, 5),
        (1.3, 0.05, 0),
    ]:
        history = extend_history(history, sigma, q, steps)
    assert history == [(1.1, 0.02, 50), (1.3, 0.02, 10), (1.3, 0.05, 5)]
    whole = epsilon_for([(1.1, 0.02, 50), (1.3, 0.02, 10), (1.3, 0.05, 5)], 1e-5, accountant)
    assert epsilon_for(history, 1e-5, accountant) == whole
    assert epsilon_for([(1.1, 0.02, 49), (1.3, 0.02, 10), (1.3, 0.05, 5)], 1e-5, accountant) < whole
    assert epsilon_for([], 1e-5, accountant) == 0.0


# ----------------------------------------------------------------------------------- the CKKS sum
def test_ckks_sum_error_is_far_below_the_decoders_rounding():
    """16 sites' statistics vectors with counts up to 1e6: the raw decrypted slots of the summed
    ciphertext differ from the plaintext slots by far less than the 7.6e-6 that rounding to 2^-16
    absorbs, so the decoded sum is the plaintext one up to that rounding (docs/privacy.md measured 3e-9)."""
    import tenseal as ts

    from fedweigh.histograms import statistics_vector
    from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context
    from fedweigh.secure.vectors import LIMB_BASE, decrypt_vector, encrypt_vector, sum_encrypted

    rng = np.random.default_rng(5)
    ctx = make_context()
    public = context_from_bytes(serialize_context(ctx, with_secret_key=False), role="server")
    vectors = []
    for _ in range(16):
        n = int(rng.integers(10_000, 1_000_000))
        counts = rng.integers(0, n, 14)
        counts[rng.integers(0, 14)] = 0  # a missing finding: N_k c_k near N_k^2
        vectors.append(statistics_vector(counts, n))
    total = sum_encrypted(public, [encrypt_vector(ctx, v) for v in vectors])
    raw = np.asarray(ts.ckks_vector_from(ctx, total).decrypt())
    plain = np.sum(vectors, axis=0)
    length = plain.size
    hi = np.sum([np.floor(v / LIMB_BASE) for v in vectors], axis=0)
    lo = np.sum([v - np.floor(v / LIMB_BASE) * LIMB_BASE for v in vectors], axis=0)
    error = np.max(np.abs(raw - np.concatenate([lo, hi, [16.0]])))
    assert error < 1e-7
    decoded = decrypt_vector(ctx, total, length, num_contributions=16)
    np.testing.assert_array_equal(decoded[:-1], plain[:-1])
    assert decoded[-1] == pytest.approx(
        math.fsum(v[-1] for v in vectors), abs=2.0**-17 + 1e-8 + 2 * np.spacing(plain[-1])
    )


# ----------------------------------------------------------------------------------- ranks and tests
#: Demsar (2006), Table 5(a): critical values q_0.05 of the two-tailed Nemenyi test, k = 2..10.
DEMSAR_Q05 = {2: 1.960, 3: 2.343, 4: 2.569, 5: 2.728, 6: 2.850, 7: 2.949, 8: 3.031, 9: 3.102, 10: 3.164}


@pytest.mark.parametrize(("k", "q"), sorted(DEMSAR_Q05.items()))
def test_nemenyi_critical_values_are_demsars(k, q):
    assert nemenyi_q(k) == pytest.approx(q, abs=1e-3)  # the table's three decimals
    assert nemenyi_cd(k, 12) == pytest.approx(nemenyi_q(k) * math.sqrt(k * (k + 1) / (6 * 12)), rel=1e-12)


def test_friedman_p_is_the_textbook_statistic():
    """chi2_F = 12 N / (k (k + 1)) [sum_j R_j^2 - k (k + 1)^2 / 4] on k - 1 degrees of freedom
    (untied scores; Demsar 2006, eq. 3)."""
    import pandas as pd

    rng = np.random.default_rng(2)
    scores = rng.normal(size=(9, 5)) + np.linspace(0, 1, 5)
    n, k = scores.shape
    ranks = np.vstack([stats.rankdata(-row) for row in scores])
    r = ranks.mean(axis=0)
    chi2 = 12 * n / (k * (k + 1)) * (np.sum(r**2) - k * (k + 1) ** 2 / 4)
    assert friedman_p(pd.DataFrame(scores)) == pytest.approx(stats.chi2.sf(chi2, k - 1), rel=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_wilcoxon_p_is_the_exact_signed_rank_p(seed):
    """Two-sided exact p of the signed-rank statistic, by enumerating every sign pattern (n <= 9,
    no ties, zero differences dropped)."""
    rng = np.random.default_rng(seed)
    d = rng.normal(0.3, 1.0, size=int(rng.integers(4, 10)))
    d = np.append(d, 0.0)  # a zero difference: dropped
    nonzero = d[d != 0]
    ranks = stats.rankdata(np.abs(nonzero))
    w_plus = ranks[nonzero > 0].sum()
    sums = np.array(
        [
            sum(r for r, s in zip(ranks, signs, strict=True) if s)
            for signs in itertools.product((0, 1), repeat=ranks.size)
        ]
    )
    p = min(1.0, 2 * min(np.mean(sums <= w_plus), np.mean(sums >= w_plus)))
    assert wilcoxon_p(list(d)) == pytest.approx(p, rel=1e-9)


def test_holm_is_the_step_down_rule():
    """p~_(i) = max_{k <= i} min(1, (m - k + 1) p_(k)) over the sorted p-values; None stays None."""
    rng = np.random.default_rng(4)
    for _ in range(20):
        m = int(rng.integers(1, 8))
        raw = {f"m{i}": float(x) for i, x in enumerate(rng.uniform(0, 0.3, m))}
        raw["untested"] = None
        got = holm(raw)
        assert got["untested"] is None
        names = sorted((k for k in raw if raw[k] is not None), key=lambda k: raw[k])
        running = 0.0
        for i, name in enumerate(names, start=1):
            running = max(running, min(1.0, (m - i + 1) * raw[name]))
            assert got[name] == pytest.approx(running, rel=1e-12)

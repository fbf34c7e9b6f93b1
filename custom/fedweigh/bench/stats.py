"""Comparing methods across scenarios: average ranks, Friedman test, Nemenyi critical difference.

Demšar, "Statistical Comparisons of Classifiers over Multiple Data Sets", JMLR 7 (2006):

- per scenario (block) i, methods are ranked on the score, 1 = best, ties get the average rank;
  R_j = mean_i r_ij is method j's average rank;
- Friedman's test of "all methods perform alike" (scipy.stats.friedmanchisquare, tie-corrected);
- Nemenyi's critical difference CD = q_alpha sqrt(k (k + 1) / (6 N)) for k methods over N scenarios,
  with q_alpha = studentized_range.ppf(1 - alpha, k, inf) / sqrt(2); two methods whose average ranks
  differ by more than CD differ significantly. Pairwise p-values from scikit-posthocs
  (``posthoc_nemenyi_friedman``) feed its critical-difference diagram.

A missing score (NaN) ranks below every finite score of its scenario.

Against FedAvg (how much a method beats it, rather than whether the methods differ): the Wilcoxon
signed-rank test (``scipy.stats.wilcoxon``, two-sided, zero differences dropped) of a method's
per-scenario effects, with Holm's step-down correction over the methods tested
(``statsmodels.stats.multitest.multipletests``).

Intervals that include training noise (a new seed redraws the data, partition, initialisation and
shuffles, so the seed is the unit of replication):

- **paired t interval over seeds** (``paired_t_interval``): per scenario, d_s = AUC_method(s) -
  AUC_reference(s) for each seed s; mean d, SE = sd(d) / sqrt(n) (ddof 1), interval
  mean +- t_{1-alpha/2, n-1} SE, p of Student's t test of "mean d = 0" (``scipy.stats.t``);
- **random effects across scenarios** (``dersimonian_laird``): DerSimonian & Laird, Controlled
  Clinical Trials 7 (1986): per scenario i an effect y_i with variance v_i (its SE^2 over seeds),
  w_i = 1 / v_i, Q = sum w_i (y_i - y_FE)^2, tau^2 = max(0, (Q - (k - 1)) / (sum w - sum w^2 / sum w)),
  w*_i = 1 / (v_i + tau^2), mu = sum w*_i y_i / sum w*_i, SE(mu) = sum(w*)^-1/2, interval
  mu +- z_{1-alpha/2} SE(mu), p from the normal; beside it, as a check for few scenarios, the
  Hartung-Knapp-Sidik-Jonkman interval mu +- t_{1-alpha/2, k-1} SE_HK with
  SE_HK^2 = sum w*_i (y_i - mu)^2 / ((k - 1) sum w*_i) (Hartung & Knapp, Stat Med 20 (2001));
- **power** of that pooled test at a true effect delta (``pooled_power``), with S scenarios of n seeds,
  paired seed SD sigma and between-scenario variance tau^2: SE = sqrt((tau^2 + sigma^2 / n) / S),
  power = Phi(delta / SE - z_{1-alpha/2}) + Phi(-delta / SE - z_{1-alpha/2}); and of the per-scenario
  paired t test (``paired_t_power``, the noncentral t with df n - 1 and ncp delta sqrt(n) / sigma).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

__all__ = [
    "MIN_METHODS",
    "MIN_SCENARIOS",
    "Comparison",
    "Interval",
    "RandomEffects",
    "average_ranks",
    "compare",
    "dersimonian_laird",
    "friedman_p",
    "holm",
    "nemenyi_cd",
    "nemenyi_pvalues",
    "nemenyi_q",
    "paired_t_interval",
    "paired_t_power",
    "pooled_power",
    "rank_table",
    "seeds_for_power",
    "wilcoxon_p",
]

#: Fewest methods and scenarios for which the Friedman test is run.
MIN_METHODS, MIN_SCENARIOS = 3, 2


def _filled(table: pd.DataFrame) -> np.ndarray:
    values = table.to_numpy(dtype=np.float64)
    return np.where(np.isfinite(values), values, -np.inf)


def rank_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per row (scenario), the rank of each column (method): 1 = highest score, ties averaged, NaN last."""
    from scipy.stats import rankdata

    ranks = np.vstack([rankdata(-row, method="average") for row in _filled(table)]) if len(table) else []
    return pd.DataFrame(ranks, index=table.index, columns=table.columns, dtype=np.float64)


def average_ranks(table: pd.DataFrame) -> pd.Series:
    """R_j = mean over scenarios of method j's rank (1 = best)."""
    return rank_table(table).mean(axis=0)


def friedman_p(table: pd.DataFrame) -> float | None:
    """p-value of Friedman's test over the table (rows = scenarios, columns = methods).

    None when there are fewer than 3 methods or 2 scenarios, or when the statistic is undefined
    (every scenario ranks all methods equal).
    """
    from scipy.stats import friedmanchisquare

    n, k = table.shape
    if k < MIN_METHODS or n < MIN_SCENARIOS:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        p = friedmanchisquare(*_filled(table).T).pvalue
    return float(p) if math.isfinite(p) else None


def nemenyi_q(k: int, alpha: float = 0.05) -> float:
    """q_alpha of the Nemenyi test for k methods: the studentized range quantile over sqrt(2)."""
    from scipy.stats import studentized_range

    if k < 2:
        raise ValueError(f"the Nemenyi test needs at least 2 methods, got {k}")
    return float(studentized_range.ppf(1.0 - alpha, k, np.inf) / math.sqrt(2.0))


def nemenyi_cd(k: int, n: int, alpha: float = 0.05) -> float:
    """CD = q_alpha sqrt(k (k + 1) / (6 N)) for k methods compared over N scenarios."""
    if n < 1:
        raise ValueError(f"the critical difference needs at least 1 scenario, got {n}")
    return nemenyi_q(k, alpha) * math.sqrt(k * (k + 1) / (6.0 * n))


def nemenyi_pvalues(table: pd.DataFrame) -> pd.DataFrame:
    """Pairwise Nemenyi p-values (methods x methods) from scikit-posthocs, for the CD diagram."""
    import scikit_posthocs as sp

    p = sp.posthoc_nemenyi_friedman(_filled(table))
    p.index = list(table.columns)
    p.columns = list(table.columns)
    return p


@dataclass
class Comparison:
    """Ranks and tests of one metric; ``p``, ``cd`` and ``pvalues`` are None when not computed."""

    table: pd.DataFrame
    ranks: pd.Series
    p: float | None
    cd: float | None
    pvalues: pd.DataFrame | None
    note: str


def compare(table: pd.DataFrame, alpha: float = 0.05) -> Comparison:
    """Average ranks, Friedman p and Nemenyi CD of a scenarios x methods table of scores.

    The tests need >= 3 methods and >= 2 scenarios; otherwise ``p``, ``cd`` are None and ``note``
    says why.
    """
    n, k = table.shape
    ranks = average_ranks(table) if n and k else pd.Series(dtype=np.float64)
    if k < MIN_METHODS or n < MIN_SCENARIOS:
        note = (
            f"Friedman/Nemenyi not computed: they need >= {MIN_METHODS} methods and >= {MIN_SCENARIOS} "
            f"scenarios (here {k} methods, {n} scenarios)"
        )
        return Comparison(table, ranks, None, None, None, note)
    p = friedman_p(table)
    note = "" if p is not None else "Friedman p undefined: every scenario ranks all methods equal"
    return Comparison(table, ranks, p, nemenyi_cd(k, n, alpha), nemenyi_pvalues(table), note)


def wilcoxon_p(differences: Sequence[float]) -> float | None:
    """Two-sided Wilcoxon signed-rank p of "the median difference is 0" over scenarios.

    Zero differences are dropped (``zero_method="wilcox"``); None when no non-zero finite difference
    is left. With n non-zero differences the smallest attainable p is 2 / 2^n (exact test): n <= 5
    can never reach 0.05.
    """
    from scipy.stats import wilcoxon

    d = np.asarray([x for x in differences if x is not None and math.isfinite(x)], dtype=np.float64)
    if not np.any(d != 0.0):
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        p = wilcoxon(d, zero_method="wilcox", alternative="two-sided").pvalue
    return float(p) if math.isfinite(p) else None


def holm(pvalues: dict[str, float | None]) -> dict[str, float | None]:
    """Holm-adjusted p-values over the non-None entries: sorted p_(1) <= ... <= p_(m),
    p~_(i) = max_{k <= i} min(1, (m - k + 1) p_(k)); None entries stay None."""
    from statsmodels.stats.multitest import multipletests

    tested = [k for k, p in pvalues.items() if p is not None]
    adjusted = dict.fromkeys(pvalues)
    if tested:
        _, p_adj, _, _ = multipletests([pvalues[k] for k in tested], method="holm")
        adjusted.update({k: float(p) for k, p in zip(tested, p_adj, strict=True)})
    return adjusted


# ------------------------------------------------------------------- intervals with training noise
@dataclass(frozen=True)
class Interval:
    """A mean difference over seeds with its t interval: ``se`` = sd / sqrt(n), ``p`` of "mean = 0"."""

    mean: float
    low: float
    high: float
    sd: float
    se: float
    n: int
    p: float

    def as_dict(self) -> dict[str, float | int]:
        return {
            "mean": self.mean,
            "ci_low": self.low,
            "ci_high": self.high,
            "sd": self.sd,
            "se": self.se,
            "n_seeds": self.n,
            "p": self.p,
        }


def _finite(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)


def paired_t_interval(differences: Sequence[float | None], confidence: float = 0.95) -> Interval | None:
    """Mean of the per-seed paired differences and its Student t interval over seeds (df n - 1).

    None with fewer than two finite differences (no seed-to-seed variance to estimate). When every
    difference is equal the interval is the point and p is 1 at 0, 0 elsewhere.
    """
    from scipy.stats import t as student_t

    d = _finite(differences)
    n = d.size
    if n < 2:
        return None
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    se = sd / math.sqrt(n)
    if se == 0.0:
        return Interval(mean, mean, mean, 0.0, 0.0, n, 1.0 if mean == 0.0 else 0.0)
    half = float(student_t.ppf(0.5 + confidence / 2.0, n - 1)) * se
    p = float(2.0 * student_t.sf(abs(mean) / se, n - 1))
    return Interval(mean, mean - half, mean + half, sd, se, n, p)


@dataclass(frozen=True)
class RandomEffects:
    """DerSimonian-Laird pooled effect over k scenarios: estimate, interval, SE, tau^2, Q, I^2, p."""

    mean: float
    low: float
    high: float
    se: float
    tau2: float
    q: float
    i2: float
    k: int
    p: float
    low_hk: float | None = None
    high_hk: float | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "mean": self.mean,
            "ci_low": self.low,
            "ci_high": self.high,
            "se": self.se,
            "tau2": self.tau2,
            "q": self.q,
            "i2": self.i2,
            "k": self.k,
            "p": self.p,
            "ci_low_hk": self.low_hk,
            "ci_high_hk": self.high_hk,
        }


def dersimonian_laird(
    effects: Sequence[float], variances: Sequence[float], confidence: float = 0.95
) -> RandomEffects | None:
    """Random-effects estimate of the mean effect over scenarios (DerSimonian & Laird 1986), with the
    Hartung-Knapp interval beside the normal one (None with one scenario).

    ``effects`` y_i and their ``variances`` v_i (> 0), one per scenario; None when no scenario has a
    finite effect with a positive variance. One scenario: tau^2 = 0 (the estimate is that scenario's).
    """
    from scipy.stats import norm
    from scipy.stats import t as student_t

    pairs = [
        (float(y), float(v))
        for y, v in zip(effects, variances, strict=True)
        if y is not None and v is not None and math.isfinite(y) and math.isfinite(v) and v > 0
    ]
    if not pairs:
        return None
    y = np.array([p[0] for p in pairs])
    v = np.array([p[1] for p in pairs])
    k = y.size
    w = 1.0 / v
    fixed = float((w * y).sum() / w.sum())
    q = float((w * (y - fixed) ** 2).sum())
    c = float(w.sum() - (w**2).sum() / w.sum())
    tau2 = max(0.0, (q - (k - 1)) / c) if k > 1 and c > 0 else 0.0
    w_star = 1.0 / (v + tau2)
    mean = float((w_star * y).sum() / w_star.sum())
    se = float(math.sqrt(1.0 / w_star.sum()))
    z = float(norm.ppf(0.5 + confidence / 2.0))
    i2 = max(0.0, (q - (k - 1)) / q) if q > 0 and k > 1 else 0.0  # one scenario: no heterogeneity
    p = float(2.0 * norm.sf(abs(mean) / se))
    low_hk = high_hk = None
    if k > 1:
        se_hk = math.sqrt(float((w_star * (y - mean) ** 2).sum() / ((k - 1) * w_star.sum())))
        half = float(student_t.ppf(0.5 + confidence / 2.0, k - 1)) * se_hk
        low_hk, high_hk = mean - half, mean + half
    return RandomEffects(mean, mean - z * se, mean + z * se, se, tau2, q, i2, k, p, low_hk, high_hk)


def pooled_power(
    delta: float, sd: float, tau2: float, seeds: int, scenarios: int, alpha: float = 0.05
) -> float:
    """Power of the two-sided random-effects z test of the pooled effect at a true effect ``delta``:
    SE = sqrt((tau^2 + sd^2 / seeds) / scenarios), Phi(delta / SE - z) + Phi(-delta / SE - z)."""
    from scipy.stats import norm

    if seeds < 1 or scenarios < 1:
        raise ValueError(f"pooled_power needs >= 1 seed and scenario, got {seeds} and {scenarios}")
    se = math.sqrt((tau2 + sd**2 / seeds) / scenarios)
    z = float(norm.ppf(1.0 - alpha / 2.0))
    if se == 0.0:
        return 1.0 if delta != 0 else alpha
    return float(norm.cdf(delta / se - z) + norm.cdf(-delta / se - z))


def seeds_for_power(
    delta: float,
    sd: float,
    tau2: float,
    scenarios: int,
    alpha: float = 0.05,
    power: float = 0.8,
    max_seeds: int = 1000,
) -> int | None:
    """Fewest seeds per scenario for which :func:`pooled_power` reaches ``power``; None when even
    ``max_seeds`` does not (the between-scenario variance tau^2 alone keeps the SE too large)."""
    for n in range(2, max_seeds + 1):
        if pooled_power(delta, sd, tau2, n, scenarios, alpha) >= power:
            return n
    return None


def paired_t_power(delta: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t test over n seeds at a true mean difference ``delta``:
    P(|T| > t_{1-alpha/2, n-1}) for T noncentral t with df n - 1 and ncp delta sqrt(n) / sd."""
    from scipy.stats import nct
    from scipy.stats import t as student_t

    if n < 2:
        raise ValueError(f"a paired t test needs >= 2 seeds, got {n}")
    crit = float(student_t.ppf(1.0 - alpha / 2.0, n - 1))
    ncp = delta * math.sqrt(n) / sd
    return float(nct.sf(crit, n - 1, ncp) + nct.cdf(-crit, n - 1, ncp))

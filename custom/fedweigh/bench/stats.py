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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

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

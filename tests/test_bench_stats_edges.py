"""The benchmark's statistics at their edges (``fedweigh.bench.stats``): each size requirement on both
sides with its message, the degenerate tables and standard errors, defaults that must reach the formula,
and the Nemenyi quantiles against Demsar's (2006) published table."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
from scipy.optimize import brentq

from fedweigh.bench.stats import (
    compare,
    friedman_p,
    nemenyi_cd,
    nemenyi_q,
    paired_t_power,
    pooled_power,
    rank_table,
    seeds_for_power,
    wilcoxon_p,
)


def table(values, methods=None) -> pd.DataFrame:
    values = np.asarray(values, dtype=float)
    return pd.DataFrame(values, columns=methods or [f"m{j}" for j in range(values.shape[1])])


# ---- friedman_p --------------------------------------------------------------------------------


def test_friedman_needs_three_methods_and_two_scenarios_each_on_its_own():
    assert friedman_p(table([[0.7, 0.6, 0.5]])) is None  # one scenario, three methods
    assert friedman_p(table([[0.7, 0.6]] * 5)) is None  # five scenarios, two methods
    p = friedman_p(table([[0.7, 0.6, 0.5], [0.8, 0.6, 0.4]]))
    assert p is not None and 0.0 < p < 1.0


def test_friedman_of_a_table_that_ranks_every_method_equal_is_none_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert friedman_p(table([[0.5, 0.5, 0.5], [0.6, 0.6, 0.6], [0.7, 0.7, 0.7]])) is None


# ---- nemenyi_q, nemenyi_cd ---------------------------------------------------------------------

# Demsar (2006), JMLR 7, Table 5: critical values q_alpha of the two-tailed Nemenyi test
DEMSAR_Q = {
    0.05: {2: 1.960, 3: 2.343, 4: 2.569, 5: 2.728, 6: 2.850},
    0.10: {2: 1.645, 3: 2.052, 4: 2.291, 5: 2.459},
}


@pytest.mark.parametrize("alpha, k", [(a, k) for a, row in DEMSAR_Q.items() for k in row])
def test_nemenyi_q_matches_demsars_table(alpha, k):
    assert nemenyi_q(k, alpha) == pytest.approx(DEMSAR_Q[alpha][k], abs=1.5e-3)


def test_nemenyi_needs_two_methods():
    assert nemenyi_q(2) == pytest.approx(1.960, abs=1.5e-3)
    with pytest.raises(ValueError, match=r"^the Nemenyi test needs at least 2 methods, got 1$"):
        nemenyi_q(1)


def test_the_critical_difference_takes_one_scenario_and_its_alpha():
    assert nemenyi_cd(3, 1) == pytest.approx(nemenyi_q(3) * math.sqrt(3 * 4 / 6.0))
    # Demsar's example: k = 4 methods over N = 14 data sets, CD(0.05) = 1.25 (rounded)
    assert nemenyi_cd(4, 14) == pytest.approx(2.569 * math.sqrt(4 * 5 / (6 * 14)), abs=2e-3)
    assert nemenyi_cd(4, 14, alpha=0.10) == pytest.approx(2.291 * math.sqrt(4 * 5 / (6 * 14)), abs=2e-3)
    with pytest.raises(ValueError, match=r"^the critical difference needs at least 1 scenario, got 0$"):
        nemenyi_cd(3, 0)


# ---- pooled_power, seeds_for_power -------------------------------------------------------------


def test_pooled_power_takes_one_seed_and_one_scenario_and_refuses_fewer():
    assert 0.0 < pooled_power(0.5, 1.0, 0.0, 1, 1) < 1.0
    message = r"^pooled_power needs >= 1 seed and scenario, got {} and {}$"
    with pytest.raises(ValueError, match=message.format(0, 3)):
        pooled_power(0.5, 1.0, 0.0, 0, 3)
    with pytest.raises(ValueError, match=message.format(3, 0)):
        pooled_power(0.5, 1.0, 0.0, 3, 0)


def test_pooled_power_is_the_two_sided_z_power_at_its_default_alpha():
    # SE = sqrt((tau^2 + sd^2 / seeds) / scenarios) = 1 here; z_0.975 = 1.959964
    expected = 0.5 * math.erfc(-(0.5 - 1.959964) / math.sqrt(2)) + 0.5 * math.erfc(
        -(-0.5 - 1.959964) / math.sqrt(2)
    )
    assert pooled_power(0.5, 0.0, 1.0, 3, 1) == pytest.approx(expected, abs=1e-6)
    assert pooled_power(0.5, 0.0, 1.0, 3, 1) == pooled_power(0.5, 0.0, 1.0, 3, 1, alpha=0.05)
    assert pooled_power(0.5, 0.0, 1.0, 3, 1, alpha=0.2) > pooled_power(0.5, 0.0, 1.0, 3, 1)


@pytest.mark.parametrize("delta", [1.0, 0.25, -2.0])
def test_with_no_variance_any_effect_is_found_and_none_is_found_at_alpha(delta):
    assert pooled_power(delta, 0.0, 0.0, 3, 2) == 1.0
    assert pooled_power(0.0, 0.0, 0.0, 3, 2) == 0.05
    assert pooled_power(0.0, 0.0, 0.0, 3, 2, alpha=0.1) == 0.1


def test_seeds_for_power_starts_at_two_seeds():
    assert seeds_for_power(1.0, 0.1, 0.0, 2) == 2


def test_seeds_for_power_stops_where_the_power_reaches_the_target_exactly():
    target = pooled_power(0.3, 1.0, 0.0, 5, 4)
    assert seeds_for_power(0.3, 1.0, 0.0, 4, power=target) == 5


def test_seeds_for_power_searches_up_to_max_seeds_inclusive():
    # an effect that needs between 1000 and 1001 seeds (one scenario, no between-scenario variance)
    delta = brentq(lambda d: pooled_power(d, 1.0, 0.0, 1, 1) - 0.8, 1e-3, 10.0) / math.sqrt(1000.5)
    assert pooled_power(delta, 1.0, 0.0, 1000, 1) < 0.8 <= pooled_power(delta, 1.0, 0.0, 1001, 1)
    assert seeds_for_power(delta, 1.0, 0.0, 1) is None  # default max_seeds = 1000
    assert seeds_for_power(delta, 1.0, 0.0, 1, max_seeds=1001) == 1001
    assert seeds_for_power(delta, 1.0, 0.0, 1, max_seeds=1000) is None


# ---- paired_t_power ----------------------------------------------------------------------------


def test_a_paired_t_test_takes_two_seeds_and_refuses_one():
    assert 0.0 < paired_t_power(1.0, 1.0, 2) < 1.0
    with pytest.raises(ValueError, match=r"^a paired t test needs >= 2 seeds, got 1$"):
        paired_t_power(1.0, 1.0, 1)


# ---- rank_table and compare ----------------------------------------------------------------------


def test_rank_table_keeps_the_scenarios_as_its_index_and_ranks_missing_scores_last():
    scores = pd.DataFrame(
        [[0.7, None, 0.6], [0.5, 0.9, 0.9]], index=["s-a", "s-b"], columns=["x", "y", "z"], dtype=object
    )  # as read from records: Python objects, None where a cell has no score
    ranks = rank_table(scores)
    assert list(ranks.index) == ["s-a", "s-b"] and ranks.dtypes.eq(np.float64).all()
    assert ranks.loc["s-a"].tolist() == [1.0, 3.0, 2.0] and ranks.loc["s-b"].tolist() == [3.0, 1.5, 1.5]


def test_rank_table_and_compare_of_a_table_without_scenarios_are_empty():
    empty = pd.DataFrame(columns=["x", "y", "z"], dtype=np.float64)
    assert rank_table(empty).shape == (0, 3) and rank_table(empty).dtypes.eq(np.float64).all()
    result = compare(empty)
    assert result.ranks.empty and result.ranks.dtype == np.float64
    assert result.table is empty and result.p is None and result.cd is None
    assert result.note.endswith("(here 3 methods, 0 scenarios)")


def test_compare_keeps_its_table_and_alpha_and_says_when_friedman_is_undefined():
    scores = table([[0.7, 0.6, 0.5], [0.8, 0.6, 0.65], [0.9, 0.7, 0.6]])
    result = compare(scores, alpha=0.1)
    assert result.table is scores and result.note == ""
    assert result.cd == nemenyi_cd(3, 3, 0.1) != nemenyi_cd(3, 3)
    ties = table([[0.5, 0.5, 0.5], [0.6, 0.6, 0.6]])
    tied = compare(ties)
    assert tied.table is ties and tied.p is None
    assert tied.note == "Friedman p undefined: every scenario ranks all methods equal"


# ---- wilcoxon_p ------------------------------------------------------------------------------------


def test_wilcoxon_leaves_out_missing_and_non_finite_differences():
    from scipy.stats import wilcoxon

    given = [0.1, None, -0.2, float("nan"), 0.3, 0.05, float("inf"), 0.4]
    expected = wilcoxon([0.1, -0.2, 0.3, 0.05, 0.4]).pvalue
    assert wilcoxon_p(given) == pytest.approx(expected, rel=1e-12)

"""Intervals that include training noise: the paired t interval over seeds, DerSimonian-Laird across
scenarios, the power of the pooled test, the endpoints, the paired noise floor and the finding groups.

Each figure is checked against an independent computation: SciPy's t interval and t test, statsmodels'
meta-analysis and power functions, scikit-learn's AUC, a simulation of the pooled test.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from sklearn.metrics import roc_auc_score
from statsmodels.stats.meta_analysis import combine_effects
from statsmodels.stats.power import TTestPower

from fedweigh.bench.effects import (
    endpoint_scores,
    finding_group_aucs,
    paired_noise_floor,
    rare_findings,
    seed_effects,
    verdict,
)
from fedweigh.bench.report import effect_overview_table, effect_scenario_table, within_noise_floor_line
from fedweigh.bench.stats import (
    dersimonian_laird,
    paired_t_interval,
    paired_t_power,
    pooled_power,
    seeds_for_power,
)


# ------------------------------------------------------------------------------- paired t interval
def test_paired_t_interval_is_scipys_t_interval_and_t_test():
    d = [0.012, 0.031, -0.004, 0.020, 0.007]
    got = paired_t_interval(d)
    low, high = stats.t.interval(0.95, len(d) - 1, loc=np.mean(d), scale=stats.sem(d))
    assert (got.low, got.high) == pytest.approx((low, high), abs=1e-12)
    assert got.mean == pytest.approx(np.mean(d))
    assert got.sd == pytest.approx(np.std(d, ddof=1))
    assert got.p == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue, abs=1e-12)
    assert got.n == 5


def test_paired_t_interval_needs_two_seeds_and_handles_equal_differences():
    assert paired_t_interval([0.01]) is None
    assert paired_t_interval([0.01, float("nan")]) is None
    same = paired_t_interval([0.0, 0.0, 0.0])
    assert (same.low, same.high, same.p) == (0.0, 0.0, 1.0)
    assert paired_t_interval([0.02, 0.02]).p == 0.0


# ---------------------------------------------------------------------------- DerSimonian-Laird
def test_dersimonian_laird_matches_statsmodels_and_the_formula():
    y = np.array([0.020, -0.004, 0.011, 0.035])
    v = np.array([0.006, 0.004, 0.009, 0.005]) ** 2
    got = dersimonian_laird(y, v)
    ref = combine_effects(y, v, method_re="dl", use_t=False)
    assert got.mean == pytest.approx(ref.mean_effect_re, abs=1e-12)
    assert got.se == pytest.approx(math.sqrt(ref.var_eff_w_re), abs=1e-12)
    assert got.tau2 == pytest.approx(ref.tau2, abs=1e-15)
    low, high = ref.conf_int(alpha=0.05)[1]  # rows: fixed, random (DL), fixed wls, random wls
    assert got.tau2 > 0
    # the formula written out
    w = 1 / v
    fixed = (w * y).sum() / w.sum()
    q = (w * (y - fixed) ** 2).sum()
    tau2 = max(0.0, (q - 3) / (w.sum() - (w**2).sum() / w.sum()))
    ws = 1 / (v + tau2)
    mu = (ws * y).sum() / ws.sum()
    se = ws.sum() ** -0.5
    assert (got.q, got.tau2, got.mean, got.se) == pytest.approx((q, tau2, mu, se), abs=1e-14)
    assert (got.low, got.high) == pytest.approx((mu - 1.959963984540054 * se, mu + 1.959963984540054 * se))
    assert (got.low, got.high) == pytest.approx((low, high), abs=1e-12)
    assert got.p == pytest.approx(2 * stats.norm.sf(abs(mu) / se))
    # the Hartung-Knapp interval: statsmodels' random-effects WLS row with t intervals
    hk = combine_effects(y, v, method_re="dl", use_t=True).conf_int(alpha=0.05)[3]
    assert (got.low_hk, got.high_hk) == pytest.approx(tuple(hk), abs=1e-12)
    assert got.high_hk - got.low_hk > got.high - got.low


def test_dersimonian_laird_with_homogeneous_effects_is_the_fixed_effect():
    y, v = [0.01, 0.0101, 0.0099], [1e-4, 2e-4, 1e-4]
    got = dersimonian_laird(y, v)
    w = 1 / np.array(v)
    assert got.tau2 == 0.0 and got.i2 == 0.0
    assert got.mean == pytest.approx((w * y).sum() / w.sum())
    one = dersimonian_laird([0.02], [4e-4])
    assert (one.mean, one.se, one.tau2) == pytest.approx((0.02, 0.02, 0.0))
    assert one.low_hk is None and one.high_hk is None
    assert dersimonian_laird([0.02], [0.0]) is None


# ---------------------------------------------------------------------------------------- power
def test_paired_t_power_is_statsmodels_ttest_power():
    for delta, sd, n in ((0.01, 0.012, 3), (0.01, 0.006, 8), (0.005, 0.02, 20)):
        expected = TTestPower().power(effect_size=delta / sd, nobs=n, alpha=0.05, alternative="two-sided")
        assert paired_t_power(delta, sd, n) == pytest.approx(expected, abs=1e-10)


def test_pooled_power_agrees_with_a_simulation_of_the_pooled_z_test():
    delta, sd, tau2, n, s, alpha = 0.01, 0.012, 0.004**2, 6, 4, 0.01
    rng = np.random.default_rng(0)
    reps = 40_000
    scenario_effects = delta + rng.normal(0, math.sqrt(tau2), (reps, s))
    observed = scenario_effects + rng.normal(0, sd / math.sqrt(n), (reps, s))
    se = math.sqrt((tau2 + sd**2 / n) / s)
    rejected = np.abs(observed.mean(axis=1) / se) > stats.norm.ppf(1 - alpha / 2)
    assert pooled_power(delta, sd, tau2, n, s, alpha) == pytest.approx(rejected.mean(), abs=0.01)


def test_seeds_for_power_is_the_first_count_reaching_it():
    n = seeds_for_power(0.01, 0.015, 0.0, 4, alpha=0.05 / 8)
    assert pooled_power(0.01, 0.015, 0.0, n, 4, 0.05 / 8) >= 0.8
    assert pooled_power(0.01, 0.015, 0.0, n - 1, 4, 0.05 / 8) < 0.8
    # between-scenario variance alone above the SE the power needs: no seed count is enough
    assert seeds_for_power(0.01, 0.015, 0.02**2, 4) is None


# ------------------------------------------------------------------------------------ endpoints
def _results(rows: list[tuple[str, str, int, int, float]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["scenario", "method", "seed", "round", "auc"])


def test_endpoints_final_round_and_mean_of_the_last_scored_rounds():
    rows = []
    for t, a in [(0, 0.5), (1, None), (2, 0.60), (3, None), (4, 0.70), (5, None), (6, 0.74), (8, 0.80)]:
        rows.append(("a", "m", 0, t, np.nan if a is None else a))
    frame = _results(rows)
    assert endpoint_scores(frame, "final").loc[("a", "m", 0)] == pytest.approx(0.80)
    assert endpoint_scores(frame, "last_k").loc[("a", "m", 0)] == pytest.approx((0.70 + 0.74 + 0.80) / 3)
    assert endpoint_scores(frame, "last_k", last_k=10).loc[("a", "m", 0)] == pytest.approx(
        (0.60 + 0.70 + 0.74 + 0.80) / 4
    )  # round 0 (before training) never counts
    with pytest.raises(ValueError, match="unknown endpoint"):
        endpoint_scores(frame, "best")


def _two_scenarios() -> tuple[pd.DataFrame, dict]:
    """Final AUCs of fedavg and m on scenarios a, b over 4 seeds; m's per-seed differences known."""
    diffs = {"a": [0.02, 0.01, 0.03, 0.00], "b": [-0.01, 0.004, 0.0, -0.02]}
    rows = []
    for sc, ds in diffs.items():
        for seed, d in enumerate(ds):
            base = 0.7 + 0.01 * seed
            rows += [(sc, "fedavg", seed, 3, base), (sc, "m", seed, 3, base + d)]
    return _results(rows), diffs


def test_seed_effects_are_per_scenario_t_intervals_pooled_by_dersimonian_laird():
    frame, diffs = _two_scenarios()
    got = seed_effects(endpoint_scores(frame, "final"), ["fedavg", "m"], ["a", "b"])
    assert set(got) == {"m"}
    for sc, d in diffs.items():
        low, high = stats.t.interval(0.95, 3, loc=np.mean(d), scale=stats.sem(d))
        assert got["m"]["scenarios"][sc]["ci_low"] == pytest.approx(low, abs=1e-12)
        assert got["m"]["scenarios"][sc]["ci_high"] == pytest.approx(high, abs=1e-12)
    y = [np.mean(diffs[s]) for s in "ab"]
    v = [stats.sem(diffs[s]) ** 2 for s in "ab"]
    ref = combine_effects(np.array(y), np.array(v), method_re="dl", use_t=False)
    assert got["m"]["pooled"]["mean"] == pytest.approx(ref.mean_effect_re, abs=1e-12)
    assert got["m"]["pooled"]["k"] == 2


def test_one_scenario_is_pooled_as_its_own_t_interval():
    """Nothing to pool over one scenario: the pooled entry is its t interval over seeds (a z interval on
    the same SE would be narrower than the t's with few seeds) and I^2 is 0."""
    frame, diffs = _two_scenarios()
    got = seed_effects(endpoint_scores(frame, "final"), ["fedavg", "m"], ["a"])
    pooled, only = got["m"]["pooled"], got["m"]["scenarios"]["a"]
    low, high = stats.t.interval(0.95, 3, loc=np.mean(diffs["a"]), scale=stats.sem(diffs["a"]))
    assert (pooled["ci_low"], pooled["ci_high"]) == pytest.approx((low, high), abs=1e-12)
    assert pooled["p"] == only["p"] and pooled["k"] == 1 and pooled["i2"] == 0.0 and pooled["tau2"] == 0.0
    z = stats.norm.ppf(0.975) * stats.sem(diffs["a"])
    assert pooled["ci_high"] - pooled["ci_low"] > 2 * z  # wider than the z interval it replaces


def test_paired_noise_floor_is_the_seed_sd_of_the_difference_not_of_the_auc():
    frame, diffs = _two_scenarios()
    floor = paired_noise_floor(endpoint_scores(frame, "final"), ["fedavg", "m"], ["a", "b"])
    expected = np.mean([np.std(diffs[s], ddof=1) for s in "ab"])
    assert floor == {"m": pytest.approx(expected)}
    raw_sd = frame[frame.method == "m"].groupby("scenario")["auc"].std().mean()
    assert abs(floor["m"] - raw_sd) > 1e-3  # the AUC's own seed SD is another figure


def test_verdict_reads_the_interval():
    assert verdict(0.001, 0.02) == "better"
    assert verdict(-0.02, -0.001) == "worse"
    assert verdict(-0.01, 0.02) == "no evidence"
    assert verdict(None, None) == "no evidence"


# ------------------------------------------------------------------------------ finding groups
def test_common_and_rare_finding_auc():
    rng = np.random.default_rng(3)
    prevalence = np.array([0.4, 0.3, 0.05, 0.35, 0.08, 0.25, 0.5, 0.03])  # C = 8: 2 rare (2 and 7)
    labels = (rng.random((600, 8)) < prevalence).astype(np.float64)
    scores = labels * 0.4 + rng.random((600, 8))
    assert rare_findings(labels) == [2, 7]
    per = [roc_auc_score(labels[:, j], scores[:, j]) for j in range(8)]
    common, rare = finding_group_aucs(labels, scores[None])
    assert rare == pytest.approx(np.mean([per[2], per[7]]))
    assert common == pytest.approx(np.mean([per[j] for j in (0, 1, 3, 4, 5, 6)]))
    assert finding_group_aucs(rng.integers(0, 3, 50), rng.random((1, 50, 3))) is None  # multi-class


# --------------------------------------------------------------------------------------- report
def _summary() -> dict:
    frame, _ = _two_scenarios()
    scores = {e: endpoint_scores(frame, e) for e in ("final", "last_k")}
    return {
        "scenarios": ["a", "b"],
        "effect_vs_fedavg": {
            "m": {
                "a": {"mean": 0.015, "ci_low": 0.012, "ci_high": 0.018},
                "b": {"mean": -0.0065, "ci_low": -0.009, "ci_high": -0.004},
            }
        },
        "effect_vs_fedavg_seeds": {
            e: seed_effects(s, ["fedavg", "m"], ["a", "b"]) for e, s in scores.items()
        },
        "noise_floor_paired_auc": paired_noise_floor(scores["final"], ["fedavg", "m"], ["a", "b"]),
        "noise_floor_auc": 0.001,
        "endpoint_last_k": 3,
        "wilcoxon_holm_p_auc": {"m": 0.5},
        "plateau_reached": {"m": 1.0},
    }


def test_report_verdicts_come_from_the_seed_interval_and_the_image_interval_is_labelled():
    summary = _summary()
    table = effect_scenario_table(summary, "b")
    assert "test-set sampling only" in table.splitlines()[0]
    row = table.splitlines()[2].split(" | ")
    # the image-only interval excludes 0, the seed interval does not: no evidence
    assert row[3] == "no evidence" and row[4].startswith("[-0.0090, -0.0040]")
    overview = effect_overview_table(summary)
    assert "random-effects estimate" in overview.splitlines()[0]
    line = within_noise_floor_line(summary, "b")
    assert line.startswith("- within the paired noise floor") and "m (" in line


# ------------------------------------------------------------------------------ committed runs
def test_committed_runs_seed_tables_match_an_independent_recount():
    """The two SynthCXR grids: every effect's interval over seeds is SciPy's t interval of the final
    rounds' paired differences, and 9 of their 56 method-scenario effects exclude 0 (against 37 with the
    image-only intervals)."""
    from pathlib import Path

    from fedweigh.bench.tables import results_tables

    root = Path(__file__).resolve().parents[1] / "docs" / "results"
    excluding = total = image_only = 0
    for run in ("standard-synthcxr", "standard-synthcxr-baselines"):
        results = pd.read_csv(root / run / "results.csv")
        final = results[results["round"] == results["round"].max()].set_index(["scenario", "method", "seed"])[
            "auc"
        ]
        table = results_tables(root / run)["effects_over_seeds:final"].splitlines()
        header = [c.strip() for c in table[0].strip("|").split("|")]
        for line in table[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            method = cells[0]
            for sc in header[1:5]:
                d = (final[sc][method] - final[sc]["fedavg"]).to_numpy()
                low, high = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
                assert cells[header.index(sc)] == f"{d.mean():+.4f} [{low:+.4f}, {high:+.4f}]"
                excluding += low > 0 or high < 0
                total += 1
        summary = json.loads((root / run / "summary.json").read_text())
        for by_scenario in summary["effect_vs_fedavg"].values():
            image_only += sum(e["ci_low"] > 0 or e["ci_high"] < 0 for e in by_scenario.values())
    assert (excluding, total, image_only) == (9, 56, 37)

"""Effects against FedAvg: paired bootstrap AUC differences, Wilcoxon-Holm, noise floor, plateau, GM at 0.5.

Small hand-made cells whose answers are known: a copy of FedAvg has effect 0, perfect scores a
positive effect whose interval excludes 0; AUCs are checked against scikit-learn on explicit resamples.
"""

from __future__ import annotations

import numpy as np
import pytest
from figures import captured_figures, effect_points, noise_band
from scipy.stats import wilcoxon

from fedweigh.bench.cells import cell_key, store_cell
from fedweigh.bench.effects import (
    PLATEAU_TOL_AUC,
    against_fedavg,
    bootstrap_aucs,
    noise_floor,
    paired_effect,
    plateau_reached,
    resample_counts,
    weighted_macro_auc,
)
from fedweigh.bench.plots import IMAGE_ONLY_GID, plot_effects
from fedweigh.bench.report import effect_tables
from fedweigh.bench.stats import holm, wilcoxon_p
from fedweigh.metrics import geometric_mean, macro_auc


def _multilabel(rng: np.random.Generator, n: int = 120, c: int = 4) -> tuple[np.ndarray, np.ndarray]:
    labels = (rng.random((n, c)) < 0.3).astype(np.float64)
    labels[:2] = [1.0] * c  # every finding has positives and negatives
    labels[2:4] = [0.0] * c
    scores = np.round(labels * 0.3 + rng.random((n, c)) * 0.7, 1)  # many ties
    return labels, scores


def _record(scenario: str, method: str, seed: int, aucs: list[float], rounds: int) -> dict:
    rows = [{"round": t, "test_auc": a} for t, a in enumerate(aucs)]
    return {
        "key": cell_key(scenario, method, seed),
        "scenario": scenario,
        "method": method,
        "seed": seed,
        "rounds": rounds,
        "rows": rows,
    }


def _store(cells, scenario, method, seed, scores, labels, aucs=(0.5, 0.6, 0.62)) -> dict:
    rec = _record(scenario, method, seed, list(aucs), len(aucs) - 1)
    store_cell(cells, rec, np.asarray(scores)[None], labels)
    return rec


# ----------------------------------------------------------------------------------- weighted AUC
def test_weighted_auc_equals_sklearn_on_the_full_set_and_on_explicit_resamples():
    rng = np.random.default_rng(0)
    labels, scores = _multilabel(rng)
    labels[rng.random(labels.shape) < 0.1] = np.nan  # unknown labels are ignored
    n = len(labels)
    assert weighted_macro_auc(labels, scores, np.ones((1, n)))[0] == pytest.approx(
        macro_auc(labels, scores)[0], abs=1e-12
    )
    counts = resample_counts(n, 5, rng)
    got = weighted_macro_auc(labels, scores, counts)
    for b in range(5):
        drawn = np.repeat(np.arange(n), counts[b])
        assert got[b] == pytest.approx(macro_auc(labels[drawn], scores[drawn])[0], abs=1e-12)
    classes = rng.integers(0, 3, n)  # multi-class: one-vs-rest per class
    probs = rng.random((n, 3))
    assert weighted_macro_auc(classes, probs, np.ones((1, n)))[0] == pytest.approx(
        macro_auc(classes, probs)[0], abs=1e-12
    )


def test_a_finding_with_one_class_in_a_resample_is_left_out_of_that_resample():
    rng = np.random.default_rng(1)
    labels, scores = _multilabel(rng, n=30, c=3)
    labels[:, 2] = 0.0
    labels[5, 2] = 1.0  # finding 2: one positive image
    n = len(labels)
    counts = np.ones((2, n))
    counts[1, 5] = 0  # resample 1 misses it: finding 2 has no AUC there
    counts[1, 6] = 2
    got = weighted_macro_auc(labels, scores, counts)
    drawn = np.repeat(np.arange(n), counts[1].astype(int))
    expected = np.mean([macro_auc(labels[drawn, j], scores[drawn, j])[0] for j in (0, 1)])
    assert got[1] == pytest.approx(expected, abs=1e-12)
    assert got[0] == pytest.approx(macro_auc(labels, scores)[0], abs=1e-12)


# -------------------------------------------------------------------------------- paired effects
def test_a_copy_of_fedavg_has_effect_zero_on_every_resample(tmp_path):
    rng = np.random.default_rng(2)
    labels, scores = _multilabel(rng)
    records = []
    for seed in (0, 1):
        records.append(_store(tmp_path, "sc", "fedavg", seed, scores, labels))
        records.append(_store(tmp_path, "sc", "fedprox", seed, scores, labels))  # a copy of FedAvg
    got = against_fedavg(["fedprox", "fedavg"], ["sc"], [0, 1], records, tmp_path, n_resamples=200)
    e = got.effects["fedprox"]["sc"]
    assert e.mean == 0.0 and e.ci_low == 0.0 and e.ci_high == 0.0


def test_cells_scored_in_parallel_give_the_same_numbers(tmp_path):
    """jobs=2 scores the cells in two processes: every effect, p-value and GM at 0.5 is the serial one."""
    rng = np.random.default_rng(5)
    labels, scores = _multilabel(rng)
    records = []
    for seed in (0, 1):
        for method, noise in (("fedavg", 0.5), ("feddraw", 0.3), ("fedbb", 0.6)):
            noisy = np.round(labels * (1 - noise) + rng.random(labels.shape) * noise, 2)
            records.append(_store(tmp_path, "sc", method, seed, noisy, labels))
    args = (["fedavg", "feddraw", "fedbb"], ["sc"], [0, 1], records, tmp_path)
    serial = against_fedavg(*args, n_resamples=50)
    parallel = against_fedavg(*args, n_resamples=50, jobs=2)
    assert parallel.effects == serial.effects and parallel.effects["feddraw"]["sc"] is not None
    assert parallel.wilcoxon_holm_p == serial.wilcoxon_holm_p
    assert parallel.gm_05 == serial.gm_05 and len(serial.gm_05) == 6


def test_perfect_scores_beat_fedavg_with_an_interval_excluding_zero(tmp_path):
    rng = np.random.default_rng(3)
    labels, scores = _multilabel(rng)
    records = [
        _store(tmp_path, "sc", "fedavg", 0, scores, labels),
        _store(tmp_path, "sc", "feddraw", 0, labels, labels),  # perfect scores
        _store(tmp_path, "sc", "fedbb", 0, 1.0 - labels, labels),  # perfectly wrong
    ]
    got = against_fedavg(["feddraw", "fedavg", "fedbb"], ["sc"], [0], records, tmp_path, n_resamples=300)
    ref = macro_auc(labels, scores)[0]
    oracle, inverted = got.effects["feddraw"]["sc"], got.effects["fedbb"]["sc"]
    assert oracle.mean == pytest.approx(1.0 - ref, abs=1e-12)
    assert 0.0 < oracle.ci_low <= oracle.mean <= oracle.ci_high
    assert inverted.mean == pytest.approx(0.0 - ref, abs=1e-12)
    assert inverted.ci_high < 0.0


def test_the_effect_averages_the_seeds_and_the_interval_pools_their_resamples():
    rng = np.random.default_rng(4)
    labels, scores = _multilabel(rng)
    better = np.clip(scores + 0.5 * labels, 0, 1)
    per_seed = [
        (bootstrap_aucs(better, labels, s, 400), bootstrap_aucs(scores, labels, s, 400)) for s in (0, 1)
    ]
    method, ref = [m for m, _ in per_seed], [r for _, r in per_seed]
    e = paired_effect(method, ref)
    assert e.mean == pytest.approx(np.mean([m[0] - r[0] for m, r in per_seed]), abs=1e-12)
    pooled = np.mean([m[1] - r[1] for m, r in per_seed], axis=0)
    assert (e.ci_low, e.ci_high) == pytest.approx(tuple(np.percentile(pooled, [2.5, 97.5])), abs=1e-12)
    # the same seed gives the same resamples, another seed others
    assert np.array_equal(bootstrap_aucs(scores, labels, 0, 50)[1], bootstrap_aucs(scores, labels, 0, 50)[1])
    assert not np.array_equal(
        bootstrap_aucs(scores, labels, 0, 50)[1], bootstrap_aucs(scores, labels, 1, 50)[1]
    )


def test_cells_of_one_seed_must_share_their_test_labels(tmp_path):
    rng = np.random.default_rng(5)
    labels, scores = _multilabel(rng)
    other = labels.copy()
    other[0, 0] = 1.0 - other[0, 0]
    records = [
        _store(tmp_path, "sc", "fedavg", 0, scores, labels),
        _store(tmp_path, "sc", "feddraw", 0, scores, other),
    ]
    with pytest.raises(ValueError, match="test labels differ"):
        against_fedavg(["feddraw", "fedavg"], ["sc"], [0], records, tmp_path, n_resamples=10)


# ----------------------------------------------------------------------------------------- tests
def test_holm_on_known_p_values():
    # sorted 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04 -> monotone 0.03, 0.06, 0.06
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": None}) == pytest.approx(
        {"a": 0.03, "b": 0.06, "c": 0.06, "d": None}
    )
    assert holm({"a": 0.6, "b": 0.7}) == {"a": 1.0, "b": 1.0}


def test_wilcoxon_on_known_differences():
    # six positive differences: exact two-sided p = 2 / 2^6
    assert wilcoxon_p([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]) == pytest.approx(2 / 64)
    d = [0.05, -0.01, 0.02, 0.0, 0.03, -0.04, 0.06]
    assert wilcoxon_p(d) == pytest.approx(wilcoxon(d, zero_method="wilcox").pvalue)
    assert wilcoxon_p([0.0, 0.0]) is None and wilcoxon_p([]) is None


def test_noise_floor_is_the_mean_over_cells_of_the_seed_standard_deviation():
    rows = [
        ("a", "m", 0, 0.70),
        ("a", "m", 1, 0.74),
        ("b", "m", 0, 0.60),
        ("b", "m", 1, 0.60),
        ("b", "m", 2, 0.66),
    ]
    expected = (np.std([0.70, 0.74], ddof=1) + np.std([0.60, 0.60, 0.66], ddof=1)) / 2
    assert noise_floor(rows) == pytest.approx(expected)
    assert noise_floor([("a", "m", 0, 0.7), ("b", "m", 0, 0.6)]) is None


def test_plateau_compares_the_last_round_with_the_last_scored_round_before_two_thirds():
    every5 = [(0, 0.5), (5, 0.6), (10, 0.65), (15, 0.70), (20, 0.740), (25, 0.75), (30, 0.744)]
    assert plateau_reached(every5, 30, tol=0.005) is True  # 0.744 - 0.740 (round 20)
    assert plateau_reached(every5, 30, tol=0.003) is False
    assert (
        plateau_reached([(0, 0.5), (1, 0.6), (2, 0.7), (3, 0.8), (4, 0.801)], 4, tol=0.005) is False
    )  # vs round 2
    assert plateau_reached([(0, 0.5), (4, 0.8)], 4, tol=0.005) is None  # local: rounds 0 and T only
    assert plateau_reached([(0, 0.5), (1, 0.6)], 2, tol=0.005) is None  # round T not scored


def test_undefined_statistics_are_null_with_a_reason(tmp_path):
    rng = np.random.default_rng(6)
    labels, scores = _multilabel(rng)
    records = [
        _store(tmp_path, "sc", "feddraw", 0, scores, labels, aucs=(0.5, 0.6, 0.7, 0.71)),
        _store(tmp_path, "sc", "fedbb", 0, scores, labels, aucs=(0.5, 0.6, 0.7, 0.8)),
    ]
    got = against_fedavg(["feddraw", "fedbb"], ["sc"], [0], records, tmp_path, n_resamples=10)
    assert got.effects is None and got.wilcoxon_holm_p is None and got.noise_floor is None
    assert set(got.notes) == {"effect_vs_fedavg", "wilcoxon_holm_p_auc", "noise_floor_auc"}
    # one seed: the fixed tolerance; gains over rounds 2..3 of 0.01 and 0.1
    assert got.plateau_tol == PLATEAU_TOL_AUC
    assert got.plateau == {"feddraw": 0.0, "fedbb": 0.0}
    assert got.gm_05[("sc", "fedbb", 0)] == pytest.approx(geometric_mean(labels, scores, 0.5)[0])


def test_wilcoxon_holm_and_gm_at_05_across_scenarios(tmp_path):
    rng = np.random.default_rng(7)
    records, scenarios = [], [f"s{i}" for i in range(6)]
    for sc in scenarios:
        labels, scores = _multilabel(rng)
        records.append(_store(tmp_path, sc, "fedavg", 0, scores, labels))
        records.append(_store(tmp_path, sc, "feddraw", 0, np.clip(scores + 0.3 * labels, 0, 1), labels))
        records.append(_store(tmp_path, sc, "fedbb", 0, scores[::-1], labels))
    got = against_fedavg(["feddraw", "fedbb", "fedavg"], scenarios, [0], records, tmp_path, n_resamples=20)
    raw = {m: wilcoxon([got.effects[m][sc].mean for sc in scenarios]).pvalue for m in ("feddraw", "fedbb")}
    assert got.wilcoxon_holm_p == pytest.approx(holm(raw))
    assert got.wilcoxon_holm_p["feddraw"] == pytest.approx(min(1.0, 2 * 2 / 64))  # all 6 effects positive


def test_report_names_the_effects_within_the_noise_floor():
    summary = {
        "scenarios": ["sc"],
        "effect_vs_fedavg": {
            "feddraw": {"sc": {"mean": 0.004, "ci_low": -0.01, "ci_high": 0.02}},
            "fedbb": {"sc": {"mean": -0.05, "ci_low": -0.07, "ci_high": -0.03}},
        },
        "noise_floor_auc": 0.01,
        "wilcoxon_holm_p_auc": {"feddraw": None, "fedbb": None},
        "plateau_reached": {"feddraw": 0.5, "fedbb": 1.0, "fedavg": 1.0},
        "plateau_tolerance_auc": 0.01,
        "bootstrap_resamples": 1000,
        "stats_notes": {},
    }
    text = "\n".join(effect_tables(summary))
    assert "- within the noise floor (|effect| < 0.0100): feddraw\n" in text
    assert "| feddraw | +0.0040 | [-0.0100, +0.0200] | no |" in text
    assert "| fedbb | -0.0500 | [-0.0700, -0.0300] | yes |" in text


def _two_effects_summary() -> dict:
    return {
        "scenarios": ["sc", "other"],
        "effect_vs_fedavg": {
            "feddraw": {
                "sc": {"mean": 0.004, "ci_low": -0.01, "ci_high": 0.02},
                "other": {"mean": 0.03, "ci_low": 0.02, "ci_high": 0.04},
            },
            "fedbb": {"sc": {"mean": -0.05, "ci_low": -0.07, "ci_high": -0.03}, "other": None},
            "fedadp": {"sc": {"mean": 0.005, "ci_low": 0.001, "ci_high": 0.009}, "other": None},
        },
        "noise_floor_auc": 0.01,
    }


def test_effects_plot_draws_each_effect_with_its_interval_and_the_noise_floor(tmp_path):
    summary = _two_effects_summary()
    path = tmp_path / "effects.png"
    with captured_figures() as figures:
        plot_effects(summary, path, "effects")
    fig = figures[path]
    assert path.stat().st_size > 2000
    # filled = the interval excludes 0 and |effect| > floor: fedbb, and feddraw on "other"; not feddraw
    # on "sc" (interval holds 0) nor fedadp (interval excludes 0, effect within the floor)
    assert effect_points(fig) == {
        "sc": {
            "feddraw": (0.004, -0.01, 0.02, False),
            "fedbb": (-0.05, -0.07, -0.03, True),
            "fedadp": (0.005, 0.001, 0.009, False),
        },
        "other": {"feddraw": (0.03, 0.02, 0.04, True)},
    }
    for ax in fig.axes:
        assert noise_band(ax) == pytest.approx((-0.01, 0.01))


def test_effects_plot_needs_effects(tmp_path):
    with pytest.raises(ValueError, match="no effects against FedAvg"):
        plot_effects({"scenarios": ["sc"], "effect_vs_fedavg": None}, tmp_path / "e.png", "run")


def _rounded(points: dict) -> dict:
    return {p: {m: (*(round(v, 9) for v in e[:3]), e[3]) for m, e in by.items()} for p, by in points.items()}


def test_effects_plot_draws_the_seed_paired_intervals_when_the_summary_has_them(tmp_path):
    """With training noise in the summary the rows are the seed-paired intervals of the primary endpoint
    (filled: the interval excludes 0, whatever the image-only interval says), the image-only interval is
    the grey line beside each row, and a last panel holds the pooled random-effects estimate."""
    summary = _two_effects_summary()

    def iv(mean, low, high):
        return {"mean": mean, "ci_low": low, "ci_high": high, "sd": 0.01, "se": 0.005, "n_seeds": 3, "p": 0.5}

    summary["effect_vs_fedavg_seeds"] = {
        "last_k": {
            # the image-only interval of feddraw on "other" excludes 0; its seed interval does not
            "feddraw": {
                "scenarios": {"sc": iv(0.006, 0.001, 0.011), "other": iv(0.02, -0.01, 0.05)},
                "pooled": iv(0.01, -0.002, 0.022),
            },
            "fedbb": {"scenarios": {"sc": iv(-0.04, -0.09, 0.01), "other": None}, "pooled": None},
            "fedadp": {
                "scenarios": {"sc": iv(0.004, -0.002, 0.010), "other": None},
                "pooled": iv(0.004, -0.002, 0.010),
            },
        },
        "final": None,
    }
    path = tmp_path / "effects.png"
    with captured_figures() as figures:
        plot_effects(summary, path, "effects")
    fig = figures[path]
    assert _rounded(effect_points(fig)) == {
        "sc": {
            "feddraw": (0.006, 0.001, 0.011, True),
            "fedbb": (-0.04, -0.09, 0.01, False),
            "fedadp": (0.004, -0.002, 0.010, False),
        },
        "other": {"feddraw": (0.02, -0.01, 0.05, False)},
        "pooled (random effects)": {
            "feddraw": (0.01, -0.002, 0.022, False),
            "fedadp": (0.004, -0.002, 0.010, False),
        },
    }
    # no seed-noise band (the intervals hold the seeds); the image-only intervals drawn in grey beside
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert all(noise_band(ax) is None for ax in panels.values())
    grey = sorted(
        tuple(np.round(seg[:, 0], 6))
        for coll in panels["sc"].collections
        if coll.get_gid() == IMAGE_ONLY_GID
        for seg in coll.get_segments()
    )
    assert grey == sorted([(-0.01, 0.02), (-0.07, -0.03), (0.001, 0.009)])
    # the final round is drawn when asked
    with captured_figures() as figures:
        summary["effect_vs_fedavg_seeds"]["final"] = {
            "feddraw": {"scenarios": {"sc": iv(-0.03, -0.05, -0.01), "other": None}, "pooled": None}
        }
        plot_effects(summary, path, "effects", endpoint="final")
    assert _rounded(effect_points(figures[path]))["sc"] == {"feddraw": (-0.03, -0.05, -0.01, True)}


def test_a_decision_curve_axis_stays_within_the_range_net_benefit_is_read_in(tmp_path, monkeypatch):
    """Net benefit far below zero (a model worse than treating no one) is clipped at a tenth of the top
    below zero, not scaled to: the axis shows where the curves can be useful."""
    import matplotlib.pyplot as plt

    from fedweigh.bench.plots import plot_decision_curves

    close, kept = plt.close, []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    thresholds = np.linspace(0.01, 0.99, 50)
    curves = {"a": np.linspace(0.2, -0.68, 50), "b": np.linspace(0.1, 0.0, 50)}
    plot_decision_curves(thresholds, curves, np.linspace(0.2, -5.0, 50), tmp_path / "dc.png", "t")
    plot_decision_curves(
        thresholds, {"a": np.linspace(0.3, 0.0, 50)}, np.linspace(0.3, -0.2, 50), tmp_path / "dc2.png", "t"
    )
    (low, high), (low2, high2) = (fig.axes[0].get_ylim() for fig in kept)
    for fig in kept:
        close(fig)
    assert high == pytest.approx(0.2 * 1.1 + 0.01) and low == pytest.approx(-0.1 * high)
    assert low2 == pytest.approx(-0.01) and high2 == pytest.approx(0.3 * 1.1 + 0.01)

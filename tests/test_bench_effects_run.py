"""``against_fedavg`` on hand-made runs, every field against a value computed here: the noise floor from
each cell's final AUC (a cell whose last round was not scored left out), the plateau fractions at that
floor, the effects from the bootstrap of the bootstrap seed asked for, the finding groups, GM at 0.5, the
notes word for word; where the cells are scored (in this process unless ``jobs`` > 1 and there are
several cells; workers spawned, at most one per cell); and the effect helpers' edge cases."""

from __future__ import annotations

import multiprocessing as mp
import warnings

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score
from test_bench_stats import _multilabel, _record, _store

from fedweigh.bench import effects
from fedweigh.bench.effects import (
    against_fedavg,
    bootstrap_aucs,
    finding_group_aucs,
    paired_effect,
    per_finding_auc,
    plateau_reached,
    rare_findings,
)
from fedweigh.bench.stats import holm, wilcoxon_p
from fedweigh.metrics import geometric_mean

#: (method, seed) -> test AUC of rounds 0..6; None: the round was not scored
CURVES = {
    ("fedavg", 0): (0.5, 0.6, 0.65, 0.7, 0.72, 0.73, 0.725),  # gain over round 4: 0.005
    ("fedavg", 1): (0.5, 0.6, 0.65, 0.7, 0.70, 0.74, 0.76),  # 0.06
    ("fedavg", 2): (0.5, 0.6, 0.65, 0.7, None, 0.74, 0.71),  # round 4 not scored: over round 3, 0.01
    ("feddraw", 0): (0.5, 0.6, 0.66, 0.71, 0.73, 0.73, 0.731),  # 0.001
    ("feddraw", 1): (0.5, 0.6, 0.66, 0.71, 0.73, 0.75, None),  # round T not scored: no final AUC
    ("feddraw", 2): (0.5, 0.6, 0.66, 0.71, 0.73, 0.74, 0.78),  # 0.05
    ("fedbb", 0): (0.5, 0.55, 0.6, 0.62, 0.64, 0.64, 0.645),  # 0.005
    ("fedbb", 1): (0.5, 0.55, 0.6, 0.62, 0.64, 0.64, 0.70),  # 0.06
    ("fedbb", 2): (0.5, 0.55, 0.6, 0.62, 0.63, 0.66, 0.70),  # 0.07
}
METHODS, SEEDS = ("fedavg", "feddraw", "fedbb"), (0, 1, 2)


class NoPool:
    """Stands in for ProcessPoolExecutor where no worker process may start."""

    def __init__(self, *_, **__):
        raise AssertionError("a worker pool was started")


class SerialPool:
    """Stands in for ProcessPoolExecutor: records how it was made and maps in this process."""

    made: list[dict] = []

    def __init__(self, max_workers=None, mp_context=None):
        SerialPool.made.append({"max_workers": max_workers, "mp_context": mp_context})

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False

    def map(self, fn, *iterables, chunksize=1):
        return map(fn, *iterables)


def _run(tmp_path, methods=METHODS, seeds=SEEDS, scenario="sc", store=True):
    """Records (and stored predictions) of ``methods`` x ``seeds``: multi-label labels with an unknown
    entry, shared by the methods of a seed; each method's scores the labels plus its own noise."""
    rng = np.random.default_rng(11)
    records, cells = [], {}
    for seed in seeds:
        labels, _ = _multilabel(rng, n=60, c=4)
        labels[7, 2] = np.nan
        for i, method in enumerate(methods):
            noise = (0.8, 0.7, 0.9)[i % 3]  # no perfect separation: every AUC below 1
            scores = np.round(np.nan_to_num(labels) * (1 - noise) + rng.random(labels.shape) * noise, 2)
            aucs = CURVES[(method, seed)]
            if store:
                records.append(_store(tmp_path, scenario, method, seed, scores, labels, aucs=aucs))
            else:
                records.append(_record(scenario, method, seed, list(aucs), len(aucs) - 1))
            cells[(scenario, method, seed)] = (scores, labels)
    return records, cells


def _expected_floor() -> float:
    finals = {  # the final AUC of each cell whose round 6 was scored
        "fedavg": [0.725, 0.76, 0.71],
        "feddraw": [0.731, 0.78],
        "fedbb": [0.645, 0.70, 0.70],
    }
    return float(np.mean([np.std(v, ddof=1) for v in finals.values()]))


def test_every_field_of_a_three_seed_run_against_fedavg(tmp_path, monkeypatch):
    monkeypatch.setattr(effects, "ProcessPoolExecutor", NoPool)  # one job (the default): in this process
    records, cells = _run(tmp_path)
    got = against_fedavg(
        list(METHODS), ["sc"], list(SEEDS), records, tmp_path, n_resamples=40, bootstrap_seed=7
    )

    floor = _expected_floor()
    assert got.noise_floor == pytest.approx(floor, rel=1e-12) and got.plateau_tol == got.noise_floor
    assert (
        0.03 < floor < 0.035
    )  # so that the gains of 0.05 and more fall above it, those of 0.01 and less below
    assert got.plateau == pytest.approx({"fedavg": 2 / 3, "feddraw": 1 / 2, "fedbb": 1 / 3})

    boot = {k: bootstrap_aucs(s[None], y, k[2], 40, 7) for k, (s, y) in cells.items()}
    for method in ("feddraw", "fedbb"):
        expected = paired_effect(
            [boot[("sc", method, s)] for s in SEEDS], [boot[("sc", "fedavg", s)] for s in SEEDS]
        )
        assert got.effects[method]["sc"] == expected
    raw = {m: wilcoxon_p([got.effects[m]["sc"].mean]) for m in ("feddraw", "fedbb")}
    assert got.wilcoxon_holm_p == holm(raw) and set(raw) == {"feddraw", "fedbb"}

    assert got.gm_05 == {k: geometric_mean(y, s, 0.5)[0] for k, (s, y) in cells.items()}
    assert got.finding_groups == {k: finding_group_aucs(y, s[None]) for k, (s, y) in cells.items()}
    assert got.notes == {}


def test_another_bootstrap_seed_gives_another_interval(tmp_path):
    records, _ = _run(tmp_path, methods=("fedavg", "feddraw"), seeds=(0,))
    args = (["fedavg", "feddraw"], ["sc"], [0], records, tmp_path)
    seven, zero = (
        against_fedavg(*args, n_resamples=40, bootstrap_seed=b).effects["feddraw"]["sc"] for b in (7, 0)
    )
    assert seven.mean == zero.mean and (seven.ci_low, seven.ci_high) != (zero.ci_low, zero.ci_high)


def test_several_jobs_spawn_one_worker_per_cell_at_most_and_give_the_serial_numbers(tmp_path, monkeypatch):
    records, _ = _run(tmp_path, methods=("fedavg", "feddraw"), seeds=(0,))
    args = (["fedavg", "feddraw"], ["sc"], [0], records, tmp_path)
    serial = against_fedavg(*args, n_resamples=30)
    SerialPool.made = []
    monkeypatch.setattr(effects, "ProcessPoolExecutor", SerialPool)
    two = against_fedavg(*args, n_resamples=30, jobs=2)  # two cells, two jobs: a pool of two
    five = against_fedavg(*args, n_resamples=30, jobs=5)  # five jobs, two cells: still two workers
    assert [m["max_workers"] for m in SerialPool.made] == [2, 2]
    assert all(m["mp_context"].get_start_method() == "spawn" for m in SerialPool.made)
    assert isinstance(SerialPool.made[0]["mp_context"], type(mp.get_context("spawn")))
    for parallel in (two, five):
        assert parallel.effects == serial.effects and parallel.gm_05 == serial.gm_05
        assert parallel.finding_groups == serial.finding_groups
    monkeypatch.setattr(effects, "ProcessPoolExecutor", NoPool)
    one_cell = [r for r in records if r["method"] == "feddraw"]
    assert against_fedavg(["feddraw"], ["sc"], [0], one_cell, tmp_path, jobs=2).gm_05  # one cell: no pool


def test_a_run_without_fedavg_skips_the_bootstrap_and_keeps_its_floor_and_finding_groups(
    tmp_path, monkeypatch
):
    def no_bootstrap(*_, **__):
        raise AssertionError("bootstrapped a run without FedAvg")

    monkeypatch.setattr(effects, "bootstrap_aucs", no_bootstrap)
    records, cells = _run(tmp_path, methods=("feddraw", "fedbb"))
    got = against_fedavg(["feddraw", "fedbb"], ["sc"], list(SEEDS), records, tmp_path)
    finals = {"feddraw": [0.731, 0.78], "fedbb": [0.645, 0.70, 0.70]}
    assert got.noise_floor == pytest.approx(np.mean([np.std(v, ddof=1) for v in finals.values()]), rel=1e-12)
    assert got.effects is None and got.wilcoxon_holm_p is None
    assert got.finding_groups == {k: finding_group_aucs(y, s[None]) for k, (s, y) in cells.items()}
    assert set(got.notes) == {"effect_vs_fedavg", "wilcoxon_holm_p_auc"}


def test_every_note_of_a_run_that_can_say_little(tmp_path):
    """One seed, no FedAvg, no stored predictions, a method scored at rounds 0 and T only: the notes."""
    records, _ = _run(tmp_path, methods=("feddraw",), seeds=(0,), store=False)
    records.append(
        {
            **records[0],
            "method": "fedbb",
            "rows": [{"round": 0, "test_auc": 0.5}, {"round": 6, "test_auc": 0.6}],
        }
    )
    got = against_fedavg(["feddraw", "fedbb"], ["sc"], [0], records, tmp_path)
    assert got.plateau == {
        "feddraw": 1.0,
        "fedbb": None,
    }  # a gain of 0.001 < 0.005 and got.gm_05 == {} and got.finding_groups == {}
    findings = "common and rare findings are defined for multi-label test sets with stored predictions"
    assert got.notes == {
        "noise_floor_auc": "needs at least two seeds",
        "plateau_reached": (
            "null for a method none of whose cells has a scored round after round 0 and at or before 2T/3"
        ),
        "mean_auc_common": findings,
        "mean_auc_rare": findings,
        "effect_vs_fedavg": "FedAvg is not among the run's methods",
        "wilcoxon_holm_p_auc": "FedAvg is not among the run's methods",
    }


def test_wilcoxon_skips_an_undefined_effect_and_notes_a_method_with_none_defined(tmp_path):
    """feddraw has no cell in s2 (its effect there undefined, left out of its test); fedprox is a copy of
    FedAvg (every effect zero: no p, and the note says why)."""
    rng = np.random.default_rng(4)
    records = []
    for sc in ("s1", "s2"):
        labels, scores = _multilabel(rng)
        records.append(_store(tmp_path, sc, "fedavg", 0, scores, labels))
        records.append(_store(tmp_path, sc, "fedprox", 0, scores, labels))
        if sc == "s1":
            records.append(_store(tmp_path, sc, "feddraw", 0, np.clip(scores + 0.3 * labels, 0, 1), labels))
    got = against_fedavg(
        ["fedavg", "fedprox", "feddraw"], ["s1", "s2"], [0], records, tmp_path, n_resamples=20
    )
    assert got.effects["feddraw"]["s2"] is None and got.effects["feddraw"]["s1"].mean > 0
    assert got.wilcoxon_holm_p == holm(
        {"fedprox": None, "feddraw": wilcoxon_p([got.effects["feddraw"]["s1"].mean])}
    )
    assert got.wilcoxon_holm_p["fedprox"] is None and got.wilcoxon_holm_p["feddraw"] is not None
    assert got.notes == {
        "noise_floor_auc": "needs at least two seeds",
        "wilcoxon_holm_p_auc": "null for a method whose per-scenario effects are all zero or undefined",
    }


def test_a_cell_without_stored_predictions_leaves_the_cells_after_it_scored(tmp_path):
    records, cells = _run(tmp_path, methods=("feddraw", "fedbb"), seeds=(0,))
    missing = {**records[0], "key": "sc__feddraw__s9", "seed": 9}
    got = against_fedavg(["feddraw", "fedbb"], ["sc"], [0, 9], [missing, *records], tmp_path)
    assert set(got.gm_05) == set(cells) == set(got.finding_groups)


# ----------------------------------------------------------------------------------------- helpers
def test_plateau_at_a_gain_equal_to_the_tolerance_is_not_reached():
    assert (
        plateau_reached([(0, 0.25), (2, 0.25), (3, 0.5)], 3, tol=0.25) is False
    )  # 0.5 - 0.25 = 0.25 exactly
    assert plateau_reached([(0, 0.25), (2, 0.25), (3, 0.5)], 3, tol=0.2500001) is True


def test_plateau_ignores_an_unscored_round_and_a_curve_with_round_t_only():
    assert plateau_reached([(0, 0.5), (2, float("nan")), (3, 0.7)], 3, tol=0.5) is None  # t0 is round 0
    assert plateau_reached([(0, 0.5), (2, None), (3, 0.7)], 3, tol=0.5) is None
    assert plateau_reached([(3, 0.7)], 3, tol=0.5) is None  # no round at or before 2T/3 at all


def test_rare_findings_break_ties_by_the_order_the_findings_are_listed():
    labels = np.zeros((10, 20))
    labels[:3, :10] = 1.0  # findings 0-9: prevalence 0.3
    labels[:2, 10:] = 1.0  # findings 10-19: prevalence 0.2, tied; ceil(20 / 4) = 5 of them are rare
    assert rare_findings(labels) == [10, 11, 12, 13, 14]


def test_finding_groups_of_two_findings_and_of_one_models_scores_as_a_matrix():
    rng = np.random.default_rng(8)
    labels = (rng.random((40, 2)) < np.array([0.5, 0.2])).astype(np.float64)
    labels[:2], labels[2:4] = 1.0, 0.0
    scores = rng.random((40, 2))
    got = finding_group_aucs(labels, scores)
    expected = (roc_auc_score(labels[:, 0], scores[:, 0]), roc_auc_score(labels[:, 1], scores[:, 1]))
    assert got == pytest.approx(expected, abs=1e-12)
    assert finding_group_aucs(labels, scores[None]) == got


def test_a_group_whose_findings_have_no_auc_is_nan_without_a_warning():
    labels = np.zeros((8, 4))
    labels[:4, :3] = 1.0  # finding 3 (the rare one) has no positive: no AUC
    scores = np.linspace(1, 0, 32).reshape(8, 4)  # the positives score highest
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        common, rare = finding_group_aucs(labels, scores)
    assert np.isnan(rare) and common == 1.0


def test_per_finding_auc_of_class_indices_is_one_vs_rest():
    rng = np.random.default_rng(9)
    labels = rng.integers(0, 3, 50)
    scores = rng.random((50, 3))
    expected = [roc_auc_score(labels == j, scores[:, j]) for j in range(3)]
    assert per_finding_auc(labels, scores) == pytest.approx(expected, abs=1e-12)

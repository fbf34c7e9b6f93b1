"""Per-hospital outcomes: each site's AUC on the test set weighted to its own population."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedweigh.bench.modes import site_outcomes
from fedweigh.bench.report import results_frame, site_outcomes_summary, site_summary
from fedweigh.data import primary_labels
from fedweigh.data.base import Federation, LabeledImages, SiteData
from fedweigh.metrics import macro_auc, population_weights, weighted_macro_auc


def test_population_weights_by_hand():
    w = population_weights(np.array([0, 0, 1, 2]), np.array([0.5, 0.5, 0.0]))
    np.testing.assert_allclose(w, [0.25, 0.25, 0.5, 0.0])
    # a group the test set lacks is dropped and the rest renormalised
    np.testing.assert_allclose(population_weights(np.array([0, 1]), np.array([0.2, 0.2, 0.6])), [0.5, 0.5])
    with pytest.raises(ValueError, match="no row of any group"):
        population_weights(np.array([0, 0]), np.array([0.0, 1.0]))


def test_weighted_auc_equals_the_auc_of_the_rows_repeated_by_their_weights():
    rng = np.random.default_rng(0)
    y = (rng.random((60, 3)) < 0.4).astype(np.float64)
    s = rng.random((60, 3)) + 0.3 * y
    reps = rng.integers(0, 4, size=60)
    expected, _ = macro_auc(np.repeat(y, reps, axis=0), np.repeat(s, reps, axis=0))
    assert weighted_macro_auc(y, s, reps / reps.sum()) == pytest.approx(expected, abs=1e-12)


def _images(labels: np.ndarray, domain=None) -> LabeledImages:
    return LabeledImages(
        images=np.zeros((len(labels), 1, 2, 2), dtype=np.float32),
        labels=labels.astype(np.float32),
        class_names=("a", "b"),
        task="multilabel",
        domain=domain,
    )


def _federation(domain: bool = False) -> tuple[Federation, np.ndarray]:
    rng = np.random.default_rng(1)
    test = (rng.random((400, 2)) < 0.3).astype(np.float32)
    site_a = np.array([[1, 0]] * 30 + [[0, 0]] * 10, dtype=np.float32)  # mostly finding a
    site_b = np.array([[0, 1]] * 5 + [[0, 0]] * 95, dtype=np.float32)  # mostly no finding, larger
    sites = [
        SiteData("site-1", _images(site_a[:30]), _images(site_a[30:])),
        SiteData("site-2", _images(site_b[:90]), _images(site_b[90:])),
    ]
    dom = np.repeat([0, 1], 200) if domain else None
    return Federation("x", sites, _images(test, dom)), test


def test_each_site_is_scored_on_the_test_rows_weighted_to_its_label_mix():
    fed, test = _federation()
    scores = np.random.default_rng(2).random((1, 400, 2)) + 0.4 * test[None]
    out = site_outcomes(fed, ["site-1", "site-2"], scores)
    assert out["site_images"] == {"site-1": 40, "site-2": 100}
    # independently: groups over all rows, the site's shares, w_i = q_g / n_g over the test rows
    every = np.concatenate([s.train.labels for s in fed.sites] + [s.val.labels for s in fed.sites] + [test])
    groups = primary_labels(every, "multilabel")[-400:]
    for name, mix in (("site-1", {0: 30, 2: 10}), ("site-2", {1: 5, 2: 95})):
        q = np.array([mix.get(g, 0) for g in range(3)], dtype=np.float64)
        q /= q.sum()
        w = np.array([q[g] / np.sum(groups == g) for g in groups])
        assert out["site_auc"][name] == pytest.approx(weighted_macro_auc(test, scores[0], w), abs=1e-12)
    assert out["site_auc"]["site-1"] != pytest.approx(macro_auc(test, scores[0])[0], abs=1e-4)


def test_one_model_per_site_and_a_domain_mixed_test_set():
    fed, test = _federation(domain=True)
    rng = np.random.default_rng(3)
    scores = rng.random((2, 400, 2))
    out = site_outcomes(fed, ["site-1", "site-2"], scores)
    scores[1, :200] = 0  # site-2's model on site-1's domain: must not change site-2's outcome
    scores[0, 200:] = 0  # nor site-1's model on site-2's domain
    assert site_outcomes(fed, ["site-1", "site-2"], scores)["site_auc"] == out["site_auc"]
    scores[0, :200] = 0  # site-1's own model on its own domain does
    assert site_outcomes(fed, ["site-1", "site-2"], scores)["site_auc"]["site-1"] != out["site_auc"]["site-1"]


def _record(method: str, seed: int, aucs: dict, sizes: dict, test_auc: float) -> dict:
    return {
        "dataset": "synthcxr",
        "scenario": "sc",
        "method": method,
        "seed": seed,
        "rows": [{"round": 0, "test_auc": 0.5}, {"round": 1, "test_auc": test_auc}],
        "site_auc": aucs,
        "site_images": sizes,
    }


def test_results_csv_and_summary_carry_worst_and_smallest_site():
    sizes = {"big": 300, "small": 40, "mid": 100}
    recs = [
        _record("fedavg", 0, {"big": 0.8, "small": 0.6, "mid": 0.7}, sizes, 0.75),
        _record("fedavg", 1, {"big": 0.82, "small": 0.7, "mid": 0.65}, sizes, 0.77),
        {**_record("uniform", 0, {}, {}, 0.7), "site_auc": None},  # a cell stored before them
    ]
    assert site_summary(recs[0]) == {
        "site_auc/big": 0.8,
        "site_auc/small": 0.6,
        "site_auc/mid": 0.7,
        "worst_site_auc": 0.6,
        "smallest_site_auc": 0.6,
    }
    frame = results_frame(recs)
    final = frame[(frame.method == "fedavg") & (frame["round"] == 1)]
    assert list(final.worst_site_auc) == [0.6, 0.65] and list(final.smallest_site_auc) == [0.6, 0.7]
    assert json.loads(final.site_auc.iloc[1]) == {"big": 0.82, "small": 0.7, "mid": 0.65}
    assert frame[frame["round"] == 0].worst_site_auc.isna().all()
    summary = site_outcomes_summary(recs, ["fedavg", "uniform"], ["sc"])
    assert set(summary) == {"fedavg"}  # no per-site figures invented for the old cell
    sc = summary["fedavg"]["sc"]
    assert sc["worst_site_auc"] == pytest.approx(0.625) and sc["smallest_site_auc"] == pytest.approx(0.65)
    assert sc["site_auc/big"] == pytest.approx(0.81) and sc["auc"] == pytest.approx(0.76) and sc["seeds"] == 2
    assert math.isclose(summary["fedavg"]["mean"]["worst_site_auc"], 0.625)


def test_a_cell_stored_before_site_outcomes_gets_them_on_the_next_run(tmp_path):
    from fedweigh.bench.config import make_config
    from fedweigh.bench.runner import run_bench

    config = make_config(
        "smoke",
        "synthcxr",
        methods=["fedavg"],
        scenarios=["noisy-large"],
        sites=["site-1", "site-2"],
        rounds=1,
    )
    first = run_bench(config, tmp_path, progress=False)
    path = tmp_path / "cells" / "noisy-large__fedavg__s0.json"
    record = json.loads(path.read_text())
    fresh = record["site_auc"]
    assert set(fresh) == {"site-1", "site-2"}
    assert first.summary["site_outcomes"]["fedavg"]["noisy-large"]["site_auc/site-1"] == pytest.approx(
        fresh["site-1"]
    )
    for key in ("site_auc", "site_images"):  # as a cell stored before them
        del record[key]
    path.write_text(json.dumps(record))
    again = run_bench(config, tmp_path, progress=False)
    assert again.trained == 0  # the settings are unchanged: the cell is reused, not retrained
    assert json.loads(path.read_text())["site_auc"] == pytest.approx(fresh, abs=1e-6)
    worst = again.summary["site_outcomes"]["fedavg"]["noisy-large"]["worst_site_auc"]
    assert worst == pytest.approx(min(fresh.values()), abs=1e-6)

"""`fedweigh bench`: the smoke profile end to end, resumability, the references, ranks and tests."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pandas as pd
import pytest
import scikit_posthocs as sp
from figures import assert_weights_plot, captured_figures, effect_points, lines
from scipy.stats import friedmanchisquare, rankdata

from fedweigh.bench import make_config, parse_method, run_bench, run_cell
from fedweigh.bench.cells import CELLS_DIR, cell_key, is_done, load_cell_scores, settings_hash
from fedweigh.bench.cli import add_bench_parser, main_bench
from fedweigh.bench.config import bench_safeguards, cell_args
from fedweigh.bench.curves import macro_roc, net_benefit
from fedweigh.bench.effects import PLATEAU_TOL_AUC
from fedweigh.bench.federations import federation_for, pool_sites
from fedweigh.bench.modes import TestScorer
from fedweigh.bench.report import RESULT_COLUMNS, SUMMARY_KEYS
from fedweigh.bench.runner import engine_layout
from fedweigh.bench.stats import (
    average_ranks,
    compare,
    friedman_p,
    holm,
    nemenyi_cd,
    nemenyi_pvalues,
    wilcoxon_p,
)
from fedweigh.metrics import geometric_mean, macro_auc, youden_thresholds
from fedweigh.models import build_model
from fedweigh.train import get_params, predict

SMOKE_FEDERATED = ["feddraw", "fedbb", "fedavg"]


#: The figures the smoke run saved, by path (filled by the ``smoke`` fixture).
SMOKE_FIGURES: dict = {}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-smoke")
    config = make_config("smoke", "synthcxr")
    with captured_figures() as figures:
        result = run_bench(config, out, progress=False)
    SMOKE_FIGURES.update(figures)
    return config, result, out


def _final(results: pd.DataFrame, rounds: int) -> pd.DataFrame:
    return results[results["round"] == rounds]


# ------------------------------------------------------------------------------------------ outputs
def test_smoke_summary_has_exactly_the_documented_keys(smoke):
    config, result, out = smoke
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == list(SUMMARY_KEYS)
    assert summary == result.summary
    assert summary["dataset"] == "synthcxr" and summary["profile"] == "smoke"
    assert summary["methods"] == list(config.methods) == [*SMOKE_FEDERATED, "centralized"]
    assert summary["scenarios"] == ["iid-4", "label-a0.5"] and summary["seeds"] == [0]
    assert set(summary["mean_auc"]) == set(summary["mean_gm"]) == set(config.methods)
    # references are reported but not ranked
    assert set(summary["avg_rank_auc"]) == set(summary["avg_rank_gm"]) == set(SMOKE_FEDERATED)
    for key in ("friedman_p_auc", "friedman_p_gm"):
        assert 0.0 <= summary[key] <= 1.0
    # k = 3 methods over N = 2 scenarios: CD = q_0.05(3) sqrt(3 * 4 / 12), q = 2.343 (Demsar 2006, Table 5)
    assert summary["nemenyi_cd_auc"] == pytest.approx(2.343, abs=1e-3)
    assert summary["nemenyi_cd_gm"] == summary["nemenyi_cd_auc"]
    assert summary["wall_seconds"] > 0
    assert result.trained == 8 and result.skipped == 0


def test_smoke_summary_reports_effects_against_fedavg(smoke):
    """Effects, Wilcoxon-Holm, plateau and GM at 0.5 of the smoke run, against its recorded metrics."""
    config, result, out = smoke
    summary = result.summary
    final = _final(pd.read_csv(out / "results.csv"), config.rounds).set_index(["scenario", "method"])
    assert set(summary["effect_vs_fedavg"]) == {"feddraw", "fedbb", "centralized"}
    for method, by_scenario in summary["effect_vs_fedavg"].items():
        for scenario in config.scenarios:
            effect = by_scenario[scenario]
            recorded = final.loc[(scenario, method), "auc"] - final.loc[(scenario, "fedavg"), "auc"]
            assert effect["mean"] == pytest.approx(recorded, abs=1e-5)
            same = np.array_equal(
                load_cell_scores(out / CELLS_DIR, cell_key(scenario, method, 0))[0],
                load_cell_scores(out / CELLS_DIR, cell_key(scenario, "fedavg", 0))[0],
            )
            # FedDRAW ends its two smoke rounds on uniform weights: on iid-4 it is FedAvg
            assert (
                (effect["ci_low"] == effect["ci_high"] == 0.0)
                if same
                else effect["ci_low"] < effect["ci_high"]
            )
    raw = {
        m: wilcoxon_p([summary["effect_vs_fedavg"][m][sc]["mean"] for sc in config.scenarios])
        for m in ("feddraw", "fedbb")
    }
    assert summary["wilcoxon_holm_p_auc"] == pytest.approx(holm(raw))
    # one seed: no noise floor (the notes say why), so the plateau uses the fixed tolerance
    assert summary["noise_floor_auc"] is None and "noise_floor_auc" in summary["stats_notes"]
    assert summary["plateau_tolerance_auc"] == PLATEAU_TOL_AUC
    results = pd.read_csv(out / "results.csv").set_index(["scenario", "method", "round"])["auc"]
    for m in config.methods:  # T = 2, every round scored: AUC(2) - AUC(1) < tol
        gains = [results[(sc, m, 2)] - results[(sc, m, 1)] for sc in config.scenarios]
        assert summary["plateau_reached"][m] == pytest.approx(np.mean([g < PLATEAU_TOL_AUC for g in gains]))
    # threshold 0.5: GM at 0.5 from the stored predictions is the recorded GM
    assert summary["mean_gm_05"] == pytest.approx(summary["mean_gm"], abs=1e-6)
    report = (out / "report.md").read_text()
    assert (
        "## Test AUC against FedAvg" in report
        and "noise_floor_auc is null: needs at least two seeds" in report
    )


def test_smoke_results_csv_rows_and_invariants(smoke):
    config, _, out = smoke
    results = pd.read_csv(out / "results.csv")
    assert list(results.columns) == list(RESULT_COLUMNS)
    assert len(results) == len(config.scenarios) * len(config.methods) * len(config.seeds) * (
        config.rounds + 1
    )
    assert results["auc"].between(0.0, 1.0).all() and results["gm"].between(0.0, 1.0).all()
    for scenario, group in results[results["round"] == 0].groupby("scenario"):
        # round 0 is theta^0, built from the seed, for every method: identical test scores
        assert group["auc"].nunique() == 1, scenario
        assert np.allclose(group["loss"], group["loss"].iloc[0])
    for _, row in results.iterrows():
        weights = json.loads(row["weights"])
        if row["method"] in SMOKE_FEDERATED and row["round"] >= 1:
            assert set(weights) == {"site-1", "site-2", "site-3", "site-4"}
            assert sum(weights.values()) == pytest.approx(1.0, abs=1e-9)
        else:
            assert weights == {}
    # the centralized reference and round-T rows carry no train loss from the future
    assert results.loc[results["round"] == config.rounds, "train_loss"].isna().all()
    assert results.loc[results["round"] < config.rounds, "train_loss"].notna().all()


def test_smoke_average_ranks_agree_with_the_final_scores(smoke):
    config, result, out = smoke
    results = pd.read_csv(out / "results.csv")
    final = _final(results, config.rounds)
    for metric in ("auc", "gm"):
        table = final.groupby(["scenario", "method"])[metric].mean().unstack()[SMOKE_FEDERATED]
        ranks = np.vstack([rankdata(-row, method="average") for row in table.to_numpy()])
        expected = dict(zip(SMOKE_FEDERATED, ranks.mean(axis=0), strict=True))
        got = result.summary[f"avg_rank_{metric}"]
        assert got == pytest.approx(expected, abs=1e-12)
        k = len(SMOKE_FEDERATED)
        assert sum(got.values()) == pytest.approx(k * (k + 1) / 2)  # each scenario hands out ranks 1..k
        means = final.groupby("method")[metric].mean()
        for m in config.methods:
            assert result.summary[f"mean_{metric}"][m] == pytest.approx(means[m], abs=1e-12)
        # a method that is best in every scenario has average rank 1
        for m in SMOKE_FEDERATED:
            if (table[m].to_numpy()[:, None] > table.drop(columns=m).to_numpy()).all():
                assert got[m] == 1.0


def test_smoke_writes_plots_and_report(smoke):
    config, _, out = smoke
    plots = out / "plots"
    expected = [plots / "cd_auc.png", plots / "cd_gm.png", plots / "effects_vs_fedavg.png"]
    for scenario in config.scenarios:
        expected += [plots / "auc_by_round" / f"{scenario}.png", plots / "roc" / f"{scenario}.png"]
        expected += [plots / "dca" / f"{scenario}.png"]
        expected += [plots / "weights" / scenario / f"{m}.png" for m in SMOKE_FEDERATED]
    for path in expected:
        assert path.is_file() and path.stat().st_size > 2000, path
    assert set(expected) <= set(SMOKE_FIGURES)
    assert not (plots / "confusion").exists()  # multi-label data: no confusion matrices
    report = (out / "report.md").read_text()
    words = ("precision", "recall", "f1", "specificity", "Friedman p", "centralized", "cd_auc.png")
    for word in (*words, "![plots/effects_vs_fedavg.png]"):
        assert word in report


def test_smoke_effects_plot_shows_the_summarys_effects(smoke):
    config, _, out = smoke
    summary = json.loads((out / "summary.json").read_text())
    shown = effect_points(SMOKE_FIGURES[out / "plots" / "effects_vs_fedavg.png"])
    assert set(shown) == set(config.scenarios)
    for method, by_scenario in summary["effect_vs_fedavg"].items():
        for scenario, e in by_scenario.items():
            if e is None:
                assert method not in shown[scenario]
                continue
            mean, low, high, _ = shown[scenario][method]
            assert (mean, low, high) == pytest.approx((e["mean"], e["ci_low"], e["ci_high"]), abs=1e-12)


def test_smoke_plots_show_the_recorded_results(smoke):
    """Weights, AUC by round and ROC curves drawn from the run's own records and stored scores."""
    from fedweigh.bench.report import load_cell_scores

    config, _, out = smoke
    plots = out / "plots"
    results = pd.read_csv(out / "results.csv")
    for scenario in config.scenarios:
        records = {
            m: json.loads((out / CELLS_DIR / f"{scenario}__{m}__s0.json").read_text()) for m in config.methods
        }
        for method in SMOKE_FEDERATED:
            weighted = [r for r in records[method]["rows"] if r.get("weights")]
            assert [r["round"] for r in weighted] == list(range(1, config.rounds + 1))
            assert_weights_plot(SMOKE_FIGURES[plots / "weights" / scenario / f"{method}.png"], weighted)
        shown = lines(SMOKE_FIGURES[plots / "auc_by_round" / f"{scenario}.png"].axes[0])
        assert set(shown) == set(config.methods)
        for method, (x, y) in shown.items():
            rows = results[(results["scenario"] == scenario) & (results["method"] == method)].dropna(
                subset=["auc"]
            )
            np.testing.assert_array_equal(x, rows["round"].to_numpy())
            np.testing.assert_allclose(y, rows["auc"].to_numpy(), rtol=0, atol=1e-12)
        roc = lines(SMOKE_FIGURES[plots / "roc" / f"{scenario}.png"].axes[0])
        final = results[(results["scenario"] == scenario) & (results["round"] == config.rounds)]
        for method in config.methods:
            auc = float(final.loc[final["method"] == method, "auc"].iloc[0])
            ((fpr, tpr),) = [xy for label, xy in roc.items() if label == f"{method} (AUC {auc:.3f})"]
            scores, labels = load_cell_scores(out / CELLS_DIR, records[method]["key"])
            grid, expected_tpr = macro_roc(labels, scores[0])
            np.testing.assert_allclose(fpr, grid)
            np.testing.assert_allclose(tpr, expected_tpr, rtol=0, atol=1e-12)


def test_rerun_skips_finished_cells(smoke):
    config, first, out = smoke
    cells = sorted((out / CELLS_DIR).glob("*.json"))
    assert len(cells) == 8
    stamps = {p.name: p.stat().st_mtime_ns for p in cells}
    again = run_bench(config, out, progress=False)
    assert again.trained == 0 and again.skipped == 8
    assert {p.name: p.stat().st_mtime_ns for p in (out / CELLS_DIR).glob("*.json")} == stamps
    drop = {"wall_seconds"}
    assert {k: v for k, v in again.summary.items() if k not in drop} == {
        k: v for k, v in first.summary.items() if k not in drop
    }
    # a stored cell is reused only with the same settings
    assert is_done(out / CELLS_DIR, config, "iid-4", "fedavg", 0)
    assert not is_done(out / CELLS_DIR, make_config("smoke", "synthcxr", rounds=3), "iid-4", "fedavg", 0)
    assert not is_done(out / CELLS_DIR, make_config("smoke", "synthcxr", max_steps=3), "iid-4", "fedavg", 0)


# --------------------------------------------------------------------------------------- references
def test_local_reference_is_the_mean_over_sites_of_their_own_models():
    config = make_config(
        "smoke", "synthcxr", methods=["local"], scenarios=["label-a0.5"], sites=["site-1", "site-2"], rounds=1
    )
    record, scores, labels = run_cell(config, "label-a0.5", "local", 0)
    assert scores.shape[0] == 2 and scores.shape[2] == 14  # one final model per site
    per_site = [macro_auc(labels, s)[0] for s in scores]
    final = record["rows"][-1]
    assert final["round"] == 1 and "weights" not in final
    assert final["test_auc"] == pytest.approx(np.mean(per_site), abs=1e-5)


def test_youden_thresholds_change_thresholded_metrics_only():
    kwargs = {"methods": ["centralized"], "scenarios": ["iid-4"], "sites": ["site-1", "site-2"], "rounds": 1}
    plain = make_config("smoke", "synthcxr", **kwargs)
    youden = make_config("smoke", "synthcxr", threshold="youden", **kwargs)
    assert settings_hash(plain, "iid-4", "centralized", 0) != settings_hash(youden, "iid-4", "centralized", 0)
    a, scores_a, _ = run_cell(plain, "iid-4", "centralized", 0)
    b, scores_b, _ = run_cell(youden, "iid-4", "centralized", 0)
    np.testing.assert_array_equal(scores_a, scores_b)  # the same training
    for ra, rb in zip(a["rows"], b["rows"], strict=True):
        assert ra["test_auc"] == rb["test_auc"] and ra["val_gm"] == rb["val_gm"]
    labels = federation_for(plain, "iid-4", 0).test.labels
    assert a["rows"][-1]["test_gm"] == pytest.approx(geometric_mean(labels, scores_a[0], 0.5)[0], abs=1e-12)
    # youden: per-finding thresholds from the pooled validation splits, for the model being scored
    fed = federation_for(youden, "iid-4", 0)
    args = cell_args(youden, "iid-4", 0, parse_method("centralized"))
    scorer = TestScorer(args, fed.test, pool_sites(fed.sites).val, "youden")
    model = build_model(args.arch, 14, 1, args.size, seed=args.seed)
    thresholds = youden_thresholds(scorer.val.labels, predict(model, scorer.val))
    expected = geometric_mean(fed.test.labels, predict(model, fed.test), thresholds)[0]
    assert scorer.metrics(get_params(model))["test_gm"] == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="threshold"):
        make_config("smoke", "synthcxr", threshold="0.3")


def test_method_labels_carry_scheme_options():
    spec = parse_method("feddraw:beta_max=2.0,rho=0.5,outer=linear")
    assert (spec.scheme, spec.base, spec.loss) == ("feddraw", "feddraw", "default")
    assert spec.scheme_args == {"beta_max": 2.0, "rho": 0.5, "outer": "linear"}
    assert parse_method("fedbb").loss == "pnb" and parse_method("fedbb").needs_statistics()
    # FedDisco's default target is uniform (its authors' code): only the pooled-histogram target needs it
    assert (
        parse_method("feddisco:target=global").needs_statistics()
        and not parse_method("feddisco").needs_statistics()
    )
    assert not parse_method("fedavg").needs_statistics()
    with pytest.raises(ValueError, match="unknown method 'fedfoo'"):
        parse_method("fedfoo")
    with pytest.raises(ValueError, match="method .feddraw.: .*nonsense"):
        parse_method("feddraw:nonsense=1")
    with pytest.raises(ValueError, match="key=value"):
        parse_method("feddraw:beta_max")


# ---------------------------------------------------------------------------------------- statistics
def test_friedman_and_critical_difference_match_scipy_and_scikit_posthocs():
    scores = np.array(
        [
            [0.80, 0.75, 0.70, 0.60],
            [0.82, 0.79, 0.71, 0.69],
            [0.78, 0.80, 0.66, 0.61],
            [0.90, 0.85, 0.85, 0.70],
        ]
    )
    table = pd.DataFrame(scores, index=list("abcd"), columns=["m1", "m2", "m3", "m4"])
    assert friedman_p(table) == pytest.approx(friedmanchisquare(*scores.T).pvalue, rel=1e-12)
    # hand-computed ranks: (1,2,3,4), (1,2,3,4), (2,1,3,4), (1,2.5,2.5,4)
    assert average_ranks(table).tolist() == pytest.approx([1.25, 1.875, 2.875, 4.0])
    # q_0.05 for k = 4 is 2.569 (Demsar 2006, Table 5): CD = 2.569 sqrt(4 * 5 / (6 * 4))
    assert nemenyi_cd(4, 4) == pytest.approx(2.569 * math.sqrt(20 / 24), abs=2e-3)
    expected = sp.posthoc_nemenyi_friedman(scores).to_numpy()
    assert np.allclose(nemenyi_pvalues(table).to_numpy(), expected)
    comp = compare(table)
    assert comp.p == friedman_p(table) and comp.cd == nemenyi_cd(4, 4) and comp.note == ""


def test_tests_need_three_methods_and_two_scenarios_and_nan_ranks_last():
    two_methods = pd.DataFrame([[0.7, 0.6], [0.8, 0.5]], columns=["a", "b"])
    comp = compare(two_methods)
    assert comp.p is None and comp.cd is None and "3 methods" in comp.note
    assert comp.ranks.tolist() == [1.0, 2.0]
    one_scenario = pd.DataFrame([[0.7, 0.6, 0.5]], columns=["a", "b", "c"])
    assert compare(one_scenario).p is None
    with_nan = pd.DataFrame([[np.nan, 0.6, 0.6]], columns=["a", "b", "c"])
    assert average_ranks(with_nan).tolist() == [3.0, 1.5, 1.5]


def test_net_benefit_and_roc_by_hand():
    labels = np.array([[1], [1], [0], [0]], dtype=np.float32)
    scores = np.array([[0.9], [0.3], [0.6], [0.1]], dtype=np.float32)
    nb = net_benefit(labels, scores, np.array([0.2, 0.5]))
    # p_t = 0.2: treated {0.9, 0.3, 0.6}: TP 2, FP 1 -> 2/4 - 1/4 * 0.25 = 0.4375
    # p_t = 0.5: treated {0.9, 0.6}: TP 1, FP 1 -> 1/4 - 1/4 * 1 = 0
    assert nb["model"].tolist() == pytest.approx([0.4375, 0.0])
    assert nb["treat_all"].tolist() == pytest.approx([0.5 - 0.5 * 0.25, 0.0])
    grid, tpr = macro_roc(np.array([0, 1, 2, 1]), np.eye(3)[[0, 1, 2, 1]].astype(np.float32))
    assert tpr[0] == 1.0 and np.all(tpr == 1.0)  # perfect separation: TPR 1 at every FPR
    with pytest.raises(ValueError, match="threshold"):
        net_benefit(labels, scores, np.array([0.0]))


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_parser_defaults_and_bad_arguments(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--out", str(tmp_path), "--methods", "fedavg", "feddraw:beta_max=2"])
    assert args.func is main_bench and args.profile == "smoke" and args.dataset == "synthcxr"
    assert args.methods == ["fedavg", "feddraw:beta_max=2"]
    assert args.jobs == 0 and args.site_workers == 0  # automatic: every core busy with one thread
    bad = parser.parse_args(["bench", "--out", str(tmp_path), "--scenarios", "nowhere-7"])
    assert main_bench(bad) == 2
    assert "nowhere-7" in capsys.readouterr().out
    assert not (tmp_path / "cells").exists()


def test_engine_layout_keeps_every_core_busy():
    assert engine_layout(1, cores=2) == (1, 2)  # one cell: its sites train in two processes
    assert engine_layout(12, cores=2) == (2, 1)  # many cells: two cells at a time, sites in-process
    assert engine_layout(3, cores=8) == (3, 2)
    assert engine_layout(5, cores=1) == (1, 1)


@pytest.mark.slow
def test_process_pool_gives_the_serial_results_on_digits(tmp_path):
    """--jobs 2 (spawned workers, 1 torch thread) reproduces in-process cells; multi-class plots."""
    config = make_config(
        "smoke",
        "digits",
        methods=["fedavg", "local"],
        scenarios=["label-a0.5"],
        sites=["site-1", "site-2"],
        rounds=1,
        threads=1,
    )
    with captured_figures() as figures:
        result = run_bench(config, tmp_path, jobs=2, progress=False)
    assert result.trained == 2
    for method in config.methods:
        record, _, _ = run_cell(config, "label-a0.5", method, 0)
        stored = json.loads((tmp_path / CELLS_DIR / f"label-a0.5__{method}__s0.json").read_text())
        for got, want in zip(stored["rows"], record["rows"], strict=True):
            assert got["test_auc"] == pytest.approx(want["test_auc"], abs=1e-6)
            assert got["test_accuracy"] == pytest.approx(want["test_accuracy"], abs=1e-6)
    confusion = tmp_path / "plots" / "confusion" / "label-a0.5.png"
    assert confusion.stat().st_size > 2000
    # one row-normalised confusion matrix per method, from the final models' stored test scores
    from fedweigh.bench.curves import confusion as confusion_matrix
    from fedweigh.bench.report import load_cell_scores

    panels = {ax.get_title(): ax for ax in figures[confusion].axes if ax.get_images()}
    assert set(panels) == set(config.methods)
    for method, ax in panels.items():
        record = json.loads((tmp_path / CELLS_DIR / f"label-a0.5__{method}__s0.json").read_text())
        scores, labels = load_cell_scores(tmp_path / CELLS_DIR, record["key"])
        counts = sum(confusion_matrix(labels, s) for s in scores).astype(float)
        np.testing.assert_allclose(
            ax.get_images()[0].get_array(), counts / counts.sum(axis=1, keepdims=True), rtol=0, atol=1e-12
        )
    assert result.summary["friedman_p_auc"] is None  # one federated method
    assert "Friedman/Nemenyi not computed" in (tmp_path / "report.md").read_text()


def test_the_bench_runs_the_schemes_without_safeguards_unless_asked():
    from fedweigh.cli import build_parser
    from fedweigh.server.safeguards import DEFAULT_MIN_UPDATE_COSINE, DEFAULT_UPDATE_NORM_BOUND

    off = make_config("smoke", "synthcxr").safeguards
    assert (off.max_share, off.update_norm_bound, off.min_update_cosine) == (None, None, None)
    deploy = make_config("smoke", "synthcxr", safeguards="deploy").safeguards
    assert (deploy.max_share, deploy.update_norm_bound, deploy.min_update_cosine) == (
        "auto",
        DEFAULT_UPDATE_NORM_BOUND,
        DEFAULT_MIN_UPDATE_COSINE,
    )
    one = make_config(
        "smoke", "synthcxr", safeguards=bench_safeguards("deploy", min_update_cosine=None)
    ).safeguards
    assert one.min_update_cosine is None and one.max_share == "auto"
    with pytest.raises(ValueError, match="safeguards must be one of off, deploy"):
        make_config("smoke", "synthcxr", safeguards="on")
    args = build_parser().parse_args(["bench", "--safeguards", "deploy", "--max-share", "0.4", "--out", "x"])
    assert args.safeguards == "deploy" and args.max_share == 0.4 and not hasattr(args, "update_norm_bound")

"""docs/results.md: every table is tied to its run's committed data, and sourced tables are rebuilt
verbatim from that run's summary.json and results.csv (fedweigh.bench.tables)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from figures import captured_figures, effect_points

from fedweigh.bench.report import RESULT_COLUMNS, seeds_above_table
from fedweigh.bench.tables import (
    check_document,
    main,
    marked_tables,
    replicate_table,
    results_tables,
    site_weight_table,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "docs" / "results.md"


def test_every_table_of_docs_results_is_rebuilt_verbatim_from_its_committed_run():
    assert check_document(RESULTS_MD, ROOT) == []
    marked, _ = marked_tables(RESULTS_MD.read_text())
    assert marked, "docs/results.md shows no table"
    for table in marked:  # a table without committed data says why
        assert table.run is not None or len(table.reason) > 20, table.line


def _run(tmp_path: Path, multiclass: bool = False) -> Path:
    """A two-scenario run with FedAvg, FedDRAW and centralized, two rounds, one seed."""
    run = tmp_path / "docs" / "results" / "tiny"
    run.mkdir(parents=True)
    final = {  # (scenario, method) -> final AUC, GM, accuracy
        ("a", "feddraw"): (0.71, 0.52, 0.61),
        ("a", "fedavg"): (0.69, 0.50, 0.60),
        ("a", "centralized"): (0.80, 0.60, 0.70),
        ("b", "feddraw"): (0.64, 0.41, 0.51),
        ("b", "fedavg"): (0.66, 0.45, 0.55),
        ("b", "centralized"): (0.75, 0.55, 0.65),
    }
    rows = []
    for (sc, m), (auc, gm, acc) in final.items():
        for t in (0, 1, 2):
            last = t == 2
            rows.append(
                {
                    "dataset": "x",
                    "scenario": sc,
                    "method": m,
                    "seed": 0,
                    "round": t,
                    "auc": auc if last else 0.5,
                    "gm": gm if last else 0.1,
                    "accuracy": (acc if last else 0.1) if multiclass else float("nan"),
                }
            )
    pd.DataFrame(rows).reindex(columns=list(RESULT_COLUMNS)).to_csv(run / "results.csv", index=False)
    summary = {
        "methods": ["feddraw", "fedavg", "centralized"],
        "scenarios": ["a", "b"],
        "mean_auc": {"feddraw": 0.675, "fedavg": 0.675, "centralized": 0.775},
        "mean_gm": {"feddraw": 0.465, "fedavg": 0.475, "centralized": 0.575},
        "mean_gm_05": {"feddraw": 0.3, "fedavg": 0.2, "centralized": None},
        "avg_rank_auc": {"feddraw": 1.5, "fedavg": 1.5},
        "avg_rank_gm": {"feddraw": 1.5, "fedavg": 1.5},
        "friedman_p_auc": None,
        "friedman_p_gm": None,
        "nemenyi_cd_auc": None,
        "nemenyi_cd_gm": None,
        "effect_vs_fedavg": {
            "feddraw": {
                "a": {"mean": 0.02, "ci_low": 0.001, "ci_high": 0.04},
                "b": {"mean": -0.02, "ci_low": -0.05, "ci_high": 0.01},
            },
            "centralized": {
                "a": {"mean": 0.11, "ci_low": 0.08, "ci_high": 0.14},
                "b": {"mean": 0.09, "ci_low": 0.06, "ci_high": 0.12},
            },
        },
        "wilcoxon_holm_p_auc": {"feddraw": 1.0},
        "plateau_reached": {"feddraw": 0.5, "fedavg": 1.0, "centralized": 1.0},
    }
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_the_tables_show_the_runs_numbers(tmp_path):
    tables = results_tables(_run(tmp_path))
    assert tables["methods"].splitlines()[2:] == [
        "| feddraw | 0.6750 | 0.4650 | 0.3000 | 1.50 | 1.50 |",
        "| fedavg | 0.6750 | 0.4750 | 0.2000 | 1.50 | 1.50 |",
        "| centralized | 0.7750 | 0.5750 | - | - | - |",
    ]
    assert tables["tests"].splitlines()[2:] == ["| AUC | - | - |", "| GM | - | - |"]
    assert tables["auc_by_scenario"].splitlines()[2:] == [
        "| a | 0.7100 | 0.6900 | 0.8000 |",
        "| b | 0.6400 | 0.6600 | 0.7500 |",
        "| **mean** | 0.6750 | 0.6750 | 0.7750 |",
    ]
    assert tables["effects:a"].splitlines()[2:] == [
        "| feddraw | +0.0200 | [+0.0010, +0.0400] | yes |",
        "| centralized | +0.1100 | [+0.0800, +0.1400] | yes |",
    ]
    assert tables["effects"].splitlines()[2:] == [
        "| feddraw | +0.0000 | 1 of 2 | 1.0000 | 0.50 |",
        "| centralized | +0.1000 | 2 of 2 | not tested | 1.00 |",
    ]
    assert tables["seeds_above_fedavg"].splitlines() == [
        "| method | a | b | all |",
        "|---|---|---|---|",
        "| feddraw | 1 of 1 | 0 of 1 | 1 of 2 |",
        "| centralized | 1 of 1 | 1 of 1 | 2 of 2 |",
    ]
    assert "accuracy_by_scenario" not in tables  # multi-label: no accuracy
    multiclass_tables = results_tables(_run(tmp_path / "mc", multiclass=True))
    multiclass = multiclass_tables["methods"]
    assert (
        multiclass.splitlines()[0]
        == "| method | mean AUC | mean GM | GM at 0.5 | accuracy | avg rank AUC | avg rank GM |"
    )
    assert multiclass.splitlines()[2] == "| feddraw | 0.6750 | 0.4650 | 0.3000 | 0.5600 | 1.50 | 1.50 |"
    assert multiclass_tables["accuracy_by_scenario"].splitlines()[2:] == [
        "| a | 0.6100 | 0.6000 | 0.7000 |",
        "| b | 0.5100 | 0.5500 | 0.6500 |",
        "| **mean** | 0.5600 | 0.5750 | 0.6750 |",
    ]


def _document(run: Path, root: Path, names: list[str]) -> Path:
    tables = results_tables(run)
    rel = run.relative_to(root).as_posix()
    body = "\n\n".join(f"Text.\n<!-- table: {rel} {n} -->\n{tables[n]}" for n in names)
    path = root / "docs" / "results.md"
    path.write_text(
        f"# Results\n\n{body}\n\n<!-- table: none (run kept elsewhere) -->\n| x |\n|---|\n| 1 |\n"
    )
    return path


def test_a_document_matching_its_data_passes_and_any_drift_is_named(tmp_path):
    run = _run(tmp_path)
    doc = _document(run, tmp_path, ["methods", "auc_by_scenario", "effects", "effects:b"])
    assert check_document(doc, tmp_path) == []
    text = doc.read_text()
    # a number edited in the docs
    doc.write_text(text.replace("| a | 0.7100 |", "| a | 0.7200 |"))
    problems = check_document(doc, tmp_path)
    assert len(problems) == 1 and "auc_by_scenario differs" in problems[0] and "| a | 0.7100 |" in problems[0]
    # the data changed under the docs
    doc.write_text(text)
    summary = json.loads((run / "summary.json").read_text())
    summary["effect_vs_fedavg"]["feddraw"]["b"]["ci_high"] = 0.02
    (run / "summary.json").write_text(json.dumps(summary))
    assert [p.split(": ")[1] for p in check_document(doc, tmp_path)] == [
        "docs/results/tiny effects:b differs; rebuilt:\n| method | effect | 95% interval | excludes 0 |\n"
        "|---|---|---|---|\n| feddraw | -0.0200 | [-0.0500, +0.0200] | no |\n"
        "| centralized | +0.0900 | [+0.0600, +0.1200] | yes |"
    ]


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda t: t.replace("<!-- table: none (run kept elsewhere) -->\n", ""), "without a '<!-- table"),
        (lambda t: t.replace(" methods -->", " ranks -->"), "no table 'ranks'"),
        (lambda t: t.replace("docs/results/tiny methods", "docs/results/gone methods"), "lacks summary.json"),
    ],
)
def test_unmarked_tables_unknown_names_and_missing_runs_are_problems(tmp_path, edit, problem):
    doc = _document(_run(tmp_path), tmp_path, ["methods"])
    doc.write_text(edit(doc.read_text()))
    problems = check_document(doc, tmp_path)
    assert len(problems) == 1 and problem in problems[0]


def test_the_module_prints_every_table_under_its_marker(tmp_path, capsys):
    run = _run(tmp_path)
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    for name, text in results_tables(run).items():
        assert f"<!-- table: {run} {name} -->\n{text}\n" in out


def test_the_module_draws_a_runs_effects_from_its_summary(tmp_path, capsys):
    run = _run(tmp_path)
    png = tmp_path / "effects.png"
    with captured_figures() as figures:
        assert main([str(run), "--effects-plot", str(png)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    shown = effect_points(figures[png])
    for method, by_scenario in summary["effect_vs_fedavg"].items():
        for scenario, e in by_scenario.items():
            assert shown[scenario][method][:3] == pytest.approx((e["mean"], e["ci_low"], e["ci_high"]))
    assert f"wrote {png}" in capsys.readouterr().err


def test_seeds_above_fedavg_counts_each_seeds_final_round():
    """Only the final round counts, per (scenario, seed); a tie is not above; a missing seed is not counted."""
    rows = []
    final = {  # (scenario, seed) -> (fedavg, x)
        ("a", 0): (0.60, 0.61),
        ("a", 1): (0.70, 0.70),
        ("a", 2): (0.65, 0.66),
        ("b", 0): (0.50, 0.40),
    }
    for (sc, seed), (ref, x) in final.items():
        for method, auc in (("fedavg", ref), ("x", x)):
            rows.append({"scenario": sc, "method": method, "seed": seed, "round": 0, "auc": 0.99})
            rows.append({"scenario": sc, "method": method, "seed": seed, "round": 5, "auc": auc})
    rows.append({"scenario": "b", "method": "fedavg", "seed": 1, "round": 5, "auc": 0.5})  # x lacks seed 1
    table = seeds_above_table(pd.DataFrame(rows), ["fedavg", "x"], ["a", "b"])
    assert table.splitlines()[2:] == ["| x | 2 of 3 | 0 of 1 | 2 of 4 |"]


def test_site_weight_is_the_mean_over_the_rounds_and_seeds_the_site_took_part_in():
    rows = []
    for seed, weights in ((0, [0.2, 0.4]), (1, [0.6, None])):  # seed 1, round 2: site-1 not sampled
        rows.append({"scenario": "a", "method": "m", "seed": seed, "round": 0, "weights": "{}"})
        for t, w in enumerate(weights, start=1):
            shares = {"site-2": 0.5} if w is None else {"site-1": w, "site-2": 1 - w}
            rows.append(
                {"scenario": "a", "method": "m", "seed": seed, "round": t, "weights": json.dumps(shares)}
            )
    rows.append({"scenario": "a", "method": "centralized", "seed": 0, "round": 1, "weights": "{}"})
    table = site_weight_table(pd.DataFrame(rows), ["m", "centralized"], ["a"], "site-1")
    assert table.splitlines()[2:] == ["| a | 0.4000 | - |"]


def _final_rows(final: dict[tuple[str, str, int], float]) -> pd.DataFrame:
    rows = []
    for (sc, m, seed), auc in final.items():
        rows.append({"scenario": sc, "method": m, "seed": seed, "round": 0, "auc": 0.5})
        rows.append({"scenario": sc, "method": m, "seed": seed, "round": 3, "auc": auc})
    return pd.DataFrame(rows).reindex(columns=list(RESULT_COLUMNS))


def test_replicate_table_sets_the_shared_cells_of_two_runs_side_by_side(tmp_path):
    """Per method: how far a rerun moved its final AUCs, each run's mean effect, the cells whose sign kept."""
    first = {
        ("a", "fedavg", 0): 0.70,
        ("a", "x", 0): 0.72,
        ("a", "fedavg", 1): 0.60,
        ("a", "x", 1): 0.59,
        ("a", "y", 0): 0.80,  # only in the first run: not compared
    }
    second = {
        ("a", "fedavg", 0): 0.71,
        ("a", "x", 0): 0.75,
        ("a", "fedavg", 1): 0.60,
        ("a", "x", 1): 0.61,
        ("b", "fedavg", 0): 0.50,
        ("b", "x", 0): 0.40,  # scenario b only in the second run
    }
    for name, final in (("one", first), ("two", second)):
        (tmp_path / name).mkdir()
        _final_rows(final).to_csv(tmp_path / name / "results.csv", index=False)
    table = replicate_table(tmp_path / "one", tmp_path / "two")
    assert table.splitlines() == [
        "| method | cells | mean abs. dAUC | max abs. dAUC | effect, one | effect, two | same sign |",
        "|---|---|---|---|---|---|---|",
        "| fedavg | 2 | 0.0050 | 0.0100 | - | - | - |",
        # effects: one (+0.02, -0.01) -> +0.005; two (+0.04, +0.01) -> +0.025; seed 1 flipped sign
        "| x | 2 | 0.0250 | 0.0300 | +0.0050 | +0.0250 | 1 of 2 |",
    ]
    # in a document: verbatim passes, a changed figure is named with the rebuilt table
    doc = tmp_path / "doc.md"
    doc.write_text(f"# R\n\n<!-- table: one replicate:two -->\n{table}\n")
    assert check_document(doc, tmp_path) == []
    doc.write_text(doc.read_text().replace("1 of 2", "2 of 2"))
    problems = check_document(doc, tmp_path)
    assert len(problems) == 1 and "one replicate:two differs" in problems[0] and "1 of 2" in problems[0]
    doc.write_text(f"# R\n\n<!-- table: one replicate:gone -->\n{table}\n")
    assert "gone lacks results.csv" in check_document(doc, tmp_path)[0]

"""The results tables of the docs, rebuilt from a run's committed ``summary.json`` and ``results.csv``.

A table in a Markdown document is tied to its data by a marker on the line before it:

    <!-- table: docs/results/RUN NAME -->

RUN is the run's folder (relative to the repository root) holding ``summary.json`` and
``results.csv``, NAME one of :func:`results_tables`' keys, or ``replicate:OTHER`` with OTHER another
run's folder: the same cells of both runs side by side (:func:`replicate_table`). A confirmatory
study's folder (it holds ``plan.json``) gives the study's tables (``claims``, ``claim:ID``:
:func:`fedweigh.bench.study.folder_tables`), rebuilt by its planned analysis. A table whose run
was not kept says so:

    <!-- table: none (REASON) -->

:func:`check_document` rebuilds every sourced table and returns the ones that differ from the text,
so a number in the docs cannot drift from the data. ``python -m fedweigh.bench.tables RUN`` prints a
run's tables with their markers, ready to paste.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from fedweigh.bench.report import (
    RESULTS_CSV,
    SUMMARY_JSON,
    _fmt,
    _scenario_table,
    effect_overview_table,
    effect_scenario_table,
    final_table,
    markdown_table,
    seed_effects_table,
    seed_statistics,
    seeds_above_table,
)

__all__ = [
    "MARKER",
    "MarkedTable",
    "check_document",
    "marked_tables",
    "methods_table",
    "replicate_table",
    "results_tables",
    "tests_table",
]

#: ``<!-- table: RUN NAME -->`` (a sourced table) or ``<!-- table: none (REASON) -->``.
MARKER = re.compile(r"^<!-- table: (?:none \((?P<reason>[^)]+)\)|(?P<run>\S+) (?P<name>\S+)) -->$")


def methods_table(summary: dict, results: pd.DataFrame) -> str:
    """method | mean AUC | mean GM | GM at 0.5 | [accuracy |] avg rank AUC | avg rank GM (GM at 0.5:
    ``mean_gm_05``; accuracy: multi-class runs, the final round's mean over scenarios and seeds from
    results.csv)."""
    methods, scenarios = summary["methods"], summary["scenarios"]
    accuracy = final_table(results, "accuracy", methods, scenarios).mean(axis=0)
    multiclass = bool(accuracy.notna().any())
    header = [
        "method",
        "mean AUC",
        "mean GM",
        "GM at 0.5",
        *(["accuracy"] if multiclass else []),
        "avg rank AUC",
        "avg rank GM",
    ]
    rows = []
    for m in methods:
        ranks = [summary[f"avg_rank_{k}"].get(m) for k in ("auc", "gm")]
        rows.append(
            [
                m,
                summary["mean_auc"][m],
                summary["mean_gm"][m],
                (summary.get("mean_gm_05") or {}).get(m),
                *([accuracy[m]] if multiclass else []),
                *["-" if r is None else _fmt(r, 2) for r in ranks],
            ]
        )
    return markdown_table(header, rows)


def site_weight_table(results: pd.DataFrame, methods: list[str], scenarios: list[str], site: str) -> str:
    """scenario | one column per method: ``site``'s aggregation weight, mean over the rounds and seeds
    in which it took part (``-`` where it never did, e.g. centralized)."""
    weights = results[results["round"] >= 1].copy()
    weights["w"] = [json.loads(w).get(site) if isinstance(w, str) else None for w in weights["weights"]]
    weights = weights.dropna(subset=["w"])
    table = weights.groupby(["scenario", "method"])["w"].mean().unstack("method")
    table = table.reindex(index=list(scenarios), columns=list(methods)).astype(float)
    rows = [[sc, *table.loc[sc].tolist()] for sc in table.index]
    return markdown_table(["scenario", *methods], rows)


def _final_cells(results: pd.DataFrame) -> pd.Series:
    """Final-round test AUC per (scenario, method, seed)."""
    last = results["round"] == results.groupby(["scenario", "method", "seed"])["round"].transform("max")
    return results[last].set_index(["scenario", "method", "seed"])["auc"].astype(float)


def replicate_table(run: str | Path, other: str | Path, reference: str = "fedavg") -> str:
    """The cells two runs share, side by side: how far a rerun moves a cell, and whether effects keep.

    method | cells | mean |dAUC| | max |dAUC| | effect, RUN | effect, OTHER | same sign: for each method
    of both runs, over the (scenario, seed) cells both hold: dAUC is the difference of a cell's final
    test AUC between the runs; an effect is the method's final AUC minus ``reference``'s in the same
    (scenario, seed), its mean over the shared cells in each run; "same sign" counts the cells whose
    effect has the same sign in both runs (``-`` on the reference's own row).
    """
    a = _final_cells(pd.read_csv(Path(run) / RESULTS_CSV))
    b = _final_cells(pd.read_csv(Path(other) / RESULTS_CSV))
    shared = a.index.intersection(b.index)
    methods = [m for m in dict.fromkeys(shared.get_level_values("method"))]
    if reference in methods:  # the reference first, then the methods in the first run's order
        methods = [reference, *[m for m in methods if m != reference]]
    rows = []
    for m in methods:
        cells = [c for c in shared if c[1] == m]
        diff = np.abs(np.array([a[c] - b[c] for c in cells]))
        effects = None
        if m != reference:
            paired = [c for c in cells if (c[0], reference, c[2]) in shared]
            ea = np.array([a[c] - a[(c[0], reference, c[2])] for c in paired])
            eb = np.array([b[c] - b[(c[0], reference, c[2])] for c in paired])
            if len(paired):
                effects = (
                    f"{ea.mean():+.4f}",
                    f"{eb.mean():+.4f}",
                    f"{int(np.sum(np.sign(ea) == np.sign(eb)))} of {len(paired)}",
                )
        rows.append([m, str(len(cells)), diff.mean(), diff.max(), *(effects or ("-", "-", "-"))])
    header = [
        "method",
        "cells",
        "mean abs. dAUC",
        "max abs. dAUC",
        f"effect, {Path(run).name}",
        f"effect, {Path(other).name}",
        "same sign",
    ]
    return markdown_table(header, rows)


def tests_table(summary: dict) -> str:
    """metric | Friedman p | Nemenyi CD, for AUC and GM."""
    rows = [
        [k.upper(), _fmt(summary[f"friedman_p_{k}"], 4), _fmt(summary[f"nemenyi_cd_{k}"], 2)]
        for k in ("auc", "gm")
    ]
    return markdown_table(["metric", "Friedman p", "Nemenyi CD"], rows)


def results_tables(run: str | Path) -> dict[str, str]:
    """Every table of a run by name: ``methods``, ``tests``, ``auc_by_scenario``, ``gm_by_scenario``,
    ``accuracy_by_scenario`` (multi-class runs), ``site_weight:site-1`` (the first site's mean
    aggregation weight),
    and with FedAvg in the run ``effects``, ``effects:SCENARIO``, ``seeds_above_fedavg`` and
    ``effects_over_seeds:final`` / ``effects_over_seeds:last_k`` (each effect with its 95% interval over
    seeds and the random-effects estimate across scenarios, recomputed from ``results.csv``)."""
    run = Path(run)
    summary = json.loads((run / SUMMARY_JSON).read_text())
    results = pd.read_csv(run / RESULTS_CSV)
    methods, scenarios = summary["methods"], summary["scenarios"]
    tables = {
        "methods": methods_table(summary, results),
        "tests": tests_table(summary),
        "auc_by_scenario": _scenario_table(final_table(results, "auc", methods, scenarios)),
        "gm_by_scenario": _scenario_table(final_table(results, "gm", methods, scenarios)),
    }
    accuracy = final_table(results, "accuracy", methods, scenarios)
    if accuracy.notna().any().any():  # multi-class runs: AUC saturates long before accuracy does
        tables["accuracy_by_scenario"] = _scenario_table(accuracy)
    tables["site_weight:site-1"] = site_weight_table(results, methods, scenarios, "site-1")
    if summary.get("effect_vs_fedavg"):
        tables["effects"] = effect_overview_table(summary)
        tables["seeds_above_fedavg"] = seeds_above_table(results, methods, scenarios)
        tables.update({f"effects:{sc}": effect_scenario_table(summary, sc) for sc in scenarios})
        seeds = seed_statistics(results, methods, scenarios)["effect_vs_fedavg_seeds"]
        tables.update({f"effects_over_seeds:{e}": seed_effects_table(seeds[e], scenarios) for e in seeds})
    return tables


@dataclass(frozen=True)
class MarkedTable:
    """A Markdown table of a document and its marker: ``run``/``name``, or ``reason`` when none."""

    line: int
    run: str | None
    name: str | None
    reason: str | None
    text: str


def marked_tables(markdown: str) -> tuple[list[MarkedTable], list[int]]:
    """(the tables with a marker on the line before, the 1-based first lines of tables without one)."""
    lines = markdown.splitlines()
    marked, unmarked = [], []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        match = MARKER.match(lines[start - 1]) if start else None
        if match is None:
            unmarked.append(start + 1)
            continue
        text = "\n".join(lines[start:i])
        marked.append(MarkedTable(start + 1, match["run"], match["name"], match["reason"], text))
    return marked, unmarked


def check_document(path: str | Path, root: str | Path) -> list[str]:
    """Problems of a document's tables: an unmarked table, an unknown run or name, a table that differs
    from its rebuild (with the rebuilt text). Empty when every sourced table is verbatim its data."""
    path, root = Path(path), Path(root)
    marked, unmarked = marked_tables(path.read_text())
    problems = [f"{path.name}:{n}: table without a '<!-- table: ... -->' marker" for n in unmarked]
    built: dict[str, dict[str, str]] = {}
    for t in marked:
        if t.run is None:
            continue
        run = root / t.run
        if t.name.startswith("replicate:"):
            other = t.name.split(":", 1)[1]
            missing = [r for r in (t.run, other) if not (root / r / RESULTS_CSV).is_file()]
            if missing:
                problems.append(f"{path.name}:{t.line}: {', '.join(missing)} lacks {RESULTS_CSV}")
            elif (rebuilt := replicate_table(run, root / other)) != t.text:
                problems.append(f"{path.name}:{t.line}: {t.run} {t.name} differs; rebuilt:\n{rebuilt}")
            continue
        if (run / "plan.json").is_file():  # a confirmatory study's folder: its planned analysis
            if not (run / RESULTS_CSV).is_file():
                problems.append(f"{path.name}:{t.line}: {t.run} lacks {RESULTS_CSV} (the study has not run)")
                continue
            from fedweigh.bench.study import folder_tables

            tables = built.setdefault(t.run, folder_tables(run))
        elif not (run / SUMMARY_JSON).is_file() or not (run / RESULTS_CSV).is_file():
            problems.append(f"{path.name}:{t.line}: {t.run} lacks {SUMMARY_JSON} or {RESULTS_CSV}")
            continue
        else:
            tables = built.setdefault(t.run, results_tables(run))
        if t.name not in tables:
            problems.append(
                f"{path.name}:{t.line}: no table {t.name!r} in {t.run}; tables: {', '.join(tables)}"
            )
        elif tables[t.name] != t.text:
            problems.append(f"{path.name}:{t.line}: {t.run} {t.name} differs; rebuilt:\n{tables[t.name]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Print a run's tables, each under its marker; with ``--effects-plot PNG`` also draw its effects
    against FedAvg (:func:`fedweigh.bench.plots.plot_effects`) from its summary.json."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m fedweigh.bench.tables",
        description="Print the Markdown tables of a benchmark run (summary.json + results.csv).",
    )
    parser.add_argument("run", help="the run's directory (holding summary.json and results.csv)")
    parser.add_argument("--effects-plot", metavar="PNG", help="also draw the effects against FedAvg here")
    parser.add_argument(
        "--replicate", metavar="OTHER", help="also compare the cells this run shares with run OTHER"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    run = args.run.rstrip("/")
    for name, text in results_tables(run).items():
        print(f"<!-- table: {run} {name} -->\n{text}\n")
    if args.replicate:
        other = args.replicate.rstrip("/")
        print(f"<!-- table: {run} replicate:{other} -->\n{replicate_table(run, other)}\n")
    if args.effects_plot:
        from fedweigh.bench.plots import plot_effects

        summary = json.loads((Path(run) / SUMMARY_JSON).read_text())
        if not summary.get("effect_vs_fedavg"):
            print(f"{run}/{SUMMARY_JSON}: no effect_vs_fedavg (FedAvg not in the run)", file=sys.stderr)
            return 2
        title = f"{summary.get('dataset', Path(run).name)}: effects against FedAvg on test AUC"
        print(f"wrote {plot_effects(summary, args.effects_plot, title)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark's outputs: ``results.csv``, ``summary.json``, ``report.md`` and ``plots/``.

Scores compared across methods are the test metrics of the final global model (round T), averaged
over seeds. Average ranks and the Friedman / Nemenyi tests cover the federated methods only; the
references (``centralized``, ``local``) appear in the means and tables as points of comparison.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

import fedweigh.bench.curves as curves
import fedweigh.bench.plots as bp
from fedweigh.bench.cells import CELLS_DIR, load_cell_scores
from fedweigh.bench.effects import (
    ENDPOINTS,
    LAST_K,
    N_RESAMPLES,
    REFERENCE_METHOD,
    AgainstFedAvg,
    against_fedavg,
    endpoint_scores,
    paired_noise_floor,
    seed_effects,
    verdict,
)
from fedweigh.bench.stats import Comparison, compare
from fedweigh.io import atomic_write_json, atomic_write_text
from fedweigh.methods import REFERENCE_METHODS, parse_method
from fedweigh.plots import plot_client_weights

RESULTS_CSV = "results.csv"
SUMMARY_JSON = "summary.json"
REPORT_MD = "report.md"
PLOTS_DIR = "plots"
EFFECTS_PNG = "effects_vs_fedavg.png"

_TEST_METRICS = (
    "auc",
    "gm",
    "loss",
    "precision",
    "recall",
    "f1",
    "specificity",
    "accuracy",
    "balanced_accuracy",
)

#: results.csv columns: one row per (scenario, method, seed, round); test metrics unprefixed.
RESULT_COLUMNS: tuple[str, ...] = (
    "dataset",
    "scenario",
    "method",
    "seed",
    "round",
    *_TEST_METRICS,
    "val_auc",
    "val_gm",
    "train_loss",
    "weights",
    "scheme_values",
    "round_seconds",
    "worst_site_auc",
    "smallest_site_auc",
    "site_auc",
)

#: summary.json keys, exactly.
SUMMARY_KEYS: tuple[str, ...] = (
    "dataset",
    "profile",
    "methods",
    "scenarios",
    "seeds",
    "mean_auc",
    "mean_gm",
    "avg_rank_auc",
    "avg_rank_gm",
    "friedman_p_auc",
    "friedman_p_gm",
    "nemenyi_cd_auc",
    "nemenyi_cd_gm",
    "mean_gm_05",
    "effect_vs_fedavg",
    "wilcoxon_holm_p_auc",
    "effect_vs_fedavg_seeds",
    "interval_sources",
    "endpoint_last_k",
    "mean_auc_last_k",
    "mean_auc_common",
    "mean_auc_rare",
    "noise_floor_auc",
    "noise_floor_paired_auc",
    "plateau_reached",
    "plateau_tolerance_auc",
    "bootstrap_resamples",
    "stats_notes",
    "site_outcomes",
    "wall_seconds",
)

_OTHER_KEYS = ("val_auc", "val_gm", "train_loss", "round_seconds")


def _is_scheme_value(key: str) -> bool:
    return key not in ("round", "weights", "round_seconds") and not key.startswith(
        ("val_", "test_", "train_")
    )


def site_summary(record: dict) -> dict[str, float]:
    """A cell's per-hospital outcomes (:func:`fedweigh.bench.modes.site_outcomes`) as flat keys:
    ``site_auc/<site>``, ``worst_site_auc`` (the lowest) and ``smallest_site_auc`` (the site with the
    fewest train + val images; the first of a tie); {} for a cell stored without them."""
    aucs, sizes = record.get("site_auc"), record.get("site_images")
    if not aucs or not sizes:
        return {}
    finite = [v for v in aucs.values() if v is not None and math.isfinite(v)]
    smallest = min(sizes, key=lambda name: sizes[name])
    return {
        **{f"site_auc/{name}": float(v) for name, v in aucs.items()},
        "worst_site_auc": min(finite) if finite else float("nan"),
        "smallest_site_auc": float(aucs[smallest]),
    }


def results_frame(records: Sequence[dict]) -> pd.DataFrame:
    """One row per (scenario, method, seed, round) with the columns of :data:`RESULT_COLUMNS`; the
    final round's row carries the per-hospital outcomes (``site_auc`` as JSON {site: AUC})."""
    out = []
    for rec in records:
        sites = site_summary(rec)
        last = max(int(r["round"]) for r in rec["rows"]) if rec["rows"] else -1
        for row in rec["rows"]:
            item = {
                "dataset": rec["dataset"],
                "scenario": rec["scenario"],
                "method": rec["method"],
                "seed": int(rec["seed"]),
                "round": int(row["round"]),
            }
            item.update({m: row.get(f"test_{m}", np.nan) for m in _TEST_METRICS})
            item.update({k: row.get(k, np.nan) for k in _OTHER_KEYS})
            item["weights"] = json.dumps(row.get("weights", {}), sort_keys=True)
            item["scheme_values"] = json.dumps(
                {k: v for k, v in row.items() if _is_scheme_value(k)}, sort_keys=True
            )
            final = bool(sites) and int(row["round"]) == last
            item["worst_site_auc"] = sites["worst_site_auc"] if final else np.nan
            item["smallest_site_auc"] = sites["smallest_site_auc"] if final else np.nan
            item["site_auc"] = (
                json.dumps({k.split("/", 1)[1]: v for k, v in sites.items() if k.startswith("site_auc/")})
                if final
                else ""
            )
            out.append(item)
    return pd.DataFrame(out, columns=list(RESULT_COLUMNS))


def final_table(
    results: pd.DataFrame, metric: str, methods: Sequence[str], scenarios: Sequence[str]
) -> pd.DataFrame:
    """Scenarios x methods: the final round's ``metric`` averaged over seeds."""
    last = results["round"] == results.groupby(["scenario", "method", "seed"])["round"].transform("max")
    table = results[last].groupby(["scenario", "method"])[metric].mean().unstack("method")
    return table.reindex(index=list(scenarios), columns=list(methods)).astype(np.float64)


def _json_number(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _mean_by_method(table: pd.DataFrame) -> dict[str, float | None]:
    return {m: _json_number(table[m].mean()) for m in table.columns}


def compare_methods(config, results: pd.DataFrame) -> dict[str, Comparison]:
    """Ranks and tests of the federated methods on the final test AUC and GM."""
    ranked = [m for m in config.methods if parse_method(m).kind == "federated"]
    return {m: compare(final_table(results, m, ranked, list(config.scenarios))) for m in ("auc", "gm")}


def gm_05_table(against: AgainstFedAvg, methods: Sequence[str], scenarios: Sequence[str]) -> pd.DataFrame:
    """Scenarios x methods: GM at threshold 0.5 of the final model(s), averaged over seeds."""
    frame = pd.DataFrame(
        [(sc, m, s, v) for (sc, m, s), v in against.gm_05.items()],
        columns=["scenario", "method", "seed", "gm"],
    )
    table = (
        frame.groupby(["scenario", "method"])["gm"].mean().unstack("method") if len(frame) else pd.DataFrame()
    )
    return table.reindex(index=list(scenarios), columns=list(methods)).astype(np.float64)


def site_outcomes_summary(records: Sequence[dict], methods: Sequence[str], scenarios: Sequence[str]) -> dict:
    """summary.json's ``site_outcomes``: per method and scenario the means over seeds of the global
    test AUC (``auc``), ``worst_site_auc``, ``smallest_site_auc`` and each ``site_auc/<site>``, with
    ``seeds`` (cells that carry them); per method ``mean`` over the scenarios that have them."""
    out: dict[str, dict] = {}
    for m in methods:
        by_scenario: dict[str, dict] = {}
        for sc in scenarios:
            cells = [(r, site_summary(r)) for r in records if r["method"] == m and r["scenario"] == sc]
            cells = [(r, s) for r, s in cells if s]
            if not cells:
                continue
            keys = sorted({k for _, s in cells for k in s})
            entry = {"auc": _json_number(np.mean([r["rows"][-1].get("test_auc", np.nan) for r, _ in cells]))}
            entry.update({k: _json_number(np.nanmean([s.get(k, np.nan) for _, s in cells])) for k in keys})
            entry["seeds"] = len(cells)
            by_scenario[sc] = entry
        if by_scenario:
            mean = {
                k: _json_number(np.nanmean([np.nan if e[k] is None else e[k] for e in by_scenario.values()]))
                for k in ("auc", "worst_site_auc", "smallest_site_auc")
            }
            out[m] = {"mean": mean, **by_scenario}
    return out


#: What each interval of summary.json covers.
INTERVAL_SOURCES: dict[str, str] = {
    "effect_vs_fedavg": "test-set sampling only: paired bootstrap over the test images, seeds pooled",
    "effect_vs_fedavg_seeds": (
        "training noise included: per scenario a paired t interval over seeds of the per-seed "
        "differences; across scenarios a DerSimonian-Laird random-effects estimate"
    ),
}


def group_auc_table(
    against: AgainstFedAvg, methods: Sequence[str], scenarios: Sequence[str], group: int
) -> pd.DataFrame:
    """Scenarios x methods: common (``group`` 0) or rare (1) finding AUC of the final model(s),
    averaged over seeds."""
    frame = pd.DataFrame(
        [(sc, m, s, v[group]) for (sc, m, s), v in against.finding_groups.items()],
        columns=["scenario", "method", "seed", "auc"],
    )
    table = (
        frame.groupby(["scenario", "method"])["auc"].mean().unstack("method")
        if len(frame)
        else pd.DataFrame()
    )
    return table.reindex(index=list(scenarios), columns=list(methods)).astype(np.float64)


def seed_statistics(results: pd.DataFrame, methods: Sequence[str], scenarios: Sequence[str]) -> dict:
    """The seed-inclusive part of summary.json from the per-round results alone: ``effect_vs_fedavg_seeds``
    (per endpoint, :func:`fedweigh.bench.effects.seed_effects`; None without FedAvg),
    ``mean_auc_last_k`` and ``noise_floor_paired_auc`` (final round)."""
    scores = {e: endpoint_scores(results, e) for e in ENDPOINTS}
    last_k = scores["last_k"].groupby(["scenario", "method"]).mean().unstack("method")
    last_k = last_k.reindex(index=list(scenarios), columns=list(methods)).astype(np.float64)
    has_reference = REFERENCE_METHOD in methods
    return {
        "effect_vs_fedavg_seeds": {e: seed_effects(s, methods, scenarios) for e, s in scores.items()}
        if has_reference
        else None,
        "mean_auc_last_k": _mean_by_method(last_k),
        "noise_floor_paired_auc": {
            m: _json_number(v) for m, v in paired_noise_floor(scores["final"], methods, scenarios).items()
        }
        if has_reference
        else None,
    }


def build_summary(
    config,
    results: pd.DataFrame,
    comparisons: dict[str, Comparison],
    wall_seconds: float,
    against: AgainstFedAvg,
    n_resamples: int = N_RESAMPLES,
    records: Sequence[dict] = (),
) -> dict:
    """summary.json's content: exactly :data:`SUMMARY_KEYS` (``site_outcomes`` from ``records``)."""
    methods, scenarios = list(config.methods), list(config.scenarios)
    effects = against.effects
    seeds = seed_statistics(results, methods, scenarios)
    summary = {
        "dataset": config.dataset,
        "profile": config.profile,
        "methods": methods,
        "scenarios": scenarios,
        "seeds": [int(s) for s in config.seeds],
        "mean_auc": _mean_by_method(final_table(results, "auc", methods, scenarios)),
        "mean_gm": _mean_by_method(final_table(results, "gm", methods, scenarios)),
        "avg_rank_auc": {m: float(r) for m, r in comparisons["auc"].ranks.items()},
        "avg_rank_gm": {m: float(r) for m, r in comparisons["gm"].ranks.items()},
        "friedman_p_auc": comparisons["auc"].p,
        "friedman_p_gm": comparisons["gm"].p,
        "nemenyi_cd_auc": comparisons["auc"].cd,
        "nemenyi_cd_gm": comparisons["gm"].cd,
        "mean_gm_05": _mean_by_method(gm_05_table(against, methods, scenarios)),
        "effect_vs_fedavg": None
        if effects is None
        else {
            m: {sc: None if e is None else e.as_dict() for sc, e in by_sc.items()}
            for m, by_sc in effects.items()
        },
        "wilcoxon_holm_p_auc": against.wilcoxon_holm_p,
        "effect_vs_fedavg_seeds": seeds["effect_vs_fedavg_seeds"],
        "interval_sources": dict(INTERVAL_SOURCES),
        "endpoint_last_k": LAST_K,
        "mean_auc_last_k": seeds["mean_auc_last_k"],
        "mean_auc_common": _mean_by_method(group_auc_table(against, methods, scenarios, 0)),
        "mean_auc_rare": _mean_by_method(group_auc_table(against, methods, scenarios, 1)),
        "noise_floor_auc": against.noise_floor,
        "noise_floor_paired_auc": seeds["noise_floor_paired_auc"],
        "plateau_reached": against.plateau,
        "plateau_tolerance_auc": float(against.plateau_tol),
        "bootstrap_resamples": int(n_resamples),
        "stats_notes": dict(against.notes),
        "site_outcomes": site_outcomes_summary(records, methods, scenarios),
        "wall_seconds": float(wall_seconds),
    }
    assert tuple(summary) == SUMMARY_KEYS
    return summary


# -------------------------------------------------------------------------------------------- plots
def _weights_plots(config, scenario: str, by_cell: dict, plots: Path) -> list[Path]:
    """The client weights by round of each federated method on ``scenario`` (first seed)."""
    written: list[Path] = []
    first_seed = config.seeds[0]
    for method in config.methods:
        rec = by_cell[(scenario, method, first_seed)]
        weighted = [r for r in rec["rows"] if r.get("weights")]
        if parse_method(method).kind == "federated" and weighted:
            safe = method.replace(":", "_").replace(",", "_").replace("/", "_")
            written.append(
                plot_client_weights(
                    [r["round"] for r in weighted],
                    [r["weights"] for r in weighted],
                    plots / "weights" / scenario / f"{safe}.png",
                    title=f"{scenario} / {method} (seed {first_seed}): client weights",
                )
            )
    return written


def _score_curves(config, scenario: str, by_cell: dict, out: Path, thresholds: np.ndarray) -> dict:
    """From the stored test scores of ``scenario``'s cells, per method: the macro ROC (grid, mean TPR
    over seeds and models), the mean net benefit and, multi-class, the summed confusion matrix; with
    the net benefit of treating all and the class names."""
    roc, dca, conf, treat_all, class_names = {}, {}, {}, None, None
    for method in config.methods:
        tprs, nbs, mats = [], [], []
        for seed in config.seeds:
            rec = by_cell[(scenario, method, int(seed))]
            task, class_names = rec["task"], rec["class_names"]
            loaded = load_cell_scores(out / CELLS_DIR, rec["key"])
            if loaded is None:
                continue
            scores, labels = loaded
            for s in scores:  # one model (federated, centralized) or one per site (local)
                grid, tpr = curves.macro_roc(labels, s)
                tprs.append(tpr)
                nb = curves.net_benefit(labels, s, thresholds)
                nbs.append(nb["model"])
                treat_all = nb["treat_all"]
                if task == "multiclass":
                    mats.append(curves.confusion(labels, s))
        if tprs:
            roc[method] = (grid, np.mean(tprs, axis=0))
            dca[method] = np.mean(nbs, axis=0)
        if mats:
            conf[method] = np.sum(mats, axis=0)
    return {"roc": roc, "dca": dca, "confusion": conf, "treat_all": treat_all, "class_names": class_names}


def _curve_plots(
    scenario: str, found: dict, final_auc: pd.DataFrame, thresholds: np.ndarray, plots: Path
) -> list[Path]:
    """ROC and decision curves of ``scenario`` and, multi-class, its confusion matrices."""
    written: list[Path] = []
    if found["roc"]:
        auc = {m: float(final_auc.loc[scenario, m]) for m in found["roc"]}
        written.append(
            bp.plot_roc(
                found["roc"], plots / "roc" / f"{scenario}.png", f"{scenario}: macro ROC, final models", auc
            )
        )
        written.append(
            bp.plot_decision_curves(
                thresholds,
                found["dca"],
                found["treat_all"],
                plots / "dca" / f"{scenario}.png",
                f"{scenario}: decision curves",
            )
        )
    if found["confusion"]:
        written.append(
            bp.plot_confusion_matrices(
                found["confusion"],
                found["class_names"] or [],
                plots / "confusion" / f"{scenario}.png",
                f"{scenario}: confusion (row-normalised)",
            )
        )
    return written


def write_plots(
    config, records: Sequence[dict], results: pd.DataFrame, comparisons: dict, out: Path
) -> list[Path]:
    """Every figure under ``out/plots``; returns the written paths."""
    plots = out / PLOTS_DIR
    written: list[Path] = []
    for metric, comp in comparisons.items():
        if comp.pvalues is not None:
            title = f"{config.dataset}: critical difference, test {metric.upper()} (Nemenyi, alpha 0.05)"
            written.append(bp.plot_cd_diagram(comp, plots / f"cd_{metric}.png", title))
    references = [m for m in config.methods if parse_method(m).kind != "federated"]
    by_cell = {(r["scenario"], r["method"], int(r["seed"])): r for r in records}
    thresholds = np.round(np.arange(0.01, 1.0, 0.01), 2)
    final_auc = final_table(results, "auc", config.methods, config.scenarios)
    for scenario in config.scenarios:
        written.append(
            bp.plot_auc_by_round(results, scenario, plots / "auc_by_round" / f"{scenario}.png", references)
        )
        written += _weights_plots(config, scenario, by_cell, plots)
        found = _score_curves(config, scenario, by_cell, out, thresholds)
        written += _curve_plots(scenario, found, final_auc, thresholds, plots)
    return written


# ------------------------------------------------------------------------------------------ report
def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    return f"{x:.{digits}f}" if math.isfinite(x) else "-"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table (numbers formatted to 4 decimals)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(v if isinstance(v, str) else _fmt(v) for v in row) + " |")
    return "\n".join(lines)


def _scenario_table(table: pd.DataFrame) -> str:
    rows = [[sc, *table.loc[sc].tolist()] for sc in table.index]
    means = table.mean(axis=0)
    rows.append(["**mean**", *means.tolist()])
    return markdown_table(["scenario", *table.columns], rows)


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.4f}"


def _interval(low: float | None, high: float | None) -> str:
    return "-" if low is None or high is None else f"[{_signed(low)}, {_signed(high)}]"


def _seed_scenario_table(summary: dict, scenario: str, endpoint: str = "final") -> str:
    """method | effect | seed-paired 95% interval | verdict | 95% interval, test-set sampling only."""
    seeds = summary["effect_vs_fedavg_seeds"][endpoint]
    rows = []
    for method, by_scenario in summary["effect_vs_fedavg"].items():
        s = seeds.get(method, {}).get("scenarios", {}).get(scenario)
        e = by_scenario.get(scenario)
        rows.append(
            [
                method,
                _signed(s["mean"]) if s else _signed(e["mean"]) if e else "-",
                _interval(s["ci_low"], s["ci_high"]) if s else "-",
                verdict(s["ci_low"], s["ci_high"]) if s else "no evidence (< 2 seeds)",
                _interval(e["ci_low"], e["ci_high"]) if e else "-",
            ]
        )
    header = [
        "method",
        "effect",
        "95% interval over seeds",
        "verdict",
        "95% interval, test-set sampling only",
    ]
    return markdown_table(header, rows)


def effect_scenario_table(summary: dict, scenario: str) -> str:
    """One scenario's effects against FedAvg. With seed-paired intervals in the summary: method |
    effect | 95% interval over seeds | verdict (from that interval) | 95% interval, test-set sampling
    only; a summary without them (written before they existed): method | effect | 95% interval |
    excludes 0."""
    if summary.get("effect_vs_fedavg_seeds"):
        return _seed_scenario_table(summary, scenario)
    rows = []
    for method, by_scenario in summary["effect_vs_fedavg"].items():
        e = by_scenario.get(scenario)
        if e is None:
            rows.append([method, "-", "-", "-"])
            continue
        excludes = "yes" if e["ci_low"] > 0 or e["ci_high"] < 0 else "no"
        interval = f"[{_signed(e['ci_low'])}, {_signed(e['ci_high'])}]"
        rows.append([method, _signed(e["mean"]), interval, excludes])
    return markdown_table(["method", "effect", "95% interval", "excludes 0"], rows)


def within_noise_floor_line(summary: dict, scenario: str) -> str | None:
    """The line naming the scenario's effects with |effect| < noise floor; None without a noise floor.

    With paired floors in the summary (``noise_floor_paired_auc``) each method's effect is set against
    the seed SD of its own paired difference to FedAvg; otherwise against the raw AUC's seed SD."""
    paired = summary.get("noise_floor_paired_auc")
    if paired:
        within = [
            f"{m} ({paired[m]:.4f})"
            for m, by_scenario in summary["effect_vs_fedavg"].items()
            if by_scenario.get(scenario) is not None
            and paired.get(m) is not None
            and abs(by_scenario[scenario]["mean"]) < paired[m]
        ]
        if not within:
            return "- no effect lies within its paired noise floor"
        return f"- within the paired noise floor (|effect| < seed SD of the paired difference): {', '.join(within)}"
    floor = summary["noise_floor_auc"]
    if floor is None:
        return None
    within = [
        m
        for m, by_scenario in summary["effect_vs_fedavg"].items()
        if by_scenario.get(scenario) is not None and abs(by_scenario[scenario]["mean"]) < floor
    ]
    if not within:
        return f"- no effect lies within the noise floor ({floor:.4f})"
    return f"- within the noise floor (|effect| < {floor:.4f}): {', '.join(within)}"


def effect_overview_table(summary: dict) -> str:
    """Per method: mean effect over scenarios, scenarios above FedAvg, Wilcoxon-Holm p, plateau fraction."""
    pvalues, plateau = summary["wilcoxon_holm_p_auc"], summary["plateau_reached"]
    rows = []
    for method, by_scenario in summary["effect_vs_fedavg"].items():
        means = [e["mean"] for e in by_scenario.values() if e is not None]
        rows.append(
            [
                method,
                _signed(float(np.mean(means))) if means else "-",
                f"{sum(x > 0 for x in means)} of {len(means)}",
                _fmt(pvalues.get(method)) if method in pvalues else "not tested",
                _fmt(plateau.get(method), 2),
            ]
        )
    header = ["method", "mean effect", "scenarios above FedAvg", "Wilcoxon p (Holm)", "plateau reached"]
    seeds = summary.get("effect_vs_fedavg_seeds")
    if seeds:
        header += [
            "random-effects estimate [95%], final",
            "verdict",
            f"random-effects estimate [95%], last {summary.get('endpoint_last_k', LAST_K)}",
        ]
        for row in rows:
            pooled = {e: (seeds[e].get(row[0]) or {}).get("pooled") for e in ENDPOINTS}
            final, last = pooled["final"], pooled["last_k"]
            row += [
                f"{_signed(final['mean'])} {_interval(final['ci_low'], final['ci_high'])}" if final else "-",
                verdict(final["ci_low"], final["ci_high"]) if final else "no evidence (undefined)",
                f"{_signed(last['mean'])} {_interval(last['ci_low'], last['ci_high'])}" if last else "-",
            ]
    return markdown_table(header, rows)


def seeds_above_table(results: pd.DataFrame, methods: Sequence[str], scenarios: Sequence[str]) -> str:
    """Per method and scenario, in how many seeds its final test AUC is above FedAvg's ("k of n").

    The bootstrap interval covers the test images only; this counts how often a new seed (data,
    partition, initialisation, shuffles) keeps the sign of the effect.
    """
    last = results["round"] == results.groupby(["scenario", "method", "seed"])["round"].transform("max")
    final = results[last]

    def auc_of(method: str) -> pd.Series:
        return final[final["method"] == method].set_index(["scenario", "seed"])["auc"]

    reference = auc_of(REFERENCE_METHOD)
    rows = []
    for m in methods:
        if m == REFERENCE_METHOD:
            continue
        diff = (auc_of(m) - reference).dropna()
        by_scenario = [diff[diff.index.get_level_values("scenario") == sc] for sc in scenarios]
        cells = [f"{int((d > 0).sum())} of {len(d)}" for d in by_scenario]
        rows.append([m, *cells, f"{int((diff > 0).sum())} of {len(diff)}"])
    return markdown_table(["method", *scenarios, "all"], rows)


def seed_effects_table(effects: dict, scenarios: Sequence[str]) -> str:
    """Per method: each scenario's effect with its 95% interval over seeds, the random-effects estimate
    across scenarios with its interval, and the verdicts ("k of n" scenario intervals excluding 0).

    ``effects``: one endpoint of ``effect_vs_fedavg_seeds`` (:func:`fedweigh.bench.effects.seed_effects`).
    """

    def cell(e: dict | None) -> str:
        return "-" if e is None else f"{_signed(e['mean'])} {_interval(e['ci_low'], e['ci_high'])}"

    rows = []
    for method, by in effects.items():
        per = [by["scenarios"].get(sc) for sc in scenarios]
        verdicts = [verdict(e["ci_low"], e["ci_high"]) for e in per if e is not None]
        pooled = by["pooled"]
        rows.append(
            [
                method,
                *[cell(e) for e in per],
                cell(pooled),
                verdict(pooled["ci_low"], pooled["ci_high"]) if pooled else "no evidence",
                f"{sum(v != 'no evidence' for v in verdicts)} of {len(verdicts)}",
            ]
        )
    header = ["method", *scenarios, "random effects", "verdict", "scenarios excluding 0"]
    return markdown_table(header, rows)


def effect_tables(summary: dict) -> list[str]:
    """report.md's effects against FedAvg, from summary.json alone: per scenario the effect on test AUC
    with its bootstrap interval and a line naming the effects within the noise floor; per method the
    Wilcoxon-Holm p and the plateau fraction."""
    effects, floor = summary["effect_vs_fedavg"], summary["noise_floor_auc"]
    notes = summary["stats_notes"]
    lines = ["## Test AUC against FedAvg", ""]
    if effects is None:
        return [*lines, f"Not computed: {notes.get('effect_vs_fedavg', 'no FedAvg cells')}.", ""]
    if summary.get("effect_vs_fedavg_seeds"):
        lines += [
            "Effect = method's final test AUC - FedAvg's, mean over the per-seed differences. **95% interval "
            "over seeds** (training noise included): paired t interval of the per-seed differences; the "
            "verdict (better / worse / no evidence) comes from it. Across scenarios: DerSimonian-Laird "
            f"random-effects estimate, at the final round and over the last {summary['endpoint_last_k']} "
            f"scored rounds. The last column covers **test-set sampling only** ({summary['bootstrap_resamples']} "
            "paired bootstrap resamples of the test images, seeds pooled). Paired noise floor: a method's "
            "seed SD of its difference to FedAvg, mean over scenarios.",
            "",
        ]
    else:
        lines += [
            f"Effect = method's test AUC - FedAvg's, mean over seeds; 95% interval from "
            f"{summary['bootstrap_resamples']} paired bootstrap resamples of the test images. Noise floor "
            + (
                f"(standard deviation of the final test AUC across seeds, mean over scenarios and methods): "
                f"{floor:.4f}."
                if floor is not None
                else f"not computed: it {notes.get('noise_floor_auc', 'is undefined')}."
            ),
            "",
        ]
    for scenario in summary["scenarios"]:
        lines += [f"### {scenario}", "", effect_scenario_table(summary, scenario), ""]
        line = within_noise_floor_line(summary, scenario)
        if line is not None:
            lines += [line, ""]
    plateau = summary["plateau_reached"]
    lines += [
        "### Across scenarios",
        "",
        effect_overview_table(summary),
        "",
        f"Plateau reached: fraction of the method's cells whose test AUC gained less than "
        f"{summary['plateau_tolerance_auc']:.4f} over the last third of the rounds (FedAvg: "
        f"{_fmt(plateau.get(REFERENCE_METHOD), 2)}).",
        "",
    ]
    return lines


def _settings_lines(config, records: Sequence[dict], summary: dict, task: str) -> list[str]:
    """report.md's title and settings: scenarios, methods, seeds, local training, thresholds, wall time."""
    methods, scenarios = list(config.methods), list(config.scenarios)
    c = config.client
    cell_seconds = [float(r.get("seconds", 0.0)) for r in records]
    return [
        f"# fedweigh bench: {config.dataset}, profile {config.profile}",
        "",
        f"- scenarios ({len(scenarios)}): {', '.join(scenarios)}",
        f"- methods ({len(methods)}): {', '.join(methods)}",
        f"- seeds: {', '.join(str(s) for s in config.seeds)}; rounds: {config.rounds}"
        + (f"; sites: {', '.join(config.sites)}" if config.sites else ""),
        f"- local training (every method): {c.arch} ({c.norm} norm), {c.size} px, "
        f"{'all' if c.num_images is None else c.num_images} images, {c.epochs} epoch(s) of batch "
        f"{c.batch_size}, at most {c.max_steps if c.max_steps is not None else 'unlimited'} steps, "
        f"{c.optimizer} lr {c.lr}; losses: BCE/CE, except FedBB (PNB) and DAFL (DAFL loss)",
        "- thresholded test metrics (GM, precision, recall, F1, specificity): "
        + (
            "per-finding Youden's J on the sites' validation splits"
            if config.threshold == "youden" and task == "multilabel"
            else "arg-max"
            if task == "multiclass"
            else "sigmoid >= 0.5"
        ),
        f"- wall time: {summary['wall_seconds']:.0f} s this invocation; cells: {len(records)}, "
        f"{sum(cell_seconds):.0f} s of cell compute, {np.mean(cell_seconds) if cell_seconds else 0:.1f} s per cell",
        "",
        "Scores are test metrics of the final global model (round T), averaged over seeds; `local` is the "
        "mean over sites of each site's own model. Ranks and tests cover the federated methods.",
        "",
    ]


def _headline_lines(methods: Sequence[str], summary: dict, comparisons: dict) -> list[str]:
    """report.md's headline: the best average AUC rank, the Friedman tests, the gap to centralized."""
    lines = ["## Headline", ""]
    ranked = [m for m in methods if m in summary["avg_rank_auc"]]
    if ranked:
        best = min(ranked, key=lambda m: summary["avg_rank_auc"][m])
        lines.append(f"- best average AUC rank: **{best}** ({summary['avg_rank_auc'][best]:.2f})")
    for metric in ("auc", "gm"):
        comp: Comparison = comparisons[metric]
        p, cd = summary[f"friedman_p_{metric}"], summary[f"nemenyi_cd_{metric}"]
        if p is None:
            lines.append(f"- {metric.upper()}: {comp.note}")
        else:
            verdict = "significant" if p < 0.05 else "not significant"
            lines.append(
                f"- {metric.upper()}: Friedman p = {p:.4g} ({verdict} at 0.05), Nemenyi CD = {_fmt(cd, 3)}"
            )
    fed_means = {m: summary["mean_auc"][m] for m in ranked if summary["mean_auc"].get(m) is not None}
    central = summary["mean_auc"].get("centralized")
    if fed_means and central is not None:
        best_fed = max(fed_means, key=fed_means.get)
        lines.append(
            f"- best federated mean AUC: {best_fed} {fed_means[best_fed]:.4f}; centralized {central:.4f} "
            f"(gap {central - fed_means[best_fed]:+.4f})"
        )
    return lines


def _score_table_lines(
    results: pd.DataFrame, summary: dict, methods: Sequence[str], scenarios: Sequence[str], task: str
) -> list[str]:
    """report.md's per-method table (every test metric, GM at 0.5, ranks) and the per-scenario AUC and GM."""
    lines = ["## Per method (mean over scenarios and seeds, final round)", ""]
    metrics = ["auc", "gm", "precision", "recall", "f1", "specificity"]
    if task == "multiclass":
        metrics += ["accuracy", "balanced_accuracy"]
    per_method = {m: final_table(results, m, methods, scenarios).mean(axis=0) for m in metrics}
    header = ["method", *metrics, "gm@0.5", "rank AUC", "rank GM"]
    rows = []
    for m in methods:
        rows.append(
            [
                m,
                *[per_method[k][m] for k in metrics],
                summary["mean_gm_05"].get(m),
                summary["avg_rank_auc"].get(m, "-"),
                summary["avg_rank_gm"].get(m, "-"),
            ]
        )
    lines += [markdown_table(header, rows), ""]
    for metric in ("auc", "gm"):
        lines += [
            f"## Test {metric.upper()} per scenario",
            "",
            _scenario_table(final_table(results, metric, methods, scenarios)),
            "",
        ]
    return lines


def site_outcome_lines(summary: dict) -> list[str]:
    """report.md's per-hospital outcomes: per method the global test AUC next to the worst site's
    and the smallest site's (each on a test set weighted to that site's label mix), means over
    scenarios and seeds; [] when no cell carries them."""
    outcomes = summary.get("site_outcomes") or {}
    if not outcomes:
        return []
    rows = [
        (m, _fmt(o["mean"]["auc"]), _fmt(o["mean"]["worst_site_auc"]), _fmt(o["mean"]["smallest_site_auc"]))
        for m, o in outcomes.items()
    ]
    return [
        "### Per-hospital outcomes",
        "",
        "Each site's AUC on the test set weighted to its own label mix (and its own scanner's images "
        "where the test set is mixed by site): does a method help the small hospital or the "
        "federation as a whole? Means over scenarios and seeds; per scenario and site in summary.json "
        "(`site_outcomes`).",
        "",
        markdown_table(("method", "global AUC", "worst site AUC", "smallest site AUC"), rows),
        "",
    ]


def _nemenyi_lines(comparisons: dict) -> list[str]:
    """report.md's Nemenyi p-value matrices (AUC, GM) where the comparison has them."""
    lines: list[str] = []
    for metric in ("auc", "gm"):
        comp = comparisons[metric]
        if comp.pvalues is None:
            continue
        lines += [f"## Nemenyi p-values, {metric.upper()}", ""]
        names = list(comp.pvalues.columns)
        lines += [markdown_table(["", *names], [[n, *comp.pvalues.loc[n].tolist()] for n in names]), ""]
    return lines


def _figure_lines(plots: list[Path], out: Path) -> list[str]:
    """report.md's figures: the headline ones shown, the others linked."""
    if not plots:
        return []
    lines = ["## Figures", ""]
    for path in plots:
        rel = path.relative_to(out).as_posix()
        if rel.startswith((f"{PLOTS_DIR}/cd_", f"{PLOTS_DIR}/auc_by_round/", f"{PLOTS_DIR}/{EFFECTS_PNG}")):
            lines.append(f"![{rel}]({rel})")
        else:
            lines.append(f"- [{rel}]({rel})")
    lines.append("")
    return lines


def _note_lines(config, summary: dict, comparisons: dict, task: str) -> list[str]:
    """report.md's notes: why a statistic is missing, what the run could not compute, the references."""
    notes = [comparisons[m].note for m in ("auc", "gm") if comparisons[m].note]
    notes += [f"{key} is null: {why}" for key, why in summary["stats_notes"].items()]
    if config.threshold != "youden" and task == "multilabel":
        notes.append(
            "GM at Youden thresholds is not available for this run: the thresholds come from validation "
            "predictions, which the cells do not store (run with --threshold youden)"
        )
    refs = [m for m in config.methods if m in REFERENCE_METHODS]
    if refs:
        notes.append(f"references {', '.join(refs)} are not ranked")
    if not notes:
        return []
    return ["## Notes", "", *[f"- {n}" for n in dict.fromkeys(notes)], ""]


def write_report(
    config,
    records: Sequence[dict],
    results: pd.DataFrame,
    summary: dict,
    comparisons: dict,
    plots: list[Path],
    out: Path,
) -> Path:
    """report.md: settings, the headline, per-method and per-scenario tables, tests, and the figures."""
    methods, scenarios = list(config.methods), list(config.scenarios)
    task = records[0]["task"] if records else "multilabel"
    lines = _settings_lines(config, records, summary, task)
    lines += _headline_lines(methods, summary, comparisons)
    lines += ["", *_score_table_lines(results, summary, methods, scenarios, task)]
    lines += effect_tables(summary)
    if summary["effect_vs_fedavg"] and len(config.seeds) > 1:
        lines += [
            "### Seeds above FedAvg",
            "",
            "In how many seeds the method's final test AUC is above FedAvg's (the interval above covers the "
            "test images; this, a new draw of data, partition, initialisation and shuffles).",
            "",
            seeds_above_table(results, methods, scenarios),
            "",
        ]
    lines += site_outcome_lines(summary)
    lines += _nemenyi_lines(comparisons)
    lines += _figure_lines(plots, out)
    lines += _note_lines(config, summary, comparisons, task)
    return atomic_write_text(out / REPORT_MD, "\n".join(lines), private=False)


def write_outputs(
    config,
    records: Sequence[dict],
    out: str | Path,
    start: float,
    n_resamples: int = N_RESAMPLES,
    jobs: int = 1,
) -> dict:
    """Write results.csv, plots, summary.json and report.md into ``out``; returns the summary.

    ``start`` is the ``time.perf_counter()`` value at the start of the run (for ``wall_seconds``);
    ``n_resamples``: bootstrap resamples per (scenario, seed) of the effects against FedAvg;
    ``jobs``: processes that score the stored cells (bootstrap, GM at 0.5) in parallel.
    """
    out = Path(out)
    results = results_frame(records)
    atomic_write_text(out / RESULTS_CSV, results.to_csv(index=False), private=False)
    comparisons = compare_methods(config, results)
    against = against_fedavg(
        config.methods, config.scenarios, config.seeds, records, out / CELLS_DIR, n_resamples, jobs=jobs
    )
    plots = write_plots(config, records, results, comparisons, out)
    summary = build_summary(
        config, results, comparisons, time.perf_counter() - start, against, n_resamples, records
    )
    atomic_write_json(out / SUMMARY_JSON, summary, private=False, indent=1)
    if summary["effect_vs_fedavg"]:
        title = f"{config.dataset}: effects against FedAvg on test AUC"
        plots.insert(0, bp.plot_effects(summary, out / PLOTS_DIR / EFFECTS_PNG, title))
    write_report(config, records, results, summary, comparisons, plots, out)
    return summary

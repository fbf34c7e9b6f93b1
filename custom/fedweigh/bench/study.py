"""A pre-registered confirmatory study: the plan (``plan.json``), its power calculation, the run and the
planned analysis.

The plan names the claims (method vs reference), the methods with their defaults, the scenarios, the
fresh seeds, the primary endpoint and the test. Everything here reads the plan; nothing is chosen
after the run.

- **Measured paired SD** (``measured_paired_sd``): from committed runs (their ``results.csv``), per
  method, the paired seed-to-seed SD of its endpoint difference to the reference, pooled over the
  runs' scenarios as sqrt(mean_i sd_i^2); and the between-scenario variance tau^2 of its effect
  (DerSimonian-Laird over the run's scenarios, mean over runs).
- **Power** (``power_analysis``): per claim, the power of the pooled random-effects test at
  ``delta`` with the plan's seeds and scenarios (:func:`fedweigh.bench.stats.pooled_power`), at the
  Bonferroni level alpha / m (the first and strictest step of Holm's procedure over m claims), and
  the seeds per scenario that reach the target power. A claim without a measured SD (a pair never
  run side by side) takes the plan's ``unmeasured_sd_quantile`` of the measured SDs and tau^2 = 0;
  its power is then an upper bound as far as scenarios differ in effect.
- **Cost**: core-seconds per cell, the larger of a run's wall time x cores / cells and its mean
  summed round time, maximised over the runs; the study's wall time is cells x that / cores.
- **Analysis** (``analyse``): per claim and scenario the paired t interval over seeds of the primary
  endpoint's difference; across scenarios the DerSimonian-Laird estimate with its interval and p;
  Holm's correction over the claims; verdict ``better`` / ``worse`` when the Holm-adjusted p is below
  alpha (by the estimate's sign), ``no evidence`` otherwise. The Hartung-Knapp interval (a check for
  few scenarios) and the secondary endpoint (final round) are reported beside it, not tested.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from fedweigh.bench.effects import ENDPOINTS, REFERENCE_METHOD, endpoint_scores, seed_effects
from fedweigh.bench.report import markdown_table
from fedweigh.bench.stats import (
    holm,
    paired_t_power,
    pooled_power,
    seeds_for_power,
)

__all__ = [
    "CLAIMS_MD",
    "POWER_JSON",
    "STUDY_SUMMARY_JSON",
    "Claim",
    "Plan",
    "analyse",
    "claims_table",
    "load_plan",
    "main",
    "measured_paired_sd",
    "outcomes",
    "outcomes_table",
    "plan_config",
    "power_analysis",
    "power_table",
    "run_study",
    "write_analysis",
]

POWER_JSON = "power.json"
PLAN_JSON = "plan.json"
CLAIMS_MD = "claims.md"
STUDY_SUMMARY_JSON = "summary.json"
#: Test outcomes of a claim.
VERDICTS = ("better", "worse", "no evidence")


@dataclass(frozen=True)
class Claim:
    """``method`` against ``reference`` (both method labels of the plan), with a one-line statement."""

    id: str
    method: str
    reference: str
    statement: str


@dataclass(frozen=True)
class Plan:
    """What the study runs and how it is analysed (see docs/results/study/PLAN.md)."""

    dataset: str
    profile: str
    methods: tuple[str, ...]
    scenarios: tuple[str, ...]
    seeds: tuple[int, ...]
    claims: tuple[Claim, ...]
    primary_endpoint: str = "last_k"
    secondary_endpoint: str = "final"
    alpha: float = 0.05
    delta: float = 0.01
    target_power: float = 0.8
    rounds: int | None = None
    eval_every: int | None = None
    client: dict = field(default_factory=dict)
    cores: int = 2
    unmeasured_sd_quantile: float = 0.75

    @property
    def cells(self) -> int:
        return len(self.methods) * len(self.scenarios) * len(self.seeds)


def _field(raw: dict, name: str, source: str, kind: type | tuple[type, ...]):
    if name not in raw:
        raise ValueError(f"{source}: missing field {name!r}")
    value = raw[name]
    if not isinstance(value, kind):
        raise ValueError(f"{source}: field {name!r} must be {kind}, got {value!r}")
    return value


def load_plan(path: str | Path) -> Plan:
    """The :class:`Plan` in a JSON file; ValueError naming the file and the bad field."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON plan ({e})") from None
    src = str(path)
    methods = tuple(_field(raw, "methods", src, list))
    claims = []
    for i, c in enumerate(_field(raw, "claims", src, list)):
        where = f"{src}: claims[{i}]"
        claim = Claim(
            str(_field(c, "id", where, str)),
            str(_field(c, "method", where, str)),
            str(_field(c, "reference", where, str)),
            str(_field(c, "statement", where, str)),
        )
        for side in (claim.method, claim.reference):
            if side not in methods:
                raise ValueError(f"{where}: {side!r} is not among the plan's methods {list(methods)}")
        claims.append(claim)
    if len({c.id for c in claims}) != len(claims):
        raise ValueError(f"{src}: two claims share an id")
    endpoints = {
        k: raw.get(k, d) for k, d in (("primary_endpoint", "last_k"), ("secondary_endpoint", "final"))
    }
    for k, v in endpoints.items():
        if v not in ENDPOINTS:
            raise ValueError(f"{src}: field {k!r} must be one of {ENDPOINTS}, got {v!r}")
    return Plan(
        dataset=str(_field(raw, "dataset", src, str)),
        profile=str(_field(raw, "profile", src, str)),
        methods=methods,
        scenarios=tuple(_field(raw, "scenarios", src, list)),
        seeds=tuple(int(s) for s in _field(raw, "seeds", src, list)),
        claims=tuple(claims),
        alpha=float(raw.get("alpha", 0.05)),
        delta=float(raw.get("delta", 0.01)),
        target_power=float(raw.get("target_power", 0.8)),
        rounds=raw.get("rounds"),
        eval_every=raw.get("eval_every"),
        client=dict(raw.get("client", {})),
        cores=int(raw.get("cores", 2)),
        unmeasured_sd_quantile=float(raw.get("unmeasured_sd_quantile", 0.75)),
        **endpoints,
    )


def plan_config(plan: Plan):
    """The :class:`fedweigh.bench.config.BenchConfig` that runs exactly the plan's cells. The committed
    plan ran before the sites' statistics release was the default, with exact label statistics: its
    cells keep that setting (and their cache keys), so the study reproduces as planned."""
    from fedweigh.bench.config import make_config

    return make_config(
        plan.profile,
        plan.dataset,
        exact_statistics=True,
        methods=plan.methods,
        scenarios=plan.scenarios,
        seeds=plan.seeds,
        rounds=plan.rounds,
        eval_every=plan.eval_every,
        **plan.client,
    )


# --------------------------------------------------------------------------------------- power
def _run_dataset(run: Path) -> str | None:
    summary = run / "summary.json"
    return json.loads(summary.read_text()).get("dataset") if summary.is_file() else None


def measured_paired_sd(
    runs: Sequence[str | Path], reference: str = "fedavg", endpoint: str = "last_k"
) -> dict[str, dict]:
    """Per method of the runs: ``sd`` (paired seed SD of its difference to ``reference``, pooled as
    sqrt of the mean variance over every run's scenarios), ``tau2`` (DerSimonian-Laird between-scenario
    variance, mean over runs), ``scenarios`` (how many (run, scenario) pairs) and ``runs``."""
    variances: dict[str, list[float]] = {}
    taus: dict[str, list[float]] = {}
    sources: dict[str, list[str]] = {}
    for run in map(Path, runs):
        results = pd.read_csv(run / "results.csv")
        scores = endpoint_scores(results, endpoint)
        methods = list(dict.fromkeys(results["method"]))
        scenarios = list(dict.fromkeys(results["scenario"]))
        if reference not in methods:
            continue
        effects = seed_effects(scores, methods, scenarios, reference)
        for m, e in effects.items():
            per = [s for s in e["scenarios"].values() if s is not None]
            if not per:
                continue
            variances.setdefault(m, []).extend(s["sd"] ** 2 for s in per)
            if e["pooled"] is not None:
                taus.setdefault(m, []).append(e["pooled"]["tau2"])
            sources.setdefault(m, []).append(run.as_posix())
    return {
        m: {
            "sd": float(math.sqrt(np.mean(v))),
            "tau2": float(np.mean(taus.get(m, [0.0]))),
            "scenarios": len(v),
            "runs": sources[m],
        }
        for m, v in variances.items()
    }


def cell_seconds(runs: Sequence[str | Path], cores: int = 2) -> dict:
    """Core-seconds per cell of each run (the larger of wall x ``cores`` / cells and the mean summed
    round time per cell) and their maximum, the planning figure."""
    per_run = {}
    for run in map(Path, runs):
        results = pd.read_csv(run / "results.csv")
        summary = json.loads((run / "summary.json").read_text())
        cells = results.groupby(["scenario", "method", "seed"])
        wall = float(summary["wall_seconds"]) * cores / cells.ngroups
        train = float(cells["round_seconds"].sum().mean())
        per_run[run.as_posix()] = {"cells": cells.ngroups, "wall_per_cell": wall, "rounds_per_cell": train}
    planning = max(max(r["wall_per_cell"], r["rounds_per_cell"]) for r in per_run.values())
    return {"runs": per_run, "planning_core_seconds_per_cell": planning}


def power_analysis(plan: Plan, runs: Sequence[str | Path]) -> dict:
    """power.json: the measured SDs (primary endpoint), per claim the SD and tau^2 used, the power of
    the pooled test with the plan's seeds, the seeds that reach the target power, the power of one
    scenario's paired t test, and the study's cost."""
    runs = [Path(r) for r in runs if _run_dataset(Path(r)) == plan.dataset]
    if not runs:
        raise ValueError(f"no committed run of dataset {plan.dataset!r} among the runs given")
    measured = measured_paired_sd(runs, "fedavg", plan.primary_endpoint)
    sds = [v["sd"] for v in measured.values()]
    unmeasured_sd = float(np.quantile(sds, plan.unmeasured_sd_quantile))
    m = len(plan.claims)
    alpha_claim = plan.alpha / m
    n, s = len(plan.seeds), len(plan.scenarios)
    claims = {}
    for c in plan.claims:
        data = measured.get(c.method) if c.reference == "fedavg" else None
        sd = data["sd"] if data else unmeasured_sd
        tau2 = data["tau2"] if data else 0.0
        claims[c.id] = {
            "method": c.method,
            "reference": c.reference,
            "sd": sd,
            "tau2": tau2,
            "sd_source": "measured"
            if data
            else f"quantile {plan.unmeasured_sd_quantile} of the measured SDs (pair not measured; tau^2 = 0)",
            "power": pooled_power(plan.delta, sd, tau2, n, s, alpha_claim),
            "power_tau2_zero": pooled_power(plan.delta, sd, 0.0, n, s, alpha_claim),
            "seeds_needed": seeds_for_power(plan.delta, sd, tau2, s, alpha_claim, plan.target_power),
            "seeds_needed_tau2_zero": seeds_for_power(plan.delta, sd, 0.0, s, alpha_claim, plan.target_power),
            "power_one_scenario_3_seeds": paired_t_power(plan.delta, sd, 3, plan.alpha),
        }
    cost = cell_seconds(runs, plan.cores)
    per_cell = cost["planning_core_seconds_per_cell"]
    return {
        "endpoint": plan.primary_endpoint,
        "delta": plan.delta,
        "alpha": plan.alpha,
        "alpha_per_claim": alpha_claim,
        "target_power": plan.target_power,
        "seeds": n,
        "scenarios": s,
        "measured": measured,
        "measured_sd_range": [min(sds), max(sds)],
        "unmeasured_sd": unmeasured_sd,
        "claims": claims,
        "cost": {
            **cost,
            "cells": plan.cells,
            "cores": plan.cores,
            "wall_seconds": plan.cells * per_cell / plan.cores,
        },
    }


def _num(x: float | None, digits: int = 4) -> str:
    return "-" if x is None or not math.isfinite(float(x)) else f"{float(x):.{digits}f}"


def power_table(power: dict) -> str:
    """PLAN.md's power table from power.json: per claim the SD and tau^2 used, power with the plan's
    seeds (measured tau^2, and tau^2 = 0), seeds needed for the target power."""
    rows = []
    for cid, c in power["claims"].items():
        rows.append(
            [
                cid,
                f"{c['method']} vs {c['reference']}",
                f"{_num(c['sd'])} ({'measured' if c['sd_source'] == 'measured' else 'assumed'})",
                _num(math.sqrt(c["tau2"])),
                _num(c["power"], 2),
                _num(c["power_tau2_zero"], 2),
                "-" if c["seeds_needed"] is None else str(c["seeds_needed"]),
                "-" if c["seeds_needed_tau2_zero"] is None else str(c["seeds_needed_tau2_zero"]),
                _num(c["power_one_scenario_3_seeds"], 2),
            ]
        )
    header = [
        "claim",
        "comparison",
        "paired SD",
        "tau",
        f"power, {power['seeds']} seeds",
        "power, tau = 0",
        "seeds for 80%",
        "seeds for 80%, tau = 0",
        "power, 1 scenario x 3 seeds",
    ]
    return markdown_table(header, rows)


# ------------------------------------------------------------------------------------- analysis
def analyse(plan: Plan, results: pd.DataFrame, power: dict | None = None) -> dict:
    """The planned analysis of the study's per-round results (``results.csv``): per claim the primary
    endpoint's per-scenario seed intervals, the random-effects estimate, raw and Holm-adjusted p,
    verdict, the planned power, and the secondary endpoint's estimate."""
    found = set(results["method"])
    missing = [m for m in plan.methods if m not in found]
    if missing:
        raise ValueError(f"the study's results lack the plan's method(s) {missing}")
    scores = {e: endpoint_scores(results, e) for e in {plan.primary_endpoint, plan.secondary_endpoint}}
    per_claim: dict[str, dict] = {}
    for c in plan.claims:
        out = {"method": c.method, "reference": c.reference, "statement": c.statement}
        for role, endpoint in (("primary", plan.primary_endpoint), ("secondary", plan.secondary_endpoint)):
            effects = seed_effects(scores[endpoint], [c.reference, c.method], plan.scenarios, c.reference)
            out[role] = {"endpoint": endpoint, **effects[c.method]}
        per_claim[c.id] = out
    raw = {
        cid: None if c["primary"]["pooled"] is None else c["primary"]["pooled"]["p"]
        for cid, c in per_claim.items()
    }
    adjusted = holm(raw)
    for cid, c in per_claim.items():
        pooled = c["primary"]["pooled"]
        c["p"], c["p_holm"] = raw[cid], adjusted[cid]
        significant = adjusted[cid] is not None and adjusted[cid] < plan.alpha
        c["verdict"] = ("better" if pooled["mean"] > 0 else "worse") if significant else "no evidence"
        c["planned_power"] = None if power is None else power["claims"][cid]["power"]
    return {
        "outcomes": outcomes(plan, results),
        "plan": {
            "dataset": plan.dataset,
            "profile": plan.profile,
            "methods": list(plan.methods),
            "scenarios": list(plan.scenarios),
            "seeds": list(plan.seeds),
            "primary_endpoint": plan.primary_endpoint,
            "secondary_endpoint": plan.secondary_endpoint,
            "alpha": plan.alpha,
            "correction": "holm",
        },
        "claims": per_claim,
    }


#: Per-hospital outcomes of the final model (results.csv columns, on the final round's row).
SITE_OUTCOMES = ("worst_site_auc", "smallest_site_auc")


def outcomes(plan: Plan, results: pd.DataFrame) -> dict:
    """Reported beside the claims, not tested (no correction, no verdict): per method its mean over the
    plan's scenarios and seeds of the primary and secondary endpoints and of the per-hospital outcomes
    (the worst site's and the smallest site's test AUC of the final model); and, for every method but
    the reference (FedAvg; without it the plan's first method), the paired difference to it of each per-hospital
    outcome, pooled over scenarios as the claims are (per-scenario paired t over seeds, then
    DerSimonian-Laird)."""
    reference = REFERENCE_METHOD if REFERENCE_METHOD in plan.methods else plan.methods[0]
    keys = ["scenario", "method", "seed"]
    last = results["round"] == results.groupby(keys)["round"].transform("max")
    final = results[last].set_index(keys).sort_index()
    scores = {e: endpoint_scores(results, e) for e in (plan.primary_endpoint, plan.secondary_endpoint)}
    for col in SITE_OUTCOMES:
        scores[col] = final[col].astype(np.float64) if col in final else pd.Series(np.nan, index=final.index)

    def mean_of(series: pd.Series, method: str) -> float | None:
        values = series.xs(method, level="method").to_numpy(dtype=np.float64)
        values = values[np.isfinite(values)]
        return float(values.mean()) if values.size else None

    out: dict[str, dict] = {}
    for m in plan.methods:
        out[m] = {"means": {name: mean_of(s, m) for name, s in scores.items()}, "vs_reference": {}}
    for col in SITE_OUTCOMES:
        effects = seed_effects(scores[col], plan.methods, plan.scenarios, reference)
        for m, e in effects.items():
            out[m]["vs_reference"][col] = e["pooled"]
    return {"reference": reference, "methods": out}


def outcomes_table(analysis: dict) -> str:
    """One row per method: mean primary and final-round AUC, worst-site and smallest-site AUC, and the
    pooled paired difference of the last two to the reference with its 95% interval over seeds."""
    o = analysis["outcomes"]
    rows = []
    for m, v in o["methods"].items():
        means = list(v["means"].values())
        diffs = []
        for col in SITE_OUTCOMES:
            e = v["vs_reference"].get(col)
            diffs.append("-" if e is None else f"{e['mean']:+.4f} [{e['ci_low']:+.4f}, {e['ci_high']:+.4f}]")
        rows.append([m, *(_num(x) for x in means), *diffs])
    ref = o["reference"]
    header = [
        "method",
        "macro AUC (primary)",
        "macro AUC (final round)",
        "worst site AUC",
        "smallest site AUC",
        f"worst site vs {ref} [95% over seeds]",
        f"smallest site vs {ref} [95% over seeds]",
    ]
    return markdown_table(header, rows)


def claims_table(analysis: dict) -> str:
    """One row per claim: effect and 95% interval over seeds (random effects, primary endpoint), Holm p,
    planned power, verdict, and the final round's estimate."""
    rows = []
    for cid, c in analysis["claims"].items():
        p, s = c["primary"]["pooled"], c["secondary"]["pooled"]
        rows.append(
            [
                cid,
                f"{c['method']} vs {c['reference']}",
                "-" if p is None else f"{p['mean']:+.4f}",
                "-" if p is None else f"[{p['ci_low']:+.4f}, {p['ci_high']:+.4f}]",
                _num(c["p_holm"]),
                _num(c["planned_power"], 2),
                c["verdict"],
                "-"
                if p is None or p["ci_low_hk"] is None
                else f"[{p['ci_low_hk']:+.4f}, {p['ci_high_hk']:+.4f}]",
                "-" if s is None else f"{s['mean']:+.4f} [{s['ci_low']:+.4f}, {s['ci_high']:+.4f}]",
            ]
        )
    header = [
        "claim",
        "comparison",
        "effect",
        "95% interval over seeds (random effects)",
        "p (Holm)",
        "power (planned)",
        "verdict",
        "Hartung-Knapp 95% (sensitivity)",
        "final round: effect [95%]",
    ]
    return markdown_table(header, rows)


def scenario_table(analysis: dict, claim: str) -> str:
    """One claim's per-scenario effects: scenario | effect | 95% interval over seeds | seeds | p."""
    rows = []
    for sc, e in analysis["claims"][claim]["primary"]["scenarios"].items():
        rows.append(
            [
                sc,
                "-" if e is None else f"{e['mean']:+.4f}",
                "-" if e is None else f"[{e['ci_low']:+.4f}, {e['ci_high']:+.4f}]",
                "-" if e is None else str(e["n_seeds"]),
                "-" if e is None else _num(e["p"]),
            ]
        )
    return markdown_table(["scenario", "effect", "95% interval over seeds", "seeds", "p (t test)"], rows)


def study_tables(analysis: dict) -> dict[str, str]:
    """Every table of the study by name: ``claims``, ``claim:ID`` (per scenario) and ``outcomes``
    (per method, not tested)."""
    return (
        {"claims": claims_table(analysis)}
        | {f"claim:{cid}": scenario_table(analysis, cid) for cid in analysis["claims"]}
        | {"outcomes": outcomes_table(analysis)}
    )


def folder_tables(folder: str | Path) -> dict[str, str]:
    """The tables of a committed study folder (plan.json, results.csv, power.json when there), rebuilt
    by the planned analysis from its per-round results: what a document's study tables must equal."""
    folder = Path(folder)
    power_file = folder / POWER_JSON
    power = json.loads(power_file.read_text()) if power_file.is_file() else None
    plan = load_plan(folder / PLAN_JSON)
    return study_tables(analyse(plan, pd.read_csv(folder / "results.csv"), power))


def claims_markdown(analysis: dict) -> str:
    """claims.md: the claims table and each claim's per-scenario table, each under a marker."""
    lines = ["# Confirmatory study: claims", ""]
    for name, table in study_tables(analysis).items():
        lines += [f"<!-- table: {name} -->", table, ""]
    return "\n".join(lines)


def write_analysis(plan: Plan, run_dir: str | Path, out_dir: str | Path, power: dict | None = None) -> dict:
    """Analyse ``run_dir/results.csv`` as planned; write ``out_dir``/summary.json, claims.md and a copy of
    the per-round results.csv; returns the analysis."""
    from fedweigh.io import atomic_write_json, atomic_write_text

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    results = pd.read_csv(run_dir / "results.csv")
    analysis = analyse(plan, results, power)
    if (run_dir / "summary.json").is_file():
        bench = json.loads((run_dir / "summary.json").read_text())
        analysis["wall_seconds"] = bench.get("wall_seconds")
        analysis["secondary_metrics"] = {
            k: bench.get(k) for k in ("mean_auc", "mean_auc_last_k", "mean_auc_common", "mean_auc_rare")
        }
    analysis["time"] = study_time(run_dir)
    if run_dir.resolve() != out_dir.resolve():
        atomic_write_text(out_dir / "results.csv", results.to_csv(index=False), private=False)
    atomic_write_json(out_dir / STUDY_SUMMARY_JSON, analysis, private=False, indent=1)
    atomic_write_text(out_dir / CLAIMS_MD, claims_markdown(analysis), private=False)
    return analysis


INVOCATIONS = "study_invocations.jsonl"


def study_time(work_dir: str | Path) -> dict | None:
    """How long the study took, across the invocations it took (a run stopped and resumed): per
    invocation of ``run`` (its start, from ``study_invocations.jsonl``) the cells written before the next
    one started, and its wall time up to the last of them (an invocation that wrote none counts 0 s, so
    a rerun that finds every cell cached adds nothing); their sum; and the cells' own training seconds summed (parallel
    jobs overlap, so that sum exceeds the wall time). None without an invocation log."""
    import datetime as dt

    work_dir = Path(work_dir)
    log = work_dir / INVOCATIONS
    if not log.is_file():
        return None
    starts = sorted(json.loads(line)["started"] for line in log.read_text().splitlines() if line.strip())
    cells = [
        (f.stat().st_mtime, float(json.loads(f.read_text()).get("seconds") or 0.0))
        for f in sorted((work_dir / "cells").glob("*.json"))
    ]
    invocations = []
    for i, start in enumerate(starts):
        end_limit = starts[i + 1] if i + 1 < len(starts) else math.inf
        written = [m for m, _ in cells if start <= m < end_limit]
        invocations.append(
            {
                "started": dt.datetime.fromtimestamp(start, dt.timezone.utc).isoformat(timespec="seconds"),
                "cells": len(written),
                "wall_seconds": round(max(written) - start if written else 0.0, 1),
            }
        )
    return {
        "invocations": invocations,
        "wall_seconds": round(sum(i["wall_seconds"] for i in invocations), 1),
        "cell_seconds": round(sum(sec for _, sec in cells), 1),
        "cells": len(cells),
    }


def run_study(
    plan: Plan, work_dir: str | Path, out_dir: str | Path, jobs: int = 1, progress: bool = True
) -> dict:
    """Run the plan's cells with the bench runner in ``work_dir`` (its cell cache: a rerun resumes
    after an interruption), then the planned analysis into ``out_dir``."""
    from fedweigh.bench.runner import run_bench

    power_file = Path(out_dir) / POWER_JSON
    power = json.loads(power_file.read_text()) if power_file.is_file() else None
    import time

    from fedweigh.io import atomic_write_text

    log = Path(work_dir) / INVOCATIONS  # the study's time across interruptions: one line per invocation
    before = log.read_text() if log.is_file() else ""
    atomic_write_text(log, before + json.dumps({"started": time.time(), "jobs": jobs}) + "\n", private=False)
    run_bench(plan_config(plan), work_dir, jobs=jobs, progress=progress)
    return write_analysis(plan, work_dir, out_dir, power)


def main(argv: list[str] | None = None) -> int:
    """``power``: write power.json from committed runs; ``run``: the study's cells then its analysis;
    ``analyse``: the analysis of a finished run."""
    import argparse
    import sys

    from fedweigh.io import atomic_write_json

    parser = argparse.ArgumentParser(prog="benchmarks/study.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("power", help="the power calculation from committed runs")
    p.add_argument("--plan", required=True)
    p.add_argument(
        "--runs", nargs="+", required=True, help="committed run folders (results.csv, summary.json)"
    )
    p.add_argument("--out", required=True, help="power.json to write")
    r = sub.add_parser("run", help="run the plan's cells (resumable), then the planned analysis")
    r.add_argument("--plan", required=True)
    r.add_argument("--work", required=True, help="the bench's output folder (cells cache; reused to resume)")
    r.add_argument("--out", required=True, help="where summary.json, claims.md and results.csv go")
    r.add_argument("--jobs", type=int, default=2)
    a = sub.add_parser("analyse", help="the planned analysis of a finished run")
    a.add_argument("--plan", required=True)
    a.add_argument("--run", required=True)
    a.add_argument("--out", required=True)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        plan = load_plan(args.plan)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "power":
        power = power_analysis(plan, args.runs)
        atomic_write_json(Path(args.out), power, private=False, indent=1)
        print(power_table(power))
        print(f"cells {plan.cells}, about {power['cost']['wall_seconds'] / 3600:.2f} h on {plan.cores} cores")
        return 0
    if args.command == "run":
        analysis = run_study(plan, args.work, args.out, jobs=args.jobs)
    else:
        power_file = Path(args.out) / POWER_JSON
        power = json.loads(power_file.read_text()) if power_file.is_file() else None
        analysis = write_analysis(plan, args.run, args.out, power)
    print(claims_table(analysis))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The confirmatory study: its plan, the power calculation rebuilt from the committed runs, the planned
analysis on a synthetic results table with known effects, every table rebuilt from committed data,
and (slow) a tiny run of the driver end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.meta_analysis import combine_effects
from statsmodels.stats.multitest import multipletests

from fedweigh.bench.study import (
    analyse,
    claims_markdown,
    load_plan,
    main,
    power_analysis,
    power_table,
    study_tables,
)

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "docs" / "results" / "study"
PLAN = STUDY / "plan.json"


# ------------------------------------------------------------------------------------------ plan
def test_the_committed_plan_loads_and_names_its_claims_methods():
    plan = load_plan(PLAN)
    assert len(plan.claims) == 8 and plan.cells == 8 * 4 * 7
    assert {"uniform", "feddraw-nosim", "feddraw-noanneal", "fedbb-paper"} <= set(plan.methods)
    assert plan.primary_endpoint == "last_k" and plan.secondary_endpoint == "final"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p.pop("seeds"), "missing field 'seeds'"),
        (lambda p: p["claims"][0].update(reference="fedprox"), "claims[0]: 'fedprox' is not among"),
        (lambda p: p.update(primary_endpoint="best"), "field 'primary_endpoint' must be one of"),
        (lambda p: p["claims"][1].update(id="C1"), "two claims share an id"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_file_and_field(tmp_path, edit, message):
    raw = json.loads(PLAN.read_text())
    edit(raw)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_plan(path)
    assert str(path) in str(info.value)


def _committed_seeds() -> set[int]:
    seeds: set[int] = set()
    for csv in (ROOT / "docs" / "results").rglob("results.csv"):
        if csv.parent == STUDY:  # the study's own run
            continue
        seeds |= set(pd.read_csv(csv, usecols=["seed"])["seed"].astype(int))
    for js in (ROOT / "docs" / "results").rglob("*.json"):
        if js.parent == STUDY:
            continue
        for match in re.finditer(r'"seeds?": \[?([0-9, \n]+)', js.read_text()):
            seeds |= {int(s) for s in re.findall(r"\d+", match.group(1))}
    return seeds


def test_the_plans_seeds_were_never_used_by_a_committed_run():
    """No committed run but the study's own uses one of its seeds (runs added after the plan take other
    fresh seeds, e.g. the backbone grid's 2000-2001)."""
    used = _committed_seeds()
    assert used and {0, 1, 2} <= used
    assert not used & set(load_plan(PLAN).seeds), sorted(used & set(load_plan(PLAN).seeds))


# ----------------------------------------------------------------------------------------- power
RUNS = [
    ROOT / "docs" / "results" / r
    for r in ("standard-synthcxr", "standard-synthcxr-baselines", "standard-synthcxr-8-scenarios")
]


def test_power_json_is_rebuilt_from_the_committed_runs(monkeypatch):
    committed = json.loads((STUDY / "power.json").read_text())
    monkeypatch.chdir(ROOT)  # power.json names the runs relative to the repository
    rebuilt = json.loads(json.dumps(power_analysis(load_plan(PLAN), [r.relative_to(ROOT) for r in RUNS])))
    assert _close(rebuilt, committed)


def _close(a, b) -> bool:
    """Equal up to float rounding, recursively (a clear assertion error on the first difference)."""
    if isinstance(a, dict):
        assert set(a) == set(b), set(a) ^ set(b)
        return all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        assert len(a) == len(b)
        return all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)
        return True
    assert a == b
    return True


def test_plan_md_shows_power_json_verbatim():
    power = json.loads((STUDY / "power.json").read_text())
    text = (STUDY / "PLAN.md").read_text()
    assert f"<!-- table: power -->\n{power_table(power)}\n" in text
    wall = power["cost"]["wall_seconds"]
    assert f"**{wall:,.0f} s ({wall / 3600:.2f} h) on 2 CPU cores**" in text
    per_run = [max(r["wall_per_cell"], r["rounds_per_cell"]) for r in power["cost"]["runs"].values()]
    assert f"{min(per_run):.0f} s on one machine, {max(per_run):.0f} s on the other" in text
    assert f"{power['cost']['cells']} cells x {power['cost']['planning_core_seconds_per_cell']:.0f} s" in text
    tau0 = [c["power_tau2_zero"] for c in power["claims"].values()]
    assert f"{min(tau0):.2f}-{max(tau0):.2f}" in text
    three = [c["power_one_scenario_3_seeds"] for c in power["claims"].values()]
    assert f"{100 * min(three):.0f}-{100 * max(three):.0f}% power" in text
    assert f"alpha 0.05 / 8 = {power['alpha_per_claim']}" in text
    assert power["claims"]["C1"]["power"] >= 0.8  # the plan's seeds reach the target where measured


# -------------------------------------------------------------------------- analysis, synthetic
def _synthetic(plan, rng: np.random.Generator) -> pd.DataFrame:
    """Per-round results of the plan's cells: AUC = base(scenario, seed) + effect(method) + noise,
    scored at rounds 0, 10, 20, 25, 30; the smallest site's AUC 0.1 lower, 0.02 higher with ``uniform``."""
    offsets = {m: 0.0 for m in plan.methods} | {"feddraw": 0.03, "fedbb-cbr": -0.03}
    small_site = {m: 0.0 for m in plan.methods} | {"uniform": 0.02}  # equal weights help the small site
    site_rng = np.random.default_rng(
        rng.bit_generator.seed_seq.entropy + 1
    )  # leaves rng's draws as they were
    rows = []
    for sc in plan.scenarios:
        for seed in plan.seeds:
            base = 0.75 + rng.normal(0, 0.02)
            for m in plan.methods:
                for t in (0, 10, 20, 25, 30):
                    auc = 0.5 if t == 0 else base + offsets[m] + rng.normal(0, 0.004)
                    # per-hospital outcomes on the final round's row only, as the bench writes them
                    small = base - 0.1 + small_site[m] + site_rng.normal(0, 0.004) if t == 30 else np.nan
                    worst = min(small, auc - 0.02) if t == 30 else np.nan
                    rows.append((plan.dataset, sc, m, seed, t, auc, worst, small))
    columns = ["dataset", "scenario", "method", "seed", "round", "auc", "worst_site_auc", "smallest_site_auc"]
    return pd.DataFrame(rows, columns=columns)


def test_planned_analysis_on_a_synthetic_table_with_known_effects():
    plan = load_plan(PLAN)
    results = _synthetic(plan, np.random.default_rng(0))
    analysis = analyse(plan, results)
    claims = analysis["claims"]
    assert claims["C1"]["verdict"] == "better"  # feddraw +0.03 over fedavg
    assert claims["C3"]["verdict"] == "worse"  # fedbb-cbr -0.03 against uniform
    assert claims["C8"]["verdict"] == "no evidence"  # uniform = fedavg
    assert claims["C6"]["verdict"] == "better"
    # C1 by hand: per scenario the mean of the last three scored rounds, paired over seeds, pooled by DL
    last = results[results["round"] >= 20].groupby(["scenario", "method", "seed"])["auc"].mean()
    y, v = [], []
    for sc in plan.scenarios:
        d = (last[sc]["feddraw"] - last[sc]["fedavg"]).to_numpy()
        y.append(d.mean())
        v.append(stats.sem(d) ** 2)
        low, high = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
        got = claims["C1"]["primary"]["scenarios"][sc]
        assert (got["ci_low"], got["ci_high"]) == pytest.approx((low, high), abs=1e-12)
    ref = combine_effects(np.array(y), np.array(v), method_re="dl", use_t=False)
    # equal true effects: Q < k - 1, so DerSimonian-Laird's tau^2 is truncated at 0 and the estimate is
    # the fixed-effect one (statsmodels leaves its tau^2 estimate negative here)
    assert ref.tau2 <= 0 and claims["C1"]["primary"]["pooled"]["tau2"] == 0.0
    assert claims["C1"]["primary"]["pooled"]["mean"] == pytest.approx(ref.mean_effect_fe, abs=1e-12)
    # Holm over all claims
    p = [claims[c]["p"] for c in claims]
    assert [claims[c]["p_holm"] for c in claims] == pytest.approx(list(multipletests(p, method="holm")[1]))
    # the secondary endpoint is the final round
    final = results[results["round"] == 30].set_index(["scenario", "method", "seed"])["auc"]
    d = final["noisy-large"]["feddraw"] - final["noisy-large"]["fedavg"]
    assert claims["C1"]["secondary"]["scenarios"]["noisy-large"]["mean"] == pytest.approx(d.mean())


def test_per_hospital_outcomes_are_reported_beside_the_claims_against_fedavg():
    """Reported, not tested: each method's mean endpoints and worst / smallest site AUC, and the paired
    difference of the site outcomes to FedAvg pooled over scenarios as the claims are."""
    plan = load_plan(PLAN)
    results = _synthetic(plan, np.random.default_rng(3))
    out = analyse(plan, results)["outcomes"]
    assert out["reference"] == "fedavg" and list(out["methods"]) == list(plan.methods)
    final = results[results["round"] == 30]
    for m in ("fedavg", "uniform", "fedbb-cbr"):
        means = out["methods"][m]["means"]
        rows = final[final["method"] == m]
        assert means["smallest_site_auc"] == pytest.approx(rows["smallest_site_auc"].mean(), abs=1e-12)
        assert means["worst_site_auc"] == pytest.approx(rows["worst_site_auc"].mean(), abs=1e-12)
        assert means["final"] == pytest.approx(rows["auc"].mean(), abs=1e-12)
    assert out["methods"]["fedavg"]["vs_reference"] == {}
    small = out["methods"]["uniform"]["vs_reference"]["smallest_site_auc"]
    assert small["ci_low"] > 0.01 and small["ci_high"] < 0.03  # the +0.02 built in, and nothing else
    same = out["methods"]["feddraw-nosim"]["vs_reference"]["smallest_site_auc"]
    assert abs(same["mean"]) < 0.005  # no built-in difference: noise only
    # one scenario's paired t interval by hand feeds the pooled estimate
    by = final.set_index(["scenario", "method", "seed"])["smallest_site_auc"]
    d = (by["rare-small"]["uniform"] - by["rare-small"]["fedavg"]).to_numpy()
    pooled_inputs = [(by[sc]["uniform"] - by[sc]["fedavg"]).to_numpy() for sc in plan.scenarios]
    ref = combine_effects(
        np.array([x.mean() for x in pooled_inputs]),
        np.array([stats.sem(x) ** 2 for x in pooled_inputs]),
        method_re="dl",
        use_t=False,
    )
    fe_or_re = ref.mean_effect_re if ref.tau2 > 0 else ref.mean_effect_fe
    assert small["mean"] == pytest.approx(fe_or_re, abs=1e-12)
    assert d.size == len(plan.seeds)
    table = study_tables(analyse(plan, results))["outcomes"]
    assert (
        "| uniform | " in table
        and f"{small['mean']:+.4f} [{small['ci_low']:+.4f}, {small['ci_high']:+.4f}]" in table
    )


def test_analysis_refuses_results_without_a_planned_method():
    plan = load_plan(PLAN)
    results = _synthetic(plan, np.random.default_rng(1))
    with pytest.raises(ValueError, match="feddraw-nosim"):
        analyse(plan, results[results["method"] != "feddraw-nosim"])


def test_analyse_command_writes_the_tables_that_rebuild_from_its_files(tmp_path):
    plan = load_plan(PLAN)
    run = tmp_path / "run"
    run.mkdir()
    _synthetic(plan, np.random.default_rng(2)).to_csv(run / "results.csv", index=False)
    out = tmp_path / "study"
    assert main(["analyse", "--plan", str(PLAN), "--run", str(run), "--out", str(out)]) == 0
    _assert_study_rebuilds(out, plan)


def test_a_documents_study_tables_are_rebuilt_by_the_planned_analysis(tmp_path):
    """A ``<!-- table: FOLDER claims -->`` marker on a study folder (it holds plan.json) ties a document's
    table to the study's results.csv: verbatim passes, one changed figure is named with its rebuild."""
    from fedweigh.bench.tables import check_document

    plan = load_plan(PLAN)
    folder = tmp_path / "docs" / "results" / "study"
    folder.mkdir(parents=True)
    (folder / "plan.json").write_text(PLAN.read_text())
    doc = tmp_path / "results.md"
    doc.write_text("<!-- table: docs/results/study claims -->\n| a |\n|---|\n")
    assert check_document(doc, tmp_path) == [
        "results.md:2: docs/results/study lacks results.csv (the study has not run)"
    ]
    _synthetic(plan, np.random.default_rng(5)).to_csv(folder / "results.csv", index=False)
    tables = study_tables(analyse(plan, pd.read_csv(folder / "results.csv")))
    text = "\n\n".join(
        f"<!-- table: docs/results/study {name} -->\n{tables[name]}" for name in ("claims", "claim:C1")
    )
    doc.write_text(text + "\n")
    assert check_document(doc, tmp_path) == []
    effect = re.search(r"\| C1 \| feddraw vs fedavg \| ([+-]\d\.\d{4}) \|", text)[1]
    changed = text.replace(f"| C1 | feddraw vs fedavg | {effect} |", "| C1 | feddraw vs fedavg | +9.9999 |")
    doc.write_text(changed + "\n")
    problems = check_document(doc, tmp_path)
    assert len(problems) == 1 and problems[0].startswith("results.md:2: docs/results/study claims differs")


def _assert_study_rebuilds(out: Path, plan) -> None:
    """claims.md and summary.json of a study folder are rebuilt verbatim from its results.csv."""
    summary = json.loads((out / "summary.json").read_text())
    power = json.loads((out / "power.json").read_text()) if (out / "power.json").is_file() else None
    rebuilt = analyse(plan, pd.read_csv(out / "results.csv"), power)
    assert _close(json.loads(json.dumps(rebuilt["claims"])), summary["claims"])
    text = (out / "claims.md").read_text()
    assert text == claims_markdown(rebuilt)
    assert set(study_tables(rebuilt)) == {"claims", "outcomes", *(f"claim:{c}" for c in rebuilt["claims"])}


def test_every_committed_study_table_rebuilds_from_its_data():
    """Once the study has run, its committed tables are rebuilt from its committed results.csv; until
    then the plan says it has no result yet."""
    plan = load_plan(PLAN)
    if (STUDY / "results.csv").is_file():
        _assert_study_rebuilds(STUDY, plan)
    else:
        assert "Status: **running, no result yet**" in (STUDY / "PLAN.md").read_text()
        assert not (STUDY / "claims.md").exists() and not (STUDY / "summary.json").exists()


# --------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_a_tiny_study_runs_end_to_end_and_resumes(tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(
        json.dumps(
            {
                "dataset": "synthcxr",
                "profile": "smoke",
                "methods": ["fedavg", "feddraw"],
                "scenarios": ["label-a0.5"],
                "seeds": [1000, 1001],
                "rounds": 1,
                "client": {"num_images": 160},
                "claims": [{"id": "C1", "method": "feddraw", "reference": "fedavg", "statement": "tiny"}],
            }
        )
    )
    work, out = tmp_path / "work", tmp_path / "out"
    args = ["run", "--plan", str(plan_file), "--work", str(work), "--out", str(out), "--jobs", "1"]
    assert main(args) == 0
    _assert_study_rebuilds(out, load_plan(plan_file))
    cells = sorted((work / "cells").glob("*.json"))
    assert len(cells) == 4
    stamps = [c.stat().st_mtime_ns for c in cells]
    assert main(args) == 0  # a rerun reuses every stored cell
    assert [c.stat().st_mtime_ns for c in cells] == stamps


def test_the_plan_runs_exactly_its_cells_or_names_a_method_not_yet_in_the_catalogue():
    from fedweigh.bench.study import plan_config
    from fedweigh.methods import ALL_METHODS, VARIANTS

    plan = load_plan(PLAN)
    missing = [m for m in plan.methods if m not in (*ALL_METHODS, *VARIANTS)]
    if missing:
        with pytest.raises(ValueError, match=f"unknown method '{missing[0]}'"):
            plan_config(plan)
        return
    config = plan_config(plan)
    assert sorted(config.cells()) == sorted(
        (sc, m, s) for sc in plan.scenarios for m in plan.methods for s in plan.seeds
    )
    assert config.profile == "standard" and config.rounds == 30 and config.eval_every == 5
    assert config.exact_statistics  # as the committed study ran: before the release was the default


def test_the_studys_time_adds_up_its_invocations(tmp_path):
    """Two invocations (a run that stopped, one that resumed it): each owns the cells written before the
    next started and ends with the last of them; one that found nothing left to run adds 0 s."""
    import os

    from fedweigh.bench.study import INVOCATIONS, study_time

    assert study_time(tmp_path) is None
    cells = tmp_path / "cells"
    cells.mkdir()
    (tmp_path / INVOCATIONS).write_text(
        "".join(json.dumps({"started": t, "jobs": 2}) + "\n" for t in (1000.0, 5000.0, 9000.0))
    )
    for name, mtime, seconds in (("a", 1500.0, 400.0), ("b", 2600.0, 900.0), ("c", 5900.0, 800.0)):
        (cells / f"{name}.json").write_text(json.dumps({"seconds": seconds}))
        os.utime(cells / f"{name}.json", (mtime, mtime))
    t = study_time(tmp_path)
    assert [(i["cells"], i["wall_seconds"]) for i in t["invocations"]] == [(2, 1600.0), (1, 900.0), (0, 0.0)]
    assert t["wall_seconds"] == 2500.0 and t["cell_seconds"] == 2100.0 and t["cells"] == 3
    assert t["invocations"][1]["started"] == "1970-01-01T01:23:20+00:00"

"""docs/security.md's attack, honest-cost and trade-off tables are the benchmarks' own output for the
JSON files committed in docs/results/security/, and each file's summary is what its rows give."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "security"
DOC = ROOT / "docs" / "security.md"
SETTINGS = ("deploy", "robust", "hardened")


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _record(setting: str) -> dict:
    return json.loads((RESULTS / f"attacks-{setting}.json").read_text())


@pytest.mark.parametrize("setting", SETTINGS)
def test_each_attack_table_is_the_benchmarks_output_for_its_committed_run(setting):
    attacks = _load("bench_attacks")
    record = _record(setting)
    assert record["complete"] and record["settings"]["safeguards"] == setting
    assert attacks.markdown_table(record) in DOC.read_text()


@pytest.mark.parametrize("setting", SETTINGS)
def test_each_runs_summary_is_what_its_rows_give(setting):
    """The last line (tried, crashed or stalled, worst drops) recomputed from the rows, without the
    benchmark's own summarise: one site, two colluders and HE apart."""
    record = _record(setting)
    rows = record["attacks"]

    def worst(selected):
        drops = [r["auc_drop"] for r in selected if r["completed"] and r["auc_drop"] == r["auc_drop"]]
        return round(max(drops), 4) if drops else None

    plain = [r for r in rows if not r["he"]]
    assert record["summary"] == {
        "tried": len(rows),
        "crashed_or_stalled": sum(bool(r["crashed_or_stalled"]) for r in rows),
        "worst_auc_drop_one_site": worst([r for r in plain if len(r["attackers"]) == 1]),
        "worst_auc_drop_two_colluders": worst([r for r in plain if len(r["attackers"]) == 2]),
        "worst_auc_drop_he": worst([r for r in rows if r["he"]]),
    }
    assert len(rows) >= 30 and sum(r["he"] for r in rows) >= 1


def test_the_honest_cost_and_trade_off_tables_are_the_benchmarks_output():
    cost = _load("bench_safeguard_cost")
    record = json.loads((RESULTS / "safeguard-cost.json").read_text())
    text = DOC.read_text()
    assert cost.markdown(record) in text
    assert cost.tradeoff_table(record, {s: _record(s) for s in SETTINGS}) in text


def test_the_trade_off_table_reads_not_run_for_a_setting_without_its_run():
    cost = _load("bench_safeguard_cost")
    record = json.loads((RESULTS / "safeguard-cost.json").read_text())
    table = cost.tradeoff_table(record, {"deploy": _record("deploy")})
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert "not run" in rows["robust"] and "not run" not in rows["deploy"]
    table = cost.tradeoff_table(record, {"hardened": _record("hardened")})
    assert table.splitlines()[-1].startswith("| hardened | not run |")


def test_the_round_time_figures_in_the_docs_are_the_committed_runs():
    record = json.loads((ROOT / "docs" / "results" / "round-time" / "round-time.json").read_text())
    text = " ".join(DOC.read_text().split())
    each = " and ".join(f"{r:.3f}" for r in record["round_time"]["ratio_per_repeat"])
    assert f"took {each} times a stock FedAvg round" in text
    assert f"ratio of the medians {record['round_time']['ratio_of_medians']:.3f}" in text
    server = record["server"]["server_seconds_10_densenet121"]
    assert (
        f"FedDRAW {server['feddraw']:.3f} s" in text
        and f"FedAvg's weights and aggregate {server['fedavg']:.3f} s" in text
    )

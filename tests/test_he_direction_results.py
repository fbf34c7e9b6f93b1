"""The committed measurement of the HE direction check (docs/results/he-direction/he_direction.json):
its summary and table are what benchmarks/bench_he_direction.py rebuilds from its runs, and they back
the bound the guard ships with."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from fedweigh.site.he_guard import DIRECTION_BOUND, TREND_DECAY

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "he-direction"
_spec = importlib.util.spec_from_file_location(
    "bench_he_direction", ROOT / "benchmarks" / "bench_he_direction.py"
)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_he_direction"] = bench
_spec.loader.exec_module(bench)


def record() -> dict:
    return json.loads((RESULTS / "he_direction.json").read_text())


def test_the_summary_and_table_are_rebuilt_from_the_runs():
    data = record()
    assert bench.summarize(data) == data["summary"]
    assert bench.markdown_table(data) in (RESULTS / "README.md").read_text()


def test_the_shipped_bound_is_the_measured_one_and_refuses_no_honest_round():
    data = record()
    settings = data["settings"]
    assert settings["direction_bound"] == DIRECTION_BOUND and settings["trend_decay"] == TREND_DECAY
    honest = data["summary"]["honest"]
    assert honest["runs"] == len(data["honest"]) + len(data["honest-long"]) > 0
    assert honest["rounds_refused"] == 0
    assert honest["judged"]["min"] > DIRECTION_BOUND  # every honest site-round above the bound
    assert {r["scenario"] for r in data["honest"]} == {s for s, _ in bench.HONEST}


def test_the_negated_and_tripled_update_is_refused_with_the_check_and_not_without():
    """Refused in every round with the check (the sites keep the initial model: the attack is named,
    its damage not undone while it goes on), accepted without it."""
    rows = {(r["scenario"], r["factor"]): r for r in record()["summary"]["attacks"]}
    iid = rows[("iid-4", -3.0)]
    assert iid["without"]["refused_rounds"] == []
    # every model that holds the negated update is refused (round 1's is the initial model, in clear)
    assert iid["with"]["refused_rounds"] == list(range(2, record()["settings"]["rounds"] + 2))


def test_security_md_quotes_the_measured_honest_spread_and_the_shipped_bound():
    honest = record()["summary"]["honest"]
    page = (ROOT / "docs" / "security.md").read_text()
    quoted = (
        f"at least {DIRECTION_BOUND:g} (honest rounds: min {honest['judged']['min']:.2f}, median "
        f"{honest['judged']['median']:.2f} over {honest['judged']['n']} site-rounds"
    )
    assert quoted in page

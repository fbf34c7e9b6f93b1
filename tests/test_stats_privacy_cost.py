"""The cost of private label statistics by default (docs/results/stats-dp-cost/, written by
benchmarks/bench_stats_dp_cost.py): the summary and the table docs/privacy.md quotes are rebuilt from the
committed per-cell AUCs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "stats-dp-cost"


@pytest.fixture(scope="module")
def cost() -> dict:
    return json.loads((RESULTS / "cost.json").read_text())


def rebuilt_summary(cells: list[dict]) -> list[dict]:
    """Per method x scenario, in the cells' order: mean of DP - exact over seeds, 95% t interval."""
    rows = []
    for method in dict.fromkeys(c["method"] for c in cells):
        for scenario in dict.fromkeys(c["scenario"] for c in cells):
            mine = sorted(
                (c for c in cells if c["method"] == method and c["scenario"] == scenario),
                key=lambda c: c["seed"],
            )
            d = np.array([c["test_auc_dp"] - c["test_auc_exact"] for c in mine])
            half = stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
            rows.append((method, scenario, d.mean(), d.mean() - half, d.mean() + half, d.size))
    return rows


def test_the_settings_are_the_default_release_over_at_least_three_seeds(cost):
    s = cost["settings"]
    assert s["epsilon"] == 1.0 and s["delta"] == 1e-5
    assert len(s["seeds"]) >= 3 and s["image_size"] == 32 and s["rounds"] >= 1
    assert set(s["methods"]) == {"fedbb", "dafl", "feddisco:target=global"}
    assert set(s["scenarios"]) == {"quantity-shift", "label-a0.5", "noisy-large", "rare-small"}
    keys = {(c["method"], c["scenario"], c["seed"]) for c in cost["cells"]}
    assert keys == {(m, sc, seed) for m in s["methods"] for sc in s["scenarios"] for seed in s["seeds"]}
    assert all(0.0 <= c[k] <= 1.0 for c in cost["cells"] for k in ("test_auc_dp", "test_auc_exact"))


def test_the_summary_is_rebuilt_from_the_cells(cost):
    rebuilt = rebuilt_summary(cost["cells"])
    assert len(rebuilt) == len(cost["summary"])
    for (method, scenario, mean, low, high, n), row in zip(rebuilt, cost["summary"], strict=True):
        e = row["effect_auc"]
        assert (row["method"], row["scenario"], e["n"]) == (method, scenario, n)
        assert (e["mean"], e["low"], e["high"]) == pytest.approx((mean, low, high), abs=1e-12)


def test_the_table_for_privacy_md_is_the_rebuilt_summary(cost):
    lines = [
        "| method | scenario | DP - exact test AUC (mean) | 95% interval | seeds |",
        "|---|---|---|---|---|",
    ]
    for method, scenario, mean, low, high, n in rebuilt_summary(cost["cells"]):
        lines.append(f"| {method} | {scenario} | {mean:+.4f} | [{low:+.4f}, {high:+.4f}] | {n} |")
    assert (RESULTS / "table.md").read_text() == "\n".join(lines) + "\n"


def test_privacy_md_quotes_the_table_and_the_settings_it_ran_with(cost):
    page = (ROOT / "docs" / "privacy.md").read_text()
    section = page.split("### Cost of private statistics by default", 1)[1].split("\n### ", 1)[0]
    assert (RESULTS / "table.md").read_text() in section
    s = cost["settings"]
    assert f"SynthCXR at\n{s['image_size']} px, {s['num_images']} images, {s['rounds']} rounds" in section
    assert f"seeds {s['seeds'][0]}-{s['seeds'][-1]} ({len(s['seeds'])} seeds)" in section
    assert f"epsilon {s['epsilon']:g}, delta {s['delta']:g}" in section

"""The cost of private label statistics by default: test AUC with the sites' Gaussian release (epsilon 1.0,
the site policy's default) against exact statistics, for the methods that use the global statistics.

Methods: FedBB (CBR weights + PNB loss, both from the global histogram), DAFL (c_client and the global
class ratios) and FedDisco with ``target="global"`` (label discrepancy to the global histogram). Each cell
runs twice through the benchmark's own code (:func:`fedweigh.bench.modes.run_cell`: the sites' trainers
under the simulation policy), once with the default release and once with ``exact_statistics`` (a
simulation policy with ``statistics_epsilon`` None); the two runs share every seed but the statistics
noise, so their difference is paired. Per method and scenario the JSON holds the mean paired effect
(DP minus exact, final test AUC) with a 95% t interval over the seeds:
``mean +- t_{0.975, n-1} * sd / sqrt(n)``.

Sized for about 40 minutes of 2 CPU cores: the ``quick`` profile's model and data (compact DenseNet,
2,400 SynthCXR images at 32 px, batch 32, at most 8 local steps) for 8 rounds, the standard profile's
four scenarios, 5 seeds. Cells are stored in ``OUT/{dp,exact}/cells`` and a rerun resumes from them.

    nice -n 10 .venv/bin/python benchmarks/bench_stats_dp_cost.py --out /tmp/stats-dp-cost \\
        --json docs/results/stats-dp-cost/cost.json --table docs/results/stats-dp-cost/table.md
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
from scipy import stats as scipy_stats

from fedweigh.bench.cells import CELLS_DIR, cell_key, is_done, load_cell
from fedweigh.bench.cluster import run_cells
from fedweigh.bench.config import make_config
from fedweigh.bench.profiles import PROFILES

METHODS = ("fedbb", "dafl", "feddisco:target=global")
SCENARIOS = PROFILES["standard"].scenarios
SEEDS = (0, 1, 2, 3, 4)
ROUNDS = 8
PROFILE = "quick"
ARMS = ("dp", "exact")

logger = logging.getLogger("bench_stats_dp_cost")


class _Bar:
    """The progress bar :func:`run_cells` advances: one log line per cell."""

    def __init__(self, arm: str, total: int) -> None:
        self.arm, self.total, self.done, self.t0 = arm, total, 0, time.perf_counter()

    def set_postfix_str(self, text: str) -> None:
        logger.info("%s: running %s", self.arm, text)

    def update(self, n: int) -> None:
        self.done += n
        logger.info("%s: %d/%d cells, %.0f s", self.arm, self.done, self.total, time.perf_counter() - self.t0)


def t_interval(values: list[float]) -> dict:
    """Mean and 95% t interval over ``values`` (n >= 2): mean +- t_{0.975, n-1} sd / sqrt(n)."""
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    mean = float(x.mean())
    half = float(scipy_stats.t.ppf(0.975, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": int(n)}


def summarise(cells: list[dict]) -> list[dict]:
    """Per method x scenario: the paired effect (DP minus exact, final test AUC) over the seeds."""
    out = []
    for method in dict.fromkeys(c["method"] for c in cells):
        for scenario in dict.fromkeys(c["scenario"] for c in cells):
            mine = [c for c in cells if c["method"] == method and c["scenario"] == scenario]
            diffs = [c["test_auc_dp"] - c["test_auc_exact"] for c in sorted(mine, key=lambda c: c["seed"])]
            if len(diffs) >= 2:
                out.append({"method": method, "scenario": scenario, "effect_auc": t_interval(diffs)})
    return out


def markdown_table(summary: list[dict]) -> str:
    """The table docs/privacy.md quotes: per method x scenario, mean paired effect [95% interval]."""
    lines = [
        "| method | scenario | DP - exact test AUC (mean) | 95% interval | seeds |",
        "|---|---|---|---|---|",
    ]
    for row in summary:
        e = row["effect_auc"]
        lines.append(
            f"| {row['method']} | {row['scenario']} | {e['mean']:+.4f} | [{e['low']:+.4f}, {e['high']:+.4f}] | {e['n']} |"
        )
    return "\n".join(lines) + "\n"


def final_test_auc(record: dict) -> float:
    """The final global model's test AUC of a stored cell (its last scored row)."""
    scored = [r for r in record["rows"] if "test_auc" in r]
    return float(scored[-1]["test_auc"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/stats-dp-cost"), help="cell cache folder")
    parser.add_argument("--json", type=Path, default=Path("docs/results/stats-dp-cost/cost.json"))
    parser.add_argument("--table", type=Path, default=Path("docs/results/stats-dp-cost/table.md"))
    parser.add_argument("--jobs", type=int, default=2, help="cells run in parallel (processes)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    opts = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    configs = {
        arm: make_config(
            PROFILE,
            "synthcxr",
            methods=METHODS,
            scenarios=SCENARIOS,
            seeds=opts.seeds,
            rounds=opts.rounds,
            exact_statistics=arm == "exact",
            threads=1,
        )
        for arm in ARMS
    }
    t0 = time.perf_counter()
    for arm, config in configs.items():
        cells_dir = opts.out / arm / CELLS_DIR
        cells_dir.mkdir(parents=True, exist_ok=True)
        todo = [c for c in config.cells() if not is_done(cells_dir, config, *c)]
        logger.info("%s: %d of %d cells to run", arm, len(todo), len(config.cells()))
        failures = run_cells(config, todo, cells_dir, _Bar(arm, len(todo)), jobs=opts.jobs)
        if failures:
            raise SystemExit(f"{arm}: {len(failures)} cell(s) failed: {failures}")
    cells = []
    for scenario, method, seed in configs["dp"].cells():
        key = cell_key(scenario, method, seed)
        dp, exact = (load_cell(opts.out / arm / CELLS_DIR, key) for arm in ARMS)
        assert dp is not None and exact is not None, key
        cells.append(
            {
                "method": method,
                "scenario": scenario,
                "seed": seed,
                "test_auc_dp": final_test_auc(dp),
                "test_auc_exact": final_test_auc(exact),
                "seconds_dp": float(dp["seconds"]),
                "seconds_exact": float(exact["seconds"]),
            }
        )
    summary = summarise(cells)
    client = configs["dp"].client
    result = {
        "settings": {
            "profile": PROFILE,
            "dataset": "synthcxr",
            "rounds": opts.rounds,
            "sites": "each scenario's own (standard scenarios)",
            "scenarios": list(SCENARIOS),
            "methods": list(METHODS),
            "seeds": list(opts.seeds),
            "image_size": client.size,
            "num_images": client.num_images,
            "max_steps": client.max_steps,
            "batch_size": client.batch_size,
            "epsilon": configs["dp"].statistics_epsilon(),
            "delta": client.stats_dp_delta,
            "mechanism": "analytic Gaussian, one release per site and job (the default site policy)",
            "effect": "final test AUC with the default release minus with exact statistics, paired by seed",
            "interval": "95% t interval over seeds: mean +- t_{0.975,n-1} sd / sqrt(n)",
            "command": "nice -n 10 .venv/bin/python benchmarks/bench_stats_dp_cost.py",
            "wall_seconds_this_run": round(time.perf_counter() - t0, 1),
        },
        "cells": cells,
        "summary": summary,
    }
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(result, indent=1) + "\n")
    opts.table.write_text(markdown_table(summary))
    print(markdown_table(summary))


if __name__ == "__main__":
    main()

"""What the safeguards cost honest federations: the honest-cost pairing measures a setting against the
same cells with the safeguards off, with an interval over the cells (training noise) and one over the
test images; the bench takes the robust options and keys its cells by them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from fedweigh.bench.cells import cell_key, store_cell
from fedweigh.bench.costs import cell_interval, honest_cost

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _store(
    folder: Path, scenario: str, method: str, seed: int, scores: np.ndarray, labels: np.ndarray, **audit
):
    record = {"key": cell_key(scenario, method, seed), "safeguards": audit}
    store_cell(folder, record, scores[None], labels)


def test_honest_cost_pairs_each_cell_with_its_run_without_safeguards(tmp_path):
    rng = np.random.default_rng(0)
    labels = (rng.random((200, 3)) < 0.3).astype(np.float32)
    cells = [("quantity-shift", "fedavg", s) for s in (0, 1)]
    good = labels + rng.normal(0, 0.8, labels.shape)
    worse = labels + rng.normal(0, 3.0, labels.shape)
    dirs = {name: tmp_path / name / "cells" for name in ("off", "deploy", "robust")}
    for _, method, seed in cells:
        _store(dirs["off"], "quantity-shift", method, seed, good, labels)
        _store(
            dirs["deploy"],
            "quantity-shift",
            method,
            seed,
            good,
            labels,
            site_rounds_left_out=0,
            site_rounds_bounded=2,
            rounds_unchanged=[],
        )
        _store(
            dirs["robust"],
            "quantity-shift",
            method,
            seed,
            worse,
            labels,
            site_rounds_left_out=1,
            site_rounds_bounded=3,
            rounds_unchanged=[4],
        )
    out = honest_cost(dirs, cells, n_resamples=200)
    assert out["deploy"]["effect"] == {"mean": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    robust = out["robust"]
    assert robust["effect"]["mean"] < 0 and robust["effect"]["ci_high"] < 0
    assert robust["audit"] == {
        "site_rounds_left_out": 2,
        "site_rounds_bounded": 6,
        "rounds_unchanged": 2,
        "cells": 2,
    }
    assert out["deploy"]["effect_cells"]["mean"] == 0.0 and out["deploy"]["effect_cells"]["cells"] == 2
    assert out["robust"]["effect_cells"]["mean"] == pytest.approx(robust["effect"]["mean"])
    cost = _load("bench_safeguard_cost")
    table = cost.markdown({"settings": out})
    assert "| robust | -0." in table and "(2 cells)" in table and "| 2 | 6 | 2 |" in table
    with pytest.raises(ValueError, match="'off' setting"):
        honest_cost({"deploy": dirs["deploy"]}, cells)


def test_the_bench_takes_the_robust_options_and_keys_its_cells_by_them():
    from fedweigh.bench.cells import settings_hash
    from fedweigh.bench.cli import _bench_config
    from fedweigh.bench.config import make_config
    from fedweigh.cli import build_parser

    argv = ["bench", "--safeguards", "robust", "--aggregator", "trimmed_mean", "--krum-f", "1"]
    args = build_parser().parse_args([*argv, "--clip-norm", "3", "--out", "x"])
    g = _bench_config(args).safeguards
    assert (g.aggregator, g.krum_f, g.clip_norm, g.array_cosine, g.max_share) == (
        "trimmed_mean",
        1,
        3.0,
        0.0,
        "auto",
    )
    hashes = {
        name: settings_hash(make_config("smoke", "synthcxr", safeguards=name), "iid-4", "fedavg", 0)
        for name in ("off", "deploy", "robust", "hardened")
    }
    assert len(set(hashes.values())) == 4


def test_the_interval_over_cells_is_students_t_on_the_paired_differences():
    from scipy import stats

    d = [0.01, -0.02, 0.005, 0.0, 0.012]
    got = cell_interval(d)
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=np.mean(d), scale=stats.sem(d))
    assert got["mean"] == pytest.approx(np.mean(d)) and got["cells"] == 5
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((lo, hi))
    assert cell_interval([0.1]) is None and cell_interval([0.1, float("nan")]) is None

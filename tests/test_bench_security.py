"""The security benchmarks' own logic: the attacks do what their names say, the summary line counts
them by kind, and the honest-cost pairing measures a setting against the same cells with the
safeguards off."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from fedweigh.bench.cells import cell_key, store_cell
from fedweigh.bench.costs import honest_cost
from fedweigh.protocol import META_NUM_SAMPLES, META_NUM_STEPS, META_SCALARS
from fedweigh.server.rounds import ClientResult

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def attacks():
    return _load("bench_attacks")


def _honest(g: dict) -> ClientResult:
    rng = np.random.default_rng(0)
    params = {k: (v + 0.01 * rng.normal(size=v.shape)).astype(v.dtype) for k, v in g.items()}
    return ClientResult("site-4", params, {META_NUM_SAMPLES: 270, META_NUM_STEPS: 10, META_SCALARS: {}}, {})


G = {
    "net.features.conv0.weight": np.zeros((4, 3), np.float32),
    "net.features.norm0.running_var": np.array([1.0, 0.5, 2.0], np.float32),
    "net.class_layers.out.weight": np.zeros((2, 3), np.float32),
    "net.class_layers.out.bias": np.zeros(2, np.float32),
}


def _norm(params: dict, key: str) -> float:
    return float(np.linalg.norm(np.asarray(params[key], np.float64) - np.asarray(G[key], np.float64)))


def test_the_attacks_count_at_least_thirty_and_cover_every_family_and_colluders(attacks):
    rows = attacks.ATTACKS
    assert len(rows) >= 30
    assert {attacks.FAMILY[a.method] for a in rows} == {"size", "step", "scalar", "parameter"}
    assert any(len(a.attackers) == 2 for a in rows)
    for kind in (
        "bn-negvar",
        "noise",
        "steps:1",
        "steps:1000",
        "steps:10000000",
        "flip-head",
        "metric:weights",
    ):
        assert any(a.kind == kind for a in rows), kind


def test_classifier_flip_touches_only_the_classifier_at_the_norm_bound(attacks):
    honest = _honest(G)
    bad = attacks._tamper("flip-head", honest, G, 1, {}, None)
    for key in G:
        if "class_layers" in key:
            assert _norm(bad.params, key) == pytest.approx(
                attacks.BOUND_FACTOR * _norm(honest.params, key), rel=1e-5
            )
            delta = bad.params[key] - G[key]
            own = honest.params[key] - G[key]
            assert float(np.sum(delta * own)) < 0  # flipped
        else:
            np.testing.assert_array_equal(bad.params[key], honest.params[key])


def test_bn_attack_lowers_the_smallest_variance_at_the_norm_bound(attacks):
    honest = _honest(G)
    bad = attacks._tamper("bn-negvar", honest, G, 1, {}, None)
    key = "net.features.norm0.running_var"
    assert _norm(bad.params, key) == pytest.approx(attacks.BOUND_FACTOR * _norm(honest.params, key), rel=1e-5)
    assert bad.params[key][1] < G[key][1] and bad.params[key][[0, 2]].tolist() == G[key][[0, 2]].tolist()


def test_forged_quantities_and_metrics(attacks):
    honest = _honest(G)
    assert attacks._tamper("steps:10000000", honest, G, 1, {}, None).meta[META_NUM_STEPS] == 10_000_000
    both = attacks._tamper("flip-head+samples", honest, G, 1, {}, None)
    assert both.meta[META_NUM_SAMPLES] == attacks.FORGED_COUNT * 270
    assert attacks._tamper("metric:weights", honest, G, 1, {}, None).metrics == {"weights": 1.0}
    noise = attacks._tamper("noise", honest, G, 1, {}, None)
    for key in G:
        assert _norm(noise.params, key) == pytest.approx(
            attacks.BOUND_FACTOR * _norm(honest.params, key), rel=1e-5
        )
    with pytest.raises(ValueError, match="unknown attack kind"):
        attacks._tamper("nothing", honest, G, 1, {}, None)


def _row(attackers: int, drop: float, he: bool = False, failed: bool = False) -> dict:
    return {
        "attackers": ["site-4"] * attackers,
        "he": he,
        "completed": not failed,
        "crashed_or_stalled": failed,
        "auc_drop": float("nan") if failed else drop,
    }


def test_summary_line_separates_one_site_colluders_and_he(attacks):
    rows = [_row(1, 0.02), _row(1, 0.05), _row(2, 0.3), _row(1, 0.0, failed=True)]
    line = attacks.summary_line(attacks.summarise(rows))
    assert (
        line
        == "attacks: 4 tried, 1 crashed or stalled, worst AUC drop 0.0500 (one site), 0.3000 (two colluders), n/a (HE)"
    )
    line = attacks.summary_line(attacks.summarise([*rows, _row(1, 0.1, he=True)]))
    assert line.endswith("0.0500 (one site), 0.3000 (two colluders), 0.1000 (HE)")


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
    cost = _load("bench_safeguard_cost")
    table = cost.markdown({"settings": out})
    assert "| robust | -0." in table and "| 2 | 6 | 2 |" in table
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


def test_the_he_attacks_are_counted_as_he_rows_with_the_attack_tables_columns(attacks, monkeypatch):
    """bench_attacks calls attacks_he.run_he_attacks as that file defines it and gives each row the
    columns its summary and table read, so the last line's H counts them."""
    he = _load("attacks_he")
    calls = []

    def fake_run(fed, defences=True, **kwargs):
        calls.append((fed, defences))
        row = {"attack": "x", "path": "HE updates", "completed": True, "stalled_rounds": [], "why": "-"}
        return [{**row, "crashed_or_stalled": False, "auc": 0.6, "clean_auc": 0.7, "auc_drop": 0.1}]

    import inspect

    inspect.signature(he.run_he_attacks).bind("fed", defences=False)  # the call bench_attacks makes
    assert attacks.Keys is attacks.attacks_he.Keys  # one key-pair class, attacks_he.py's
    monkeypatch.setattr(attacks.attacks_he, "run_he_attacks", fake_run)
    rows = attacks._he_rows("fed", None, "off")
    assert calls == [("fed", False)]
    assert rows[0]["he"] is True and rows[0]["attackers"] == [he.ATTACKER]
    summary = attacks.summarise(rows)
    assert summary["worst_auc_drop_he"] == pytest.approx(0.1) and summary["tried"] == 1
    assert "(HE)" in attacks.summary_line(summary) and "0.1000 (HE)" in attacks.summary_line(summary)

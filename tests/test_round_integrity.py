"""The round keeps its record, its model and its weights whole whatever one site sends: site metrics
never touch a server field, the aggregate is checked before it becomes the global model, and every
scheme's weights are a distribution."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from fedweigh.server.loop import LoopSettings, TrainTask, Transport, ValidateTask, run_rounds
from fedweigh.server.records import RoundRecorder
from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.server.validation import check_site_metrics
from fedweigh.weighting import get_scheme

SITES = ("site-1", "site-2", "site-3", "site-4")


def g0() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": rng.normal(0, 0.1, (4, 5)).astype(np.float32), "n": np.array(3, np.int64)}


def honest(site: str, g: dict, scale: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sum(map(ord, site)))
    common = np.ones_like(g["w"]) * scale
    return {
        "w": (g["w"] + common + rng.normal(0, scale / 2, g["w"].shape)).astype(np.float32),
        "n": g["n"] + 2,
    }


def result(site: str, params, n: int = 100, steps: int = 2, metrics=None) -> ClientResult:
    return ClientResult(
        site,
        params,
        {"num_samples": n, "NUM_STEPS_CURRENT_ROUND": steps, "fedweigh_scalars": {}},
        metrics if metrics is not None else {"val_auc": 0.6},
    )


# --------------------------------------------------------------------------- 1. site metrics namespace
FORGED_METRICS = {
    "weights": 1.0,
    "excluded": 2.0,
    "round": 7.0,
    "global_updated": 0.0,
    "bounded": 3.0,
    "round_seconds": 1e9,
    "weight/site-1": 0.9,
    "server_rss_mb": 1.0,
    "lambda": 0.123,  # FedDRAW's schedule value on the row
    "val_auc": 0.6,
}


class _Sites(Transport):
    """Four in-process sites answering with honest updates and the metrics given."""

    def __init__(self, metrics: dict):
        self.metrics = metrics

    def site_names(self):
        return list(SITES)

    def train(self, task: TrainTask):
        g = {k: np.asarray(v) for k, v in task.params.items()}
        return [
            result(s, honest(s, g, 0.01 * task.round_index), metrics=self.metrics if s == "site-4" else None)
            for s in SITES
        ]

    def validate(self, task: ValidateTask):
        return [dict(self.metrics)] + [{"val_auc": 0.6}] * 3


def test_a_site_metric_named_like_a_server_field_is_refused_and_the_record_stays_whole(tmp_path, caplog):
    g = g0()
    step = RoundStep(get_scheme("feddraw"), PlaintextBackend(g), num_rounds=3)
    recorder = RoundRecorder(tmp_path, "feddraw")
    with caplog.at_level(logging.WARNING):
        run_rounds(step, _Sites(FORGED_METRICS), recorder, step.plan("feddraw", {}), LoopSettings())
    rows = json.loads((tmp_path / "fedweigh_metrics.json").read_text())["rounds"]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]  # before: a metric "weights" raised TypeError
    for row in rows[1:]:
        assert set(row["weights"]) == set(SITES) and row["global_updated"] is True
        assert row["excluded"] == {} and "bounded" not in row
        assert row["round_seconds"] < 1e6 and row["lambda"] != pytest.approx(0.123)
    assert all("weight/site-1" not in r and "server_rss_mb" not in r for r in rows)
    assert all(r["val_auc"] == pytest.approx(0.6) for r in rows)
    csv = (tmp_path / "fedweigh_metrics.csv").read_text().splitlines()
    assert csv[0].count("weight/site-1") == 1 and len(csv) == 5
    logged = caplog.text
    for name in ("weights", "excluded", "round", "global_updated", "lambda"):
        assert f"site-4: metric {name!r} is refused: the name is reserved" in logged


def test_check_site_metrics_names_the_site_and_the_reason():
    accepted, refused = check_site_metrics(
        "site-2",
        {"val_auc": 0.7, "x": float("nan"), 3: 1.0, "a b": 1.0, "weights": 1.0, "beta": 2.0},
        {"beta"},
    )
    assert accepted == {"val_auc": 0.7}
    assert set(refused) == {"3", "a b", "weights", "beta"}
    assert all(why.startswith("site-2: metric") for why in refused.values())
    assert check_site_metrics("site-2", ["not", "a", "dict"])[0] == {}

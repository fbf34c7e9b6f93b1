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
from fedweigh.server.safeguards import DEFAULT_UPDATE_NORM_BOUND, Safeguards
from fedweigh.server.validation import ResultLimits, check_site_metrics
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
        assert row["excluded"] == {}
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


# --------------------------------------------------------------------------- 3. weights and counts
def _fednova_round(forged_steps: int, **options):
    g = g0()
    results = [result(s, honest(s, g), steps=10) for s in SITES[:3]]
    results.append(result("site-4", honest("site-4", g), steps=forged_steps))
    step = RoundStep(
        get_scheme("fednova"), PlaintextBackend(g), num_rounds=3, safeguards=Safeguards(**options)
    )
    return step.run(1, results, list(SITES)), g


@pytest.mark.parametrize("forged", [1, 1000, 10**7])
def test_fednova_with_a_forged_step_count_still_applies_a_distribution(forged):
    outcome, g = _fednova_round(forged)
    w = np.array(list(outcome.weights.values()))
    assert outcome.updated and (w >= 0).all() and w.sum() == pytest.approx(1.0, abs=1e-12)
    assert w.max() <= 0.5 + 1e-12  # and the cap holds on the distribution
    # the global model moved by a convex mix of the updates: within their range, coordinate-wise
    updates = np.stack([honest(s, g)["w"] for s in SITES])
    assert (outcome.params["w"] >= updates.min(axis=0) - 1e-6).all()
    assert (outcome.params["w"] <= updates.max(axis=0) + 1e-6).all()
    # even with every other safeguard off, the weights the round applies sum to 1 (before: 2.5, 19, 187,500)
    free, _ = _fednova_round(forged, max_share=None, update_norm_bound=None, min_update_cosine=None)
    assert sum(free.weights.values()) == pytest.approx(1.0, abs=1e-12)


def test_a_forged_step_count_far_from_the_others_is_clipped_to_the_bound():
    outcome, _ = _fednova_round(10**7)
    assert "num_steps=10000000 clipped to 1000 (within 100 x the median" in outcome.bounded["site-4"]
    outcome, _ = _fednova_round(
        1, max_share=None, update_norm_bound=None, limits=ResultLimits(min_step_ratio=None)
    )
    assert "site-4" not in outcome.bounded  # 1 step against 10 is within 100 x: the ratio alone lets it be
    assert outcome.weights["site-4"] == pytest.approx(1 / 1.3)
    # the step floor: no fewer steps than a site of its size takes (the others' 10), not 10 times the weight
    outcome, _ = _fednova_round(1, max_share=None)
    assert "num_steps=1 raised to 10 (fewer than its size makes plausible" in outcome.bounded["site-4"]
    assert outcome.weights["site-4"] == pytest.approx(0.25)


@pytest.mark.parametrize(
    "name, options",
    [
        ("fedavg", {}),
        ("fedprox", {}),
        ("fednova", {"local_optimizer": "sgd"}),
        ("fedadp", {}),
        ("ida", {}),
        ("fedawa", {}),
        ("feddraw", {}),
        ("cbr", {}),
        ("dafl", {}),
        ("feddisco", {}),
    ],
)
def test_every_schemes_weights_are_a_distribution_after_the_cap(name, options):
    g = g0()
    scalars = {"skew": 0.5, "imbalance": 2.0, "discrepancy": 0.1, "similarity": 0.5}
    results = [
        ClientResult(
            s,
            honest(s, g),
            {
                "num_samples": n,
                "NUM_STEPS_CURRENT_ROUND": tau,
                "fedweigh_scalars": dict(scalars, skew=0.2 * i),
            },
        )
        for i, (s, n, tau) in enumerate(zip(SITES, (900, 50, 30, 31), (29, 2, 1, 1), strict=True))
    ]
    step = RoundStep(get_scheme(name, **options), PlaintextBackend(g), num_rounds=3)
    outcome = step.run(1, results, list(SITES))
    assert outcome.updated, outcome.reason
    w = np.array(list(outcome.weights.values()))
    assert (w >= 0).all() and w.sum() == pytest.approx(1.0, abs=1e-12) and w.max() <= 0.5 + 1e-12


def test_a_sample_count_far_above_the_others_is_clipped_and_one_above_the_announced_is_refused():
    from fedweigh.server.safeguards import AnnouncedCounts

    g = g0()
    results = [result(s, honest(s, g), n=100) for s in SITES[:3]]
    results.append(result("site-4", honest("site-4", g), n=1_000_000))
    step = RoundStep(
        get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3, safeguards=Safeguards(max_share=None)
    )
    outcome = step.run(1, results, list(SITES))
    assert "num_samples=1000000 clipped to 10000 (at most 100 x the median" in outcome.bounded["site-4"]
    assert outcome.weights["site-4"] == pytest.approx(10_000 / 10_300)
    # against the statistics phase: more than the site announced there is a lie, left out
    announced = AnnouncedCounts({"site-1": 100, "site-2": 100, "site-3": 100, "site-4": 300})
    step = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3, announced=announced)
    outcome = step.run(1, results, list(SITES))
    assert outcome.updated and set(outcome.weights) == set(SITES[:3])
    assert (
        "num_samples=1000000 exceeds the 300 it announced in the statistics phase"
        in outcome.excluded["site-4"]
    )


# --------------------------------------------------------------------------- 2. the aggregate's check
torch = pytest.importorskip("torch")


class VarScale(torch.nn.Module):
    """x / sqrt(var) with a learned variance: finite parameters, NaN outputs once a variance is negative."""

    def __init__(self, n: int):
        super().__init__()
        self.var = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x / torch.sqrt(self.var)


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        VarScale(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 2),
    )


def tiny_global() -> dict[str, np.ndarray]:
    from fedweigh.train import get_params

    g = get_params(tiny_model())
    g["2.var"] = np.logspace(-4, 0, 16).astype(np.float32)
    g["1.running_var"] = np.logspace(-3, 0, 16).astype(np.float32)
    return g


def tiny_update(site: str, g: dict) -> dict[str, np.ndarray]:
    """An honest update: variances move by 5 % of themselves, weights by a common step plus noise."""
    rng = np.random.default_rng(sum(map(ord, site)))
    out = {}
    for k, v in g.items():
        if not np.issubdtype(v.dtype, np.floating):
            out[k] = v + 2
        elif k.endswith("var"):
            out[k] = (v * (1 + 0.05 * rng.standard_normal(v.shape))).astype(v.dtype)
        else:
            out[k] = (v + 0.01 + 0.01 * rng.standard_normal(v.shape)).astype(v.dtype)
    return out


def outputs(params: dict) -> torch.Tensor:
    from fedweigh.train import set_params

    model = tiny_model().eval()
    set_params(model, params)
    with torch.no_grad():
        return model(torch.randn(64, 8, generator=torch.Generator().manual_seed(5)))


def tiny_step(g, probe=True, **options):
    from fedweigh.server.model_check import ModelProbe

    return RoundStep(
        get_scheme("fedavg"),
        PlaintextBackend(g),
        num_rounds=3,
        safeguards=Safeguards(**options),
        probe=ModelProbe(tiny_model(), input_shape=(8,)) if probe else None,
    )


@pytest.mark.parametrize("probe", [True, False])
def test_a_negative_running_var_cannot_reach_the_global_model(probe):
    g = tiny_global()
    sent = {s: tiny_update(s, g) for s in SITES}
    sent["site-4"]["1.running_var"] = np.full(16, -5.0, np.float32)  # finite, in range, honest weights
    # (a norm bound that leaves the honest sites' buffers as sent: at 1 x the others' largest it scales the largest)
    step = tiny_step(g, probe, update_norm_bound=3.0)
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(SITES))
    assert outcome.updated and set(outcome.weights) == set(SITES)  # its parameters still count
    # the buffers are the coordinate-wise median over the sites: site-4's cannot move them
    expected = np.median(np.stack([p["1.running_var"] for p in sent.values()]), axis=0)
    np.testing.assert_allclose(outcome.params["1.running_var"], expected, rtol=1e-6)
    assert (outcome.params["1.running_var"] > 0).all() and torch.isfinite(outputs(outcome.params)).all()
    assert outcome.params["1.num_batches_tracked"] == g["1.num_batches_tracked"] + 2


def test_with_two_sites_a_negative_running_var_keeps_the_last_good_model():
    g = tiny_global()
    sent = {s: tiny_update(s, g) for s in SITES[:2]}
    sent["site-2"]["1.running_var"] = np.full(16, -5.0, np.float32)
    step = tiny_step(g, probe=False)
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(SITES[:2]))
    assert not outcome.updated and "not a majority" in outcome.reason
    assert "BatchNorm variance '1.running_var' has" in outcome.excluded["site-2"]
    assert step.backend.task_params()["1.running_var"] == pytest.approx(g["1.running_var"])


def _noise_at_the_bound(
    sent: dict, g: dict, bound: float = DEFAULT_UPDATE_NORM_BOUND
) -> dict[str, np.ndarray]:
    """Random noise on every float array of site-4's update, each just inside the norm bound."""
    rng = np.random.default_rng(11)
    out = {}
    for k, v in g.items():
        if not np.issubdtype(v.dtype, np.floating):
            out[k] = sent["site-1"][k]
            continue
        others = np.median([np.linalg.norm(sent[s][k] - v) for s in SITES[:3]])
        noise = rng.standard_normal(v.shape)
        out[k] = (v + 0.99 * bound * others * noise / np.linalg.norm(noise)).astype(v.dtype)
    return out


def test_random_noise_at_the_norm_bound_that_makes_nan_outputs_is_found_and_left_out():
    g = tiny_global()
    sent = {s: tiny_update(s, g) for s in SITES[:3]}
    sent["site-4"] = _noise_at_the_bound(sent, g)
    results = [result(s, p) for s, p in sent.items()]
    # without the probe, every array check passes and the sites get a model they cannot evaluate
    blind = tiny_step(g, probe=False, min_update_cosine=None).run(1, results, list(SITES))
    assert blind.updated and "site-4" not in blind.bounded and not torch.isfinite(outputs(blind.params)).all()
    step = tiny_step(g, min_update_cosine=None)
    outcome = step.run(1, results, list(SITES))
    assert outcome.updated and set(outcome.weights) == set(SITES[:3])
    assert sum(outcome.weights.values()) == pytest.approx(1.0)
    why = outcome.excluded["site-4"]
    assert "with its update the aggregate fails the server's check" in why and "probe batch" in why
    assert torch.isfinite(outputs(outcome.params)).all()
    assert all((step.backend.task_params()[k] == v).all() for k, v in outcome.params.items())


# --------------------------------------------------------------------------- 8. honest runs lose nothing
def test_a_trim_of_a_few_small_arrays_is_recorded_but_not_logged_as_a_scaled_update(caplog):
    rng = np.random.default_rng(4)
    g = {"a": np.zeros(4000, np.float32), "b": np.zeros(2, np.float32)}
    sent = {
        s: {"a": rng.normal(0, 0.1, 4000).astype(np.float32), "b": np.full(2, 0.001, np.float32)}
        for s in SITES
    }
    sent["site-4"]["b"] = np.full(2, 0.01, np.float32)  # one tiny array above the bound
    step = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3)
    with caplog.at_level(logging.INFO, logger="fedweigh.server.rounds"):
        outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(SITES))
    assert "arrays above 1 x the largest norm" in outcome.bounded["site-4"]
    trims = [r for r in caplog.records if "site-4: " in r.getMessage() and "arrays above" in r.getMessage()]
    assert [r.levelno for r in trims] == [logging.INFO]  # before: a warning every round
    # a real scaling (the update's norm falls by 1 % or more) is a warning
    sent["site-4"]["a"] = (sent["site-4"]["a"] * 10).astype(np.float32)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedweigh.server.rounds"):
        outcome = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3).run(
            1, [result(s, p) for s, p in sent.items()], list(SITES)
        )
    loud = [r for r in caplog.records if "site-4: 2 of 2 arrays" in r.getMessage()]
    assert [r.levelno for r in loud] == [logging.WARNING]


def test_a_small_honest_update_leaning_away_is_kept_and_the_round_goes_on_with_a_majority():
    """The direction check leaves out only an update that would undo much of the others' step."""
    g = {"w": np.zeros(64, np.float32)}
    rng = np.random.default_rng(2)
    common = np.ones(64, np.float32) * 0.1
    sent = {s: {"w": (common + rng.normal(0, 0.03, 64)).astype(np.float32)} for s in SITES[:3]}
    sent["site-4"] = {
        "w": (-0.05 * common + rng.normal(0, 0.003, 64)).astype(np.float32)
    }  # small, leaning away
    step = RoundStep(
        get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3, safeguards=Safeguards(min_clients=4)
    )
    outcome = step.run(
        1, [result(s, p, n=1000 if s != "site-4" else 10) for s, p in sent.items()], list(SITES)
    )
    assert outcome.updated and not outcome.excluded and set(outcome.weights) == set(SITES)
    # a flipped update as large as the others is left out, and the round aggregates the other three
    sent["site-4"] = {"w": (-sent["site-1"]["w"]).astype(np.float32)}
    step = RoundStep(
        get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3, safeguards=Safeguards(min_clients=4)
    )
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(SITES))
    assert outcome.updated and set(outcome.weights) == set(SITES[:3])  # before: min_clients=4 lost the round
    assert "would undo 1 x their mean update" in outcome.excluded["site-4"]


def test_the_probe_runs_the_jobs_architecture_and_refuses_a_model_it_cannot_run():
    from fedweigh.models.base import FedweighNet
    from fedweigh.server.model_check import ModelProbe, model_problem
    from fedweigh.train import get_params

    net = FedweighNet(
        arch="densenet_compact", num_classes=14, in_channels=1, img_size=32, norm="batch", seed=0
    )
    probe = ModelProbe(net)
    assert (
        tuple(probe.batch.shape) == (4, 1, 32, 32) and "net.features.norm0.running_var" in probe.buffer_keys
    )
    params = get_params(net)
    assert model_problem(params, probe) is None
    bad = dict(params)
    weight = next(k for k in params if k.endswith("conv0.weight"))
    bad[weight] = np.full_like(params[weight], 3e38)  # finite, and the outputs overflow
    assert "outputs on the server's probe batch are not finite" in model_problem(bad, probe)
    with pytest.raises(ValueError, match="in_channels / img_size"):
        ModelProbe(torch.nn.Linear(3, 2))

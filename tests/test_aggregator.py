"""FedweighAggregator: the controller's round step inside stock NVFlare FedAvg."""

from __future__ import annotations

import numpy as np
import pytest
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from fedweigh.flare.aggregator import FedweighAggregator


def _aggregator(scheme: str = "fedavg", **kwargs) -> FedweighAggregator:
    kwargs.setdefault("min_update_cosine", None)  # the updates here are opposite on purpose
    agg = FedweighAggregator(scheme=scheme, num_rounds=3, **kwargs)
    ctx = FLContext()
    g = FLModel(params_type=ParamsType.FULL, params={"w": np.zeros(3, np.float32)})
    ctx.set_prop(AppConstants.GLOBAL_MODEL, FLModelUtils.to_model_learnable(g), private=True, sticky=False)
    ctx.set_prop(AppConstants.CURRENT_ROUND, 0, private=True, sticky=False)
    agg.fl_ctx = ctx
    return agg


def _result(site: str, n: int, value: float, **meta) -> FLModel:
    return FLModel(
        params={"w": np.full(3, value, np.float32)},
        meta={"client_name": site, "num_samples": n, "NUM_STEPS_CURRENT_ROUND": 2, **meta},
    )


@pytest.mark.parametrize(
    "scheme, options, needs",
    [
        ("cbr", {}, "scalars"),
        ("feddisco", {}, "scalars"),
        ("feddisco", {"target": "global"}, "histogram"),
        ("dafl", {}, "scalars"),
    ],
)
def test_schemes_stock_fedavg_cannot_feed_are_refused(scheme, options, needs):
    with pytest.raises(ValueError, match=f"{scheme}.*{needs}.*FedweighController"):
        FedweighAggregator(scheme=scheme, scheme_args=options)


def test_sample_weights_and_the_cap_as_in_the_controller():
    results = [_result("site-1", 1_000_000, 1.0), _result("site-2", 100, -1.0), _result("site-3", 100, -1.0)]
    free = _aggregator(max_share=None)
    for r in results:
        free.accept_model(r)
    out = free.aggregate_model()
    # no cap: only the count clip (N_k at most 100 x the median of the others) bounds it
    assert free.last_weights["site-1"] == pytest.approx(10_000 / 10_200)
    default = _aggregator()  # by default no site holds more than half the weight of 3 or more
    for r in results:
        default.accept_model(r)
    default.aggregate_model()
    assert default.last_weights["site-1"] == pytest.approx(0.5)
    capped = _aggregator(max_share=0.4)
    for r in results:
        capped.accept_model(r)
    out = capped.aggregate_model()
    assert capped.last_weights["site-1"] == pytest.approx(0.4)
    assert out.params["w"] == pytest.approx(np.full(3, 0.4 - 0.6))


def test_an_invalid_result_is_skipped_and_too_few_keep_the_model():
    agg = _aggregator(min_clients=2)
    agg.accept_model(_result("site-1", 10, 1.0))
    agg.accept_model(_result("site-2", 10, float("nan")))  # non-finite: left out
    out = agg.aggregate_model()
    assert out.params["w"] == pytest.approx(np.zeros(3))  # one valid result < min_clients: unchanged
    assert agg.last_weights == {}


#: The schemes the README says stock FedAvg can feed through FedweighAggregator (they weight from
#: parameters, sample counts and steps); every other scheme is refused.
STOCK_FEDAVG_SCHEMES = {"fedavg", "uniform", "fedprox", "fednova", "fedadp", "ida", "fedawa", "feddraw"}


def test_the_schemes_stock_fedavg_can_feed_are_exactly_the_documented_ones():
    from fedweigh.weighting import SCHEMES

    accepted = set()
    for name in SCHEMES:
        try:
            FedweighAggregator(scheme=name)
        except ValueError as e:
            assert "FedweighController" in str(e)
        else:
            accepted.add(name)
    assert accepted == STOCK_FEDAVG_SCHEMES


def _stock_result(site: str, steps: int, params: dict) -> FLModel:
    """A stock NVFlare client's result: its parameters and NUM_STEPS_CURRENT_ROUND, no sample count."""
    return FLModel(params=params, meta={"client_name": site, "NUM_STEPS_CURRENT_ROUND": steps})


@pytest.mark.parametrize("scheme", sorted(STOCK_FEDAVG_SCHEMES))
def test_every_documented_scheme_runs_rounds_in_stock_fedavg(scheme):
    """Three rounds of stock FedAvg calls (CURRENT_ROUND 0, 1, 2; a new global model each round) give
    the scheme's own weights and aggregate, with its cross-round state (FedAdp's smoothed angles,
    FedAWA's logits, FedDRAW's schedules) kept by the one aggregator."""
    from fedweigh.weighting import get_scheme
    from fedweigh.weighting.base import ClientReport

    rng = np.random.default_rng(7)
    steps = {"site-1": 2, "site-2": 5, "site-3": 3}
    g = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3)}
    # the scheme alone: no weight cap, no update-norm bound, no direction filter (tests/test_robust_rounds.py)
    agg = FedweighAggregator(
        scheme=scheme, num_rounds=3, max_share=None, update_norm_bound=None, min_update_cosine=None
    )
    reference = get_scheme(scheme)
    for t in range(1, 4):
        ctx = FLContext()
        learnable = FLModelUtils.to_model_learnable(FLModel(params_type=ParamsType.FULL, params=g))
        ctx.set_prop(AppConstants.GLOBAL_MODEL, learnable, private=True, sticky=False)
        ctx.set_prop(AppConstants.CURRENT_ROUND, t - 1, private=True, sticky=False)
        agg.fl_ctx = ctx
        trained = {s: {k: v + rng.normal(0, 0.1, v.shape) for k, v in g.items()} for s in steps}
        for site, n in steps.items():
            agg.accept_model(_stock_result(site, n, trained[site]))
        out = agg.aggregate_model()
        # by hand: the stock client's step count stands in for N_k
        reports = [
            ClientReport(name=s, num_samples=n, num_steps=n, params=trained[s]) for s, n in steps.items()
        ]
        w = np.asarray(reference.weights(reports, g, t, 3))
        w = w / w.sum()  # the round applies the scheme's proportions (FedNova's sum to tau_eff x ...)
        expected = reference.aggregate(g, reports, w)
        assert agg.last_weights == pytest.approx(dict(zip(steps, w, strict=True)), abs=1e-12), t
        for k in g:
            np.testing.assert_allclose(out.params[k], expected[k], rtol=0, atol=1e-12)
        g = {k: np.asarray(v) for k, v in out.params.items()}
    if scheme in ("fedadp", "feddraw"):  # the state moved the weights away from the plain sizes
        assert max(abs(agg.last_weights[s] - n / 10) for s, n in steps.items()) > 1e-3


def test_the_aggregator_is_exported_with_its_options(tmp_path):
    """FedAvgRecipe(aggregator=FedweighAggregator(...)) writes the aggregator and its options into the job."""
    import json
    from dataclasses import asdict

    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe

    from fedweigh.flare.recipes import CLIENT_SCRIPT, ModelSpec

    aggregator = FedweighAggregator(
        scheme="feddraw", scheme_args={"beta_max": 2.0}, num_rounds=4, max_share=0.5
    )
    recipe = FedAvgRecipe(
        name="stock_feddraw",
        model={"class_path": "fedweigh.models.base.FedweighNet", "args": asdict(ModelSpec())},
        min_clients=2,
        num_rounds=4,
        train_script=CLIENT_SCRIPT,
        aggregator=aggregator,
    )
    recipe.export(str(tmp_path))
    config = json.loads((tmp_path / "stock_feddraw/app/config/config_fed_server.json").read_text())
    workflow = config["workflows"][0]
    assert workflow["path"] == "nvflare.app_common.workflows.fedavg.FedAvg"  # stock FedAvg
    assert workflow["args"]["aggregator"]["path"] == "fedweigh.flare.aggregator.FedweighAggregator"
    args = workflow["args"]["aggregator"]["args"]
    assert args["scheme"] == "feddraw" and args["scheme_args"] == {"beta_max": 2.0}
    assert args["num_rounds"] == 4 and args["max_share"] == 0.5


def test_a_result_replayed_in_a_later_round_is_refused():
    """The aggregator builds a round step per round and hands each the same digest store: a site that
    sends round 1's parameters again in round 2 is left out (a fresh store each round would take it)."""
    agg = _aggregator(min_clients=1)
    for site, value in (("site-1", 1.0), ("site-2", 2.0)):
        agg.accept_model(_result(site, 10, value))
    agg.aggregate_model()
    agg.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, 1, private=True, sticky=False)
    agg.accept_model(_result("site-1", 10, 1.0))  # the same parameters as in round 1
    agg.accept_model(_result("site-2", 10, 3.0))
    agg.aggregate_model()
    assert set(agg.last_weights) == {"site-2"}


class _StockWorkflow:
    """What stock NVFlare FedAvg holds and sets: the aggregator as an argument (it never gets an
    FLContext of its own), ``num_rounds``, and its own FLContext with NUM_ROUNDS, CURRENT_ROUND and
    the global model."""

    def __init__(self, aggregator: FedweighAggregator, num_rounds: int):
        self.aggregator, self.num_rounds = aggregator, num_rounds
        self.fl_ctx = FLContext()
        self.fl_ctx.set_prop(AppConstants.NUM_ROUNDS, num_rounds, private=True, sticky=False)

    def round(self, current_round: int, g: dict, results: list[FLModel]) -> FLModel:
        self.current_round = current_round
        self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, current_round, private=True, sticky=False)
        learnable = FLModelUtils.to_model_learnable(FLModel(params_type=ParamsType.FULL, params=g))
        self.fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, learnable, private=True, sticky=True)
        self.aggregator.reset_stats()
        for r in results:
            self.aggregator.accept_model(r)
        return self.aggregator.aggregate_model()


def test_feddraw_takes_num_rounds_and_the_round_from_the_stock_workflow():
    """FedAvgRecipe(num_rounds=3, aggregator=FedweighAggregator("feddraw")): the schedules run over
    the workflow's 3 rounds, not 1 (which gave equal weights every round)."""
    from fedweigh.weighting import get_scheme
    from fedweigh.weighting.base import ClientReport

    rng = np.random.default_rng(3)
    steps = {"site-1": 2, "site-2": 5, "site-3": 3}
    agg = FedweighAggregator(scheme="feddraw", max_share=None, update_norm_bound=None, min_update_cosine=None)
    workflow = _StockWorkflow(agg, num_rounds=3)
    reference = get_scheme("feddraw")
    g = {"w": rng.normal(size=(4, 3))}
    for t in range(1, 4):
        trained = {s: {k: v + rng.normal(0, 0.1, v.shape) for k, v in g.items()} for s in steps}
        out = workflow.round(t - 1, g, [_stock_result(s, n, trained[s]) for s, n in steps.items()])
        reports = [
            ClientReport(name=s, num_samples=n, num_steps=n, params=trained[s]) for s, n in steps.items()
        ]
        w = np.asarray(reference.weights(reports, g, t, 3))
        assert agg.last_weights == pytest.approx(dict(zip(steps, w, strict=True)), abs=1e-12), t
        g = {k: np.asarray(v) for k, v in out.params.items()}
    assert max(abs(v - n / 10) for v, n in zip(agg.last_weights.values(), steps.values(), strict=True)) > 1e-3


def test_rounds_beyond_the_aggregators_num_rounds_are_warned_about():
    agg = FedweighAggregator(scheme="fedavg", num_rounds=2, min_update_cosine=None)
    warnings: list[str] = []
    agg.warning = warnings.append
    workflow = _StockWorkflow(agg, num_rounds=2)
    g = {"w": np.zeros(3)}
    for current in range(3):  # the third round is beyond num_rounds=2
        workflow.round(current, g, [_result("site-1", 10, 1.0), _result("site-2", 10, -1.0)])
    assert any("round 3 exceeds num_rounds=2" in w for w in warnings), warnings
    other = FedweighAggregator(scheme="fedavg", num_rounds=5, min_update_cosine=None)
    other.warning = (seen := []).append
    _StockWorkflow(other, num_rounds=3).round(0, g, [_result("site-1", 10, 1.0), _result("site-2", 10, 1.0)])
    assert any("num_rounds=5 but the workflow runs 3 rounds" in w for w in seen), seen


def test_without_a_global_model_the_first_round_starts_from_the_sites_mean_with_integer_buffers():
    """No global model in the context (the workflow has not set one): the round starts from the mean of
    the sites' models, each array in its dtype, so a BatchNorm step count (int64) passes the check."""
    agg = FedweighAggregator(scheme="fedavg", num_rounds=3, min_update_cosine=None)
    ctx = FLContext()
    ctx.set_prop(AppConstants.CURRENT_ROUND, 0, private=True, sticky=False)
    agg.fl_ctx = ctx
    for site, value, steps in (("site-1", 1.0, 4), ("site-2", 3.0, 6)):
        agg.accept_model(
            FLModel(
                params={
                    "w": np.full(3, value, np.float32),
                    "bn.num_batches_tracked": np.array(steps, np.int64),
                },
                meta={"client_name": site, "num_samples": 10, "NUM_STEPS_CURRENT_ROUND": 2},
            )
        )
    out = agg.aggregate_model()
    assert agg.last_weights == {"site-1": 0.5, "site-2": 0.5}
    assert out.params["w"] == pytest.approx(np.full(3, 2.0))
    assert out.params["bn.num_batches_tracked"].dtype == np.int64

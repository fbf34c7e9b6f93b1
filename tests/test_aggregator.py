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
        ("feddisco", {}, "histogram"),
        ("dafl", {"mode": "inverse_imbalance"}, "scalars"),
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
    assert free.last_weights["site-1"] > 0.99
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

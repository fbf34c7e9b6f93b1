"""The round step's encrypted path (``backend.encrypted``) at its edges, with a stand-in backend
that records what it is given: the robust options refused by name, the secure-sum minimums read
from the result meta, the sites left out of the sum, and the weights an encrypted sum needs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from fedweigh.errors import ConfigError
from fedweigh.protocol import META_MIN_SECURE_SUM, ZERO_WEIGHT
from fedweigh.server.rounds import AggregationBackend, ClientResult, PlaintextBackend, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.weighting import get_scheme

SITES = ("site-1", "site-2", "site-3")


class StandInHE(AggregationBackend):
    """An encrypted backend's interface without the encryption: contributions are taken as sent,
    ``weigh`` gives the weights it was built with (or the scheme's), ``aggregate`` records its call."""

    encrypted = True

    def __init__(self, weights: list[float] | None = None):
        self.weights = weights
        self.aggregated: list[tuple[list[str], np.ndarray]] = []

    def check_params(self, site: str, params: Mapping[str, Any] | None) -> Any:
        if not params:
            raise ValueError(f"{site}: no ciphertexts")
        return params

    def weigh(self, scheme, reports, contributions, t, T):
        if self.weights is not None:
            return np.asarray(self.weights, dtype=np.float64)
        return np.asarray(scheme.weights(list(reports), None, t, T), dtype=np.float64)

    def aggregate(self, scheme, reports, contributions, weights):
        self.aggregated.append(([r.name for r in reports], np.asarray(weights)))
        return {"clear": np.zeros(2)}

    def task_params(self) -> dict[str, Any]:
        return {}


def he_result(site: str, minimum: object = None, meta: object = "default") -> ClientResult:
    if meta == "default":
        meta = {"num_samples": 100, "NUM_STEPS_CURRENT_ROUND": 2, "fedweigh_scalars": {}}
        if minimum is not None:
            meta[META_MIN_SECURE_SUM] = minimum
    return ClientResult(site, {"ct": site.encode()}, meta, {"val_auc": 0.6})


def he_step(backend: StandInHE | None = None, **options) -> tuple[RoundStep, list[str]]:
    logged: list[str] = []
    step = RoundStep(
        get_scheme("fedavg"),
        backend or StandInHE(),
        num_rounds=3,
        safeguards=Safeguards(**options) if options else None,
        log=logged.append,
    )
    return step, logged


@pytest.mark.parametrize(
    ("option", "value"), [("krum_f", 1), ("aggregator", "median"), ("clip_norm", 1.0), ("array_cosine", 0.0)]
)
def test_a_robust_option_under_he_is_refused_by_its_name_whatever_the_trim(option, value):
    with pytest.raises(ConfigError) as refused:
        RoundStep(get_scheme("fedavg"), StandInHE(), num_rounds=3, safeguards=Safeguards(**{option: value}))
    e = refused.value
    assert (e.source, e.field, e.value) == ("round safeguards", option, value)
    assert (
        e.allowed
        == "the robust options need plaintext updates: turn them off when updates are encrypted (he=True)"
    )


def test_the_plan_tells_the_sites_the_scheme_its_scalars_and_whether_updates_are_encrypted():
    step, _ = he_step()
    assert step.plan("fedavg", {"a": 1}) == {
        "scheme": "fedavg",
        "scheme_args": {"a": 1},
        "scalars": list(step.scalars),
        "fedprox_mu": 0.0,
        "he": True,
    }
    plain = RoundStep(get_scheme("fedavg"), PlaintextBackend({"w": np.zeros(2)}), num_rounds=3)
    assert plain.plan("fedavg", {})["he"] is False


def test_a_result_whose_meta_is_not_a_mapping_is_refused_not_fatal():
    step, logged = he_step()
    outcome = step.run(1, [he_result("site-1", meta=None), *(he_result(s) for s in SITES[1:])], list(SITES))
    assert set(outcome.excluded) == {"site-1"} and outcome.excluded["site-1"].startswith("site-1: ")
    assert outcome.updated


def test_a_malformed_secure_sum_minimum_is_refused_naming_the_site():
    step, logged = he_step()
    outcome = step.run(1, [he_result("site-2", minimum=0), *(he_result(s) for s in ("site-1", "site-3"))])
    why = "site-2: its announced secure-sum minimum must be an integer >= 1, got 0"
    assert outcome.excluded == {"site-2": why}
    assert f"round 1: skipping result: {why}" in logged


def test_a_site_whose_minimum_exceeds_the_round_is_left_out_of_the_sum_and_logged():
    step, logged = he_step()
    outcome = step.run(1, [he_result("site-3", minimum=5), *(he_result(s) for s in ("site-1", "site-2"))])
    why = "its site policy needs at least 5 contributions to a secure sum, only 3 were available"
    assert outcome.excluded == {"site-3": f"site-3: {why}"}
    assert f"round 1: leaving site-3 out of the encrypted sum: {why}" in logged
    assert outcome.updated and set(outcome.weights) == {"site-1", "site-2"}


def test_too_few_weighted_updates_for_a_secure_sum_leave_the_model_unchanged_with_the_reason():
    step, logged = he_step(StandInHE(weights=[1.0, 0.0, 0.0]), max_share=None)
    outcome = step.run(1, [he_result(s) for s in SITES])
    assert not outcome.updated
    assert outcome.reason == (
        "the scheme could not weight this round (only 1 update(s) carry weight, fewer than the 2 an "
        "encrypted sum needs)"
    )
    assert logged[-1] == f"round 1: {outcome.reason}; global model unchanged"


def test_a_weight_of_exactly_zero_weight_still_carries_weight():
    weights = [ZERO_WEIGHT, 0.5, 0.5 - ZERO_WEIGHT]  # applied as they are: they already sum to 1
    backend = StandInHE(weights=weights)
    step, _ = he_step(backend, min_secure_sum=3, max_share=None)
    outcome = step.run(1, [he_result(s) for s in SITES])
    assert outcome.updated and outcome.weights["site-1"] == ZERO_WEIGHT
    assert backend.aggregated[0][0] == list(SITES)


def test_weights_the_round_cannot_apply_are_refused_naming_the_scheme():
    step, _ = he_step(StandInHE(weights=[float("nan"), 1.0, 1.0]))
    outcome = step.run(1, [he_result(s) for s in SITES])
    assert not outcome.updated
    assert outcome.reason == (
        "the scheme could not weight this round (fedavg: the weight of 'site-1' is not finite (nan))"
    )

"""Which site the round step leaves out when the aggregate fails the server's check
(``RoundStep._checked_aggregate`` and ``_culprit``), and what the round says and logs about it.

The model is x / sqrt(var) after a linear layer (``VarScale``): its outputs are NaN once a variance is
negative, so an aggregate whose mean variance is negative fails the probe, and a site's own model
fails it when its own variance is."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_round_integrity import SITES, VarScale, result

from fedweigh.server.model_check import ModelProbe
from fedweigh.server.rounds import PlaintextBackend, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.train import get_params
from fedweigh.weighting import get_scheme


def scale_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), VarScale(4))


def site_model(g: dict, var: float, weight_shift: float = 0.0) -> dict[str, np.ndarray]:
    p = {k: v.copy() for k, v in g.items()}
    p["1.var"] = np.full(4, var, np.float32)
    p["0.weight"] = (g["0.weight"] + weight_shift).astype(np.float32)
    return p


def run_round(sites: dict, scheme: str = "uniform", counts: dict | None = None, **options):
    g = get_params(scale_model())
    logged: list[str] = []
    step = RoundStep(
        get_scheme(scheme),
        PlaintextBackend(g),
        num_rounds=3,
        safeguards=Safeguards.off(**options),
        probe=ModelProbe(scale_model(), input_shape=(3,)),
        log=logged.append,
    )
    results = [result(s, site_model(g, *spec), n=(counts or {}).get(s, 100)) for s, spec in sites.items()]
    return step.run(1, results, list(sites)), logged


def test_the_culprit_is_left_out_and_each_step_is_said_and_logged():
    outcome, logged = run_round({"site-1": (1.0,), "site-2": (1.0,), "site-3": (-5.0,)})
    assert list(outcome.excluded) == ["site-3"]
    problem = (
        logged[0]
        .removeprefix("round 1: the aggregate fails the server's check (")
        .removesuffix("); looking for its cause")
    )
    assert problem != logged[0] and problem  # the log names the check that failed
    why = f"site-3: with its update the aggregate fails the server's check ({problem}); without it, it passes"
    assert outcome.excluded["site-3"] == why
    assert logged[1:] == [
        f"round 1: skipping result: {why}",
        "round 1: aggregating the 2 remaining of 3 valid results (1 left out by the safeguards)",
    ]
    assert outcome.updated and outcome.weights == {"site-1": 0.5, "site-2": 0.5}


def test_a_culprit_of_two_leaves_no_majority_and_the_model_unchanged():
    outcome, logged = run_round({"site-1": (1.0,), "site-2": (-3.0,)})
    assert list(outcome.excluded) == ["site-2"]
    assert not outcome.updated
    assert (
        outcome.reason == "the safeguards left out 1 of 2 valid result(s); 1 remain, not a majority of them"
    )
    assert logged[-1] == f"round 1: {outcome.reason}; the global model is left unchanged"


def test_an_aggregate_that_no_single_removal_mends_leaves_the_model_unchanged():
    outcome, logged = run_round({"site-1": (-1.0,), "site-2": (-1.0,), "site-3": (-1.0,)})
    assert outcome.excluded == {} and not outcome.updated
    problem = (
        logged[0]
        .removeprefix("round 1: the aggregate fails the server's check (")
        .removesuffix("); looking for its cause")
    )
    assert outcome.reason == (
        f"the aggregate fails the server's check ({problem}) and leaving out any one site does not mend it"
    )
    assert logged[-1] == f"round 1: {outcome.reason}; the global model is left unchanged"


def test_one_site_alone_has_no_culprit():
    outcome, _ = run_round({"site-1": (-1.0,)})
    assert outcome.excluded == {} and not outcome.updated
    assert outcome.reason.endswith("and leaving out any one site does not mend it")


def test_of_two_sites_whose_removal_mends_the_aggregate_the_one_whose_own_model_fails_is_left_out():
    # FedAvg weights 900 : 400 : 50 : 50 capped at half the round: 0.5, 0.4, 0.05, 0.05, so the mean
    # variance is 0.5 x (-3) + 0.4 x 0.1 + 0.05 x (-1) + 0.05 x 11 < 0. Left out, a site's share goes
    # to the others and the cap holds site-1 at 0.5 while three remain: without site-2 site-4's share
    # grows (0.5 x (-3) + 0.25 x (-1) + 0.25 x 11 > 0), without site-1 site-2 leads; without site-3 or
    # site-4 it still fails. Of the two that mend it, site-1's own model fails (var < 0) and
    # site-2's passes, though site-2's update is the larger one (its linear layer moved by 3).
    outcome, _ = run_round(
        {"site-1": (-3.0,), "site-2": (0.1, 3.0), "site-3": (-1.0,), "site-4": (11.0,)},
        scheme="fedavg",
        counts={"site-1": 900, "site-2": 400, "site-3": 50, "site-4": 50},
        max_share="auto",
    )
    assert list(outcome.excluded) == ["site-1"]
    assert outcome.updated and set(outcome.weights) == {"site-2", "site-3", "site-4"}


@pytest.mark.parametrize(
    ("shift", "left_out"),
    [
        # site-3: var -1.5, update norms (weight 0, var 5); site-4: var -1.2, (sqrt(12) x shift, 4.4).
        # Without either the mean variance is positive; both own models fail, so the larger update goes.
        (0.5, "site-3"),  # site-4 (1.73, 4.4): L2 4.73 < 5, though the sum of its norms (6.13) is larger
        (0.85, "site-4"),  # site-4 (2.94, 4.4): L2 5.29 > 5, though its sum of cubes (110.7) is smaller
    ],
)
def test_of_two_failing_sites_whose_removal_mends_the_aggregate_the_larger_update_by_l2_is_left_out(
    shift, left_out
):
    outcome, _ = run_round({"site-1": (1.0,), "site-2": (1.0,), "site-3": (-1.5,), "site-4": (-1.2, shift)})
    assert list(outcome.excluded) == [left_out]
    assert outcome.updated and len(outcome.weights) == 3


def test_of_several_sites_whose_removal_mends_the_aggregate_the_largest_update_is_left_out():
    # two honest sites (var 1) and two that each drive var negative; without either one the mean is positive
    outcome, _ = run_round({"site-1": (1.0,), "site-2": (1.0,), "site-3": (-1.5,), "site-4": (-1.6,)})
    assert list(outcome.excluded) == ["site-4"]  # the larger of the two updates (var -1.6 vs -1.5)
    assert outcome.updated and set(outcome.weights) == {"site-1", "site-2", "site-3"}
    np.testing.assert_allclose(outcome.params["1.var"], (1.0 + 1.0 - 1.5) / 3, rtol=1e-6)


class Offset(torch.nn.Module):
    """x + offset, the offset a buffer whose name the name rule does not know."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("offset", torch.zeros(n))

    def forward(self, x):
        return x + self.offset


def test_a_buffer_of_the_probe_model_is_the_sites_median_whatever_its_name():
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), Offset(4))

    g = get_params(model())
    sent = {
        s: dict(g, **{"1.offset": np.full(4, v, np.float32)})
        for s, v in zip(SITES[:3], (1.0, 2.0, 10.0), strict=True)
    }
    step = RoundStep(
        get_scheme("uniform"),
        PlaintextBackend(g),
        num_rounds=3,
        safeguards=Safeguards.off(),
        probe=ModelProbe(model(), input_shape=(3,)),
    )
    outcome = step.run(1, [result(s, p) for s, p in sent.items()], list(sent))
    np.testing.assert_array_equal(
        outcome.params["1.offset"], np.full(4, 2.0, np.float32)
    )  # not the mean 4.33

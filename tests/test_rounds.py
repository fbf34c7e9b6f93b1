import dataclasses

import numpy as np
import pytest

from fedweigh.errors import ConfigError
from fedweigh.server.loop import sample_sites
from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep, mean_metrics
from fedweigh.server.safeguards import AcceptedDigests, Safeguards, cap_weights
from fedweigh.weighting import get_scheme


def test_sampling_is_deterministic_sized_and_varies_by_round():
    sites = [f"site-{i}" for i in range(1, 51)]
    a = sample_sites(sites, 0.1, 2, seed=0, round_index=1)
    assert a == sample_sites(list(reversed(sites)), 0.1, 2, seed=0, round_index=1)
    assert len(a) == 5 and a == sorted(a)
    assert a != sample_sites(sites, 0.1, 2, seed=0, round_index=2)
    assert len(sample_sites(sites[:4], 0.1, 3, seed=0, round_index=1)) == 3  # min_clients wins
    assert sample_sites(sites[:4], 1.0, 1, 0, 1) == sorted(sites[:4])


@pytest.mark.parametrize(
    "w, cap, expected",
    [
        ([0.7, 0.2, 0.1], 0.5, [0.5, 0.2 + 0.2 * 2 / 3, 0.1 + 0.2 / 3]),
        ([0.25, 0.25, 0.25, 0.25], 0.3, [0.25] * 4),
        ([0.9, 0.1], 0.3, [0.5, 0.5]),  # a cap below 1/K cannot hold: uniform
        ([0.6, 0.38, 0.02], 0.4, [0.4, 0.4, 0.2]),  # the excess cascades onto the next site
    ],
)
def test_cap_weights(w, cap, expected):
    out = cap_weights(np.array(w), cap)
    assert out == pytest.approx(expected)
    assert out.sum() == pytest.approx(sum(w))


def test_cap_keeps_fednova_scale():
    out = cap_weights(np.array([1.4, 0.2, 0.2]), 0.5)
    assert out.sum() == pytest.approx(1.8) and out.max() == pytest.approx(0.9)


def _result(site: str, n: int, w: np.ndarray) -> ClientResult:
    return ClientResult(site, {"w": w}, {"num_samples": n, "NUM_STEPS_CURRENT_ROUND": 1})


def _round(scheme, g, results, max_share=None):
    # the updates here are opposite on purpose: no direction check
    safeguards = Safeguards(max_share=max_share, min_update_cosine=None)
    step = RoundStep(scheme, PlaintextBackend(g), num_rounds=3, safeguards=safeguards)
    return step.run(1, results, [r.site for r in results])


def test_round_step_with_cap_bounds_an_inflated_site():
    g = {"w": np.zeros(3, np.float32)}
    results = [
        _result("site-1", 1_000_000, np.ones(3, np.float32)),
        _result("site-2", 100, -np.ones(3, np.float32)),
        _result("site-3", 100, -np.ones(3, np.float32)),
    ]
    scheme = get_scheme("fedavg")
    free = _round(scheme, g, results)
    capped = _round(scheme, g, results, max_share=0.4)
    # no cap: only the count clip (N_k at most 100 x the median of the others) bounds it
    assert free.weights["site-1"] == pytest.approx(10_000 / 10_200)
    assert capped.weights["site-1"] == pytest.approx(0.4)
    assert capped.params["w"] == pytest.approx(np.full(3, 0.4 - 0.6))


def test_plan_and_metric_means():
    def plan(name, **options):
        return RoundStep(get_scheme(name, **options), PlaintextBackend({}), num_rounds=1).plan(name, options)

    fedprox = plan("fedprox")
    assert fedprox["fedprox_mu"] == pytest.approx(0.01) and fedprox["scalars"] == []
    assert plan("cbr", gamma=1.0)["scalars"] == ["skew"]
    assert mean_metrics([{"a": 1.0, "b": float("nan")}, {"a": 3.0}]) == {"a": 2.0}


@pytest.mark.parametrize("steps", [0, -4, 10**12, float("nan")])
def test_round_step_leaves_out_a_site_with_an_impossible_step_count(steps):
    """FedNova weighs by the reported local steps: a site reporting an impossible count is left out."""
    g = {"w": np.zeros(3)}
    results = [
        ClientResult("site-1", {"w": np.ones(3)}, {"num_samples": 10, "NUM_STEPS_CURRENT_ROUND": 2}),
        ClientResult("site-2", {"w": np.ones(3)}, {"num_samples": 10, "NUM_STEPS_CURRENT_ROUND": 2}),
        ClientResult("site-3", {"w": -np.ones(3)}, {"num_samples": 10, "NUM_STEPS_CURRENT_ROUND": steps}),
    ]
    step = RoundStep(
        get_scheme("fednova"), PlaintextBackend(g), num_rounds=3, safeguards=Safeguards(min_clients=2)
    )
    outcome = step.run(1, results, ["site-1", "site-2", "site-3"])
    assert set(outcome.excluded) == {"site-3"}
    assert "NUM_STEPS_CURRENT_ROUND" in outcome.excluded["site-3"]
    assert set(outcome.weights) == {"site-1", "site-2"}
    assert outcome.params["w"] == pytest.approx(np.ones(3))  # only the two valid sites moved it


def test_a_round_does_not_depend_on_the_order_in_which_results_arrive():
    """With three or more sites, float sums depend on their order: the weights' normaliser, the aggregate
    and the mean metrics are formed in site order, so that two runs with the same inputs record the same
    values to the last bit whichever site answers first."""
    rng = np.random.default_rng(3)
    g = {"w": rng.normal(size=64).astype(np.float32)}
    results = [
        ClientResult(
            f"site-{k}",
            {"w": (g["w"] + rng.normal(0, 0.1, 64)).astype(np.float32)},
            {"num_samples": n, "NUM_STEPS_CURRENT_ROUND": 2},
            {"val_auc": v, "val_loss": 1.0 / 3.0 * k},
        )
        for k, n, v in ((1, 7, 0.1), (2, 11, 0.2), (3, 13, 0.3))
    ]
    assert 0.1 + 0.2 + 0.3 != 0.3 + 0.2 + 0.1  # the sums this guards against
    outcomes = []
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        step = RoundStep(get_scheme("fedavg"), PlaintextBackend(g), num_rounds=3)
        outcomes.append(step.run(1, [results[i] for i in order], ["site-1", "site-2", "site-3"]))
    first = outcomes[0]
    for other in outcomes[1:]:
        assert other.weights == first.weights
        assert other.metrics == first.metrics
        np.testing.assert_array_equal(other.params["w"], first.params["w"])


def test_a_round_step_is_fixed_at_construction():
    """Every input of a step is given to its constructor: nothing can be set on it afterwards, and its
    safeguards are frozen (an adapter that changed a step after building it would fail here)."""
    step = RoundStep(get_scheme("fedavg"), PlaintextBackend({}), num_rounds=2)
    for name, value in (
        ("safeguards", Safeguards(min_clients=3)),
        ("min_secure_sum", 5),
        ("digests", AcceptedDigests()),
        ("num_rounds", 3),
    ):
        with pytest.raises(AttributeError, match="fixed at construction"):
            setattr(step, name, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.safeguards.min_secure_sum = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.safeguards.limits.max_num_samples = 1  # type: ignore[misc]
    assert step.safeguards == Safeguards() and step.num_rounds == 2


@pytest.mark.parametrize(
    "option, value",
    [
        ("max_share", 1.5),
        ("max_share", "half"),
        ("update_norm_bound", 0.5),
        ("min_update_cosine", 2.0),
        ("min_secure_sum", 1),
        ("min_clients", 0),
    ],
)
def test_every_entry_point_refuses_a_bad_safeguard_with_the_same_rule(option, value):
    """One rule per option (fedweigh.checks.check_server_values), one error style, wherever it is set:
    the round step's Safeguards, the controller, the stock-FedAvg aggregator, a recipe and the bench."""
    from fedweigh.bench import make_config
    from fedweigh.bench.config import bench_safeguards
    from fedweigh.flare.aggregator import FedweighAggregator
    from fedweigh.flare.controller import FedweighController
    from fedweigh.flare.recipes import FedweighRecipe

    entry_points = {
        "round safeguards": lambda: Safeguards(**{option: value}),
        "FedweighController": lambda: FedweighController(**{option: value}),
        "bench": lambda: make_config(
            "smoke", "synthcxr", safeguards=bench_safeguards("deploy", **{option: value})
        ),
    }
    if option not in ("min_secure_sum",):
        entry_points["FedweighAggregator"] = lambda: FedweighAggregator(**{option: value})
    entry_points["recipe 'r'"] = lambda: FedweighRecipe(name="r", **{option: value})
    allowed = set()
    for source, build in entry_points.items():
        with pytest.raises(ConfigError) as info:
            build()
        assert info.value.field == option and info.value.value == value, source
        # a recipe checks the options it reads itself; the others, the controller it builds
        sources = (source, "FedweighController") if source.startswith("recipe") else (source,)
        assert str(info.value).startswith(tuple(f"{s}: {option} = " for s in sources)), str(info.value)
        allowed.add(info.value.allowed)
    assert len(allowed) == 1, allowed  # the same rule said the same way everywhere

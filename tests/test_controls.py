"""The attribution controls: uniform averaging, FedDRAW without its similarity, without its annealing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedweigh.methods import CONTROLS, METHODS, parse_method
from fedweigh.weighting import ClientReport, get_scheme


def _reports(sizes, scalars=None) -> list[ClientReport]:
    return [
        ClientReport(name=f"site-{i + 1}", num_samples=int(n), scalars=dict(scalars or {}))
        for i, n in enumerate(sizes)
    ]


@pytest.mark.parametrize("sizes", [[10], [5, 500], [3, 40, 40, 1000], list(range(2, 52))])
def test_uniform_weights_are_one_over_k_whatever_the_sizes(sizes):
    scheme = parse_method("uniform").make_scheme()
    for t in (1, 3, 5):
        w = scheme.weights(_reports(sizes), None, t, 5)
        np.testing.assert_array_equal(w, np.full(len(sizes), 1.0 / len(sizes)))


def _beta(t: int, T: int, rho: float = 0.6) -> float:
    """The deferred cosine anneal, written out: 1 until rho T, then (1 + cos(pi x)) / 2."""
    t_d = rho * T
    if t <= t_d:
        return 1.0
    return (1 + math.cos(math.pi * (t - t_d) / (T - t_d))) / 2


def test_feddraw_nosim_weights_are_the_size_prior_under_the_outer_schedule():
    sizes = np.array([600.0, 150.0, 150.0, 100.0])
    p = sizes / sizes.sum()
    scheme = parse_method("feddraw-nosim").make_scheme()
    T = 10
    for t in range(1, T + 1):
        w = scheme.weights(_reports(sizes), None, t, T)  # no parameters, no similarity: none needed
        expected = p ** _beta(t, T) / np.sum(p ** _beta(t, T))
        np.testing.assert_allclose(w, expected, rtol=1e-12)
    assert t == T and np.allclose(w, 0.25)  # beta_T = 0: the last round is uniform
    assert scheme.scalars(encrypted=True) == ()  # no site computes a similarity


def test_feddraw_noanneal_keeps_its_weights_off_uniform_at_the_end():
    sizes = [600, 150, 150, 100]
    T = 6
    # similarity reported by the sites (the HE path): site-1 the most similar
    reports = _reports(sizes, {"similarity": 0.0})
    for rep, s in zip(reports, (0.9, 0.1, 0.2, 0.3), strict=True):
        rep.scalars["similarity"] = s
    noanneal, default = parse_method("feddraw-noanneal").make_scheme(), parse_method("feddraw").make_scheme()
    w_no = noanneal.weights(reports, None, T, T)
    w_def = default.weights(reports, None, T, T)
    np.testing.assert_allclose(w_def, 0.25)  # the default anneals to 1/K
    assert noanneal.last_details["beta"] == 1.0 and default.last_details["beta"] == 0.0
    assert np.max(np.abs(w_no - 0.25)) > 0.05 and w_no[0] == w_no.max()


def test_the_controls_are_catalogue_variants_with_the_right_parts():
    assert CONTROLS == ("uniform", "feddraw-nosim", "feddraw-noanneal")
    assert METHODS["uniform"].scheme == "uniform" and METHODS["feddraw-nosim"].scheme_args == {
        "similarity": "off"
    }
    assert METHODS["feddraw-noanneal"].scheme_args == {"rho": 1.0}
    assert get_scheme("uniform").he_compatible and not parse_method("uniform").needs_statistics()
    # the paper's FedBB (SGD) is expressible, with options on top
    assert parse_method("fedbb-paper:lr=0.02").client_options == {
        "optimizer": "sgd",
        "lr": 0.02,
        "momentum": 0.9,
    }
    assert parse_method("feddraw-nosim:beta_max=2").scheme_args == {"similarity": "off", "beta_max": 2}


@pytest.mark.parametrize("name", CONTROLS)
def test_each_control_runs_as_a_recipe(name):
    from fedweigh.flare.recipes import MethodRecipe

    recipe = MethodRecipe(method=name, num_rounds=2, min_clients=2)
    options = recipe.server_options
    assert options.scheme == METHODS[name].scheme
    assert (options.scheme_args or {}) == METHODS[name].scheme_args


def test_the_controls_run_as_bench_cells():
    from fedweigh.bench.cells import settings_hash
    from fedweigh.bench.config import make_config
    from fedweigh.bench.modes import run_cell

    config = make_config(
        "smoke",
        "synthcxr",
        methods=list(CONTROLS),
        scenarios=["noisy-large"],
        sites=["site-1", "site-2"],
        rounds=2,
    )
    assert len({settings_hash(config, "noisy-large", m, 0) for m in CONTROLS}) == 3
    record, _, _ = run_cell(config, "noisy-large", "uniform", 0)
    trained = [r for r in record["rows"] if "weights" in r]
    assert len(trained) == 2 and all(np.allclose(list(r["weights"].values()), 0.5) for r in trained)
    # every cell records its per-hospital outcomes (the two sites of the run)
    assert set(record["site_auc"]) == {"site-1", "site-2"} and record["site_images"]["site-1"] > 100
    record, _, _ = run_cell(config, "noisy-large", "feddraw-nosim", 0)
    first = [r for r in record["rows"] if "weights" in r][0]["weights"]
    assert first["site-1"] > 0.7  # round 1: the size prior (site-1 holds 55 of the 70%)

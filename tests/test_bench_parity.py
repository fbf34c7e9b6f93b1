"""The bench and `nvflare simulator` give the same per-round metrics and weights for the same job."""

from __future__ import annotations

import math

import pytest
from simulation import TINY_CLIENT, TINY_ROUNDS

from fedweigh.bench import make_config, run_cell
from fedweigh.flare.jobs import _job
from fedweigh.site.args import ClientArgs

TINY = TINY_CLIENT  # the simulator runs are the shared method runs of conftest.py
ROUNDS = TINY_ROUNDS
SITES = ("site-1", "site-2")


def _bench_rows(method: str) -> list[dict]:
    config = make_config(
        "smoke",
        "synthcxr",
        methods=[method],
        scenarios=[TINY.scenario],
        seeds=[TINY.seed],
        sites=SITES,
        rounds=ROUNDS,
        num_images=TINY.num_images,
        size=TINY.size,
        max_steps=TINY.max_steps,
        batch_size=TINY.batch_size,
        threads=1,
        safeguards="deploy",  # the simulator's controller runs with its defaults
        exact_statistics=True,  # as the simulated sites' policy (simulation.run_recipe_in_simulator)
    )
    record, _, _ = run_cell(config, TINY.scenario, method, TINY.seed)
    return record["rows"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["feddraw", "fedbb"])  # fedbb adds statistics phase, PNB loss, scalars
def test_bench_matches_the_simulator(method, method_run):
    sim_rows, _ = method_run(method)
    bench_rows = _bench_rows(method)
    sim = {r["round"]: r for r in sim_rows}
    bench = {r["round"]: r for r in bench_rows}
    assert sorted(sim) == sorted(bench) == list(range(ROUNDS + 1))
    for t in range(ROUNDS + 1):
        # the same records: test_*, val_*, train_loss (rounds < T), weights and schedule values (t >= 1)
        # server-only records: the server process's memory, and which results it left out (none here)
        sim_keys = {
            k for k in sim[t] if not k.startswith("server_") and k not in ("excluded", "global_updated")
        }
        if t >= 1:
            assert sim[t]["excluded"] == {} and sim[t]["global_updated"] is True
        assert set(bench[t]) == sim_keys, (t, set(bench[t]) ^ sim_keys)
        assert ("train_loss" in bench[t]) == (t < ROUNDS)
        assert all(k in bench[t] for k in ("test_auc", "test_gm", "test_loss", "val_auc", "val_gm"))
        for key, value in bench[t].items():
            if key in ("round", "round_seconds", "weights"):
                continue
            # docs/bench.md: with one torch thread per site they agree to the last digit
            if math.isnan(value):
                assert math.isnan(sim[t][key]), (t, key)
            else:
                assert value == sim[t][key], (t, key, value - sim[t][key])
        if t >= 1:
            assert bench[t]["weights"] == sim[t]["weights"], t
    # the sites' shares differ in this scenario: the weights are not all equal in every round
    assert any(len(set(bench[t]["weights"].values())) > 1 for t in range(1, ROUNDS + 1))


def _recipe_controller(recipe):
    return recipe._job._deploy_map["server"].app_config.workflows[0].controller


@pytest.mark.parametrize(
    "method",
    ["feddraw", "fedbb", "dafl", "fedavg", "fedprox", "fednova", "fedadp", "ida", "feddisco", "fedawa"],
)
def test_bench_methods_are_the_recipes(method):
    """Scheme, loss and statistics phase of every bench method equal those of its NVFlare recipe."""
    from fedweigh.bench import parse_method

    recipe = _job(method, ClientArgs(), rounds=2, sites=2)(f"check_{method}")
    controller = _recipe_controller(recipe)
    spec = parse_method(method)
    assert (spec.scheme, spec.scheme_args) == (controller.scheme, controller.scheme_args)
    assert spec.loss == recipe.client_args.loss
    runs_statistics = controller.statistics != "none" and (
        controller._scheme.needs_global_histogram or controller.loss_needs_global_stats
    )
    assert spec.needs_statistics() == runs_statistics

"""Honest federations lose nothing to the safeguards: the shipped jobs' setting (quantity-shift, four
sites, min_clients = 4, every default safeguard on), shortened, leaves out no site and discards no
round (in-process sites, the controller's round loop and round step)."""

from __future__ import annotations

import pytest

from fedweigh.bench.config import cell_args, make_config
from fedweigh.bench.federations import federation_for
from fedweigh.bench.modes import run_federated
from fedweigh.server.records import RoundRecorder
from fedweigh.server.safeguards import Safeguards

ROUNDS = 5


def honest_run(method: str, num_images: int) -> tuple[list[dict], list[int]]:
    """The shipped jobs' client settings (32 px, batch 32, one epoch per round, quantity-shift) on
    ``num_images`` images, with the jobs' server defaults: min_clients = 4 and every safeguard on."""
    config = make_config(
        "smoke",
        scenarios=["quantity-shift"],
        methods=[method],
        seeds=[0],
        rounds=ROUNDS,
        num_images=num_images,
        size=32,
        batch_size=32,
        max_steps=100_000,  # one full epoch per round, as the jobs' clients train
        safeguards=Safeguards(min_clients=4),
    )
    spec = config.spec(method)
    fed = federation_for(config, "quantity-shift", 0)
    recorder = RoundRecorder(None, method)
    run_federated(spec, fed, cell_args(config, "quantity-shift", 0, spec), config, False, recorder)
    return recorder.rows, [len(s.train) for s in fed.sites]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["feddraw", "fedbb"])  # make demo's job, and jobs/synthcxr_fedbb
def test_the_shipped_jobs_defaults_leave_out_no_honest_site_and_lose_no_round(method):
    rows, sizes = honest_run(method, 1200)
    assert min(sizes) * 10 < max(sizes)  # a small site next to large ones, as in the jobs
    training = [r for r in rows if r["round"] >= 1]
    assert [r["round"] for r in training] == list(range(1, ROUNDS + 1))
    left_out = {r["round"]: r["excluded"] for r in training if r["excluded"]}
    assert left_out == {}  # 0 honest site-rounds left out
    assert all(r["global_updated"] for r in training)  # 0 rounds lost
    assert all(len(r["weights"]) == 4 for r in training)

import os

import pytest
import torch

torch.set_num_threads(1)
# the simulator and the data loaders read this; tests keep generated data in one folder outside git
os.environ.setdefault("FEDWEIGH_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache", "test-data"))


@pytest.fixture(scope="session")
def simulator():
    """Run a recipe through `nvflare simulator` (as a user would) and return the server's metric rows."""
    from simulation import run_recipe_in_simulator

    return run_recipe_in_simulator


@pytest.fixture(scope="session")
def method_run(tmp_path_factory):
    """``method_run(method) -> (rows, server app dir)``: the method's 3-round tiny SynthCXR job in the
    simulator with 2 sites, run once per session and shared by every test (and xdist worker) that needs it."""
    from simulation import cached_run

    from fedweigh.flare.jobs import _job

    # one folder for the whole session, shared by pytest-xdist workers (their base temps are siblings)
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "method_runs"

    def run(method: str):
        from simulation import TINY_CLIENT, TINY_ROUNDS

        return cached_run(
            method, lambda: _job(method, TINY_CLIENT, TINY_ROUNDS, 2)(f"tiny_{method}"), root, 2
        )

    return run

import os

import pytest
import torch

# ---------------------------------------------------------------------------------- test layout
# `make test` runs `pytest -n 2 --dist loadgroup --no-loadscope-reorder`: xdist hands the workers one
# unit at a time in the order below. A unit is a whole module (its tests share module fixtures, e.g.
# the provisioned federation of test_poc or the faulty run of test_failures), except the simulator
# tests of SPREAD_MODULES, each its own unit, so that the simulator runs spread over both workers.
# The longest units go first so that the short ones fill in at the end.
LONG_MODULES = ("test_poc", "test_failures")
SPREAD_MODULES = (
    "test_resume",
    "test_bench_parity",
    "test_parity_stock_fedavg",
    "test_he_simulator",
    "test_simulator_jobs",
)
FIRST_FAST_MODULES = ("test_bench", "test_explain", "test_controller_run", "test_train", "test_privacy")


def _unit(item: pytest.Item) -> tuple[tuple, str | None]:
    """(sort key, xdist group or None for a unit of its own) of a test."""
    module = item.module.__name__ if item.module is not None else item.nodeid
    if module in LONG_MODULES:
        return (0, LONG_MODULES.index(module)), module
    if module in SPREAD_MODULES and item.get_closest_marker("slow"):
        return (1, SPREAD_MODULES.index(module)), None
    rank = FIRST_FAST_MODULES.index(module) if module in FIRST_FAST_MODULES else len(FIRST_FAST_MODULES)
    return (2, rank), module


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    keyed = []
    for position, item in enumerate(items):
        key, group = _unit(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        keyed.append((key, position, item))
    items[:] = [item for _, _, item in sorted(keyed, key=lambda k: (k[0], k[1]))]


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

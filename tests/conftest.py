import os

import pytest
import torch

torch.set_num_threads(1)
# the simulator and the data loaders read this; tests keep generated data in a per-session folder
os.environ.setdefault("FEDWEIGH_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache", "test-data"))


@pytest.fixture(scope="session")
def simulator():
    """Run a recipe through `nvflare simulator` (as a user would) and return the server's metric rows."""
    from simulation import run_recipe_in_simulator

    return run_recipe_in_simulator

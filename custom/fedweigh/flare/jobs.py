"""The committed job folders under ``jobs/``, each defined once here and exported from its recipe.

``fedweigh jobs export`` rewrites ``jobs/`` from this catalogue; a test keeps the committed folders
equal to a fresh export.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from fedweigh.flare.client import ClientArgs

#: Settings of the SynthCXR jobs: 4 hospitals with quantity skew and acquisition shift, compact DenseNet.
SYNTHCXR_CLIENT = ClientArgs(dataset="synthcxr", scenario="quantity-shift", num_images=12000, epochs=1)
SYNTHCXR_ROUNDS = 5
SYNTHCXR_SITES = 4

#: Real-data jobs read the user's data from the path in these environment variables (expanded at the site).
CHESTMNIST_CLIENT = ClientArgs(
    dataset="chestmnist", scenario="quantity-shift", data_path="$FEDWEIGH_CHESTMNIST", size=64
)
CHEXPERT_CLIENT = ClientArgs(
    dataset="chexpert", scenario="quantity-shift", data_path="$FEDWEIGH_CHEXPERT", size=64
)


def _job(method: str, client: ClientArgs, rounds: int, sites: int) -> Callable:
    def make(name: str):
        from fedweigh.flare import recipes

        common = {"name": name, "num_rounds": rounds, "min_clients": sites, "client": client}
        if method == "feddraw":
            return recipes.FedDRAWRecipe(**common)
        if method == "fedbb":
            return recipes.FedBBRecipe(**common)
        if method == "dafl":
            return recipes.DAFLRecipe(**common)
        return recipes.BaselineRecipe(baseline=method, **common)

    return make


#: The methods with one SynthCXR job each.
METHODS = ("feddraw", "fedbb", "dafl", "fedavg", "fedprox", "fednova", "fedadp", "ida", "feddisco", "fedawa")

#: job folder name -> factory(name) -> Recipe
JOB_CATALOGUE: dict[str, Callable] = {
    **{f"synthcxr_{m}": _job(m, SYNTHCXR_CLIENT, SYNTHCXR_ROUNDS, SYNTHCXR_SITES) for m in METHODS},
    "chestmnist_feddraw": _job("feddraw", CHESTMNIST_CLIENT, 10, 4),
    "chexpert_feddraw": _job("feddraw", CHEXPERT_CLIENT, 10, 4),
}


def export_jobs(out_dir: str | Path = "jobs", names: list[str] | None = None) -> list[Path]:
    """Export the catalogue's jobs into ``out_dir`` (each folder replaced whole)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = names or sorted(JOB_CATALOGUE)
    unknown = [n for n in names if n not in JOB_CATALOGUE]
    if unknown:
        raise KeyError(f"unknown job(s) {unknown}; known: {sorted(JOB_CATALOGUE)}")
    written = []
    for name in names:
        recipe = JOB_CATALOGUE[name](name)
        with tempfile.TemporaryDirectory() as tmp:
            recipe.export(tmp)
            target = out_dir / name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(Path(tmp) / name, target)
        written.append(target)
    return written

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


def _synthcxr(scheme: str, **kwargs) -> Callable:
    def make(name: str):
        from fedweigh.flare.recipes import FedweighRecipe

        return FedweighRecipe(
            name=name,
            scheme=scheme,
            num_rounds=SYNTHCXR_ROUNDS,
            min_clients=SYNTHCXR_SITES,
            client=kwargs.pop("client", SYNTHCXR_CLIENT),
            **kwargs,
        )

    return make


#: job folder name -> factory(name) -> Recipe
JOB_CATALOGUE: dict[str, Callable] = {
    "synthcxr_fedavg": _synthcxr("fedavg"),
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

"""``fedweigh bench``: the FedDRAW evaluation protocol (scenarios x methods x seeds) in one process.

    from fedweigh.bench import make_config, run_bench

    config = make_config("smoke", "synthcxr")
    result = run_bench(config, "bench-out")
    result.summary["avg_rank_auc"]

Every cell trains with :class:`fedweigh.site.trainer.SiteTrainer` and weights with :mod:`fedweigh.server.rounds`, the
code the NVFlare client and controller run. Outputs are described in :mod:`fedweigh.bench.report`.
"""

from __future__ import annotations

from fedweigh.bench.profiles import PROFILES, Profile, get_profile
from fedweigh.bench.runner import BenchConfig, BenchResult, cell_key, make_config, run_bench, run_cell
from fedweigh.errors import BenchError
from fedweigh.methods import (
    ALL_METHODS,
    FEDERATED_METHODS,
    REFERENCE_METHODS,
    MethodSpec,
    parse_method,
)

__all__ = [
    "ALL_METHODS",
    "FEDERATED_METHODS",
    "PROFILES",
    "REFERENCE_METHODS",
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "MethodSpec",
    "Profile",
    "cell_key",
    "get_profile",
    "make_config",
    "parse_method",
    "run_bench",
    "run_cell",
]

"""``fedweigh bench``: the FedDRAW evaluation protocol (scenarios x methods x seeds) in one process.

    from fedweigh.bench import make_config, run_bench

    config = make_config("smoke", "synthcxr")
    result = run_bench(config, "bench-out")
    result.summary["avg_rank_auc"]

Every cell trains with :class:`fedweigh.site.trainer.SiteTrainer` and runs its rounds with
:func:`fedweigh.server.loop.run_rounds`, the code the NVFlare client and controller run. The modules:
:mod:`~fedweigh.bench.config` (what defines a benchmark), :mod:`~fedweigh.bench.cells` (stored cells
and their settings hash), :mod:`~fedweigh.bench.federations`, :mod:`~fedweigh.bench.sites` (the
in-process transport), :mod:`~fedweigh.bench.modes` (one cell: federated, centralized, local),
:mod:`~fedweigh.bench.tuning`, :mod:`~fedweigh.bench.cluster` (where cells run) and
:mod:`~fedweigh.bench.runner` (:func:`run_bench`). Outputs are described in :mod:`fedweigh.bench.report`.
"""

from __future__ import annotations

from fedweigh.bench.cells import cell_key
from fedweigh.bench.config import BenchConfig, Tuning, bench_safeguards, make_config
from fedweigh.bench.modes import run_cell
from fedweigh.bench.profiles import PROFILES, Profile, get_profile
from fedweigh.bench.runner import BenchResult, run_bench
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
    "Tuning",
    "bench_safeguards",
    "cell_key",
    "get_profile",
    "make_config",
    "parse_method",
    "run_bench",
    "run_cell",
]

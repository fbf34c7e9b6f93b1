"""The server's side of one federated round, without NVFlare: sampling, plan, weighting, aggregation.

:class:`~fedweigh.flare.controller.FedweighController` and the in-process benchmark both call these,
so a simulator run and a benchmark run weight and aggregate identically.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedweigh.weighting.base import ClientReport, WeightingScheme


def sample_sites(
    all_sites: Sequence[str], fraction: float, min_clients: int, seed: int, round_index: int
) -> list[str]:
    """Deterministic per-round sample of max(min_clients, ceil(fraction * K)) sites, in name order."""
    sites = sorted(all_sites)
    k = min(len(sites), max(min_clients, math.ceil(fraction * len(sites))))
    if k >= len(sites):
        return sites
    rng = random.Random(seed * 7_919 + round_index)
    return sorted(rng.sample(sites, k))


def client_plan(scheme_name: str, scheme_args: Mapping, scheme: WeightingScheme) -> dict:
    """What the server sends sites with each training task: the scheme, the scalars it needs from
    them, and the FedProx coefficient (0 unless the scheme is FedProx)."""
    return {
        "scheme": scheme_name,
        "scheme_args": dict(scheme_args),
        "scalars": list(scheme.required_scalars),
        "fedprox_mu": float(getattr(scheme, "client_mu", 0.0) or 0.0),
    }


def mean_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per key, the mean of the finite values the sites reported."""
    keys = sorted({k for m in metrics for k in m})
    out: dict[str, float] = {}
    for k in keys:
        vals = [float(m[k]) for m in metrics if k in m]
        vals = [v for v in vals if math.isfinite(v)]
        if vals:
            out[k] = float(np.mean(vals))
    return out


@dataclass
class RoundUpdate:
    """The outcome of weighting one round: the new global parameters and what to record."""

    params: dict[str, np.ndarray]
    weights: dict[str, float]
    values: dict[str, float]


def weigh_and_aggregate(
    scheme: WeightingScheme,
    global_params: dict[str, np.ndarray],
    reports: Sequence[ClientReport],
    round_index: int,
    num_rounds: int,
) -> RoundUpdate:
    """theta_g^t = scheme.aggregate(theta_g^{t-1}, reports, scheme.weights(...)); ValueError if the
    scheme cannot weight this round (the caller keeps the last good global model)."""
    weights = np.asarray(scheme.weights(reports, global_params, round_index, num_rounds), dtype=float)
    new_params = scheme.aggregate(global_params, reports, weights)
    values = {
        k: float(v)
        for k, v in (scheme.last_details or {}).items()
        if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
    }
    return RoundUpdate(
        params={k: np.asarray(v) for k, v in new_params.items()},
        weights={rep.name: float(w) for rep, w in zip(reports, weights, strict=True)},
        values=values,
    )

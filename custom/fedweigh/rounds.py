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


def cap_weights(weights: np.ndarray, max_share: float) -> np.ndarray:
    """Bound any one site's share of the total weight by ``max_share`` (water-filling).

    Shares s = w / sum(w) above the cap are set to it and the excess is given to the other sites in
    proportion to their shares, repeated until no share exceeds the cap; the result is rescaled to the
    original sum (FedNova's weights need not sum to 1). A cap below 1/K cannot hold and becomes 1/K.
    This bounds the influence of a site that inflates its sample count or statistics.
    """
    w = np.asarray(weights, dtype=np.float64)
    total = float(w.sum())
    if w.size == 0 or total <= 0 or not 0 < max_share < 1:
        return w
    cap = max(max_share, 1.0 / w.size)
    s = w / total
    capped = np.zeros(w.size, dtype=bool)
    for _ in range(w.size):
        over = (s > cap + 1e-15) & ~capped
        if not over.any():
            break
        capped |= over
        free = ~capped
        excess = 1.0 - cap * capped.sum()
        base = s[free].sum()
        s[capped] = cap
        if free.any():
            s[free] = s[free] / base * excess if base > 0 else excess / free.sum()
    return s * total


def scheme_values(scheme: WeightingScheme) -> dict[str, float]:
    """The scalar entries of the scheme's last ``weights`` call (e.g. FedDRAW's lambda and beta)."""
    return {
        k: float(v)
        for k, v in (scheme.last_details or {}).items()
        if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
    }


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
    max_share: float | None = None,
) -> RoundUpdate:
    """theta_g^t = scheme.aggregate(theta_g^{t-1}, reports, w), w = scheme.weights(...) capped at
    ``max_share`` of the total per site when given; ValueError if the scheme cannot weight this round
    (the caller keeps the last good global model)."""
    weights = np.asarray(scheme.weights(reports, global_params, round_index, num_rounds), dtype=float)
    if max_share is not None:
        weights = cap_weights(weights, max_share)
    new_params = scheme.aggregate(global_params, reports, weights)
    return RoundUpdate(
        params={k: np.asarray(v) for k, v in new_params.items()},
        weights={rep.name: float(w) for rep, w in zip(reports, weights, strict=True)},
        values=scheme_values(scheme),
    )

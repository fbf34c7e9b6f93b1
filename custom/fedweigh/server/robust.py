"""Robust aggregation and per-array checks that compose with the weighting schemes (plaintext only).

A scheme gives weights w_k >= 0 with total W = sum_k w_k (1 for most schemes, FedNova's effective
step count for FedNova). The round step's default is the scheme's weighted mean,
theta_g + sum_k w_k Delta_k. The options here replace or precede it, keeping the scheme's weights:

- :func:`weighted_median`: per coordinate, the weighted median of Delta_k with weights p_k = w_k / W,
  scaled back by W (theta_g + W med_p(Delta)). Breakdown point: a set of sites holding less than half
  of the weight cannot move a coordinate outside the range of the others' values (with equal
  weights, the coordinate-wise median of Yin et al., ICML 2018).
- :func:`weighted_trimmed_mean`: per coordinate, the weighted mean of Delta_k after removing weight
  mass ``trim`` from each tail (fractional at the boundary); trim 0 is the scheme's mean, trim -> 1/2
  the median. Sites holding less than ``trim`` of the weight cannot move a coordinate outside the
  others' range (Yin et al., 2018, with weights).
- :func:`multi_krum`: the m = K - f updates with the lowest Krum scores (sum of squared distances to
  their K - f - 2 nearest neighbours) are kept, the others left out; the scheme then weights the kept
  ones (Blanchard et al., NeurIPS 2017; El Mhamdi et al., ICML 2018). Its guarantee needs K >= 2f + 3.
- :func:`array_direction_outliers`: the direction check of
  :func:`fedweigh.server.safeguards.direction_outliers` applied to each array alone, so that an update
  that flips only a few arrays (the classifier) is caught; the flagged arrays of that update are left
  out (their Delta set to 0), the rest of the update counts.
- :func:`nearest_neighbour_mixing`: each update replaced by the mean of its K - f nearest updates
  (itself included) before the robust location or the scheme's mean (NNM, Allouah et al., AISTATS
  2023, "Fixing by Mixing"; ByzFL's ``NNM``): the published fix for robust aggregation on
  heterogeneous data.
- :func:`clip_factor`: clipping to an absolute L2 norm C over the whole update (every floating-point
  array flattened), factor min(1, C / ||Delta_k||), as Flower's ``DifferentialPrivacyServerSideFixedClipping``
  (``flwr.common.differential_privacy.clip_inputs``, the FlatClip of McMahan et al., ICLR 2018) does.

Costs: the median and trimmed mean sort K values per coordinate (O(P K log K) for P parameters, K x P
float64 memory); multi-Krum and the per-array check need the K x K Gram matrices (O(K^2 P)).
docs/security.md gives the measured cost in accuracy and what each bounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedweigh.server.safeguards import Safeguards, direction_outliers
from fedweigh.weighting.geometry import delta_gram64, delta_norms

__all__ = [
    "AGGREGATORS",
    "MIN_CHECKED_ARRAY_SIZE",
    "RobustAggregation",
    "Screening",
    "array_direction_outliers",
    "array_grams",
    "clip_factor",
    "krum_scores",
    "multi_krum",
    "nearest_neighbour_mixing",
    "screen_updates",
    "weighted_median",
    "weighted_trimmed_mean",
]

#: The round step's ``aggregator`` option: the scheme's weighted mean, or a robust location per
#: coordinate with the scheme's weights.
AGGREGATORS: tuple[str, ...] = ("mean", "median", "trimmed_mean")
#: Arrays with fewer values than this are not checked per array: the cosine of a 1-value array is its
#: sign, and honest sites disagree on it by chance.
MIN_CHECKED_ARRAY_SIZE = 8
#: Relative tolerance on cumulative weights (a cumulative sum of p_k may miss 1/2 by rounding).
_TOL = 1e-12


def _probabilities(weights: np.ndarray, k: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size != k:
        raise ValueError(f"{w.size} weight(s) for {k} update(s)")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"robust aggregation needs finite non-negative weights, got {w.tolist()}")
    total = float(w.sum())
    if total <= 0:
        raise ValueError(f"robust aggregation needs a positive total weight, got {total!r}")
    return w / total


def _sorted_with_mass(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values sorted per column, cumulative mass before each, cumulative mass up to each)."""
    x = np.asarray(values, dtype=np.float64)
    x = x.reshape(x.shape[0], -1)
    p = _probabilities(weights, x.shape[0])
    order = np.argsort(x, axis=0, kind="stable")
    xs = np.take_along_axis(x, order, axis=0)
    ps = p[order]
    upto = np.cumsum(ps, axis=0)
    return xs, upto - ps, upto


def weighted_median(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per column of ``values`` (K rows), the weighted median with weights p = w / sum(w).

    The lower median is the smallest x_(i) whose cumulative weight reaches 1/2, the upper one the
    smallest whose cumulative weight exceeds it; the result is their mean (so equal weights give
    ``numpy.median``). Shape: ``values.shape[1:]``.
    """
    x = np.asarray(values, dtype=np.float64)
    xs, _, upto = _sorted_with_mass(x, weights)
    lower = np.argmax(upto >= 0.5 - _TOL, axis=0)
    upper = np.argmax(upto > 0.5 + _TOL, axis=0)
    cols = np.arange(xs.shape[1])
    return (0.5 * (xs[lower, cols] + xs[upper, cols])).reshape(x.shape[1:])


def weighted_trimmed_mean(values: np.ndarray, weights: np.ndarray, trim: float) -> np.ndarray:
    """Per column, the weighted mean after removing weight mass ``trim`` from each tail.

    With p = w / sum(w) and the values sorted, value i keeps the part of its mass [c_i - p_i, c_i]
    that lies in [trim, 1 - trim]; the result is sum_i kept_i x_i / sum_i kept_i (= 1 - 2 trim). trim 0 is the
    weighted mean; with equal weights and trim = j / K it is ``scipy.stats.trim_mean(values, j / K)``.
    """
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")
    x = np.asarray(values, dtype=np.float64)
    xs, before, upto = _sorted_with_mass(x, weights)
    kept = np.minimum(upto, 1.0 - trim) - np.maximum(before, trim)
    kept = np.where(kept > _TOL, kept, 0.0)  # rounding of the cumulative sums leaks no mass
    return (np.sum(kept * xs, axis=0) / np.sum(kept, axis=0)).reshape(x.shape[1:])


def _squared_distances(gram: np.ndarray) -> np.ndarray:
    g = np.asarray(gram, dtype=np.float64)
    d = np.diag(g)
    return np.maximum(d[:, None] + d[None, :] - 2.0 * g, 0.0)


def krum_scores(gram: np.ndarray, f: int) -> np.ndarray:
    """Krum score of each update: the sum of its squared distances to its K - f - 2 nearest other
    updates (||Delta_i - Delta_j||^2 = G_ii + G_jj - 2 G_ij, from the Gram matrix); at least one
    neighbour."""
    dist = _squared_distances(gram)
    k = dist.shape[0]
    neighbours = max(1, k - int(f) - 2)
    scores = np.empty(k)
    for i in range(k):
        others = np.sort(np.delete(dist[i], i))
        scores[i] = float(np.sum(others[:neighbours]))
    return scores


def multi_krum(gram: np.ndarray, f: int, keep: int | None = None) -> list[int]:
    """Indices (ascending) of the ``keep`` updates (default K - f) with the lowest Krum scores
    (ties: the lower index). Fewer than three updates, or f = 0: all of them."""
    k = np.asarray(gram).shape[0]
    if k < 3 or f <= 0:
        return list(range(k))
    m = k - int(f) if keep is None else int(keep)
    m = min(k, max(1, m))
    scores = krum_scores(gram, f)
    order = np.argsort(scores, kind="stable")
    return sorted(int(i) for i in order[:m])


def nearest_neighbour_mixing(gram: np.ndarray, f: int) -> np.ndarray:
    """The K x K mixing matrix of NNM_f: row i holds 1 / (K - f) at the K - f updates nearest to
    Delta_i (by ||Delta_i - Delta_j||^2 = G_ii + G_jj - 2 G_ij; itself included, at distance 0; ties:
    the lower index), 0 elsewhere; Delta'_i = sum_j M_ij Delta_j (Allouah et al., AISTATS 2023).
    Rows sum to 1, so mixing the parameters theta_j mixes the updates. f = 0, or K - f < 1: the
    identity."""
    dist = _squared_distances(gram)
    k = dist.shape[0]
    m = k - int(f)
    if f <= 0 or m < 1:
        return np.eye(k)
    out = np.zeros((k, k))
    for i in range(k):
        row = dist[i].copy()
        row[i] = -1.0  # itself first, whatever rounding does to G_ii + G_ii - 2 G_ii
        out[i, np.argsort(row, kind="stable")[:m]] = 1.0 / m
    return out


def array_grams(
    global_params: Mapping[str, Any], contributions: Sequence[Mapping[str, Any]]
) -> dict[str, np.ndarray]:
    """Per floating-point array with at least :data:`MIN_CHECKED_ARRAY_SIZE` values, the K x K Gram
    matrix of the updates Delta_k = theta_k - theta_g of that array alone (float64)."""
    out: dict[str, np.ndarray] = {}
    for key, g in global_params.items():
        g = np.asarray(g)
        if not np.issubdtype(g.dtype, np.floating) or g.size < MIN_CHECKED_ARRAY_SIZE:
            continue
        g64 = g.astype(np.float64).reshape(-1)
        deltas = np.stack([np.asarray(c[key], dtype=np.float64).reshape(-1) - g64 for c in contributions])
        with np.errstate(over="ignore", invalid="ignore"):
            out[key] = deltas @ deltas.T
    return out


def array_direction_outliers(grams: Mapping[str, np.ndarray], threshold: float) -> dict[int, list[str]]:
    """Per update index, the arrays in which it points away from a consensus of the others
    (:func:`fedweigh.server.safeguards.direction_outliers` on each array's Gram matrix; three or more
    updates). An array whose Gram matrix is not finite is skipped (the norm checks deal with it)."""
    flagged: dict[int, list[str]] = {}
    for key, gram in grams.items():
        if gram.shape[0] < 3 or not np.all(np.isfinite(gram)):
            continue
        for k in direction_outliers(gram, threshold):
            flagged.setdefault(k, []).append(key)
    return flagged


def clip_factor(norm: float, clip_norm: float) -> float:
    """min(1, C / ||Delta||): the factor that brings an update's L2 norm to at most ``clip_norm``
    (Flower's ``clip_inputs``; a zero update is left as it is, a non-finite norm gives 0)."""
    if not np.isfinite(norm):
        return 0.0
    if norm <= clip_norm:
        return 1.0
    return float(clip_norm / norm)


class RobustAggregation:
    """The scheme's aggregation with a robust location per coordinate, with the scheme's weights.

    Passed to a backend's ``aggregate`` in place of the scheme: the scheme aggregates first (its
    checks, and its rule for integer buffers such as ``num_batches_tracked``); every floating-point
    array is then replaced by theta_g + W loc_p(Delta), loc the weighted median or trimmed mean,
    p = w / W, W = sum_k w_k (W is 1 for normalised schemes, FedNova's effective steps otherwise).
    """

    def __init__(self, scheme: Any, aggregator: str, trim: float = 0.0):
        if aggregator not in AGGREGATORS:
            raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, got {aggregator!r}")
        self.scheme = scheme
        self.aggregator = aggregator
        self.trim = float(trim)
        self.name = getattr(scheme, "name", "scheme")

    def location(self, deltas: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """loc_p over the rows of ``deltas`` (K x ...)."""
        if self.aggregator == "median":
            return weighted_median(deltas, weights)
        return weighted_trimmed_mean(deltas, weights, self.trim if self.aggregator == "trimmed_mean" else 0.0)

    def aggregate(
        self, global_params: Mapping[str, np.ndarray], reports: Sequence[Any], weights: np.ndarray
    ) -> dict[str, np.ndarray]:
        out = self.scheme.aggregate(global_params, reports, weights)
        if self.aggregator == "mean":
            return out
        w = np.asarray(weights, dtype=np.float64)
        total = float(w.sum())
        for key, g in global_params.items():
            g = np.asarray(g)
            if not np.issubdtype(g.dtype, np.floating):
                continue
            g64 = g.astype(np.float64)
            deltas = np.stack([np.asarray(r.params[key], dtype=np.float64) - g64 for r in reports])
            new = g64 + total * self.location(deltas, w)
            if not np.all(np.isfinite(new)):
                raise ValueError(f"{self.name}: robust aggregate of parameter {key!r} is not finite")
            out[key] = new.astype(g.dtype, copy=False)
        return out


@dataclass
class Screening:
    """What :func:`screen_updates` did: the indices kept (ascending), their contributions (clipped,
    flagged arrays left out), and per site why it was left out or what was changed in its update."""

    keep: list[int]
    contributions: list[dict[str, np.ndarray]]
    excluded: dict[str, str] = field(default_factory=dict)
    bounded: dict[str, str] = field(default_factory=dict)


def _rescaled(
    global_params: Mapping[str, Any], contribution: Mapping[str, Any], factors: Mapping[str, float]
):
    """The contribution with Delta of each array in ``factors`` multiplied by its factor."""
    out = dict(contribution)
    for key, factor in factors.items():
        g64 = np.asarray(global_params[key], dtype=np.float64)
        new = g64 + factor * (np.asarray(contribution[key], dtype=np.float64) - g64)
        out[key] = new.astype(np.asarray(contribution[key]).dtype)
    return out


def screen_updates(
    guards: Safeguards,
    global_params: Mapping[str, Any],
    names: Sequence[str],
    contributions: Sequence[Mapping[str, Any]],
) -> Screening:
    """Apply the robust options of ``guards`` that act before weighting, in this order:

    1. ``clip_norm``: Delta_k scaled by :func:`clip_factor` (whole update, every floating-point array);
    2. ``array_cosine``: the arrays in which Delta_k points away from a consensus of the others'
       (:func:`array_direction_outliers`, three or more updates) are left out of Delta_k (set to 0);
    3. ``nnm_f``: each update replaced by the mean of its K - f nearest (:func:`nearest_neighbour_mixing`,
       three or more updates; every floating-point array);
    4. ``krum_f``: only the updates :func:`multi_krum` keeps count; the others are left out.
    """
    contribs = [dict(c) for c in contributions]
    bounded: dict[str, list[str]] = {}
    excluded: dict[str, str] = {}
    floats = [k for k, g in global_params.items() if np.issubdtype(np.asarray(g).dtype, np.floating)]
    if guards.clip_norm is not None:
        norms = np.sqrt(np.sum(np.square(delta_norms(global_params, contribs)), axis=1))
        for i, norm in enumerate(norms):
            factor = clip_factor(float(norm), guards.clip_norm)
            if factor < 1.0:
                contribs[i] = _rescaled(global_params, contribs[i], dict.fromkeys(floats, factor))
                bounded.setdefault(names[i], []).append(
                    f"update norm {norm:.4g} clipped to clip_norm={guards.clip_norm:g}"
                )
    if guards.array_cosine is not None and len(contribs) >= 3:
        flagged = array_direction_outliers(array_grams(global_params, contribs), guards.array_cosine)
        for i, keys in sorted(flagged.items()):
            contribs[i] = _rescaled(global_params, contribs[i], dict.fromkeys(keys, 0.0))
            shown = ", ".join(repr(k) for k in keys[:4]) + (
                f" and {len(keys) - 4} more" if len(keys) > 4 else ""
            )
            bounded.setdefault(names[i], []).append(
                f"{len(keys)} array(s) ({shown}) point away from the other sites' updates of the same "
                f"array, which agree with each other (cosine below array_cosine={guards.array_cosine:g}); "
                "left out of its update"
            )
    if guards.nnm_f is not None and len(contribs) >= 3:
        gram = delta_gram64(global_params, contribs)
        if np.all(np.isfinite(gram)):
            mix = nearest_neighbour_mixing(gram, guards.nnm_f)
            mixed = [dict(c) for c in contribs]
            for key in floats:
                stack = np.stack([np.asarray(c[key], dtype=np.float64) for c in contribs])
                out = np.tensordot(mix, stack, axes=1)
                for i, c in enumerate(mixed):
                    c[key] = out[i].astype(np.asarray(contribs[i][key]).dtype)
            contribs = mixed
    keep = list(range(len(contribs)))
    if guards.krum_f is not None and len(contribs) >= 3:
        gram = delta_gram64(global_params, contribs)
        if np.all(np.isfinite(gram)):
            keep = multi_krum(gram, guards.krum_f)
            scores = krum_scores(gram, guards.krum_f)
            worst_kept = max(scores[i] for i in keep)
            neighbours = max(1, len(contribs) - guards.krum_f - 2)
            for i in range(len(contribs)):
                if i not in keep:
                    excluded[names[i]] = (
                        f"{names[i]}: multi-Krum (krum_f={guards.krum_f}) left its update out: squared "
                        f"distance {scores[i]:.4g} to its {neighbours} nearest update(s), above the "
                        f"{worst_kept:.4g} of every kept one"
                    )
    return Screening(
        keep=keep,
        contributions=[contribs[i] for i in keep],
        excluded=excluded,
        bounded={name: "; ".join(notes) for name, notes in bounded.items()},
    )

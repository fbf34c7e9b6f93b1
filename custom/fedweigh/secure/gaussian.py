"""The Gaussian mechanism on a site's label statistics (math only; no files, no state).

:func:`privatize_histogram` adds Gaussian noise to a site's histogram (positives per class and N_k)
before it is encrypted or sent. Adjacent datasets differ in one patient's image (added, removed or
replaced). L2 sensitivity (:func:`histogram_sensitivity`): multi-label sqrt(C + 1) (one image moves
each of its up to C positive findings by 1 and N_k by 1); multi-class sqrt(2) (a replaced image
moves two class counts by 1; an added or removed one moves one count, and N_k is the sum of the
counts). Sigma comes from (epsilon, delta) by the analytic Gaussian mechanism (Balle and Wang,
ICML 2018; :func:`analytic_gaussian_sigma`) or the classic bound
sigma = Delta sqrt(2 ln(1.25 / delta)) / epsilon (Dwork and Roth, 2014, Thm. A.1, epsilon < 1;
:func:`classic_gaussian_sigma`). Rounding, clipping at 0 and at N_k, and everything derived from
the noised histogram (DAFL's N_k c_k, the scalars a scheme asks for, the global histogram) are
post-processing and cost no further budget.

Releasing the histogram once per job and keeping the release is :mod:`fedweigh.secure.stats_release`.
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.special import log_ndtr, ndtr

from fedweigh.secure.dp_config import STATS_MECHANISMS, StatsDPConfig

__all__ = [
    "HistogramRelease",
    "analytic_gaussian_sigma",
    "classic_gaussian_sigma",
    "gaussian_delta",
    "gaussian_sigma",
    "histogram_sensitivity",
    "privatize_histogram",
]


def classic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """sigma = Delta sqrt(2 ln(1.25 / delta)) / epsilon (Dwork and Roth 2014, Thm. A.1; epsilon in (0, 1))."""
    if not 0 < epsilon < 1:
        raise ValueError(f"classic_gaussian_sigma: the bound needs 0 < epsilon < 1, got {epsilon}")
    if not 0 < delta < 1 or sensitivity <= 0:
        raise ValueError(
            f"classic_gaussian_sigma: need 0 < delta < 1 and sensitivity > 0, got {delta}, {sensitivity}"
        )
    return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def gaussian_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """The exact delta(epsilon) of the Gaussian mechanism N(f(x), sigma^2 I) with L2 sensitivity Delta.

    delta = Phi(Delta / (2 sigma) - epsilon sigma / Delta) - e^epsilon Phi(-Delta / (2 sigma) - epsilon sigma / Delta)
    (Balle and Wang, ICML 2018, Thm. 8); the second term is evaluated in log space.
    """
    if sigma <= 0 or sensitivity <= 0:
        raise ValueError(f"gaussian_delta: sigma and sensitivity must be > 0, got {sigma}, {sensitivity}")
    a = sensitivity / (2.0 * sigma)
    b = epsilon * sigma / sensitivity
    return float(max(0.0, ndtr(a - b) - math.exp(epsilon + float(log_ndtr(-a - b)))))


@functools.lru_cache(maxsize=256)
def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The smallest sigma with :func:`gaussian_delta` <= delta (analytic Gaussian mechanism, Balle and Wang 2018).

    Bisection on sigma (delta(sigma) decreases in sigma) to a relative width of 1e-12; returns the
    upper end, so the guarantee holds.
    """
    if not (epsilon > 0 and math.isfinite(epsilon)) or not 0 < delta < 1 or sensitivity <= 0:
        raise ValueError(
            "analytic_gaussian_sigma: need epsilon > 0, 0 < delta < 1 and sensitivity > 0, got "
            f"{epsilon}, {delta}, {sensitivity}"
        )
    hi = sensitivity
    while gaussian_delta(hi, epsilon, sensitivity) > delta:
        hi *= 2.0
    lo = 0.0
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        if gaussian_delta(mid, epsilon, sensitivity) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float, mechanism: str = "analytic") -> float:
    """Noise std for an (epsilon, delta)-DP Gaussian mechanism: ``"analytic"`` or ``"classic"``."""
    if mechanism == "analytic":
        return analytic_gaussian_sigma(epsilon, delta, sensitivity)
    if mechanism == "classic":
        return classic_gaussian_sigma(epsilon, delta, sensitivity)
    raise ValueError(f"gaussian_sigma: mechanism must be one of {STATS_MECHANISMS}, got {mechanism!r}")


def histogram_sensitivity(num_classes: int, task: str) -> float:
    """L2 sensitivity of a site's released histogram to one image: sqrt(C + 1) multi-label, sqrt(2) multi-class."""
    if num_classes < 1:
        raise ValueError(f"histogram_sensitivity: num_classes must be >= 1, got {num_classes}")
    if task == "multilabel":
        return math.sqrt(num_classes + 1.0)
    if task == "multiclass":
        return math.sqrt(2.0)
    raise ValueError(f"histogram_sensitivity: task must be 'multilabel' or 'multiclass', got {task!r}")


@dataclass
class HistogramRelease:
    """A site's noised label statistics, released once per job, and the mechanism behind them."""

    class_counts: np.ndarray
    num_samples: int
    epsilon: float
    delta: float
    sigma: float
    sensitivity: float
    mechanism: str
    task: str

    def as_dict(self) -> dict:
        return {
            **{k: v for k, v in asdict(self).items() if k != "class_counts"},
            "class_counts": [int(x) for x in self.class_counts],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HistogramRelease:
        return cls(
            class_counts=np.asarray(d["class_counts"], dtype=np.int64),
            num_samples=int(d["num_samples"]),
            epsilon=float(d["epsilon"]),
            delta=float(d["delta"]),
            sigma=float(d["sigma"]),
            sensitivity=float(d["sensitivity"]),
            mechanism=str(d["mechanism"]),
            task=str(d["task"]),
        )


def privatize_histogram(
    class_counts: np.ndarray,
    num_samples: int,
    task: str,
    config: StatsDPConfig,
    rng: np.random.Generator | None = None,
) -> HistogramRelease:
    """The Gaussian mechanism on (n_1..n_C, N_k), then post-processing to a consistent integer histogram.

    Multi-label: n'_i = n_i + Z_i and N' = N_k + Z_0 with Z ~ N(0, sigma^2), sigma for sensitivity
    sqrt(C + 1); then N' = max(round(N'), 1) and n'_i = clip(round(n'_i), 0, N').
    Multi-class: n'_i = max(round(n_i + Z_i), 0) with sigma for sensitivity sqrt(2), and
    N' = max(sum_i n'_i, 1) (the counts of a multi-class histogram sum to N).
    Rounding and clipping are post-processing. ``rng`` defaults to a generator seeded from the OS
    (never from the job's seed, which the server knows).
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0 or np.any(counts < 0) or num_samples < 0:
        raise ValueError(
            f"privatize_histogram: need a non-empty vector of non-negative counts and N >= 0, got "
            f"{counts.tolist()} and {num_samples}"
        )
    rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
    sensitivity = histogram_sensitivity(counts.size, task)
    sigma = gaussian_sigma(config.epsilon, config.delta, sensitivity, config.mechanism)
    noisy_counts = counts + rng.normal(0.0, sigma, size=counts.size)
    if task == "multilabel":
        n = max(int(np.rint(num_samples + rng.normal(0.0, sigma))), 1)
        released = np.clip(np.rint(noisy_counts), 0, n).astype(np.int64)
    else:
        released = np.maximum(np.rint(noisy_counts), 0).astype(np.int64)
        n = max(int(released.sum()), 1)
    return HistogramRelease(
        class_counts=released,
        num_samples=n,
        epsilon=config.epsilon,
        delta=config.delta,
        sigma=sigma,
        sensitivity=sensitivity,
        mechanism=config.mechanism,
        task=task,
    )

"""FedBB's Client Balanced Reweighting (CBR).

Chung and Lee, "Multi-Level Analyzation of Imbalance to Resolve Non-IID-Ness in Federated Learning"
(FedBB), arXiv:2606.10250, Sec. 3.6; authors' code: github.com/Happiness-Chung/FedBalance and
github.com/hphp777/FedBalance ("code" below).

    W_k = gamma * omega_a_k + (1 - gamma) * omega_b_k,   omega_b_k = N_k / N
    omega_a_k = score_k^-1 / sum_i score_i^-1        (score: the client's skew, reported as "skew")

The text's R_k = sum_i D_ki / sum_j D_kj is identically 1, so the skew score is a READING:

- ``skew="cv"`` (default): I_k = std_j(n_kj) / mean_j(n_kj), the text's "standard deviation of the
  amount of data in each category" made scale-free; omega_a uses (I_k + eps)^-1.
- ``skew="code"``: exactly what the authors' data loader computes. With D = (n - mean n)^2 it
  normalises D IN PLACE and sequentially (D_i /= sum(D) after D_0..D_{i-1} were already divided),
  then S_k = sum_i (D_i - mean D)^2 and omega_a ∝ 1 / S_k. The sequential division makes S_k depend
  on the class order and can weight a MORE skewed client higher; kept for reproduction studies.
- ``skew="sqdev"``: the same with a correct normalisation, d^ = D / sum D:
  S_k = sum_c (d^_c - 1/C)^2 = sum_c d^_c^2 - 1/C. It measures how concentrated the squared
  deviations are, not their size (for C = 2 it is always 0).
For "code" and "sqdev", omega_a uses max(S_k, eps)^-1. A perfectly balanced histogram has score 0
in every mode (the code would divide 0 by 0) and therefore takes nearly all of omega_a.

gamma: default 1, the paper's value for chest X-ray ("gamma was set to 1", Sec. 4, NIH CXR14 /
CheXpert paragraph; also 1 for CIFAR-10/100) and what the authors' multi-process server code does
(hphp777/FedBalance, 3.FedBalance_mp/methods/fedbalance.py: the imbalance weights alone). The other
repository's server (Happiness-Chung/FedBalance, methods/fedbalance.py) mixes them with the size
weights at gamma = 0.5, the text's remedy for a balanced but tiny client: ``gamma=0.5`` is one option
away. The code's omega_b is batches x batch size; ours is N_k.

Empty histogram: a site with no positive for any finding (an all-"No Finding" site, or an empty
split) has no category distribution to score; the text's score is undefined there (0/0) and the
code would divide by zero. It gets the score of a MAXIMALLY IMBALANCED site, one with all its labels
in a single category (:func:`empty_histogram_score`). For "cv" that is sqrt(C - 1), the largest
score any histogram of C categories has, so the site gets the least imbalance weight a real site
could (it still counts through omega_b when gamma < 1). The site's log names it. Never an exception.

The client computes its score from its own label histogram and sends only the scalar "skew".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from fedweigh.weighting.base import (
    ClientReport,
    ScalarContext,
    WeightingScheme,
    check_reports,
    check_round,
    scalar_vector,
)

logger = logging.getLogger("fedweigh.weighting.cbr")

SkewMode = Literal["cv", "code", "sqdev"]
SKEW_MODES: tuple[str, ...] = ("cv", "code", "sqdev")


def _counts(class_counts: np.ndarray) -> np.ndarray:
    """The histogram as float64; ValueError if it is not a vector of finite non-negative counts, or
    (for the scores, which are undefined there) if it is all zero."""
    counts = _vector(class_counts)
    if counts.sum() <= 0:
        raise ValueError(
            "class counts are all zero: the skew of an empty histogram is undefined "
            "(skew_score gives it the score of a maximally imbalanced site)"
        )
    return counts


def _vector(class_counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"class counts must be a non-empty vector, got shape {counts.shape}")
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise ValueError(f"class counts must be finite and non-negative, got {counts.tolist()}")
    return counts


def empty_histogram_score(num_classes: int, mode: str = "cv") -> float:
    """The score of an all-zero histogram: that of (1, 0, ..., 0), a site with all its labels in one
    category, e.g. sqrt(C - 1) for ``cv`` (std / mean of (n, 0, ..., 0), population std, any n)."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    one_category = np.zeros(num_classes)
    one_category[0] = 1.0
    return skew_score(one_category, mode)


def imbalance_cv(class_counts: np.ndarray) -> float:
    """I = std_j(n_j) / mean_j(n_j) (population std); 0 for a perfectly balanced histogram."""
    counts = _counts(class_counts)
    return float(counts.std() / counts.mean())


def skew_code(class_counts: np.ndarray) -> float:
    """S as the authors' data loader computes it (in-place, sequential normalisation), 0 if balanced."""
    difference = _counts(class_counts)
    difference = difference - difference.mean()
    difference = difference * difference
    if not np.any(difference > 0):
        return 0.0
    for i in range(difference.size):  # sequential: later entries see earlier ones already divided
        difference[i] = difference[i] / difference.sum()
    difference -= difference.mean()
    return float(np.sum(difference * difference))


def skew_sqdev(class_counts: np.ndarray) -> float:
    """S = sum_c d^_c^2 - 1/C with d^ = D / sum D, D = (n - mean n)^2; 0 if balanced."""
    counts = _counts(class_counts)
    dev = (counts - counts.mean()) ** 2
    total = dev.sum()
    if total <= 0:
        return 0.0
    d_hat = dev / total
    return float(max(np.sum(d_hat * d_hat) - 1.0 / counts.size, 0.0))


def skew_score(class_counts: np.ndarray, mode: str = "cv") -> float:
    """Dispatch to :func:`imbalance_cv`, :func:`skew_code` or :func:`skew_sqdev`; an all-zero
    histogram scores :func:`empty_histogram_score` (a maximally imbalanced site)."""
    counts = _vector(class_counts)
    if counts.sum() <= 0:
        if mode not in SKEW_MODES:
            raise ValueError(f"cbr: skew must be one of {', '.join(SKEW_MODES)}, got {mode!r}")
        return empty_histogram_score(counts.size, mode)
    if mode == "cv":
        return imbalance_cv(class_counts)
    if mode == "code":
        return skew_code(class_counts)
    if mode == "sqdev":
        return skew_sqdev(class_counts)
    raise ValueError(f"cbr: skew must be one of {', '.join(SKEW_MODES)}, got {mode!r}")


@dataclass(kw_only=True)
class CBRWeights(WeightingScheme):
    """W_k = gamma * omega_a_k + (1 - gamma) * N_k / N, omega_a from the reported skew."""

    name: ClassVar[str] = "cbr"
    required_scalars: ClassVar[tuple[str, ...]] = ("skew",)

    skew: SkewMode = "cv"
    gamma: float = 1.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.skew not in SKEW_MODES:
            raise ValueError(f"cbr: skew must be one of {', '.join(SKEW_MODES)}, got {self.skew!r}")
        if not math.isfinite(self.gamma) or not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"cbr: gamma must lie in [0, 1], got {self.gamma!r}")
        if not math.isfinite(self.eps) or self.eps <= 0:
            raise ValueError(f"cbr: eps must be a positive number, got {self.eps!r}")

    def client_scalars(self, ctx: ScalarContext) -> dict[str, float]:
        """{"skew": score of the client's own label histogram} (an all-zero one: :func:`empty_histogram_score`)."""
        counts = _vector(ctx.counts(self.name)[0])
        score = skew_score(counts, self.skew)
        if counts.sum() <= 0:
            logger.info(  # the site itself warns once, naming itself (fedweigh.site)
                "cbr: the site's label histogram is all zero (no positive for any finding); its skew is "
                "%.6g, the score of a maximally imbalanced site (all labels in one category)",
                score,
            )
        return {"skew": score}

    def balance_weights(self, skews: np.ndarray) -> np.ndarray:
        """omega_a from the skew scores."""
        s = np.asarray(skews, dtype=np.float64)
        inv = 1.0 / (s + self.eps) if self.skew == "cv" else 1.0 / np.maximum(s, self.eps)
        return inv / inv.sum()

    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        check_round(round_index, num_rounds)
        n = check_reports(reports, scheme=self.name, scalars=self.required_scalars)
        skews = scalar_vector(reports, "skew", scheme=self.name, nonnegative=True)
        omega_a = self.balance_weights(skews)
        omega_b = n / n.sum()
        w = self.gamma * omega_a + (1.0 - self.gamma) * omega_b
        self.last_details = {"skew": skews.tolist(), "omega_a": omega_a.tolist(), "omega_b": omega_b.tolist()}
        return w

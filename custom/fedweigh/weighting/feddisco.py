"""FedDisco: discrepancy-aware aggregation weights.

Ye et al., ICML 2023, "FedDisco: Federated Learning with Discrepancy-Aware Collaboration".

Client (from its histogram n_k; the client sends only the scalar "discrepancy"):
    D_k = n_k / sum(n_k),  d_k = KL(D_k || T) = sum_j D_kj log(D_kj / T_j)
with the target distribution T (``target=``):
- "uniform" (default): T_j = 1/C, the authors' code (MediaBrain-SJTU/FedDisco ``main.py``:
  ``global_dist = np.ones(C) / C`` unless a known imbalanced test distribution is given), the
  paper's assumption of a balanced global (test) distribution. Needs no global histogram.
- "global": T = H / sum(H), the securely aggregated training histogram (our earlier reading; it
  asks for the statistics phase). A site that holds no global histogram (the phase summed nothing,
  or it refused the sum) falls back to the uniform target with a warning.

Server:
    d~_k = d_k / sum_j d_j                      (all zero -> d~ = 0)
    w_k  = ReLU(N_k / N - a d~_k + b) / sum_j ReLU(N_j / N - a d~_j + b),   a = 0.5, b = 0.1
    if every ReLU term is 0: w_k = N_k / N

Guards (READING): terms with D_kj = 0 contribute 0; D_glob is floored at 1e-12 (it can only be 0 where
D_k is too, unless DP noise was added); negative noised counts are clipped to 0; a histogram with no
positives at all is treated as uniform over the classes (multi-label sites can have none).
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

logger = logging.getLogger("fedweigh.weighting.feddisco")

_FLOOR = 1e-12
#: Whether this process warned already that target="global" fell back to the uniform target.
_FALLBACK_WARNED: list[bool] = []
TARGETS: tuple[str, ...] = ("uniform", "global")


def class_distribution(class_counts: np.ndarray) -> np.ndarray:
    """n / sum(n) after clipping negatives to 0; uniform when the histogram is empty."""
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"class counts must be a non-empty vector, got shape {counts.shape}")
    if not np.all(np.isfinite(counts)):
        raise ValueError("class counts hold non-finite values")
    counts = np.clip(counts, 0.0, None)
    total = counts.sum()
    if total <= 0:
        return np.full(counts.size, 1.0 / counts.size)
    return counts / total


def kl_discrepancy(class_counts: np.ndarray, global_class_counts: np.ndarray | None) -> float:
    """KL(D_k || T) of the normalised class distributions (natural log); T uniform when ``global_class_counts`` is None."""
    local = class_distribution(class_counts)
    if global_class_counts is None:
        return float(np.sum(local[local > 0] * np.log(local[local > 0] * local.size)))
    glob = class_distribution(global_class_counts)
    if local.shape != glob.shape:
        raise ValueError(f"local histogram has {local.size} classes, global has {glob.size}")
    mask = local > 0
    return float(np.sum(local[mask] * np.log(local[mask] / np.maximum(glob[mask], _FLOOR))))


@dataclass(kw_only=True)
class FedDiscoWeights(WeightingScheme):
    """ReLU(N_k/N - a d~_k + b), renormalised; d_k against a uniform (default) or the global distribution."""

    name: ClassVar[str] = "feddisco"
    needs_global_histogram: ClassVar[bool] = False
    required_scalars: ClassVar[tuple[str, ...]] = ("discrepancy",)

    a: float = 0.5
    b: float = 0.1
    target: Literal["uniform", "global"] = "uniform"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.a) and math.isfinite(self.b)):
            raise ValueError(f"feddisco: a and b must be finite, got a={self.a!r}, b={self.b!r}")
        if self.target not in TARGETS:
            raise ValueError(f"feddisco: target must be one of {TARGETS}, got {self.target!r}")
        self.needs_global_histogram = self.target == "global"  # type: ignore[misc]

    def client_scalars(self, ctx: ScalarContext) -> dict[str, float]:
        """{"discrepancy": KL(D_k || T)}; ``target="global"`` needs the global histogram."""
        class_counts, _ = ctx.counts(self.name)
        if self.target == "uniform":
            return {"discrepancy": kl_discrepancy(class_counts, None)}
        global_class_counts = ctx.global_class_counts
        if global_class_counts is None and not _FALLBACK_WARNED:
            # the statistics phase gave this site no global histogram (nothing summed, or a sum it
            # refused): the uniform target, as the authors' code, rather than no result at all
            _FALLBACK_WARNED.append(True)  # once per process: it holds for the whole job
            logger.warning(
                "feddisco: target='global' but this site holds no global class histogram (the statistics "
                "phase gave none); its discrepancy is taken against the uniform target instead"
            )
        return {"discrepancy": kl_discrepancy(class_counts, global_class_counts)}

    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        check_round(round_index, num_rounds)
        n = check_reports(reports, scheme=self.name, scalars=self.required_scalars)
        d = scalar_vector(reports, "discrepancy", scheme=self.name, nonnegative=True)
        p = n / n.sum()
        d_norm = d / d.sum() if d.sum() > 0 else np.zeros_like(d)
        raw = np.maximum(p - self.a * d_norm + self.b, 0.0)
        w = raw / raw.sum() if raw.sum() > 0 else p
        self.last_details = {
            "size_prior": p.tolist(),
            "discrepancy": d.tolist(),
            "normalised": d_norm.tolist(),
        }
        return w

"""DAFL: distribution-aware statistics and aggregation (seed 003; authors' code AIPMLab/ViT-FLDAF).

Statistics (numpy, shared by the client loss in :mod:`fedweigh.losses.dafl` and the server):

- client imbalance  c_k = (1/C) sum_i (N_k - n_{k,i}) / max(n_{k,i}, 1)
- client-level global parameter  c_client = sum_k (N_k / N) c_k
- class-level global parameter   c_class_i = (N - n_i) / n_i,  n_i = sum_k n_{k,i};  0 if n_i = 0

Aggregation (:class:`DAFLWeights`; the two versions of the authors' code differ):

- ``mode="size"`` (default; Dec 2025 code, the version closest to the paper): w_k = N_k / N
- ``mode="inverse_imbalance"`` (May 2026 code; the text: "clients with lower c_k receive higher
  weights"): w_k = (c_k + eps)^-1 / sum_j (c_j + eps)^-1, c_k reported by the client as "imbalance".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from fedweigh.weighting.base import ClientReport, WeightingScheme, check_reports, check_round, scalar_vector


def client_imbalance(class_counts: np.ndarray, num_samples: int) -> float:
    """c_k = (1/C) sum_i (N_k - n_{k,i}) / max(n_{k,i}, 1)."""
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"class_counts must be a non-empty vector, got shape {counts.shape}")
    if np.any(counts < 0) or num_samples < 0:
        raise ValueError("class counts and num_samples must be non-negative")
    return float(np.mean((num_samples - counts) / np.maximum(counts, 1.0)))


def client_level_parameter(imbalances: np.ndarray, num_samples: np.ndarray) -> float:
    """c_client = sum_k (N_k / N) c_k."""
    c = np.asarray(imbalances, dtype=np.float64)
    n = np.asarray(num_samples, dtype=np.float64)
    total = n.sum()
    if total <= 0:
        raise ValueError("total number of samples must be positive")
    return float(np.sum(n / total * c))


def class_level_parameters(global_class_counts: np.ndarray, global_num_samples: int) -> np.ndarray:
    """c_class_i = (N - n_i) / n_i, and 0 for a class no client holds."""
    counts = np.asarray(global_class_counts, dtype=np.float64)
    out = np.zeros_like(counts)
    present = counts > 0
    out[present] = (global_num_samples - counts[present]) / counts[present]
    return out


@dataclass(kw_only=True)
class DAFLWeights(WeightingScheme):
    """Size weights (default) or inverse client imbalance weights.

    The DAFL loss additionally needs the global histogram (c_class); that is the loss's business,
    not the aggregation's, so ``needs_global_histogram`` stays False here.
    """

    name: ClassVar[str] = "dafl"

    mode: Literal["size", "inverse_imbalance"] = "size"
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in ("size", "inverse_imbalance"):
            raise ValueError(f"dafl: mode must be 'size' or 'inverse_imbalance', got {self.mode!r}")
        if not math.isfinite(self.eps) or self.eps <= 0:
            raise ValueError(f"dafl: eps must be a positive number, got {self.eps!r}")
        self.required_scalars = ("imbalance",) if self.mode == "inverse_imbalance" else ()  # type: ignore[misc]

    def client_scalars(
        self,
        *,
        class_counts: np.ndarray,
        num_samples: int,
        global_class_counts: np.ndarray | None = None,
        global_num_samples: int | None = None,
        params: dict[str, np.ndarray] | None = None,
        global_params: dict[str, np.ndarray] | None = None,
    ) -> dict[str, float]:
        """{"imbalance": c_k} from the client's own histogram (:func:`client_imbalance`)."""
        return {"imbalance": client_imbalance(class_counts, num_samples)}

    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        check_round(round_index, num_rounds)
        n = check_reports(reports, scheme=self.name, scalars=self.required_scalars)
        p = n / n.sum()
        if self.mode == "size":
            self.last_details = {"size_prior": p.tolist()}
            return p
        c = scalar_vector(reports, "imbalance", scheme=self.name, nonnegative=True)
        inv = 1.0 / (c + self.eps)
        w = inv / inv.sum()
        self.last_details = {"size_prior": p.tolist(), "imbalance": c.tolist()}
        return w

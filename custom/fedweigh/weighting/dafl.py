"""DAFL: distribution-aware statistics and aggregation (seed 003; authors' code AIPMLab/ViT-FLDAF).

Statistics (numpy, shared by the client loss in :mod:`fedweigh.losses.dafl` and the server):

- client imbalance  c_k = (1/C) sum_i t(n_{k,i}),  t(n) = (N_k - n) / n for a class the site holds
- client-level global parameter  c_client = sum_k (N_k / N) c_k
- class-level global parameter   c_class_i = (N - n_i) / n_i,  n_i = sum_k n_{k,i};  0 if n_i = 0

A class the site lacks (n = 0) has t = inf in the formula; ``missing=`` says what it counts as:

- ``"half"`` (default): n = 1/2 in a site of max(N_k, C) samples, t = 2 max(N_k, C) - 1. It exceeds
  the term of any class the site holds (at most N_k - 1), and c_k then exceeds C - 1, the value of a
  perfectly balanced site (the minimum of c_k over full-coverage multi-class histograms), so a site
  missing a class is never ranked as balanced, however small it is.
- ``"eps"``: t = (N_k - n) / (n + eps_count), eps_count = 1e-6 (the May 2026 code): a missing class
  makes c_k ~ 1e6 N_k, the site's inverse-imbalance weight ~ 0.
- ``"floor1"``: t = (N_k - n) / max(n, 1) (the earlier reading, close to the Dec 2025 code): a missing
  class counts like a single sample, so a site with few samples and missing classes can score below
  a balanced site.

Aggregation (:class:`DAFLWeights`, ``mode=``; the paper's Sec. 3.4-3.5: "clients with relatively
balanced data (i.e., lower c_k) receive higher aggregation weights", "assigning lower weights (w_k)
to clients with high internal skew (c_k)"; the May 2026 code's Eq. (wk)-(omega)):

- ``"inverse_imbalance"`` (default): w_k = (c_k + eps)^-1 / sum_j (c_j + eps)^-1 over the round's clients
- ``"size_inverse_imbalance"``: w_k proportional to (N_k / N) (c_k + eps)^-1 (a reading of the text's
  "adaptive regulation based on data volumes and client-specific characteristics")
- ``"size"``: w_k = N_k / N (the Dec 2025 code and its README)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from fedweigh.weighting.base import ClientReport, WeightingScheme, check_reports, check_round, scalar_vector

MissingRule = Literal["half", "eps", "floor1"]
MISSING_RULES: tuple[str, ...] = ("half", "eps", "floor1")
#: The count added to every n in ``missing="eps"`` (the authors' May 2026 code: EPS = 1e-6).
EPS_COUNT = 1e-6
MODES: tuple[str, ...] = ("inverse_imbalance", "size_inverse_imbalance", "size")


def check_missing_rule(missing: str, who: str = "dafl") -> str:
    """Return ``missing`` if it is a known rule, else raise ValueError naming the option."""
    if missing not in MISSING_RULES:
        raise ValueError(f"{who}: missing must be one of {MISSING_RULES}, got {missing!r}")
    return missing


def client_imbalance(class_counts: np.ndarray, num_samples: int, missing: MissingRule = "half") -> float:
    """c_k = (1/C) sum_i t(n_{k,i}) with t(n) = (N_k - n) / n; a missing class follows ``missing``."""
    check_missing_rule(missing)
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"class_counts must be a non-empty vector, got shape {counts.shape}")
    if np.any(counts < 0) or num_samples < 0:
        raise ValueError("class counts and num_samples must be non-negative")
    n_k = float(num_samples)
    if missing == "eps":
        terms = (n_k - counts) / (counts + EPS_COUNT)
    elif missing == "floor1":
        terms = (n_k - counts) / np.maximum(counts, 1.0)
    else:
        held = counts > 0
        terms = np.full(counts.shape, 2.0 * max(n_k, float(counts.size)) - 1.0)
        terms[held] = (n_k - counts[held]) / counts[held]
    return float(np.mean(terms))


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
    """Distribution-aware weights w_k proportional to (c_k + eps)^-1 (default), optionally times N_k, or size weights.

    c_k is computed by each client from its own histogram and reported as the scalar ``imbalance``
    (:meth:`client_scalars`); the weights are normalised over the clients of each round. The DAFL
    loss additionally needs the global histogram (c_class); that is the loss's business, so
    ``needs_global_histogram`` stays False here.
    """

    name: ClassVar[str] = "dafl"

    mode: Literal["inverse_imbalance", "size_inverse_imbalance", "size"] = "inverse_imbalance"
    missing: MissingRule = "half"
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"dafl: mode must be one of {MODES}, got {self.mode!r}")
        check_missing_rule(self.missing)
        if not math.isfinite(self.eps) or self.eps <= 0:
            raise ValueError(f"dafl: eps must be a positive number, got {self.eps!r}")
        self.required_scalars = ("imbalance",) if self.mode != "size" else ()  # type: ignore[misc]

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
        """{"imbalance": c_k} from the client's own histogram (:func:`client_imbalance`, rule ``missing``)."""
        return {"imbalance": client_imbalance(class_counts, num_samples, self.missing)}

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
        raw = 1.0 / (c + self.eps)
        if self.mode == "size_inverse_imbalance":
            raw = raw * p
        w = raw / raw.sum()
        self.last_details = {"size_prior": p.tolist(), "imbalance": c.tolist()}
        return w

"""DAFL's label-imbalance statistics, shared by its client loss and its weighting scheme (seed 003;
authors' code AIPMLab/ViT-FLDAF).

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
"""

from __future__ import annotations

from typing import Literal

import numpy as np

__all__ = [
    "EPS_COUNT",
    "MISSING_RULES",
    "MissingRule",
    "check_missing_rule",
    "class_level_parameters",
    "client_imbalance",
    "client_level_parameter",
]

MissingRule = Literal["half", "eps", "floor1"]
MISSING_RULES: tuple[str, ...] = ("half", "eps", "floor1")
#: The count added to every n in ``missing="eps"`` (the authors' May 2026 code: EPS = 1e-6).
EPS_COUNT = 1e-6


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

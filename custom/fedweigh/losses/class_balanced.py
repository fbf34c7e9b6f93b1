"""Class-balanced loss (Cui et al., "Class-Balanced Loss Based on Effective Number of Samples", CVPR 2019).

Effective number of n samples: E(n) = (1 - beta^n) / (1 - beta); class weight w_c = 1 / E(n_c)
= (1 - beta) / (1 - beta^n_c), normalised so that sum_c w_c = C. A class with n_c = 0 has
weight 0 (it has no samples to weight); the others are normalised so that all C weights sum to C.

- multiclass: L = mean_b w_{y_b} * CE_b.
- multilabel: L = mean over valid (b, j) of -[w_j y log s + v_j (1 - y) log(1 - s)], with
  n_j = positives of finding j, v_j = 1 (positives weighted, default) or v_j = w_j
  (``weight_negatives=True``: the whole BCE term of finding j weighted, as in FedBB's CB baseline code).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from .base import (
    ClientLoss,
    LossContext,
    check_num_classes,
    check_task,
    masked_mean,
    multiclass_targets,
    multilabel_targets,
    weights_buffer,
)


def inverse_effective_number(counts: np.ndarray, beta: float, a: float = 1.0) -> np.ndarray:
    """1 / E(n / a) = (1 - beta) / (1 - beta^(n / a)), float64; +inf where n = 0.

    Computed as (1 - beta) / -expm1((n / a) log1p(beta - 1)) so that beta close to 1 (e.g. 0.9999999)
    keeps full precision. beta = 1 is the limit a / n (inverse frequency); beta = 0 gives 1 (no reweighting).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    if a <= 0:
        raise ValueError(f"the count divisor a must be positive, got {a}")
    n = np.asarray(counts, dtype=np.float64) / float(a)
    if np.any(n < 0) or not np.all(np.isfinite(n)):
        raise ValueError(f"counts must be finite and non-negative, got {np.asarray(counts).tolist()}")
    out = np.full(n.shape, np.inf)
    present = n > 0
    if beta == 1.0:
        out[present] = 1.0 / n[present]
    elif beta == 0.0:
        out[present] = 1.0
    else:
        out[present] = (1.0 - beta) / -np.expm1(n[present] * np.log1p(beta - 1.0))
    return out


def class_balanced_weights(counts: np.ndarray, beta: float) -> np.ndarray:
    """Cui et al.'s weights (1 - beta) / (1 - beta^n_c) normalised to sum to C; 0 for n_c = 0."""
    inv = inverse_effective_number(counts, beta)
    w = np.where(np.isfinite(inv), inv, 0.0)
    total = w.sum()
    if total <= 0:
        return np.zeros_like(w)
    return w * (w.size / total)


class ClassBalancedLoss(ClientLoss):
    """Class-balanced BCE (multilabel) or CE (multiclass) with effective-number class weights."""

    uses_global_stats: ClassVar[bool] = True

    def __init__(
        self, task: str, class_counts: np.ndarray, beta: float = 0.9999, weight_negatives: bool = False
    ) -> None:
        super().__init__()
        self.task = check_task(task, "class_balanced")
        counts = np.asarray(class_counts)  # class_balanced_weights takes it as float64
        if counts.ndim != 1:
            raise ValueError(f"class_balanced: class_counts must be a vector, got shape {counts.shape}")
        self.num_classes = counts.size
        self.beta = float(beta)
        self.weight_negatives = bool(weight_negatives)
        self.register_buffer("class_weights", weights_buffer(class_balanced_weights(counts, beta)))

    @classmethod
    def from_context(
        cls, ctx: LossContext, beta: float = 0.9999, weight_negatives: bool = False
    ) -> ClassBalancedLoss:
        return cls(ctx.task, ctx.class_counts, beta=beta, weight_negatives=weight_negatives)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        check_num_classes(logits, self.num_classes, "class_balanced")
        w = self.class_weights.to(logits.device)
        if self.task == "multilabel":
            y, valid = multilabel_targets(logits, targets)
            v = w if self.weight_negatives else torch.ones_like(w)
            elementwise = -(w * y * F.logsigmoid(logits) + v * (1.0 - y) * F.logsigmoid(-logits))
            return masked_mean(elementwise, valid)
        t = multiclass_targets(logits, targets)
        ce = F.cross_entropy(logits, t, reduction="none")
        return (w[t] * ce).sum() / max(t.numel(), 1)

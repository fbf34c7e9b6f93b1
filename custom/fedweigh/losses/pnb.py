"""Positive-Negative Balanced (PNB) loss of FedBB (Chung & Lee, arXiv:2606.10250; authors' code FedBalance).

Inverse effective number (the text's tau is the count divisor ``a``):
    E^-1(n) = (1 - beta) / (1 - beta^(n / a))
For class j with n+_j positives and n-_j negatives:
    alpha_p_j = E^-1(n+_j) / (E^-1(n+_j) + E^-1(n-_j)),   alpha_n_j = E^-1(n-_j) / (same)
- multilabel (s = sigmoid(z), NaN targets ignored, batch means over the valid entries of column j):
    L = sum_j mu alpha_p_j [alpha_p_j mean_b(-y log s) + alpha_n_j mean_b(-(1 - y) log(1 - s))]
  (alpha_p_j appears twice: inter-case balance inside, inter-class balance outside; text and code agree)
- multiclass:  L = mean_b mu alpha_p_{y_b} (-log softmax(z_b)_{y_b})

Negatives (``negatives=``):
- "text": n-_j = N_k - n+_j (the paper's B_j^k: samples not in category j)
- "code": n-_j = sum_i n+_i - n+_j (the authors' code; equals "text" for multiclass)
- "global" (multiclass only): n-_c = (global count of class c) - n+_c, i.e. class-c samples held by
  the other clients, from the securely aggregated histogram (the authors' multi-class code).
A class with n+_j = 0 or n-_j = 0 has no positive/negative contrast; its weights are 0 and it drops
out of the loss (for n-_j = 0 this is the formula's limit alpha_p -> 0; for n+_j = 0 it is the code's
convention). Never NaN or inf.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F

from .base import (
    ClientLoss,
    LossContext,
    check_num_classes,
    check_task,
    column_masked_mean,
    multiclass_targets,
    multilabel_targets,
    weights_buffer,
)
from .class_balanced import inverse_effective_number

Negatives = Literal["text", "code", "global"]
NEGATIVES: tuple[str, ...] = ("text", "code", "global")


def pnb_alphas(
    pos_counts: np.ndarray, neg_counts: np.ndarray, beta: float, a: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """(alpha_p, alpha_n) per class; both 0 where n+ = 0 or n- = 0."""
    pos = np.asarray(pos_counts, dtype=np.float64)
    neg = np.asarray(neg_counts, dtype=np.float64)
    if pos.shape != neg.shape:
        raise ValueError(f"pnb: positive counts {pos.shape} and negative counts {neg.shape} differ in shape")
    e_pos = inverse_effective_number(pos, beta, a)
    e_neg = inverse_effective_number(neg, beta, a)
    active = (pos > 0) & (neg > 0)
    alpha_p = np.zeros_like(pos)
    alpha_n = np.zeros_like(pos)
    total = e_pos[active] + e_neg[active]
    alpha_p[active] = e_pos[active] / total
    alpha_n[active] = e_neg[active] / total
    return alpha_p, alpha_n


def pnb_negative_counts(ctx: LossContext, negatives: str = "text") -> np.ndarray:
    """n-_j for the chosen reading (see the module docstring)."""
    if negatives not in NEGATIVES:
        raise ValueError(f"pnb: negatives must be one of {NEGATIVES}, got {negatives!r}")
    pos = ctx.class_counts
    if negatives == "text":
        return np.maximum(ctx.num_samples - pos, 0.0)
    if negatives == "code":
        return np.maximum(pos.sum() - pos, 0.0)
    if ctx.task != "multiclass":
        raise ValueError("pnb: negatives='global' is defined for multiclass only (use 'text' or 'code')")
    if ctx.global_class_counts is None:
        raise ValueError(
            "pnb: negatives='global' needs LossContext.global_class_counts (the securely aggregated histogram)"
        )
    return np.maximum(np.maximum(ctx.global_class_counts, 0.0) - pos, 0.0)


class PNBLoss(ClientLoss):
    """FedBB's PNB loss from per-class positive and negative counts."""

    uses_global_stats: ClassVar[bool] = True

    def __init__(
        self,
        task: str,
        pos_counts: np.ndarray,
        neg_counts: np.ndarray,
        mu: float = 4.0,
        beta: float = 0.9999,
        a: float = 1.0,
    ) -> None:
        super().__init__()
        self.task = check_task(task, "pnb")
        if mu <= 0:
            raise ValueError(f"pnb: mu must be positive, got {mu}")
        alpha_p, alpha_n = pnb_alphas(pos_counts, neg_counts, beta, a)
        self.num_classes = alpha_p.size
        self.mu = float(mu)
        self.beta = float(beta)
        self.a = float(a)
        self.register_buffer("alpha_pos", weights_buffer(alpha_p))
        self.register_buffer("alpha_neg", weights_buffer(alpha_n))

    @classmethod
    def from_context(
        cls,
        ctx: LossContext,
        negatives: Negatives = "text",
        mu: float = 4.0,
        beta: float = 0.9999,
        a: float = 1.0,
    ) -> PNBLoss:
        neg = pnb_negative_counts(ctx, negatives)
        return cls(ctx.task, ctx.class_counts, neg, mu=mu, beta=beta, a=a)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        check_num_classes(logits, self.num_classes, "pnb")
        ap = self.alpha_pos.to(logits.device)
        if self.task == "multilabel":
            an = self.alpha_neg.to(logits.device)
            y, valid = multilabel_targets(logits, targets)
            pos = column_masked_mean(-y * F.logsigmoid(logits), valid)
            neg = column_masked_mean(-(1.0 - y) * F.logsigmoid(-logits), valid)
            return (self.mu * ap * (ap * pos + an * neg)).sum()
        t = multiclass_targets(logits, targets)
        ce = F.cross_entropy(logits, t, reduction="none")
        return (self.mu * ap[t] * ce).sum() / max(t.numel(), 1)

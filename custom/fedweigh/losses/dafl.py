"""Dynamic adaptive focal loss of DAFL (seed 003; equations recovered from the authors' code AIPMLab/ViT-FLDAF).

Statistics (reused from :mod:`fedweigh.weighting.dafl`):
    c_client   = sum_k (N_k / N) c_k,  c_k = (1/C) sum_i (N_k - n_{k,i}) / max(n_{k,i}, 1)
    c_class_i  = (N - n_i) / n_i  (0 for a class nobody holds), from the global histogram
    c_i        = lam c_client + (1 - lam) c_class_i,   lam = 0.5
- multiclass (the paper):  L = mean_b -(1 + c_{y_b}) (1 - p_t)^gamma log p_t,   gamma = 2
- multilabel (our extension for chest X-ray), per valid entry (b, j), s = sigmoid(z):
    l = -(1 + c_j) y (1 - s)^gamma log s - (1 - y) s^gamma log(1 - s);  L = mean over valid entries
Class weights w_i = 1 + c_i; ``normalize="mean"`` divides them by their mean over the classes (the
average weight is then 1), ``"none"`` keeps them raw. Default "auto": "mean" for multilabel, where
(N - n_j) / n_j reaches ~1e3 for rare findings and raw weights would blow up the loss scale and the
effective learning rate; "none" for multiclass, as in the paper.

Fallbacks when the statistics phase did not run: c_client = the local c_k, c_class from the local
histogram (recorded in ``c_client_source`` / ``c_class_source`` = "global" | "local").
The authors' optional L1 term l1 * ||theta||_1 (their value 1e-6) needs the model: set ``l1`` and add
``loss_fn.penalty(model)`` in the training loop. ``learnable_gamma=True`` makes gamma an
``nn.Parameter`` of the loss (clamped at 0 in use; the optimizer must include ``loss_fn.parameters()``).
"""

from __future__ import annotations

import logging
from typing import ClassVar, Literal

import numpy as np
import torch
from torch import nn

from fedweigh.weighting.dafl import class_level_parameters, client_imbalance

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
from .focal import sigmoid_focal_terms, softmax_focal_per_sample

logger = logging.getLogger(__name__)

Normalize = Literal["auto", "mean", "none"]
NORMALIZE: tuple[str, ...] = ("auto", "mean", "none")


def dafl_coefficients(ctx: LossContext, lam: float = 0.5) -> tuple[np.ndarray, dict[str, object]]:
    """Mixed per-class coefficients c_i = lam c_client + (1 - lam) c_class_i (clipped at 0), and their sources."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"dafl: lam must lie in [0, 1], got {lam}")
    if ctx.client_level_parameter is not None:
        c_client, client_src = float(ctx.client_level_parameter), "global"
    else:
        c_client, client_src = client_imbalance(ctx.class_counts, ctx.num_samples), "local"
    if ctx.global_class_counts is not None:
        if ctx.global_num_samples is None:
            raise ValueError("dafl: LossContext.global_class_counts is set but global_num_samples is missing")
        counts = np.maximum(ctx.global_class_counts, 0.0)
        c_class, class_src = class_level_parameters(counts, ctx.global_num_samples), "global"
    else:
        c_class, class_src = class_level_parameters(ctx.class_counts, ctx.num_samples), "local"
    c = np.maximum(lam * c_client + (1.0 - lam) * c_class, 0.0)
    info: dict[str, object] = {
        "c_client": c_client,
        "c_class": c_class,
        "c_client_source": client_src,
        "c_class_source": class_src,
    }
    return c, info


def dafl_class_weights(c: np.ndarray, normalize: str) -> np.ndarray:
    """w_i = 1 + c_i, divided by mean_i w_i when ``normalize == "mean"``."""
    w = 1.0 + np.asarray(c, dtype=np.float64)
    if normalize == "mean":
        w = w / w.mean()
    return w


class DAFLLoss(ClientLoss):
    """DAFL's class-weighted focal loss (softmax for multiclass, sigmoid per finding for multilabel)."""

    uses_global_stats: ClassVar[bool] = True

    def __init__(
        self,
        task: str,
        c: np.ndarray,
        gamma: float = 2.0,
        normalize: Normalize = "auto",
        learnable_gamma: bool = False,
        l1: float = 0.0,
        lam: float = 0.5,
    ) -> None:
        super().__init__()
        self.task = check_task(task, "dafl")
        if normalize not in NORMALIZE:
            raise ValueError(f"dafl: normalize must be one of {NORMALIZE}, got {normalize!r}")
        if gamma < 0:
            raise ValueError(f"dafl: gamma must be >= 0, got {gamma}")
        if l1 < 0:
            raise ValueError(f"dafl: l1 must be >= 0, got {l1}")
        c = np.asarray(c, dtype=np.float64)
        if c.ndim != 1 or not np.all(np.isfinite(c)):
            raise ValueError(f"dafl: c must be a finite vector, got {c.tolist()}")
        self.num_classes = c.size
        self.normalize = (
            ("mean" if self.task == "multilabel" else "none") if normalize == "auto" else normalize
        )
        self.l1 = float(l1)
        self.lam = float(lam)
        self.info: dict[str, object] = {}
        self.gamma: float | nn.Parameter
        if learnable_gamma:
            self.gamma = nn.Parameter(torch.tensor(float(gamma)))
        else:
            self.gamma = float(gamma)
        self.register_buffer("class_weights", weights_buffer(dafl_class_weights(c, self.normalize)))

    @classmethod
    def from_context(
        cls,
        ctx: LossContext,
        lam: float = 0.5,
        gamma: float = 2.0,
        normalize: Normalize = "auto",
        learnable_gamma: bool = False,
        l1: float = 0.0,
    ) -> DAFLLoss:
        c, info = dafl_coefficients(ctx, lam)
        loss = cls(
            ctx.task, c, gamma=gamma, normalize=normalize, learnable_gamma=learnable_gamma, l1=l1, lam=lam
        )
        loss.info = info
        if "local" in (info["c_client_source"], info["c_class_source"]):
            logger.info(
                "dafl: c_client from %s statistics, c_class from %s statistics",
                info["c_client_source"],
                info["c_class_source"],
            )
        return loss

    def update_context(self, ctx: LossContext) -> None:
        """Recompute the class weights from this round's statistics (keeps a learnable gamma)."""
        check_task(ctx.task, "dafl", (self.task,))
        if ctx.num_classes != self.num_classes:
            raise ValueError(f"dafl: built for {self.num_classes} classes, new context has {ctx.num_classes}")
        c, self.info = dafl_coefficients(ctx, self.lam)
        new = weights_buffer(dafl_class_weights(c, self.normalize))
        self.class_weights.copy_(new)

    def _gamma(self) -> float | torch.Tensor:
        return self.gamma.clamp_min(0.0) if isinstance(self.gamma, torch.Tensor) else self.gamma

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        check_num_classes(logits, self.num_classes, "dafl")
        w = self.class_weights.to(logits.device)
        gamma = self._gamma()
        if self.task == "multilabel":
            y, valid = multilabel_targets(logits, targets)
            pos, neg = sigmoid_focal_terms(logits, y, gamma)
            return masked_mean(w * y * pos + (1.0 - y) * neg, valid)
        t = multiclass_targets(logits, targets)
        per_sample = w[t] * softmax_focal_per_sample(logits, t, gamma)
        return per_sample.sum() / max(t.numel(), 1)

    def penalty(self, model: nn.Module) -> torch.Tensor:
        """l1 * sum |theta| over the model's trainable parameters (0 when l1 = 0)."""
        if self.l1 == 0.0:
            return super().penalty(model)
        terms = [p.abs().sum() for p in model.parameters() if p.requires_grad]
        if not terms:
            return super().penalty(model)
        return self.l1 * torch.stack(terms).sum()

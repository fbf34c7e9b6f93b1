"""Softmax cross-entropy for multi-class classification.

L = mean_b -log softmax(z_b)_{y_b}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import ClientLoss, LossContext, check_task, multiclass_targets


class CELoss(ClientLoss):
    """Plain cross-entropy (mean over the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.task = "multiclass"

    @classmethod
    def from_context(cls, ctx: LossContext) -> CELoss:
        check_task(ctx.task, "ce", ("multiclass",))
        return cls()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        t = multiclass_targets(logits, targets)
        if t.numel() == 0:
            return logits.sum() * 0.0
        return F.cross_entropy(logits, t)

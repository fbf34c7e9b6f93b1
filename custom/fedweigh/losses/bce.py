"""Binary cross-entropy over logits for multi-label classification, with NaN targets ignored.

L = mean over valid (b, j) of -[y_bj log s_bj + (1 - y_bj) log(1 - s_bj)],  s = sigmoid(logit),
computed with log-sigmoid so that it stays finite for any finite logit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import ClientLoss, LossContext, check_task, masked_mean, multilabel_targets


class BCELoss(ClientLoss):
    """Masked binary cross-entropy (mean over the non-NaN target entries)."""

    def __init__(self) -> None:
        super().__init__()
        self.task = "multilabel"

    @classmethod
    def from_context(cls, ctx: LossContext) -> BCELoss:
        check_task(ctx.task, "bce", ("multilabel",))
        return cls()

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        y, valid = multilabel_targets(logits, targets)
        elementwise = -(y * F.logsigmoid(logits) + (1.0 - y) * F.logsigmoid(-logits))
        return masked_mean(elementwise, valid)

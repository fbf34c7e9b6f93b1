"""Focal loss (Lin et al., "Focal Loss for Dense Object Detection", ICCV 2017).

- multilabel (sigmoid focal), per valid entry (b, j), s = sigmoid(z):
  l = -alpha y (1 - s)^gamma log s - (1 - alpha)(1 - y) s^gamma log(1 - s)
  (alpha=None: both alpha factors are 1); L = mean over the valid (non-NaN) entries.
- multiclass (softmax focal): L = mean_b -(1 - p_t)^gamma log p_t, p_t = softmax(z_b)_{y_b}.

gamma = 0 gives BCE / CE exactly. All powers are computed in log space
((1 - s)^gamma = exp(gamma log sigmoid(-z)), log(1 - p_t) = logsumexp over the other classes - logsumexp),
so the loss and its gradient stay finite for any finite logits and for a learnable gamma.
The helpers below are shared with the DAFL loss.
"""

from __future__ import annotations

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
)

Gamma = float | torch.Tensor


def sigmoid_focal_terms(logits: torch.Tensor, gamma: Gamma) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise positive and negative focal terms (before the targets select them).

    pos = -(1 - s)^gamma log s,  neg = -s^gamma log(1 - s),  s = sigmoid(logits).
    """
    log_s = F.logsigmoid(logits)
    log_1ms = F.logsigmoid(-logits)
    pos = -torch.exp(gamma * log_1ms) * log_s
    neg = -torch.exp(gamma * log_s) * log_1ms
    return pos, neg


def softmax_focal_terms(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample (log p_t, log(1 - p_t)) with p_t = softmax(logits)_{targets}, both computed stably."""
    log_z = torch.logsumexp(logits, dim=1)
    log_pt = logits.gather(1, targets[:, None])[:, 0] - log_z
    is_target = F.one_hot(targets, num_classes=logits.shape[1]).bool()
    others = logits.masked_fill(is_target, float("-inf"))
    log_1m_pt = torch.logsumexp(others, dim=1) - log_z
    return log_pt, log_1m_pt


def softmax_focal_per_sample(logits: torch.Tensor, targets: torch.Tensor, gamma: Gamma) -> torch.Tensor:
    """-(1 - p_t)^gamma log p_t for each sample."""
    log_pt, log_1m_pt = softmax_focal_terms(logits, targets)
    return -torch.exp(gamma * log_1m_pt) * log_pt


class FocalLoss(ClientLoss):
    """Sigmoid focal loss (multilabel) or softmax focal loss (multiclass)."""

    def __init__(self, task: str, num_classes: int, gamma: float = 2.0, alpha: float | None = None) -> None:
        super().__init__()
        self.task = check_task(task, "focal")
        if gamma < 0:
            raise ValueError(f"focal: gamma must be >= 0, got {gamma}")
        if alpha is not None:
            if self.task == "multiclass":
                raise ValueError("focal: alpha is only defined for the multilabel (sigmoid) focal loss")
            if not 0.0 <= alpha <= 1.0:
                raise ValueError(f"focal: alpha must lie in [0, 1], got {alpha}")
        self.num_classes = int(num_classes)
        self.gamma = float(gamma)
        self.alpha = alpha

    @classmethod
    def from_context(cls, ctx: LossContext, gamma: float = 2.0, alpha: float | None = None) -> FocalLoss:
        return cls(ctx.task, ctx.num_classes, gamma=gamma, alpha=alpha)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        check_num_classes(logits, self.num_classes, "focal")
        if self.task == "multilabel":
            y, valid = multilabel_targets(logits, targets)
            pos, neg = sigmoid_focal_terms(logits, self.gamma)
            a_pos, a_neg = (1.0, 1.0) if self.alpha is None else (self.alpha, 1.0 - self.alpha)
            return masked_mean(a_pos * y * pos + a_neg * (1.0 - y) * neg, valid)
        t = multiclass_targets(logits, targets)
        per_sample = softmax_focal_per_sample(logits, t, self.gamma)
        return per_sample.sum() / max(t.numel(), 1)

"""Dynamic adaptive focal loss of DAFL (seed 003; equations recovered from the authors' code AIPMLab/ViT-FLDAF).

Statistics (reused from :mod:`fedweigh.weighting.dafl`):
    c_k        = (1/C) sum_i (N_k - n_{k,i}) / n_{k,i}  (a missing class follows the ``missing`` rule)
    c_client   = sum_k (N_k / N) c_k  (from the statistics phase)
    c_class_i  = (N - n_i) / n_i  (0 for a class nobody holds), from the global histogram
    c_i        = lam c_k + (1 - lam) c_class_i,   lam = 0.5     (``client_term="local"``, default)
               | lam c_client + (1 - lam) c_class_i              (``client_term="global"``)
The class weight is w_i = 1 + c_i.
- multiclass (the paper):  L = mean_b -w_{y_b} (1 - p_t)^gamma log p_t,   gamma = 2
- multilabel (our extension for chest X-ray), per valid entry (b, j), s = sigmoid(z):
    l = -w_j y (1 - s)^gamma log s - (1 - y) s^gamma log(1 - s);  L = mean over valid entries
Normalisation (``normalize=``), a division of the weights by one positive number or vector:
- "entries" (multilabel default): positives w_j / S and negatives 1 / S with
  S = mean_j [q_j w_j + (1 - q_j)], q_j = n_{k,j} / N_k the site's prevalence: the mean weight of a
  label entry on the site's data is 1 and every positive keeps w_j times the weight of a negative.
  For multiclass S = sum_c q_c w_c.
- "mean": positives w_j / mean_j w_j, negatives 1 (the earlier default: the positive:negative ratio
  becomes w_j / mean w, 1 on average, so the loss is close to plain focal loss).
- "none" (multiclass default, the paper): raw w.
- "auto": "entries" for multilabel, "none" for multiclass.

The authors' May 2026 code mixes the site's own c_k into the loss ("keep c_k for each client, not a
weighted global average"), the Dec 2025 code the federation's c_client: ``client_term`` selects.
Fallbacks when the statistics phase did not run: ``client_term="global"`` uses the local c_k, c_class
the local histogram (recorded in ``c_client_source`` / ``c_class_source`` = "global" | "local").
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

from fedweigh.imbalance import MissingRule, check_missing_rule, class_level_parameters, client_imbalance

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

Normalize = Literal["auto", "entries", "mean", "none"]
NORMALIZE: tuple[str, ...] = ("auto", "entries", "mean", "none")
ClientTerm = Literal["local", "global"]
CLIENT_TERMS: tuple[str, ...] = ("local", "global")


def dafl_coefficients(
    ctx: LossContext, lam: float = 0.5, client_term: ClientTerm = "local", missing: MissingRule = "half"
) -> tuple[np.ndarray, dict[str, object]]:
    """Mixed per-class coefficients c_i = lam c_client + (1 - lam) c_class_i (clipped at 0), and their sources.

    c_client is the site's own c_k (``client_term="local"``) or the federation's c_client from
    ``ctx.client_level_parameter`` (``"global"``; the local c_k when the context lacks it).
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"dafl: lam must lie in [0, 1], got {lam}")
    if client_term not in CLIENT_TERMS:
        raise ValueError(f"dafl: client_term must be one of {CLIENT_TERMS}, got {client_term!r}")
    check_missing_rule(missing)
    if client_term == "global" and ctx.client_level_parameter is not None:
        c_client, client_src = float(ctx.client_level_parameter), "global"
    else:
        c_client, client_src = client_imbalance(ctx.class_counts, ctx.num_samples, missing), "local"
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


def dafl_loss_weights(
    c: np.ndarray, normalize: str, task: str, prevalence: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """(positive weights, negative weight) from w = 1 + c under ``normalize`` (see the module docstring).

    ``prevalence`` q (the site's n_j / N_k) is needed by "entries" only.
    """
    w = 1.0 + np.asarray(c, dtype=np.float64)
    if normalize == "none":
        return w, 1.0
    if normalize == "mean":
        return w / w.mean(), 1.0
    if normalize != "entries":
        raise ValueError(f"dafl: normalize must be one of {NORMALIZE[1:]} here, got {normalize!r}")
    if prevalence is None:
        raise ValueError("dafl: normalize='entries' needs the site's class prevalence")
    q = np.clip(np.asarray(prevalence, dtype=np.float64), 0.0, 1.0)
    scale = float(np.mean(q * w + (1.0 - q))) if task == "multilabel" else float(np.sum(q * w))
    if not np.isfinite(scale) or scale <= 0:
        scale = 1.0  # no samples at all: nothing to normalise
    return w / scale, 1.0 / scale


def local_prevalence(ctx: LossContext) -> np.ndarray:
    """q_j = n_{k,j} / N_k (0 for an empty site)."""
    if ctx.num_samples <= 0:
        return np.zeros(ctx.num_classes)
    return np.asarray(ctx.class_counts, dtype=np.float64) / float(ctx.num_samples)


class DAFLLoss(ClientLoss):
    """DAFL's class-weighted focal loss (softmax for multiclass, sigmoid per finding for multilabel).

    ``c``: the mixed coefficients c_i (weights w = 1 + c); ``prevalence``: the site's q_j = n_j / N_k,
    needed by ``normalize="entries"`` (the multilabel default).
    """

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
        prevalence: np.ndarray | None = None,
        client_term: ClientTerm = "local",
        missing: MissingRule = "half",
    ) -> None:
        super().__init__()
        self.task = check_task(task, "dafl")
        if normalize not in NORMALIZE:
            raise ValueError(f"dafl: normalize must be one of {NORMALIZE}, got {normalize!r}")
        if gamma < 0:
            raise ValueError(f"dafl: gamma must be >= 0, got {gamma}")
        if l1 < 0:
            raise ValueError(f"dafl: l1 must be >= 0, got {l1}")
        if client_term not in CLIENT_TERMS:
            raise ValueError(f"dafl: client_term must be one of {CLIENT_TERMS}, got {client_term!r}")
        self.missing = check_missing_rule(missing)
        c = np.asarray(c, dtype=np.float64)
        if c.ndim != 1 or not np.all(np.isfinite(c)):
            raise ValueError(f"dafl: c must be a finite vector, got {c.tolist()}")
        self.num_classes = c.size
        self.normalize = (
            ("entries" if self.task == "multilabel" else "none") if normalize == "auto" else normalize
        )
        if self.normalize == "entries" and prevalence is None:
            raise ValueError(
                "dafl: normalize='entries' needs prevalence (the site's n_j / N_k); use from_context"
            )
        self.l1 = float(l1)
        self.lam = float(lam)
        self.client_term = client_term
        self.info: dict[str, object] = {}
        self.gamma: float | nn.Parameter
        if learnable_gamma:
            self.gamma = nn.Parameter(torch.tensor(float(gamma)))
        else:
            self.gamma = float(gamma)
        pos, neg = dafl_loss_weights(c, self.normalize, self.task, prevalence)
        self.register_buffer("class_weights", weights_buffer(pos))
        self.register_buffer("negative_weight", weights_buffer(np.array(neg)))

    @classmethod
    def from_context(
        cls,
        ctx: LossContext,
        lam: float = 0.5,
        gamma: float = 2.0,
        normalize: Normalize = "auto",
        learnable_gamma: bool = False,
        l1: float = 0.0,
        client_term: ClientTerm = "local",
        missing: MissingRule = "half",
    ) -> DAFLLoss:
        c, info = dafl_coefficients(ctx, lam, client_term, missing)
        loss = cls(
            ctx.task,
            c,
            gamma=gamma,
            normalize=normalize,
            learnable_gamma=learnable_gamma,
            l1=l1,
            lam=lam,
            prevalence=local_prevalence(ctx),
            client_term=client_term,
            missing=missing,
        )
        loss.info = info
        fallback = (client_term == "global" and info["c_client_source"] == "local") or info[
            "c_class_source"
        ] == "local"
        if fallback:
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
        c, self.info = dafl_coefficients(ctx, self.lam, self.client_term, self.missing)  # type: ignore[arg-type]
        pos, neg = dafl_loss_weights(c, self.normalize, self.task, local_prevalence(ctx))
        self.class_weights.copy_(weights_buffer(pos))
        self.negative_weight.copy_(weights_buffer(np.array(neg)))

    def _gamma(self) -> float | torch.Tensor:
        return self.gamma.clamp_min(0.0) if isinstance(self.gamma, torch.Tensor) else self.gamma

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        check_num_classes(logits, self.num_classes, "dafl")
        w = self.class_weights.to(logits.device)
        gamma = self._gamma()
        if self.task == "multilabel":
            y, valid = multilabel_targets(logits, targets)
            pos, neg = sigmoid_focal_terms(logits, gamma)
            w_neg = self.negative_weight.to(logits.device)
            return masked_mean(w * y * pos + w_neg * (1.0 - y) * neg, valid)
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

"""Client losses for imbalanced (federated) classification, built from a client's label statistics.

    loss_fn = build_loss("pnb", ctx, negatives="text", mu=4.0)
    loss = loss_fn(logits, targets) + loss_fn.penalty(model)

Names in :data:`LOSSES`: "bce", "ce", "focal", "class_balanced", "pnb", "dafl"; "default" resolves to
"bce" for multilabel and "ce" for multiclass. Formulas, readings and defaults: docs/methods.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .base import ClientLoss, LossContext
from .bce import BCELoss
from .ce import CELoss
from .class_balanced import ClassBalancedLoss, class_balanced_weights, inverse_effective_number
from .dafl import DAFLLoss, dafl_coefficients
from .focal import FocalLoss
from .pnb import PNBLoss, pnb_alphas

LossBuilder = Callable[..., ClientLoss]

#: name -> builder ``(ctx: LossContext, **options) -> ClientLoss``
LOSSES: dict[str, LossBuilder] = {
    "bce": BCELoss.from_context,
    "ce": CELoss.from_context,
    "focal": FocalLoss.from_context,
    "class_balanced": ClassBalancedLoss.from_context,
    "pnb": PNBLoss.from_context,
    "dafl": DAFLLoss.from_context,
}

_DEFAULT_BY_TASK = {"multilabel": "bce", "multiclass": "ce"}


def loss_options(name: str) -> tuple[str, ...]:
    """The option names the loss ``name`` accepts."""
    params = list(inspect.signature(LOSSES[name]).parameters)
    return tuple(params[1:])  # first parameter is the context


def build_loss(name: str, ctx: LossContext, **options: Any) -> ClientLoss:
    """Build the loss ``name`` for the client described by ``ctx``.

    Raises KeyError (listing the known names) for an unknown name, TypeError for an unknown option.
    """
    resolved = _DEFAULT_BY_TASK[ctx.task] if name == "default" else name
    if resolved not in LOSSES:
        known = ", ".join(sorted(LOSSES)) + ", default"
        raise KeyError(f"unknown loss {name!r}; known losses: {known}")
    accepted = loss_options(resolved)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"loss {resolved!r} got unknown option(s) {unknown}; accepted options: {list(accepted)}"
        )
    return LOSSES[resolved](ctx, **options)


__all__ = [
    "LOSSES",
    "BCELoss",
    "CELoss",
    "ClassBalancedLoss",
    "ClientLoss",
    "DAFLLoss",
    "FocalLoss",
    "LossContext",
    "PNBLoss",
    "build_loss",
    "class_balanced_weights",
    "dafl_coefficients",
    "inverse_effective_number",
    "loss_options",
    "pnb_alphas",
]

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

__all__ = [
    "LOSSES",
    "LOSS_CLASSES",
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
    "loss_uses_global_stats",
    "pnb_alphas",
]

LossBuilder = Callable[..., ClientLoss]

#: name -> loss class (each builds itself with ``from_context(ctx, **options)``)
LOSS_CLASSES: dict[str, type[ClientLoss]] = {
    "bce": BCELoss,
    "ce": CELoss,
    "focal": FocalLoss,
    "class_balanced": ClassBalancedLoss,
    "pnb": PNBLoss,
    "dafl": DAFLLoss,
}

#: name -> builder ``(ctx: LossContext, **options) -> ClientLoss``
LOSSES: dict[str, LossBuilder] = {name: cls.from_context for name, cls in LOSS_CLASSES.items()}


def loss_uses_global_stats(name: str) -> bool:
    """Whether the loss ``name`` reads the federation's label histogram (``default``: BCE/CE, no)."""
    cls = LOSS_CLASSES.get(name)
    return bool(cls is not None and cls.uses_global_stats)


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

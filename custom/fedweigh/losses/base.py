"""What every client loss shares: the label statistics it is built from and target handling.

A loss is built once per client (and per round for the "dynamic" schemes) from a
:class:`LossContext` and then called as ``loss_fn(logits, targets)``:

- ``multilabel``: logits (B, C), targets float (B, C) of 0/1 (soft labels allowed); a NaN target is
  an ignored entry (e.g. CheXpert's U-Ignore policy) and never contributes to the loss or its gradient.
- ``multiclass``: logits (B, C), targets integer (B,) in [0, C).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
from torch import nn

from fedweigh.histograms import GlobalStats

Task = Literal["multilabel", "multiclass"]
TASKS: tuple[str, ...] = ("multilabel", "multiclass")


def _as_counts(name: str, value: np.ndarray, num_classes: int) -> np.ndarray:
    counts = np.asarray(value, dtype=np.float64)
    if counts.shape != (num_classes,):
        raise ValueError(f"LossContext.{name} must have shape ({num_classes},), got {counts.shape}")
    if not np.all(np.isfinite(counts)):
        raise ValueError(f"LossContext.{name} holds non-finite values: {counts.tolist()}")
    return counts


@dataclass
class LossContext:
    """The label statistics a client loss is built from.

    class_counts: local positives per finding (multilabel) or samples per class (multiclass).
    num_samples: N_k, the client's number of training samples.
    global_class_counts / global_num_samples: the federation's histogram and size from the secure
    statistics phase (may carry DP noise: negative entries are clipped to 0 where used).
    client_level_parameter: DAFL's c_client = sum_k N_k / N c_k (also from the statistics phase).
    """

    task: Task
    num_classes: int
    class_counts: np.ndarray
    num_samples: int
    global_class_counts: np.ndarray | None = None
    global_num_samples: int | None = None
    client_level_parameter: float | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"LossContext.task must be one of {TASKS}, got {self.task!r}")
        if int(self.num_classes) < 1 or (self.task == "multiclass" and int(self.num_classes) < 2):
            raise ValueError(
                f"LossContext.num_classes must be >= 1 (multilabel) or >= 2 (multiclass), "
                f"got {self.num_classes} for task {self.task!r}"
            )
        self.num_classes = int(self.num_classes)
        self.class_counts = _as_counts("class_counts", self.class_counts, self.num_classes)
        if np.any(self.class_counts < 0):
            raise ValueError(
                f"LossContext.class_counts must be non-negative, got {self.class_counts.tolist()}"
            )
        if self.num_samples < 0:
            raise ValueError(f"LossContext.num_samples must be non-negative, got {self.num_samples}")
        if np.any(self.class_counts > self.num_samples):
            raise ValueError(
                f"LossContext.class_counts {self.class_counts.tolist()} exceed "
                f"num_samples={self.num_samples}: a class cannot have more samples than the client"
            )
        if self.global_class_counts is not None:
            self.global_class_counts = _as_counts(
                "global_class_counts", self.global_class_counts, self.num_classes
            )
        if self.global_num_samples is not None and self.global_num_samples <= 0:
            raise ValueError(
                f"LossContext.global_num_samples must be positive, got {self.global_num_samples}"
            )
        if self.client_level_parameter is not None and not np.isfinite(self.client_level_parameter):
            raise ValueError(
                f"LossContext.client_level_parameter must be finite, got {self.client_level_parameter}"
            )

    @classmethod
    def of_site(
        cls,
        task: Task,
        num_classes: int,
        class_counts: np.ndarray,
        num_samples: int,
        global_stats: GlobalStats | None = None,
    ) -> LossContext:
        """The context of a site's own statistics and, when the statistics phase ran, the federation's
        (:class:`fedweigh.histograms.GlobalStats`)."""
        return cls(
            task=task,
            num_classes=num_classes,
            class_counts=class_counts,
            num_samples=num_samples,
            global_class_counts=None if global_stats is None else global_stats.class_counts,
            global_num_samples=None if global_stats is None else global_stats.num_samples,
            client_level_parameter=None if global_stats is None else global_stats.client_level_parameter,
        )


class ClientLoss(nn.Module):
    """Base class: ``forward(logits, targets) -> scalar``; ``penalty(model)`` for model-dependent terms.

    ``uses_global_stats`` declares that the loss reads the federation's label histogram (the
    statistics phase runs before training when a method's loss declares it).
    """

    uses_global_stats: ClassVar[bool] = False
    task: Task

    def penalty(self, model: nn.Module) -> torch.Tensor:
        """Extra term that needs the model's parameters (0 unless a loss defines one).

        The training loop adds it to the loss: ``loss = loss_fn(logits, y) + loss_fn.penalty(model)``.
        """
        param = next(model.parameters(), None)
        device = param.device if param is not None else None
        return torch.zeros((), device=device)


def check_task(task: str, loss_name: str, allowed: tuple[str, ...] = TASKS) -> Task:
    """Validate ``task`` for the loss called ``loss_name``."""
    if task not in allowed:
        raise ValueError(f"loss {loss_name!r} supports task(s) {allowed}, got {task!r}")
    return task  # type: ignore[return-value]


def multilabel_targets(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits, targets with NaN replaced by 0, and the float mask of valid (non-NaN) entries."""
    if logits.ndim != 2:
        raise ValueError(f"multilabel logits must have shape (B, C), got {tuple(logits.shape)}")
    if targets.shape != logits.shape:
        raise ValueError(
            f"multilabel targets must have the logits' shape {tuple(logits.shape)}, got {tuple(targets.shape)}"
        )
    targets = targets.to(device=logits.device, dtype=torch.float32)
    valid = ~torch.isnan(targets)
    y = torch.where(valid, targets, torch.zeros_like(targets))
    return y, valid.to(torch.float32)


def multiclass_targets(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Targets as int64 (B,), checked against the logits' shape and class range."""
    if logits.ndim != 2:
        raise ValueError(f"multiclass logits must have shape (B, C), got {tuple(logits.shape)}")
    if targets.ndim == 2 and targets.shape[1] == 1:
        targets = targets[:, 0]
    if targets.ndim != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(
            f"multiclass targets must have shape ({logits.shape[0]},), got {tuple(targets.shape)}"
        )
    if targets.is_floating_point():
        if torch.any(torch.isnan(targets)):
            raise ValueError("multiclass targets contain NaN: class indices are required")
        targets = targets.round()
    targets = targets.to(dtype=torch.int64)
    num_classes = logits.shape[1]
    if targets.numel() and bool(((targets < 0) | (targets >= num_classes)).any()):
        raise ValueError(
            f"multiclass targets must lie in [0, {num_classes}), got min {int(targets.min())}, "
            f"max {int(targets.max())}"
        )
    return targets.to(device=logits.device)  # checked where they are, then moved to the logits


def check_num_classes(logits: torch.Tensor, num_classes: int, loss_name: str) -> None:
    """The logits' class dimension must match the statistics the loss was built from."""
    if logits.ndim != 2 or logits.shape[1] != num_classes:
        raise ValueError(
            f"loss {loss_name!r} was built for {num_classes} classes, got logits of shape {tuple(logits.shape)}"
        )


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over entries where ``mask`` is 1 (0 when none is valid, still differentiable)."""
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def column_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-class (column) mean over the valid entries of each column; 0 for a column with none."""
    return (values * mask).sum(dim=0) / mask.sum(dim=0).clamp_min(1.0)


def weights_buffer(values: np.ndarray) -> torch.Tensor:
    """A float32 tensor for ``register_buffer`` (moves with ``.to(device)``)."""
    return torch.as_tensor(np.asarray(values, dtype=np.float64), dtype=torch.float32)

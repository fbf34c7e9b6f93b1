"""The ``fedweigh explain`` figure: per image its input and the gradient-rollout heatmap overlaid on it."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from fedweigh.arrays import to_numpy
from fedweigh.explain.rollout import gradient_attention_rollout
from fedweigh.io import write_figure

if TYPE_CHECKING:  # torch and matplotlib are imported where used
    from matplotlib.figure import Figure
    from torch import Tensor, nn

    from fedweigh.data.base import LabeledImages

__all__ = ["explain_grid"]

#: Characters per line of the true-findings panel title.
_TITLE_WIDTH = 34


def _probabilities(logits: Tensor, task: str) -> np.ndarray:
    """Sigmoid per finding (multilabel) or softmax over classes (multiclass)."""
    import torch

    probs = torch.sigmoid(logits) if task == "multilabel" else torch.softmax(logits, dim=1)
    return to_numpy(probs)


def _true_names(labels: np.ndarray, task: str, class_names: Sequence[str]) -> str:
    if task == "multiclass":
        return str(class_names[int(labels)])
    positive = [
        class_names[k] for k in range(len(class_names)) if np.isfinite(labels[k]) and labels[k] >= 0.5
    ]
    return ", ".join(positive) if positive else "no finding"


def _checked_rows(data: LabeledImages, names: Sequence[str], indices: Sequence[int]) -> list[int]:
    """``indices`` as ints, after checking the class names against the data and the indices against its size."""
    if len(names) != data.num_classes:
        raise ValueError(f"explain_grid: {len(names)} class names for data with {data.num_classes} classes")
    rows = [int(i) for i in indices]
    if not rows:
        raise ValueError("explain_grid: no image indices given")
    out_of_range = [i for i in rows if not 0 <= i < len(data)]
    if out_of_range:
        raise IndexError(f"explain_grid: indices {out_of_range} out of range for {len(data)} images")
    return rows


def _predict(model: nn.Module, images: Tensor, task: str, num_classes: int) -> np.ndarray:
    """The model's class probabilities (B, num_classes) for ``images``, run in eval mode (its mode is kept)."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(images)
    finally:
        model.train(was_training)
    if logits.shape[1] != num_classes:
        raise ValueError(
            f"explain_grid: the model has {logits.shape[1]} outputs but there are {num_classes} classes"
        )
    return _probabilities(logits, task)


def _explained_classes(target: Literal["predicted"] | int, probs: np.ndarray) -> np.ndarray:
    """The class explained per image: its most probable (``"predicted"``) or ``target`` for every image."""
    num_images, num_classes = probs.shape
    if target == "predicted":
        return probs.argmax(axis=1)
    if isinstance(target, int | np.integer) and 0 <= int(target) < num_classes:
        return np.full(num_images, int(target))
    raise ValueError(
        f"explain_grid: target must be 'predicted' or a class index in [0, {num_classes}), got {target!r}"
    )


def _draw(
    data: LabeledImages,
    rows: list[int],
    names: Sequence[str],
    probs: np.ndarray,
    targets: np.ndarray,
    heat: np.ndarray,
    top_k: int,
    images_per_row: int,
) -> Figure:
    """The figure: per image its input (true findings above) and the heatmap over it (the explained
    class and the ``top_k`` predictions above)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    per_row = max(1, min(images_per_row, len(rows)))
    n_rows = math.ceil(len(rows) / per_row)
    fig = Figure(figsize=(2.2 * 2 * per_row, 3.3 * n_rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_rows, 2 * per_row, squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for j, row in enumerate(rows):
        r, c = divmod(j, per_row)
        gray = data.images[row].mean(axis=0)
        top = np.argsort(-probs[j])[:top_k]
        pred = "\n".join(f"{names[k]} {probs[j, k]:.2f}" for k in top)
        truth = textwrap.fill(_true_names(data.labels[row], data.task, names), width=_TITLE_WIDTH)
        ax_in, ax_heat = axes[r, 2 * c], axes[r, 2 * c + 1]
        ax_in.imshow(gray, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax_in.set_title(f"#{row} true:\n{truth}", fontsize=7)
        ax_heat.imshow(gray, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        # The heatmap is already up-sampled to the image grid: show its pixels as they are.
        ax_heat.imshow(heat[j], cmap="jet", alpha=0.45, vmin=0.0, vmax=1.0, interpolation="nearest")
        ax_heat.set_title(f"heatmap for: {names[int(targets[j])]}\n{pred}", fontsize=7)
    fig.tight_layout()
    return fig


def explain_grid(
    model: nn.Module,
    data: LabeledImages,
    indices: Sequence[int],
    class_names: Sequence[str] | None = None,
    out_path: str | Path = "explain.png",
    target: Literal["predicted"] | int = "predicted",
    discard_ratio: float = 0.0,
    top_k: int = 3,
    images_per_row: int = 4,
    dpi: int = 90,
) -> Path:
    """Write a PNG grid: per image its input and the gradient-rollout heatmap overlaid on it.

    ``target="predicted"`` explains each image's most probable class (finding); an int explains that
    class for every image. Panel titles give the true findings and the ``top_k`` predictions with their
    probabilities (sigmoid for multi-label data, softmax for multi-class). Drawn with matplotlib's Agg
    canvas (no display needed); pixels are drawn unsmoothed, which keeps the PNG at about 15 KB per
    image at the defaults.
    """
    import torch

    names = tuple(class_names) if class_names is not None else data.class_names
    rows = _checked_rows(data, names, indices)
    device = next(model.parameters()).device
    images = torch.from_numpy(np.ascontiguousarray(data.images[rows])).to(device)
    probs = _predict(model, images, data.task, len(names))
    targets = _explained_classes(target, probs)
    heat = gradient_attention_rollout(model, images, torch.from_numpy(targets), discard_ratio=discard_ratio)
    fig = _draw(data, rows, names, probs, targets, heat, top_k, images_per_row)
    return write_figure(Path(out_path), fig, dpi=dpi, format="png")

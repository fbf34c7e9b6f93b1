"""Curves of a final model's test predictions: macro ROC, decision-curve net benefit, confusion matrix.

Multi-label scores (N, C) are read per finding; multi-class scores one-vs-rest per class (labels (N,)).
Classes without both a positive and a negative test label are left out of the macro averages.
"""

from __future__ import annotations

import numpy as np


def _indicator(labels: np.ndarray, num_classes: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim == 1:
        return np.eye(num_classes, dtype=np.float64)[labels.astype(np.int64)]
    return labels.astype(np.float64)


def _usable(y: np.ndarray) -> np.ndarray:
    """Rows with a known label (not NaN)."""
    return ~np.isnan(y)


def macro_roc(
    labels: np.ndarray, scores: np.ndarray, grid: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(FPR grid, mean TPR): each class's ROC (sklearn.metrics.roc_curve) interpolated on the grid,
    then averaged over the classes with both labels (vertical averaging, Fawcett 2006)."""
    from sklearn.metrics import roc_curve

    grid = np.linspace(0.0, 1.0, 101) if grid is None else np.asarray(grid, dtype=np.float64)
    y = _indicator(labels, scores.shape[1])
    curves = []
    for j in range(y.shape[1]):
        ok = _usable(y[:, j])
        yj = y[ok, j]
        if yj.min(initial=1.0) == yj.max(initial=0.0):
            continue
        fpr, tpr, _ = roc_curve(yj, scores[ok, j])
        curves.append(np.interp(grid, fpr, tpr))
    mean = np.mean(curves, axis=0) if curves else np.full(grid.shape, np.nan)
    return grid, mean


def net_benefit(labels: np.ndarray, scores: np.ndarray, thresholds: np.ndarray) -> dict[str, np.ndarray]:
    """Decision-curve analysis (Vickers and Elkin, Med. Decis. Making 26, 2006), macro over classes.

    For class j at threshold probability p_t: NB_j = TP_j / N_j - FP_j / N_j * p_t / (1 - p_t), where a
    case is treated when its score >= p_t. ``treat_all`` is the net benefit of treating everyone,
    pi_j - (1 - pi_j) p_t / (1 - p_t) with pi_j the prevalence; treating no one has net benefit 0.
    Returns ``{"model": (T,), "treat_all": (T,)}``, means over the classes with both labels.
    """
    pt = np.asarray(thresholds, dtype=np.float64)
    if np.any(pt <= 0) or np.any(pt >= 1):
        raise ValueError("net_benefit: threshold probabilities must lie in (0, 1)")
    odds = pt / (1.0 - pt)
    y = _indicator(labels, scores.shape[1])
    model, treat_all = [], []
    for j in range(y.shape[1]):
        ok = _usable(y[:, j])
        yj, sj = y[ok, j], scores[ok, j]
        if yj.min(initial=1.0) == yj.max(initial=0.0):
            continue
        n = yj.size
        treated = sj[None, :] >= pt[:, None]
        tp = (treated & (yj[None, :] == 1)).sum(axis=1) / n
        fp = (treated & (yj[None, :] == 0)).sum(axis=1) / n
        model.append(tp - fp * odds)
        prevalence = yj.mean()
        treat_all.append(prevalence - (1.0 - prevalence) * odds)
    nan = np.full(pt.shape, np.nan)
    return {
        "model": np.mean(model, axis=0) if model else nan,
        "treat_all": np.mean(treat_all, axis=0) if treat_all else nan,
    }


def confusion(labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Multi-class confusion matrix (true class x arg-max prediction), counts (C, C)."""
    from sklearn.metrics import confusion_matrix

    return confusion_matrix(
        np.asarray(labels).astype(np.int64), np.argmax(scores, axis=1), labels=np.arange(scores.shape[1])
    )

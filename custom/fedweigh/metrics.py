"""Classification metrics for imbalanced multi-label and multi-class evaluation.

Multi-label (one binary problem per finding): ``y_true`` is (N, C) of 0/1 and may hold NaN for
unknown labels (CheXpert's U-Ignore policy); each finding is scored on its labelled rows only and
macro averages run over findings whose labelled rows hold both a positive and a negative.
Multi-class: ``y_true`` is (N,) of class indices, scores are (N, C) probabilities, per-class metrics
are one-vs-rest with the arg-max prediction, macro over classes that are neither absent nor the
only class present.

- AUC: area under the ROC curve (scikit-learn ``roc_auc_score``), macro over findings.
- GM: geometric mean of sensitivity and specificity, GM_j = sqrt(TPR_j * TNR_j), macro over findings
  (as used for the FedDRAW evaluation and imbalanced learning in general).
- Youden's J = TPR - FPR; the threshold maximising it on validation data (Youden 1950).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
from sklearn.metrics import (
    accuracy_score,
    balanced_accuracy_score,
    confusion_matrix,
    roc_auc_score,
    roc_curve,
)

_EPS = 1e-12


def _scores_2d(y_score: np.ndarray) -> np.ndarray:
    y_score = np.asarray(y_score, dtype=np.float64)
    if y_score.ndim == 1:
        y_score = y_score[:, None]
    if y_score.ndim != 2:
        raise ValueError(f"y_score must have shape (N, C), got {y_score.shape}")
    return y_score


def _indicator(y_true: np.ndarray, num_classes: int) -> np.ndarray:
    """(N, C) float 0/1/NaN: multi-label arrays as given, multi-class index vectors one-hot encoded."""
    y_true = np.asarray(y_true)
    if y_true.ndim == 2:
        if y_true.shape[1] != num_classes:
            raise ValueError(f"y_true has {y_true.shape[1]} columns but y_score has {num_classes}")
        return y_true.astype(np.float64)
    if y_true.ndim != 1:
        raise ValueError(f"y_true must have shape (N,) or (N, C), got {y_true.shape}")
    if num_classes == 1:  # a single binary finding given as a vector
        return y_true.astype(np.float64)[:, None]
    idx = y_true.astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= num_classes):
        raise ValueError(
            f"class indices in y_true must lie in [0, {num_classes}), got [{idx.min()}, {idx.max()}]"
        )
    return np.eye(num_classes, dtype=np.float64)[idx]


def _check_rows(y_true: np.ndarray, y_score: np.ndarray) -> None:
    if y_true.shape[0] != y_score.shape[0]:
        raise ValueError(f"y_true has {y_true.shape[0]} rows but y_score has {y_score.shape[0]}")


def _valid(column: np.ndarray) -> np.ndarray:
    """Mask of labelled rows of one finding, or an empty mask when it lacks a positive or a negative."""
    mask = ~np.isnan(column)
    labelled = column[mask]
    if labelled.size == 0 or labelled.min() == labelled.max():
        return np.zeros_like(mask)
    return mask


def _predictions(y_true: np.ndarray, y_score: np.ndarray, threshold: float | np.ndarray) -> np.ndarray:
    """(N, C) 0/1 predictions: ``score >= threshold_j`` (multi-label) or one-hot arg-max (multi-class)."""
    num_classes = y_score.shape[1]
    if np.asarray(y_true).ndim == 1 and num_classes > 1:
        return np.eye(num_classes, dtype=np.float64)[np.argmax(y_score, axis=1)]
    thr = np.broadcast_to(np.asarray(threshold, dtype=np.float64), (num_classes,))
    return (y_score >= thr[None, :]).astype(np.float64)


def _confusion(y_ind: np.ndarray, y_pred: np.ndarray) -> dict[int, tuple[int, int, int, int]]:
    """(TN, FP, FN, TP) per finding with both labels present, over its labelled rows."""
    out: dict[int, tuple[int, int, int, int]] = {}
    for j in range(y_ind.shape[1]):
        mask = _valid(y_ind[:, j])
        if mask.any():
            with warnings.catch_warnings():  # labels=[0, 1] keeps the 2x2 shape when one class is absent
                warnings.filterwarnings("ignore", message="A single label was found", category=UserWarning)
                tn, fp, fn, tp = confusion_matrix(
                    y_ind[mask, j].astype(np.int64), y_pred[mask, j].astype(np.int64), labels=[0, 1]
                ).ravel()
            out[j] = (int(tn), int(fp), int(fn), int(tp))
    return out


def _macro(values: dict[int, float]) -> float:
    return float(np.mean(list(values.values()))) if values else float("nan")


def macro_auc(y_true: np.ndarray, y_score: np.ndarray) -> tuple[float, dict[int, float]]:
    """Macro ROC AUC and the per-class AUCs, over classes with both labels present (NaN labels ignored).

    ``y_true`` (N, C) multi-label or (N,) class indices (then one-vs-rest AUC per class, the
    ``roc_auc_score(multi_class="ovr", average="macro")`` definition). Returns NaN and ``{}``
    when no class qualifies.
    """
    y_score = _scores_2d(y_score)
    y_ind = _indicator(y_true, y_score.shape[1])
    _check_rows(y_ind, y_score)
    per_class: dict[int, float] = {}
    for j in range(y_ind.shape[1]):
        mask = _valid(y_ind[:, j])
        if mask.any():
            per_class[j] = float(roc_auc_score(y_ind[mask, j], y_score[mask, j]))
    return _macro(per_class), per_class


def population_weights(groups: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Row weights that make a test set look like a population with group shares ``target``.

    Row i of group g gets w_i = q_g / n_g, with n_g the test rows of group g and q the target shares
    renormalised over the groups the test set holds (a group it lacks cannot be represented); the
    weights sum to 1. A weighted metric then estimates the metric on a test set drawn from the
    population's label mix (importance weighting; no rows are drawn, so no draw noise is added).
    """
    groups = np.asarray(groups, dtype=np.int64)
    q = np.zeros(max(int(groups.max()) + 1, len(target)) if groups.size else len(target))
    q[: len(target)] = np.asarray(target, dtype=np.float64)
    counts = np.bincount(groups, minlength=q.size).astype(np.float64)
    q = np.where(counts > 0, q, 0.0)
    if not q.sum() > 0:
        raise ValueError("the test set holds no row of any group the population has")
    q /= q.sum()
    return q[groups] / counts[groups]


def weighted_macro_auc(y_true: np.ndarray, y_score: np.ndarray, weights: np.ndarray) -> float:
    """Macro ROC AUC with row weights (``roc_auc_score(sample_weight=w)`` per class), over classes with
    a positive and a negative among the rows of weight > 0; NaN when no class qualifies."""
    y_score = _scores_2d(y_score)
    y_ind = _indicator(y_true, y_score.shape[1])
    _check_rows(y_ind, y_score)
    w = np.asarray(weights, dtype=np.float64)
    per_class: dict[int, float] = {}
    for j in range(y_ind.shape[1]):
        mask = _valid(np.where(w > 0, y_ind[:, j], np.nan))
        if mask.any():
            per_class[j] = float(roc_auc_score(y_ind[mask, j], y_score[mask, j], sample_weight=w[mask]))
    return _macro(per_class)


def geometric_mean(
    y_true: np.ndarray, y_score: np.ndarray, threshold: float | np.ndarray = 0.5
) -> tuple[float, dict[int, float]]:
    """Macro geometric mean GM = mean_j sqrt(sensitivity_j * specificity_j) and the per-class GM_j.

    sensitivity_j = TP_j / (TP_j + FN_j), specificity_j = TN_j / (TN_j + FP_j). Multi-label:
    predicted positive when ``score >= threshold`` (a scalar or one threshold per finding).
    Multi-class (``y_true`` of shape (N,)): one-vs-rest with the arg-max prediction (``threshold``
    unused). Classes without both labels are excluded; NaN labels ignored.
    """
    y_score = _scores_2d(y_score)
    y_ind = _indicator(y_true, y_score.shape[1])
    _check_rows(y_ind, y_score)
    y_pred = _predictions(y_true, y_score, threshold)
    per_class = {
        j: float(np.sqrt(tp / (tp + fn) * tn / (tn + fp)))
        for j, (tn, fp, fn, tp) in _confusion(y_ind, y_pred).items()
    }
    return _macro(per_class), per_class


def youden_thresholds(y_true: np.ndarray, y_score: np.ndarray, default: float = 0.5) -> np.ndarray:
    """Per-finding threshold maximising Youden's J = TPR - FPR on (validation) data, shape (C,).

    Multi-label ``y_true`` (N, C), NaN labels ignored. The ROC curve's artificial +inf threshold
    (predict nothing positive) is never chosen; findings without both labels get ``default``.
    """
    y_score = _scores_2d(y_score)
    y_ind = _indicator(y_true, y_score.shape[1])
    _check_rows(y_ind, y_score)
    thresholds = np.full(y_ind.shape[1], default, dtype=np.float64)
    for j in range(y_ind.shape[1]):
        mask = _valid(y_ind[:, j])
        if not mask.any():
            continue
        fpr, tpr, thr = roc_curve(y_ind[mask, j], y_score[mask, j])
        finite = np.isfinite(thr)
        best = np.argmax((tpr - fpr)[finite])
        thresholds[j] = float(thr[finite][best])
    return thresholds


def evaluate_scores(
    task: str,
    y_true: np.ndarray,
    y_score: np.ndarray,
    class_names: Sequence[str],
    threshold: float | np.ndarray = 0.5,
) -> dict[str, float]:
    """All evaluation metrics of one prediction set, as a flat ``{name: float}`` dict.

    multilabel: ``auc``, ``gm``, ``auc/<finding>`` for every finding with both labels present, and
    macro ``precision``, ``recall`` (= mean sensitivity), ``f1``, ``specificity`` at ``threshold``.
    multiclass: ``accuracy``, ``balanced_accuracy``, ``auc`` (one-vs-rest macro), ``gm`` (one-vs-rest
    macro), and macro ``precision``, ``recall``, ``f1``, ``specificity`` of the arg-max prediction.
    Macro averages run over the classes with both labels present; a precision or F1 whose
    denominator is zero counts as 0. Metrics that cannot be computed are NaN.
    """
    if task not in ("multilabel", "multiclass"):
        raise ValueError(f"evaluate_scores: task must be 'multilabel' or 'multiclass', got {task!r}")
    y_score = _scores_2d(y_score)
    if len(class_names) != y_score.shape[1]:
        raise ValueError(
            f"evaluate_scores: {len(class_names)} class names but y_score has {y_score.shape[1]} columns"
        )
    y_true = np.asarray(y_true)
    if task == "multilabel" and y_true.ndim != 2:
        raise ValueError(f"evaluate_scores: multilabel y_true must have shape (N, C), got {y_true.shape}")
    if task == "multiclass" and y_true.ndim != 1:
        raise ValueError(f"evaluate_scores: multiclass y_true must have shape (N,), got {y_true.shape}")

    y_ind = _indicator(y_true, y_score.shape[1])
    _check_rows(y_ind, y_score)
    auc, auc_per_class = macro_auc(y_true, y_score)
    gm, _ = geometric_mean(y_true, y_score, threshold)
    counts = _confusion(y_ind, _predictions(y_true, y_score, threshold))

    def ratio(num: int, den: int) -> float:
        return num / den if den else 0.0

    precision = {j: ratio(tp, tp + fp) for j, (_, fp, _, tp) in counts.items()}
    recall = {j: ratio(tp, tp + fn) for j, (_, _, fn, tp) in counts.items()}
    specificity = {j: ratio(tn, tn + fp) for j, (tn, fp, _, _) in counts.items()}
    f1 = {j: ratio(2 * tp, 2 * tp + fp + fn) for j, (_, fp, fn, tp) in counts.items()}

    out: dict[str, float] = {}
    if task == "multiclass":
        labels = y_true.astype(np.int64)
        pred = np.argmax(y_score, axis=1)
        out["accuracy"] = float(accuracy_score(labels, pred)) if labels.size else float("nan")
        out["balanced_accuracy"] = (
            float(balanced_accuracy_score(labels, pred)) if labels.size else float("nan")
        )
    out["auc"] = auc
    out["gm"] = gm
    out["precision"] = _macro(precision)
    out["recall"] = _macro(recall)
    out["f1"] = _macro(f1)
    out["specificity"] = _macro(specificity)
    if task == "multilabel":
        for j, value in auc_per_class.items():
            out[f"auc/{class_names[j]}"] = value
    return out

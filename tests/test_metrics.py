"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from fedweigh.metrics import evaluate_scores, geometric_mean, macro_auc, youden_thresholds

NAN = float("nan")

# Two findings, five images.
# finding 0: labels 1 1 0 0 0, scores .9 .4 .6 .2 .1 -> at 0.5: TP=1 FN=1 FP=1 TN=2
#   sensitivity 1/2, specificity 2/3, GM sqrt(1/3); AUC: pairs (pos > neg) = 3 + 2 of 6 -> 5/6
# finding 1: labels 0 1 1 0 1, scores .1 .7 .8 .3 .6 -> perfectly separated: GM 1, AUC 1
Y = np.array([[1, 0], [1, 1], [0, 1], [0, 0], [0, 1]], dtype=np.float32)
S = np.array([[0.9, 0.1], [0.4, 0.7], [0.6, 0.8], [0.2, 0.3], [0.1, 0.6]])


def test_macro_auc_hand_ranked() -> None:
    auc, per = macro_auc(Y, S)
    assert per == pytest.approx({0: 5 / 6, 1: 1.0})
    assert auc == pytest.approx((5 / 6 + 1.0) / 2)


def test_auc_counts_ties_as_half() -> None:
    # positives .5 .8, negatives .5 .2: pairs (.5,.5) tie = 1/2, others won -> 3.5 / 4
    auc, per = macro_auc(np.array([[1], [1], [0], [0]]), np.array([[0.5], [0.8], [0.5], [0.2]]))
    assert auc == pytest.approx(3.5 / 4) and per[0] == pytest.approx(3.5 / 4)


def test_geometric_mean_2x2() -> None:
    gm, per = geometric_mean(Y, S)
    assert per[0] == pytest.approx(math.sqrt(0.5 * 2 / 3))
    assert per[1] == pytest.approx(1.0)
    assert gm == pytest.approx((math.sqrt(1 / 3) + 1) / 2)
    # per-finding thresholds: 0.95 for finding 0 predicts nothing positive -> sensitivity 0, GM 0
    gm2, per2 = geometric_mean(Y, S, threshold=np.array([0.95, 0.5]))
    assert per2 == pytest.approx({0: 0.0, 1: 1.0}) and gm2 == pytest.approx(0.5)


def test_nan_labels_are_ignored_per_finding() -> None:
    y = Y.copy()
    y[4, 0] = NAN  # finding 0 loses its negative scored 0.1: AUC = 3/4 (0.4 loses to 0.6)
    y[0, 1] = NAN  # finding 1 keeps rows 1..4, still perfectly separated
    auc, per = macro_auc(y, S)
    assert per == pytest.approx({0: 3 / 4, 1: 1.0})
    _, gm_per = geometric_mean(y, S)
    assert gm_per[0] == pytest.approx(math.sqrt(0.5 * 1 / 2))  # TN=1, FP=1 on the remaining negatives
    assert auc == pytest.approx((3 / 4 + 1) / 2)


def test_class_with_one_label_is_excluded() -> None:
    y = np.concatenate([Y, np.zeros((5, 1)), np.array([[1], [NAN], [1], [1], [NAN]])], axis=1)
    s = np.concatenate([S, np.full((5, 2), 0.3)], axis=1)
    auc, per = macro_auc(y, s)
    assert set(per) == {0, 1} and auc == pytest.approx((5 / 6 + 1.0) / 2)
    gm, gm_per = geometric_mean(y, s)
    assert set(gm_per) == {0, 1} and gm == pytest.approx((math.sqrt(1 / 3) + 1) / 2)
    auc_none, per_none = macro_auc(np.zeros((3, 2)), np.random.default_rng(0).random((3, 2)))
    assert math.isnan(auc_none) and per_none == {}


def test_youden_thresholds() -> None:
    # finding 0: perfectly separable at 0.6 (TPR 1, FPR 0); finding 1 has no positive -> default 0.5
    y = np.array([[0, 0], [0, 0], [1, 0], [1, 0]], dtype=np.float32)
    s = np.array([[0.1, 0.2], [0.3, 0.9], [0.6, 0.4], [0.8, 0.1]])
    thr = youden_thresholds(y, s)
    assert thr == pytest.approx([0.6, 0.5])
    gm, _ = geometric_mean(y, s, threshold=thr)
    assert gm == pytest.approx(1.0)
    # an uninformative finding never gets the +inf "predict nothing" threshold
    thr_bad = youden_thresholds(np.array([[1], [0]]), np.array([[0.2], [0.7]]))
    assert np.isfinite(thr_bad).all()


def test_evaluate_scores_multilabel() -> None:
    names = ("atelectasis", "effusion", "hernia")
    y = np.concatenate([Y, np.zeros((5, 1))], axis=1)  # hernia: no positive
    s = np.concatenate([S, np.full((5, 1), 0.7)], axis=1)
    out = evaluate_scores("multilabel", y, s, names)
    # finding 0: TP 1 FP 1 FN 1 TN 2; finding 1: TP 3 TN 2
    expected = {
        "auc": (5 / 6 + 1) / 2,
        "gm": (math.sqrt(1 / 3) + 1) / 2,
        "precision": (0.5 + 1) / 2,
        "recall": (0.5 + 1) / 2,
        "f1": (0.5 + 1) / 2,
        "specificity": (2 / 3 + 1) / 2,
        "auc/atelectasis": 5 / 6,
        "auc/effusion": 1.0,
    }
    assert out == pytest.approx(expected)
    with pytest.raises(ValueError, match="2 class names but y_score has 3 columns"):
        evaluate_scores("multilabel", y, s, names[:2])
    with pytest.raises(ValueError, match="task must be"):
        evaluate_scores("binary", y, s, names)


def test_evaluate_scores_multiclass() -> None:
    y = np.array([0, 0, 1, 1, 2, 2])
    s = np.array(
        [
            [0.8, 0.1, 0.1],
            [0.3, 0.6, 0.1],
            [0.2, 0.7, 0.1],
            [0.1, 0.5, 0.4],
            [0.1, 0.2, 0.7],
            [0.5, 0.2, 0.3],
        ]
    )
    # arg-max: 0 1 1 1 2 0. Per class (TP, FP, FN, TN): c0 (1,1,1,3), c1 (2,1,0,3), c2 (1,0,1,4)
    out = evaluate_scores("multiclass", y, s, ("a", "b", "c"))
    sens = np.array([1 / 2, 1.0, 1 / 2])
    spec = np.array([3 / 4, 3 / 4, 1.0])
    prec = np.array([1 / 2, 2 / 3, 1.0])
    f1 = 2 * prec * sens / (prec + sens)
    assert out["accuracy"] == pytest.approx(4 / 6)
    assert out["balanced_accuracy"] == pytest.approx(sens.mean())
    assert out["recall"] == pytest.approx(sens.mean())
    assert out["specificity"] == pytest.approx(spec.mean())
    assert out["precision"] == pytest.approx(prec.mean())
    assert out["f1"] == pytest.approx(f1.mean())
    assert out["gm"] == pytest.approx(np.sqrt(sens * spec).mean())
    assert out["auc"] == pytest.approx(roc_auc_score(y, s, multi_class="ovr", average="macro"))
    assert not any(k.startswith("auc/") for k in out)


def test_shape_errors_are_explicit() -> None:
    with pytest.raises(ValueError, match="y_true has 3 columns but y_score has 2"):
        macro_auc(np.zeros((4, 3)), np.zeros((4, 2)))
    with pytest.raises(ValueError, match="y_true has 4 rows but y_score has 5"):
        geometric_mean(np.zeros((4, 2)), np.zeros((5, 2)))
    with pytest.raises(ValueError, match=r"class indices in y_true must lie in \[0, 3\)"):
        macro_auc(np.array([0, 3]), np.zeros((2, 3)))

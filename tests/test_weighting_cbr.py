"""FedBB Client Balanced Reweighting: skew scores, weights, and reproduction of the authors' code."""

import math
from fractions import Fraction

import numpy as np
import pytest

from fedweigh.weighting import CBRWeights, ClientReport, imbalance_cv
from fedweigh.weighting.base import ScalarContext
from fedweigh.weighting.cbr import SKEW_MODES, empty_histogram_score, skew_code, skew_score, skew_sqdev


def authors_client_imbalances(client_pos_freq):
    """Literal transcription of the authors' data loader (Happiness-Chung/FedBalance,
    data_preprocessing/data_loader.py, cifar branch of partition_data): per client
    1 / sum(...) with the in-place sequential normalisation, then normalised over clients.
    These weights are what their fedbalance Server aggregates with (cw = imbalance weights)."""
    client_imbalances = []
    client_pos_freq = np.array(client_pos_freq)
    for i in range(len(client_pos_freq)):
        difference_cnt = client_pos_freq[i] - client_pos_freq[i].mean()
        for i in range(len(difference_cnt)):  # shadows the outer i, as in the original
            difference_cnt[i] = difference_cnt[i] * difference_cnt[i]
        for i in range(len(difference_cnt)):
            difference_cnt[i] = difference_cnt[i] / difference_cnt.sum()
        difference_cnt -= difference_cnt.mean()
        for i in range(len(difference_cnt)):
            difference_cnt[i] = difference_cnt[i] * difference_cnt[i]
        client_imbalances.append(1 / difference_cnt.sum())
    client_imbalances = np.array(client_imbalances)
    client_imbalances = client_imbalances / client_imbalances.sum()
    return client_imbalances


def reports_from_counts(scheme, counts, sizes):
    return [
        ClientReport(
            f"site-{i}",
            n,
            scalars=scheme.client_scalars(ScalarContext(class_counts=np.asarray(c), num_samples=n)),
        )
        for i, (c, n) in enumerate(zip(counts, sizes, strict=True))
    ]


# ----------------------------------------------------------------------------- scores by hand
def test_imbalance_cv_by_hand():
    assert imbalance_cv(np.array([1, 3])) == pytest.approx(0.5)  # std 1 / mean 2
    assert imbalance_cv(np.array([5, 5, 5])) == 0.0
    assert imbalance_cv(np.array([0, 0, 6])) == pytest.approx(np.sqrt(8) / 2)  # std sqrt(8), mean 2


def test_skew_code_exact_with_fractions():
    # counts (0, 0, 3): D = (1, 1, 4); sequential: 1/6, then 1/(1/6 + 1 + 4) = 6/31, then 4/(1/6 + 6/31 + 4)
    d = [Fraction(1), Fraction(1), Fraction(4)]
    for i in range(3):
        d[i] = d[i] / sum(d)
    assert d == [Fraction(1, 6), Fraction(6, 31), Fraction(744, 811)]
    mean = sum(d) / 3
    expected = sum((x - mean) ** 2 for x in d)
    assert skew_code(np.array([0, 0, 3])) == pytest.approx(float(expected), rel=1e-14)


def test_skew_sqdev_by_hand():
    # D = (1, 1, 4) -> d^ = (1/6, 1/6, 2/3): sum d^2 = 1/2, minus 1/C = 1/3 -> 1/6
    assert skew_sqdev(np.array([0, 0, 3])) == pytest.approx(1 / 6)
    assert skew_sqdev(np.array([90, 10])) == 0.0  # C = 2: always 0


def test_code_score_depends_on_class_order():
    a = np.array([71, 50, 2, 1, 19])
    assert skew_code(a) != pytest.approx(skew_code(a[::-1]), rel=1e-3)
    assert skew_sqdev(a) == pytest.approx(skew_sqdev(a[::-1]), rel=1e-12)
    assert imbalance_cv(a) == pytest.approx(imbalance_cv(a[::-1]), rel=1e-12)


@pytest.mark.parametrize("mode", ["cv", "code", "sqdev"])
def test_missing_class_and_balanced_histograms_give_finite_scores(mode):
    scheme = CBRWeights(skew=mode)
    counts = [[0, 12, 3, 0], [4, 4, 4, 4], [7, 0, 0, 1]]
    reps = reports_from_counts(scheme, counts, [30, 40, 50])
    skews = [r.scalars["skew"] for r in reps]
    assert all(np.isfinite(skews)) and skews[1] == 0.0
    w = scheme.weights(reps, None, 1, 3)
    assert np.all(np.isfinite(w)) and w.sum() == pytest.approx(1.0)
    assert np.argmax(w) == 1  # the balanced site takes (nearly) all of omega_a


def test_empty_histogram_rejected_by_the_raw_scores():
    with pytest.raises(ValueError, match="all zero"):
        imbalance_cv(np.zeros(4))
    with pytest.raises(ValueError, match="non-negative"):
        imbalance_cv(np.array([1, -1]))


@pytest.mark.parametrize("mode", SKEW_MODES)
def test_all_negative_site_gets_the_score_of_a_maximally_imbalanced_site(mode, caplog):
    """A site with no positive for any finding scores as one with all its labels in one finding."""
    one_finding = np.zeros(14)
    one_finding[0] = 1.0  # ("code" depends on the scale; cv and sqdev do not)
    expected = skew_score(one_finding, mode)
    assert empty_histogram_score(14, mode) == pytest.approx(expected, abs=1e-15)
    scheme = CBRWeights(skew=mode)
    with caplog.at_level("INFO", logger="fedweigh.weighting.cbr"):
        scalars = scheme.client_scalars(ScalarContext(class_counts=np.zeros(14), num_samples=20))
    assert scalars == {"skew": pytest.approx(expected, abs=1e-15)}
    assert "all zero" in caplog.text and "maximally imbalanced" in caplog.text
    if mode == "cv":  # sqrt(C - 1): the largest cv of C counts, so the least imbalance weight
        assert scalars["skew"] == pytest.approx(math.sqrt(13), rel=1e-14)
        reps = reports_from_counts(scheme, [np.zeros(14), np.arange(1, 15), one_finding], [20, 30, 40])
        w = scheme.weights(reps, None, 1, 2)
        assert np.all(np.isfinite(w)) and w.sum() == pytest.approx(1.0)
        assert w[0] == pytest.approx(w[2], rel=1e-12) and w[0] < w[1]


def test_site_with_an_empty_histogram_is_named_in_the_log(caplog):
    from dataclasses import replace

    import torch

    from fedweigh.data.base import LabeledImages, SiteData
    from fedweigh.site.args import ClientArgs
    from fedweigh.site.policy import PERMISSIVE_DEFAULT
    from fedweigh.site.trainer import SiteTrainer

    torch.set_num_threads(1)
    names = ("a", "b", "c")
    x = np.zeros((4, 1, 16, 16), dtype=np.float32)
    empty = LabeledImages(x, np.zeros((4, 3), dtype=np.float32), names, "multilabel")
    exact = replace(PERMISSIVE_DEFAULT, statistics_epsilon=None)  # the empty histogram itself is reported
    trainer = SiteTrainer(
        SiteData("site-7", empty, empty), empty, ClientArgs(size=16, eval_test=False), policy=exact
    )
    plan = {"scheme": "cbr", "scalars": ["skew"]}
    with caplog.at_level("WARNING"):
        scalars = trainer.scheme_scalars(plan, {}, {})
        trainer.scheme_scalars(plan, {}, {})
    assert scalars == {"skew": pytest.approx(math.sqrt(2), rel=1e-14)}
    site_lines = [r.getMessage() for r in caplog.records if r.name == "fedweigh.site"]
    assert len(site_lines) == 1 and site_lines[0].startswith("site-7: ") and "'cbr'" in site_lines[0]


def test_gamma_defaults_to_the_papers_chest_xray_value():
    """Chung & Lee, Sec. 4: "gamma was set to 1" for NIH CXR14 / CheXpert: the imbalance weights alone."""
    scheme = CBRWeights()
    assert scheme.gamma == 1.0
    reps = reports_from_counts(scheme, [[10, 0, 5], [4, 4, 4]], [10, 90])
    np.testing.assert_allclose(
        scheme.weights(reps, None, 1, 2), scheme.balance_weights(np.array([r.scalars["skew"] for r in reps]))
    )


# ----------------------------------------------------------------------------- weights
def test_cv_weights_by_hand():
    scheme = CBRWeights(gamma=0.5, eps=1e-6)
    reps = [ClientReport("a", 100, scalars={"skew": 0.5}), ClientReport("b", 300, scalars={"skew": 1.0})]
    inv = np.array([1 / (0.5 + 1e-6), 1 / (1.0 + 1e-6)])
    expected = 0.5 * inv / inv.sum() + 0.5 * np.array([0.25, 0.75])
    np.testing.assert_allclose(scheme.weights(reps, None, 1, 2), expected, rtol=1e-14)
    np.testing.assert_allclose(CBRWeights(gamma=0.0).weights(reps, None, 1, 2), [0.25, 0.75], rtol=1e-14)
    np.testing.assert_allclose(
        CBRWeights(gamma=1.0, eps=1e-6).weights(reps, None, 1, 2), inv / inv.sum(), rtol=1e-14
    )


def test_code_mode_reproduces_authors_code():
    rng = np.random.default_rng(1996)  # one of the paper's seeds
    counts = rng.integers(0, 400, size=(5, 14))  # 5 clients x 14 findings, as in their NIH setting
    counts[2, 3] = 0  # a site missing a class
    expected = authors_client_imbalances(counts)
    scheme = CBRWeights(skew="code", gamma=1.0)  # their server aggregates with the imbalance weights alone
    w = scheme.weights(reports_from_counts(scheme, counts, [100] * 5), None, 1, 50)
    np.testing.assert_array_equal(w, expected)


def test_code_mode_can_favour_the_more_skewed_client():
    skewed, flatter = [71, 50, 2, 1, 19], [49, 59, 97, 77, 28]
    assert imbalance_cv(np.array(skewed)) > imbalance_cv(np.array(flatter))
    code = CBRWeights(skew="code", gamma=1.0)
    cv = CBRWeights(skew="cv", gamma=1.0)
    w_code = code.weights(reports_from_counts(code, [skewed, flatter], [10, 10]), None, 1, 2)
    w_cv = cv.weights(reports_from_counts(cv, [skewed, flatter], [10, 10]), None, 1, 2)
    np.testing.assert_allclose(w_code, authors_client_imbalances([skewed, flatter]), rtol=1e-15)
    assert w_code[0] > w_code[1]  # the quirk
    assert w_cv[0] < w_cv[1]  # the reading: less skewed weighs more


def test_validation():
    with pytest.raises(ValueError, match="'b'.*'skew' must be >= 0"):
        CBRWeights().weights(
            [ClientReport("a", 1, scalars={"skew": 0.1}), ClientReport("b", 1, scalars={"skew": -0.1})],
            None,
            1,
            2,
        )
    with pytest.raises(ValueError, match="gamma"):
        CBRWeights(gamma=1.5)
    with pytest.raises(ValueError, match="skew"):
        CBRWeights(skew="gini")

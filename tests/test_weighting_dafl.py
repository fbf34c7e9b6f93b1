"""DAFL aggregation: inverse client imbalance (default, the paper's Sec. 3.4), its variants, and c_k."""

import numpy as np
import pytest

from fedweigh.imbalance import class_level_parameters, client_imbalance, client_level_parameter
from fedweigh.weighting import ClientReport, DAFLWeights, get_scheme
from fedweigh.weighting.base import ScalarContext


def _reports(scheme: DAFLWeights, hists: list[tuple[np.ndarray, int]]) -> list[ClientReport]:
    return [
        ClientReport(f"s{i}", n, scalars=scheme.client_scalars(ScalarContext(class_counts=h, num_samples=n)))
        for i, (h, n) in enumerate(hists)
    ]


def test_statistics_by_hand():
    # c_k = ((4 - 1)/1 + (4 - 3)/3) / 2 = 5/3
    assert client_imbalance(np.array([1, 3]), 4) == pytest.approx(5 / 3)
    assert client_level_parameter(np.array([1.0, 3.0]), np.array([1, 3])) == pytest.approx(2.5)
    np.testing.assert_allclose(class_level_parameters(np.array([2, 0]), 10), [4.0, 0.0])


def test_default_weights_are_the_papers_inverse_imbalance_not_size_weights():
    """Sec. 3.4: lower c_k, higher weight; w_k = (1/c_k) / sum_j (1/c_j) (May 2026 code, Eq. (wk)-(omega)).

    Site A: 40 samples, (20, 20): c_A = (20/20 + 20/20) / 2 = 1.
    Site B: 160 samples, (150, 10): c_B = (10/150 + 150/10) / 2 = 113/15 = 7.5333...
    Size weights would be (0.2, 0.8); the paper's weights are (1, 15/113) / (1 + 15/113).
    """
    scheme = DAFLWeights()
    assert scheme.mode == "inverse_imbalance" and scheme.required_scalars == ("imbalance",)
    reps = _reports(scheme, [(np.array([20, 20]), 40), (np.array([150, 10]), 160)])
    assert reps[1].scalars["imbalance"] == pytest.approx(113 / 15)
    w = scheme.weights(reps, None, 1, 5)
    expected = np.array([1.0, 15 / 113]) / (1.0 + 15 / 113)  # (0.8828, 0.1172)
    np.testing.assert_allclose(w, expected, rtol=1e-7)
    assert abs(w[0] - 0.2) > 0.6  # far from the size weights


def test_size_inverse_imbalance_by_hand():
    scheme = get_scheme("dafl", mode="size_inverse_imbalance")
    reps = _reports(scheme, [(np.array([20, 20]), 40), (np.array([150, 10]), 160)])
    raw = np.array([0.2 / 1.0, 0.8 * 15 / 113])
    np.testing.assert_allclose(scheme.weights(reps, None, 1, 5), raw / raw.sum(), rtol=1e-7)


def test_size_mode_is_fedavg_and_needs_no_scalar():
    scheme = DAFLWeights(mode="size")
    assert scheme.required_scalars == ()
    w = scheme.weights([ClientReport("a", 10), ClientReport("b", 30)], None, 1, 5)
    np.testing.assert_allclose(w, [0.25, 0.75], rtol=1e-15)


def test_inverse_imbalance_from_reported_scalars_by_hand():
    scheme = get_scheme("dafl", eps=1e-8)
    reps = [
        ClientReport("a", 10, scalars={"imbalance": 1.0}),
        ClientReport("b", 30, scalars={"imbalance": 3.0}),
    ]
    inv = np.array([1 / (1 + 1e-8), 1 / (3 + 1e-8)])
    np.testing.assert_allclose(scheme.weights(reps, None, 1, 5), inv / inv.sum(), rtol=1e-15)


def test_missing_class_rule_half_by_hand():
    # (0, 5, 5) at N_k = 10, C = 3: missing term 2 max(10, 3) - 1 = 19; c = (19 + 1 + 1) / 3 = 7
    assert client_imbalance(np.array([0, 5, 5]), 10) == pytest.approx(7.0)
    # eps rule (May 2026 code): (10 - 0) / 1e-6 dominates
    assert client_imbalance(np.array([0, 5, 5]), 10, "eps") == pytest.approx((1e7 + 2 * 5 / 5.000001) / 3)
    # floor1 rule (earlier reading): (10 + 1 + 1) / 3 = 4
    assert client_imbalance(np.array([0, 5, 5]), 10, "floor1") == pytest.approx(4.0)


@pytest.mark.parametrize("missing", ["half", "eps"])
def test_a_small_site_missing_a_class_is_not_treated_as_balanced(missing):
    """Three classes; a perfectly balanced site has c = C - 1 = 2 (the minimum). A 2-sample site
    with counts (1, 1, 0) scored 4/3 under the old max(n, 1) guard, i.e. better than balanced, and
    took most of the weight; under the stated rules its c_k exceeds 2 and it weighs less."""
    scheme = DAFLWeights(missing=missing)
    reps = _reports(scheme, [(np.array([1, 1, 0]), 2), (np.array([30, 30, 30]), 90)])
    c_small, c_balanced = reps[0].scalars["imbalance"], reps[1].scalars["imbalance"]
    assert c_balanced == pytest.approx(2.0)
    assert c_small > c_balanced
    if missing == "half":  # (1 + 1 + (2 max(2, 3) - 1)) / 3 = 7/3
        assert c_small == pytest.approx(7 / 3)
    w = scheme.weights(reps, None, 1, 2)
    assert w[0] < w[1]
    # the old guard: (1/1 + 1/1 + 2/1) / 3 = 4/3 < 2, the small site wins
    old = DAFLWeights(missing="floor1")
    reps_old = _reports(old, [(np.array([1, 1, 0]), 2), (np.array([30, 30, 30]), 90)])
    assert reps_old[0].scalars["imbalance"] == pytest.approx(4 / 3)
    assert old.weights(reps_old, None, 1, 2)[0] > 0.5


def test_half_rule_never_scores_a_missing_class_site_as_balanced():
    """c_k > C - 1 for every multi-class histogram with a missing class (sizes 1..40, C = 2..6)."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        c = int(rng.integers(2, 7))
        n = int(rng.integers(1, 41))
        counts = rng.multinomial(n, rng.dirichlet(np.full(c, 0.3)))
        if np.all(counts > 0):
            counts[int(rng.integers(c))] = 0
            n = int(counts.sum())
            if n == 0:
                continue
        assert client_imbalance(counts, n) > c - 1, (counts, n)


def test_validation():
    with pytest.raises(ValueError, match="'b'.*missing required scalar 'imbalance'"):
        DAFLWeights().weights(
            [ClientReport("a", 1, scalars={"imbalance": 1.0}), ClientReport("b", 1)], None, 1, 2
        )
    with pytest.raises(ValueError, match="mode must be one of"):
        DAFLWeights(mode="inverse")
    with pytest.raises(ValueError, match="missing must be one of .*'zero'"):
        DAFLWeights(missing="zero")
    with pytest.raises(ValueError, match="eps must be a positive number"):
        DAFLWeights(eps=0.0)

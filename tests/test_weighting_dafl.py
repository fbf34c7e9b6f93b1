"""DAFL aggregation: size weights (default) or inverse client imbalance, and its client scalar."""

import numpy as np
import pytest

from fedweigh.weighting import ClientReport, DAFLWeights, get_scheme
from fedweigh.weighting.dafl import class_level_parameters, client_imbalance, client_level_parameter


def test_existing_statistics_unchanged():
    # c_k = ((4 - 1)/1 + (4 - 3)/3) / 2 = 5/3
    assert client_imbalance(np.array([1, 3]), 4) == pytest.approx(5 / 3)
    assert client_level_parameter(np.array([1.0, 3.0]), np.array([1, 3])) == pytest.approx(2.5)
    np.testing.assert_allclose(class_level_parameters(np.array([2, 0]), 10), [4.0, 0.0])


def test_client_scalar_with_missing_class_is_finite():
    sc = DAFLWeights().client_scalars(class_counts=np.array([0, 4]), num_samples=4)
    # ((4 - 0) / max(0, 1) + (4 - 4) / 4) / 2 = 2
    assert sc == {"imbalance": pytest.approx(2.0)}


def test_size_mode_is_fedavg_and_needs_no_scalar():
    scheme = DAFLWeights()
    assert scheme.required_scalars == ()
    w = scheme.weights([ClientReport("a", 10), ClientReport("b", 30)], None, 1, 5)
    np.testing.assert_allclose(w, [0.25, 0.75], rtol=1e-15)


def test_inverse_imbalance_by_hand():
    scheme = get_scheme("dafl", mode="inverse_imbalance", eps=1e-8)
    assert scheme.required_scalars == ("imbalance",)
    reps = [
        ClientReport("a", 10, scalars={"imbalance": 1.0}),
        ClientReport("b", 30, scalars={"imbalance": 3.0}),
    ]
    inv = np.array([1 / (1 + 1e-8), 1 / (3 + 1e-8)])
    np.testing.assert_allclose(
        scheme.weights(reps, None, 1, 5), inv / inv.sum(), rtol=1e-15
    )  # ~ (0.75, 0.25)


def test_inverse_imbalance_from_histograms_with_missing_class():
    scheme = DAFLWeights(mode="inverse_imbalance")
    hists = [(np.array([0, 5, 5]), 10), (np.array([5, 5, 5]), 10)]
    reps = [
        ClientReport(f"s{i}", n, scalars=scheme.client_scalars(class_counts=h, num_samples=n))
        for i, (h, n) in enumerate(hists)
    ]
    w = scheme.weights(reps, None, 1, 2)
    # c = (10 + 1 + 1)/3 = 4 and (1 + 1 + 1)/3 = 1 -> weights ~ (1/4, 1) / 1.25
    np.testing.assert_allclose(w, [0.2, 0.8], rtol=1e-7)


def test_validation():
    with pytest.raises(ValueError, match="'b'.*missing required scalar 'imbalance'"):
        DAFLWeights(mode="inverse_imbalance").weights(
            [ClientReport("a", 1, scalars={"imbalance": 1.0}), ClientReport("b", 1)], None, 1, 2
        )
    with pytest.raises(ValueError, match="mode"):
        DAFLWeights(mode="inverse")

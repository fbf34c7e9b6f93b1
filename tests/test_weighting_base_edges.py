"""The scheme contract's edges (fedweigh.weighting.base): the distribution a round applies, each check's
both sides and message, the aggregation's integer buffers and dtypes, the registry of schemes."""

import math
import re

import numpy as np
import pytest

from fedweigh.errors import HEIncompatibleScheme
from fedweigh.weighting import ClientReport, FedAvgWeights, FedAWAWeights, FedDRAWWeights, ScalarContext, base
from fedweigh.weighting.base import (
    WeightingScheme,
    as_distribution,
    check_reports,
    check_round,
    he_capable_schemes,
    scalar_vector,
    softmax,
)

NAMES = ["a", "b", "c"]


# ------------------------------------------------------------------------------------ as_distribution
def test_the_distribution_is_flat_float64_and_sums_to_one_for_any_input_shape_and_dtype():
    out = as_distribution(np.array([[1.0], [3.0]], dtype=np.float32), ["a", "b"], scheme="s")
    assert out.shape == (2,) and out.dtype == np.float64
    assert out.tolist() == [0.25, 0.75]
    third = as_distribution(np.array([1, 1, 1], dtype=np.float32), NAMES, scheme="s")
    assert third.dtype == np.float64 and abs(third.sum() - 1.0) <= 2e-16


def test_a_zero_weight_stays_zero_and_the_rest_are_proportions():
    assert as_distribution(np.array([2.0, 0.0, 6.0]), NAMES, scheme="s").tolist() == [0.25, 0.0, 0.75]


def test_float_noise_below_the_bound_is_zero_and_the_result_still_sums_to_one():
    """A weight down to -1e-12 of the total (inclusive) is float noise, clipped to 0; the proportions of the
    rest are renormalised so that they sum to 1 to the last bit, not to (total + noise) / total."""
    w = np.array([1.0, 1e-12, -1e-12])
    assert float(w.sum()) == 1.0  # the bound is exactly -1e-12 * total
    assert as_distribution(w, NAMES, scheme="s")[2] == 0.0
    out = as_distribution(np.array([1.0, 1.0, -1e-13]), NAMES, scheme="s")
    assert out[2] == 0.0 and abs(out.sum() - 1.0) <= 2e-16 and out[0] == pytest.approx(0.5, abs=1e-16)
    big = as_distribution(np.array([1e6, -5e-7]), ["a", "b"], scheme="s")  # -5e-13 of a total of 1e6
    assert big.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("w", [[1.0, -2e-12], [1.0, -0.25], [1e6, -2e-6], [4.0, -3.0]])
def test_a_negative_weight_beyond_the_noise_bound_is_refused_naming_the_site(w):
    with pytest.raises(
        ValueError, match=rf"^fedsch: the weight of 'b' is negative \({re.escape(repr(w[1]))}\)$"
    ):
        as_distribution(np.array(w), ["a", "b"], scheme="fedsch")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_weight_that_is_not_finite_is_refused_naming_the_site(bad):
    with pytest.raises(
        ValueError, match=rf"^fedsch: the weight of 'c' is not finite \({re.escape(repr(bad))}\)$"
    ):
        as_distribution(np.array([1.0, 1.0, bad]), NAMES, scheme="fedsch")


@pytest.mark.parametrize("w", [[0.0, 0.0], [-1.0, 0.5], [1.5e308, 1.5e308]])
def test_weights_whose_total_is_not_a_positive_number_are_refused(w):
    with np.errstate(over="ignore"):
        total = float(np.sum(w))
    with (
        np.errstate(over="ignore"),
        pytest.raises(
            ValueError, match=rf"^fedsch: the weights sum to {re.escape(repr(total))}, not a positive number$"
        ),
    ):
        as_distribution(np.array(w), ["a", "b"], scheme="fedsch")


def test_one_weight_per_site_is_required():
    with pytest.raises(ValueError, match=r"^fedsch: 2 weight\(s\) for 3 site\(s\)$"):
        as_distribution(np.array([0.5, 0.5]), NAMES, scheme="fedsch")


# ------------------------------------------------------------------------------------ checks
def test_check_round_names_num_rounds_first():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(
            ValueError, match=rf"^num_rounds must be an integer >= 1, got {re.escape(repr(bad))}$"
        ):
            check_round(1, bad)
    check_round(1, 1)


def test_a_report_that_is_not_a_client_report_is_named_with_its_type():
    with pytest.raises(ValueError, match=r"^fedsch: report #1 is a dict, expected ClientReport$"):
        check_reports([ClientReport("a", 1), {"name": "b"}], scheme="fedsch")
    with pytest.raises(ValueError, match=r"^fedsch: report #0 is a NoneType, expected ClientReport$"):
        check_reports([None], scheme="fedsch")


def test_a_scalar_that_is_not_a_number_is_named():
    with pytest.raises(ValueError, match=r"^fedsch: client 'a': scalar 'skew' is not a number: 'high'$"):
        check_reports([ClientReport("a", 1, scalars={"skew": "high"})], scheme="fedsch")


def test_a_missing_scalar_lists_what_was_reported_or_none():
    with pytest.raises(
        ValueError, match=r"^fedsch: client 'a': missing required scalar 'skew' \(reported: none\)$"
    ):
        check_reports([ClientReport("a", 1)], scheme="fedsch", scalars=("skew",))
    with pytest.raises(ValueError, match=r"\(reported: \['imbalance'\]\)$"):
        check_reports([ClientReport("a", 1, scalars={"imbalance": 0.1})], scheme="fedsch", scalars=("skew",))


def test_sizes_come_back_as_float64():
    sizes = check_reports([ClientReport("a", 3), ClientReport("b", 5)], scheme="s")
    assert sizes.dtype == np.float64 and sizes.tolist() == [3.0, 5.0]


def test_a_negative_scalar_is_refused_with_the_clipping_hint():
    reports = [ClientReport("a", 1, scalars={"skew": 0.0}), ClientReport("b", 1, scalars={"skew": -0.5})]
    with pytest.raises(ValueError) as info:
        scalar_vector(reports, "skew", scheme="fedsch", nonnegative=True)
    assert str(info.value) == (
        "fedsch: client 'b': scalar 'skew' must be >= 0, got -0.5 "
        "(if the scalar is noised for privacy, clip it to its valid range before sending)"
    )
    values = scalar_vector(reports, "skew", scheme="fedsch", nonnegative=False)
    assert values.dtype == np.float64 and values.tolist() == [0.0, -0.5]


# ------------------------------------------------------------------------------------ softmax
def test_softmax_is_stable_for_large_logits_and_float64():
    assert softmax(np.array([1000.0, 1000.0])).tolist() == [0.5, 0.5]
    out = softmax(np.array([800.0, 0.0]))
    assert out[0] == 1.0 and 0.0 <= out[1] < 1e-300
    assert softmax(np.array([0.0, 1.0], dtype=np.float32)).dtype == np.float64
    assert (
        softmax(np.array([0.1, 0.2, 0.3], dtype=np.float32)).tolist()
        == softmax(np.array([0.1, 0.2, 0.3], dtype=np.float32).astype(np.float64)).tolist()
    )


# ------------------------------------------------------------------------------------ ScalarContext
@pytest.mark.parametrize(
    "ctx", [ScalarContext(), ScalarContext(class_counts=np.array([1, 2])), ScalarContext(num_samples=3)]
)
def test_counts_need_both_the_label_counts_and_the_size(ctx):
    with pytest.raises(ValueError) as info:
        ctx.counts("fedsch")
    assert str(info.value) == (
        "fedsch: the client needs its label counts and training-set size (class_counts, num_samples) for its scalars"
    )


@pytest.mark.parametrize(
    "ctx", [ScalarContext(params={"w": np.zeros(1)}), ScalarContext(global_params={"w": np.zeros(1)})]
)
def test_models_need_both_the_trained_and_the_global_parameters(ctx):
    with pytest.raises(ValueError, match=r"^fedsch: the client needs its trained and the global parameters"):
        ctx.models("fedsch")


# ------------------------------------------------------------------------------------ aggregate
def _scheme(**kwargs):
    return FedAvgWeights(**kwargs)


def test_aggregate_needs_the_global_parameters_and_finite_weights_by_name():
    reps = [ClientReport("a", 1, params={"w": np.ones(2)})]
    with pytest.raises(ValueError, match=r"^fedavg: aggregate needs the global parameters$"):
        _scheme().aggregate(None, reps, np.array([1.0]))
    with pytest.raises(ValueError, match=r"^fedavg: weights are not all finite: \[nan\]$"):
        _scheme().aggregate({"w": np.zeros(2)}, reps, np.array([math.nan]))


def test_aggregate_names_a_client_without_parameters_and_the_he_alternative():
    with pytest.raises(ValueError) as info:
        _scheme().aggregate({"w": np.zeros(2)}, [ClientReport("a", 1)], np.array([1.0]))
    assert str(info.value) == (
        "fedavg: client 'a' sent no parameters; plaintext aggregation needs them "
        "(under HE the weighted sum is formed on ciphertexts instead)"
    )


def test_a_non_finite_global_parameter_is_named_as_such():
    reps = [ClientReport("a", 1, params={"w": np.ones(2)})]
    with pytest.raises(
        ValueError, match=r"^fedavg: non-finite values in parameter 'w' from client '<global parameters>'$"
    ):
        _scheme().aggregate({"w": np.array([0.0, math.inf])}, reps, np.array([1.0]))


def test_the_max_rule_keeps_the_buffer_shape_dtype_and_exact_large_integers():
    big = 2**60
    g = {"n": np.array([[big, 5]], dtype=np.int64), "w": np.zeros(1)}
    reps = [
        ClientReport("a", 1, params={"n": np.array([[big + 1, 3]], dtype=np.int64), "w": np.zeros(1)}),
        ClientReport("b", 1, params={"n": np.array([[big, 7]], dtype=np.int64), "w": np.zeros(1)}),
    ]
    out = _scheme(integer_buffers="max").aggregate(g, reps, np.array([0.5, 0.5]))["n"]
    assert out.shape == (1, 2) and out.dtype == np.int64
    assert out.tolist() == [[big + 1, 7]]
    scalar = _scheme(integer_buffers="max").aggregate(
        {"n": np.array(4, dtype=np.int64)},
        [ClientReport(k, 1, params={"n": np.array(v, dtype=np.int64)}) for k, v in (("a", 6), ("b", 5))],
        np.array([0.5, 0.5]),
    )["n"]
    assert scalar.shape == () and int(scalar) == 6


def test_the_weighted_rule_rounds_the_weighted_delta_of_a_uint8_buffer():
    g = {"n": np.array([10, 200], dtype=np.uint8)}
    reps = [
        ClientReport("a", 1, params={"n": np.array([13, 210], dtype=np.uint8)}),
        ClientReport("b", 1, params={"n": np.array([10, 190], dtype=np.uint8)}),
    ]
    out = _scheme().aggregate(g, reps, np.array([0.75, 0.25]))["n"]
    assert out.dtype == np.uint8 and out.tolist() == [12, 205]  # 10 + rint(2.25), 200 + rint(7.5 - 2.5)


# ------------------------------------------------------------------------------------ the scheme class
def test_scalars_under_plaintext_are_the_schemes_own_and_he_adds_the_client_side_ones():
    scheme = FedDRAWWeights()
    assert scheme.scalars() == () and scheme.scalars(encrypted=False) == ()
    assert scheme.scalars(encrypted=True) == ("similarity",)


def test_a_scalar_range_is_the_schemes_own_then_the_common_one_then_unbounded():
    class Narrow(FedAvgWeights):
        scalar_ranges = {"similarity": (0.0, 1.0)}

    assert Narrow().scalar_range("similarity") == (0.0, 1.0)
    assert Narrow().scalar_range("skew") == (0.0, math.inf)
    assert FedAvgWeights().scalar_range("similarity") == (-1.0, 1.0)
    assert FedAvgWeights().scalar_range("anything") == (-math.inf, math.inf)


def test_the_he_refusal_names_the_scheme_its_reason_and_the_schemes_that_can():
    with pytest.raises(HEIncompatibleScheme) as info:
        FedAWAWeights().check_he()
    assert str(info.value) == (
        f"scheme 'fedawa' cannot run with homomorphically encrypted updates (he=True): {FedAWAWeights.he_refusal}. "
        "Under HE the server sees only ciphertexts and scalars. Choose a scheme that weights from "
        f"sample counts, steps and client-reported scalars ({', '.join(he_capable_schemes())}), "
        "or run without HE."
    )
    FedAvgWeights().check_he()


def test_a_state_that_is_not_a_dict_is_named_by_type():
    with pytest.raises(ValueError, match=r"^fedavg: state must be a dict, got list$"):
        FedAvgWeights().load_state_dict([])
    with pytest.raises(ValueError, match=r"^fedavg: state must be a dict, got NoneType$"):
        FedAvgWeights().load_state_dict(None)


def _weights(self, reports, global_params, round_index, num_rounds):
    return np.ones(len(reports))


def test_only_named_schemes_of_the_package_join_the_registry():
    before = dict(base._DEFINED)
    try:
        inside = type(
            "Probe",
            (WeightingScheme,),
            {"name": "probe", "__module__": "fedweigh.weighting.probe", "weights": _weights},
        )
        assert base._DEFINED["probe"] is inside
        type(
            "Outside",
            (WeightingScheme,),
            {"name": "outside", "__module__": "mypkg.schemes", "weights": _weights},
        )
        type(
            "Nameless", (WeightingScheme,), {"__module__": "fedweigh.weighting.nameless", "weights": _weights}
        )
        assert set(base._DEFINED) == set(before) | {"probe"}
        assert "probe" in he_capable_schemes() and "outside" not in he_capable_schemes()
    finally:
        base._DEFINED.clear()
        base._DEFINED.update(before)


def test_scalars_are_the_plaintext_ones_unless_encrypted_is_asked():
    # a scheme that keeps the base's scalars(): its HE scalars only when encrypted is asked
    probe = type(
        "HEProbe",
        (WeightingScheme,),
        {
            "name": "he-probe",
            "__module__": "mypkg.schemes",
            "he_compatible": True,
            "required_scalars": ("loss",),
            "he_client_scalars": ("similarity", "loss"),
            "weights": _weights,
        },
    )()
    assert probe.scalars() == ("loss",)
    assert probe.scalars(encrypted=False) == ("loss",)
    assert probe.scalars(encrypted=True) == ("loss", "similarity")  # each once, the scheme's own first
    scheme = FedDRAWWeights()  # FedDRAW's own scalars() passes the flag on
    assert scheme.scalars() == ()  # the server computes the similarity from plaintext parameters
    assert scheme.scalars(encrypted=True) == ("similarity",)


def test_the_max_of_a_zero_dimensional_integer_buffer_is_an_array_of_the_global_dtype():
    g = {"w": np.zeros(2, np.float32), "steps": np.array(3, dtype=np.int32)}
    reports = [
        ClientReport(name=name, num_samples=1, params={"w": np.ones(2, np.float32), "steps": np.array(n)})
        for name, n in (("a", 5), ("b", 7))
    ]
    out = FedAvgWeights(integer_buffers="max").aggregate(g, reports, np.array([0.5, 0.5]))
    assert (
        isinstance(out["steps"], np.ndarray) and out["steps"].shape == () and out["steps"].dtype == np.int32
    )
    assert int(out["steps"]) == 7

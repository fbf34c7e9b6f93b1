"""Edges of the server's result checks: each bound on both sides, each error naming the site and
the field, and a dropped entry never cutting the entries after it short."""

import math

import numpy as np
import pytest

from fedweigh.errors import InvalidClientResult
from fedweigh.protocol import META_NUM_SAMPLES, META_NUM_STEPS, META_SCALARS
from fedweigh.server.validation import (
    ResultLimits,
    check_meta,
    check_params,
    check_scalars,
    check_site_metrics,
    finite_metrics,
)


@pytest.mark.parametrize(
    "meta, field",
    [
        ({META_NUM_SAMPLES: 0}, META_NUM_SAMPLES),
        ({META_NUM_SAMPLES: 4, META_NUM_STEPS: -1}, META_NUM_STEPS),
        ({META_NUM_SAMPLES: 4, META_SCALARS: {"skew": "high"}}, "'skew'"),
    ],
)
def test_each_meta_error_names_the_site_and_the_field(meta, field):
    with pytest.raises(InvalidClientResult) as e:
        check_meta("site-7", meta, ("skew",), ResultLimits())
    assert str(e.value).startswith("site-7: ")
    assert field in str(e.value)


def test_a_result_without_parameters_is_named():
    with pytest.raises(InvalidClientResult, match=r"^site-3: result holds no parameters$"):
        check_params("site-3", {}, {"w": np.zeros(2)})


def test_the_scalar_magnitude_bound_on_both_sides():
    limits = ResultLimits(max_abs_scalar=10.0)
    assert check_scalars("s", {"a": 10.0}, ("a",), limits) == {"a": 10.0}
    assert check_scalars("s", {"a": -10.0}, ("a",), limits) == {"a": -10.0}
    for bad in (10.5, -10.5, math.nan, math.inf):
        with pytest.raises(InvalidClientResult, match="not finite or out of range"):
            check_scalars("s", {"a": bad}, ("a",), limits)


def test_the_scalar_range_is_inclusive_at_both_ends():
    ranges = {"a": (0.0, 1.0)}
    for edge in (0.0, 1.0):
        assert check_scalars("s", {"a": edge}, ("a",), ResultLimits(), ranges) == {"a": edge}
    for bad in (-1e-9, 1.0 + 1e-9):
        with pytest.raises(InvalidClientResult, match=r"outside its valid range \[0, 1\]"):
            check_scalars("s", {"a": bad}, ("a",), ResultLimits(), ranges)


def test_scalars_not_a_mapping_name_their_type():
    with pytest.raises(
        InvalidClientResult, match=r"^s: meta\['fedweigh_scalars'\] must be a mapping, got list$"
    ):
        check_scalars("s", [1.0], ("a",), ResultLimits())


def test_a_missing_scalar_does_not_stop_the_checks_of_the_next():
    with pytest.raises(InvalidClientResult) as e:
        check_scalars("s", {"b": 1.0}, ("a", "b"), ResultLimits())
    assert "missing scalar(s) ['a']" in str(e.value)
    with pytest.raises(InvalidClientResult, match="scalar 'b' is not a number"):
        check_scalars("s", {"b": "x"}, ("a", "b"), ResultLimits())


def test_a_long_bad_metric_name_is_cut_to_80_characters_in_key_and_message():
    name = "1" + "x" * 100
    accepted, refused = check_site_metrics("site-1", {name: 1.0})
    assert accepted == {}
    assert list(refused) == [name[:80]]
    message = refused[name[:80]]
    assert repr(name[:80]) in message and repr(name[:81]) not in message
    assert message.startswith("site-1: metric name ")
    assert message.endswith(
        "is refused: a metric name is a letter, then letters, digits, '_', '.', '-' or '/' (at most 64 characters)"
    )


def test_metrics_not_a_mapping_are_refused_under_one_key_naming_their_type():
    assert check_site_metrics("site-1", [("loss", 1.0)]) == (
        {},
        {"<metrics>": "site-1: its metrics are a list, not a mapping"},
    )


def test_a_dropped_metric_does_not_drop_the_ones_after_it():
    metrics = {"a": 1.0, "flag": True, "b": 2.0, "text": "x", "c": 3.0, "nan": math.nan, "d": 4}
    assert finite_metrics(metrics) == {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}

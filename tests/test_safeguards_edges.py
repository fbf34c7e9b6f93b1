"""The round step's safeguards at their edges: each bound where it binds and just where it does not,
the degenerate rounds (one site, zero updates, zero weights), the dtypes the arithmetic runs in, and
the announced counts a site may or may not set (``fedweigh.server.safeguards``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from fedweigh.errors import InvalidClientResult
from fedweigh.server.safeguards import (
    DIRECTION_MIN_PULL,
    AnnouncedCounts,
    Safeguards,
    cap_weights,
    direction_outliers,
    norm_scales,
    objecting_sites,
    plausible_counts,
    pulls_against_others,
    update_cosines,
)


def gram_of(*vectors: tuple[float, ...]) -> np.ndarray:
    u = np.asarray(vectors, dtype=np.float64)
    return u @ u.T


# ---- cap_weights -------------------------------------------------------------------------------


def test_no_weights_come_back_empty():
    out = cap_weights(np.array([]), 0.5)
    assert out.shape == (0,)


def test_weights_summing_to_zero_come_back_as_they_are():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = cap_weights(np.zeros(3), 0.5)
    np.testing.assert_array_equal(out, np.zeros(3))


@pytest.mark.parametrize("max_share", [0.0, 1.0, 1.5, -0.2])
def test_a_cap_outside_zero_one_leaves_the_weights_as_they_are(max_share):
    w = np.array([8.0, 1.0, 1.0])
    np.testing.assert_array_equal(cap_weights(w, max_share), w)


def test_integer_weights_come_back_as_float64_capped_or_not():
    assert cap_weights([8, 1, 1], 1.0).dtype == np.float64
    assert cap_weights([8, 1, 1], 0.5).dtype == np.float64
    np.testing.assert_allclose(cap_weights([8, 1, 1], 0.5), [5.0, 2.5, 2.5])


def test_a_share_within_the_tolerance_above_the_cap_is_left_as_it_is():
    top = 0.5 + 1e-15
    w = np.array([top, 1.0 - top])
    assert float(w.sum()) == 1.0  # shares are the weights themselves
    np.testing.assert_array_equal(cap_weights(w, 0.5), w)


def test_a_share_just_below_the_cap_is_left_bit_for_bit():
    w = np.array([0.5 - 4e-16, 0.3, 0.2 + 4e-16])
    assert float(w.sum()) == 1.0
    np.testing.assert_array_equal(cap_weights(w, 0.5), w)


# ---- norm_scales -------------------------------------------------------------------------------


def test_one_update_alone_is_left_as_it_is_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(norm_scales(np.array([5.0]), 3.0), [1.0])
        np.testing.assert_array_equal(norm_scales(np.array([[5.0, 2.0]]), 3.0), [[1.0, 1.0]])


def test_scales_keep_the_shape_of_the_norms():
    flat = norm_scales(np.array([1.0, 1.0, 10.0]), 3.0)
    assert flat.shape == (3,)
    np.testing.assert_allclose(flat, [1.0, 1.0, 0.3])
    table = norm_scales(np.array([[1.0, 2.0], [1.0, 2.0], [10.0, 2.0]]), 3.0)
    assert table.shape == (3, 2)
    np.testing.assert_allclose(table, [[1.0, 1.0], [1.0, 1.0], [0.3, 1.0]])


def test_scales_are_computed_in_float64_whatever_the_norms_dtype():
    scales = norm_scales(np.array([1.0, 1.0, 10.0], dtype=np.float32), 3.0)
    assert scales[2] == 3.0 / 10.0  # 0.3 in float64, not float32's 0.30000001


def test_an_update_beside_zero_updates_is_scaled_to_nothing_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scales = norm_scales(np.array([0.0, 0.0, 4.0]), 3.0)
    np.testing.assert_array_equal(scales, [1.0, 1.0, 0.0])


# ---- update_cosines, objecting_sites ------------------------------------------------------------


def test_cosines_of_small_updates_are_their_cosines():
    # norms below 1: a replacement of small denominators would show here
    cos = update_cosines(gram_of((0.1, 0.0), (0.1, 0.1), (0.0, -0.2)))
    np.testing.assert_allclose(cos[0, 1], np.sqrt(0.5))
    np.testing.assert_allclose(cos[0, 2], 0.0, atol=1e-15)
    np.testing.assert_allclose(cos[1, 2], -np.sqrt(0.5))


def test_a_zero_update_has_cosine_one_with_everything_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cos = update_cosines(gram_of((0.0, 0.0), (1.0, 0.0), (-1.0, 0.5)))
    np.testing.assert_array_equal(cos[0], [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(cos[:, 0], [1.0, 1.0, 1.0])


def test_the_diagonal_is_exactly_one():
    gram = gram_of((0.1, 0.7, 0.3), (3.0, -1.1, 0.2), (1e-3, 2e-3, 7e-3))
    np.testing.assert_array_equal(np.diag(update_cosines(gram)), [1.0, 1.0, 1.0])


def test_cosines_are_float64_whatever_the_gram_dtype():
    gram = gram_of((1.0, 0.3), (0.2, 1.0)).astype(np.float32)
    assert update_cosines(gram).dtype == np.float64


def test_an_orthogonal_update_objects_to_nothing():
    gram = gram_of((1.0, 0.0), (0.0, 1.0), (0.0, 2.0))
    np.testing.assert_array_equal(objecting_sites(gram, 0.0), [0, 0, 0])
    np.testing.assert_array_equal(objecting_sites(gram, 0.1), [2, 1, 1])


# ---- direction_outliers, pulls_against_others --------------------------------------------------

# two agreeing pairs at a right angle; the fifth opposes the first pair only (half of the others)
HALF = ((1.0, 0.0), (1.0, 0.0), (0.0, 1.0), (0.0, 1.0), (-10.0, 1.0))


def test_opposing_exactly_half_of_the_others_is_not_more_than_half():
    gram = gram_of(*HALF)
    assert pulls_against_others(gram)[4] >= 0.5  # it would be left out by its pull
    assert direction_outliers(gram, 0.0) == []


def test_opposing_more_than_half_of_the_others_is_left_out():
    gram = gram_of(*HALF[:3], (-10.0, -1.0))
    assert direction_outliers(gram, 0.0) == [3]


def test_a_cosine_at_the_threshold_is_not_below_it():
    # the third is orthogonal to both others, which agree; with no pull required it would go
    gram = gram_of((1.0, 0.0), (1.0, 0.0), (0.0, 1.0))
    assert direction_outliers(gram, 0.0, min_pull=0.0) == []
    assert direction_outliers(gram, 0.01, min_pull=0.0) == [2]


def test_a_pull_at_the_minimum_is_enough():
    gram = gram_of((1.0, 0.0), (1.0, 0.0), (-1.0, 0.0))
    assert pulls_against_others(gram)[2] == DIRECTION_MIN_PULL == 1.0
    assert direction_outliers(gram, 0.0) == [2]
    assert direction_outliers(gram, 0.0, min_pull=1.01) == []
    assert direction_outliers(gram_of((1.0, 0.0), (1.0, 0.0), (-0.99, 0.0)), 0.0) == []


def test_a_given_min_pull_replaces_the_default():
    gram = gram_of((1.0, 0.0), (1.0, 0.0), (-0.1, 0.0))  # pulls 0.1 against the others
    assert direction_outliers(gram, 0.0) == []
    assert direction_outliers(gram, 0.0, min_pull=0.0) == [2]
    assert direction_outliers(gram, 0.0, min_pull=0.05) == [2]


def test_the_pull_is_zero_where_the_others_mean_is_zero():
    gram = gram_of((0.0, 0.0), (0.0, 0.0), (1.0, 0.0))
    np.testing.assert_array_equal(pulls_against_others(gram), [-0.0, -0.0, 0.0])
    assert pulls_against_others(gram)[2] == 0.0


def test_pulls_are_summed_in_float64_whatever_the_gram_dtype():
    # a float32 sum of these loses the 1 next to 1e8
    gram = np.array(
        [[1.0, 1e8, 1.0, -1e8], [1e8, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [-1e8, 0.0, 0.0, 1.0]]
    )
    np.testing.assert_array_equal(pulls_against_others(gram.astype(np.float32)), pulls_against_others(gram))


# ---- plausible_counts --------------------------------------------------------------------------


def test_with_two_sites_each_is_bounded_by_the_other():
    np.testing.assert_array_equal(plausible_counts(np.array([10.0, 1000.0]), 3.0, lower=False), [10.0, 30.0])


def test_integer_counts_are_clipped_in_float64():
    out = plausible_counts(np.array([3, 3, 100]), 2.5, lower=False)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [3.0, 3.0, 7.5])


def test_counts_in_a_column_come_back_as_one_per_site():
    out = plausible_counts(np.array([[10.0], [10.0], [100.0]]), 3.0, lower=False)
    assert out.shape == (3,)
    np.testing.assert_array_equal(out, [10.0, 10.0, 30.0])


# ---- AnnouncedCounts ---------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, -5, 5.5, True, "7", None])
def test_a_count_that_is_not_a_positive_integer_is_not_noted(count):
    announced = AnnouncedCounts({"site-1": count})
    assert len(announced) == 0
    announced.check("site-1", 10**6)  # nothing announced: nothing to exceed


def test_an_announced_count_of_one_binds():
    announced = AnnouncedCounts({"site-1": 1, "site-2": np.int64(40)})
    assert len(announced) == 2
    announced.check("site-1", 1)
    with pytest.raises(InvalidClientResult, match=r"site-1: num_samples=2 exceeds the 1 it announced"):
        announced.check("site-1", 2)
    with pytest.raises(InvalidClientResult, match=r"site-2: num_samples=41 exceeds the 40"):
        announced.check("site-2", 41)


# ---- Safeguards --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, given",
    [
        ("max_share", 1),
        ("update_norm_bound", 3),
        ("min_update_cosine", 0),
        ("array_cosine", 0),
        ("clip_norm", 2),
        ("trim", 0),
    ],
)
def test_an_integer_option_is_stored_as_a_float(name, given):
    value = getattr(Safeguards(**{name: given}), name)
    assert type(value) is float and value == given

"""The label statistics' checks on both sides of every bound, with the messages that name the source."""

import math
import re

import numpy as np
import pytest

from fedweigh.histograms import (
    META_NUM_CONTRIBUTIONS,
    NOISED_N_TOLERANCE,
    GlobalStats,
    PlainExchange,
    check_announced_size,
    check_statistics_vector,
    decode_sum,
    global_stats_of,
)

GOOD = {"class_counts": [3, 0], "num_samples": 4, "client_level_parameter": 0.5}


def test_from_dict_bounds_on_both_sides():
    stats = GlobalStats.from_dict(GOOD, "f.json")
    assert (
        stats.class_counts.tolist() == [3, 0]
        and stats.num_samples == 4
        and stats.client_level_parameter == 0.5
    )
    assert (
        GlobalStats.from_dict({**GOOD, "num_samples": 1, "client_level_parameter": 2}, "f").num_samples == 1
    )
    cases = [
        ([1], "f.json: global statistics must be a JSON object, got list"),
        ({"num_samples": 4}, "f.json: global statistics lack class_counts, client_level_parameter"),
        (
            {**GOOD, "class_counts": []},
            "f.json: class_counts must be a non-empty list of integers in [0, 2^63), got []",
        ),
        (
            {**GOOD, "class_counts": [1, -1]},
            "f.json: class_counts must be a non-empty list of integers in [0, 2^63), got [1, -1]",
        ),
        (
            {**GOOD, "class_counts": [1, True]},
            "f.json: class_counts must be a non-empty list of integers in [0, 2^63), got [1, True]",
        ),
        (
            {**GOOD, "class_counts": [1.0]},
            "f.json: class_counts must be a non-empty list of integers in [0, 2^63), got [1.0]",
        ),
        (  # beyond int64: refused, not an overflow or an array of Python objects
            {**GOOD, "class_counts": [1, 2**63]},
            f"f.json: class_counts must be a non-empty list of integers in [0, 2^63), got [1, {2**63}]",
        ),
        ({**GOOD, "num_samples": 0}, "f.json: num_samples must be an integer >= 1, got 0"),
        ({**GOOD, "num_samples": True}, "f.json: num_samples must be an integer >= 1, got True"),
        (
            {**GOOD, "client_level_parameter": True},
            "f.json: client_level_parameter must be a finite number, got True",
        ),
        (
            {**GOOD, "client_level_parameter": math.inf},
            "f.json: client_level_parameter must be a finite number, got inf",
        ),
        (
            {**GOOD, "client_level_parameter": "0.5"},
            "f.json: client_level_parameter must be a finite number, got '0.5'",
        ),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            GlobalStats.from_dict(data, "f.json")


def test_decode_sum_bounds_on_both_sides():
    stats = decode_sum(np.array([4.0, 0.4, 4.0, 2.0]))  # a count equal to N, one rounding to 0
    assert stats.class_counts.tolist() == [4, 0] and stats.num_samples == 4
    assert stats.client_level_parameter == 0.5
    assert stats.class_counts.dtype == np.int64
    for total, message in (
        ([1.0, 2.0], "implausible global statistics: the sum is not 3 finite numbers"),
        ([1.0, 2.0, 4.0, math.nan], "implausible global statistics: the sum is not 4 finite numbers"),
        (
            [5.0, 4.0, 0.0],
            "implausible global statistics: N=4, counts=[5] (every count must lie in 0..N, N > 0)",
        ),
        (
            [-1.0, 4.0, 0.0],
            "implausible global statistics: N=4, counts=[-1] (every count must lie in 0..N, N > 0)",
        ),
        (
            [0.0, 0.0, 0.0],
            "implausible global statistics: N=0, counts=[0] (every count must lie in 0..N, N > 0)",
        ),
    ):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            decode_sum(np.array(total))
    with pytest.raises(ValueError, match="^global statistics need at least one site's histogram$"):
        global_stats_of([])


def test_announced_size_bounds_on_both_sides():
    stats = GlobalStats(np.array([10]), 100, 0.0)
    check_announced_size(stats, 100, noised=False, own_num_samples=100)  # exact, and equal to the site's own
    for bad in (True, 0, -5, 100.0, None):
        with pytest.raises(
            ValueError,
            match=f"^the server's sum announces no valid sum of N_k \\(got {re.escape(repr(bad))}\\)$",
        ):
            check_announced_size(stats, bad, noised=False, own_num_samples=10)
    with pytest.raises(
        ValueError,
        match="^the decoded sum gives N = 100, the server holds sum N_k = 101 from the sizes the sites report in clear: a contribution",
    ):
        check_announced_size(stats, 101, noised=False, own_num_samples=10)
    with pytest.raises(ValueError, match="^the decoded sum gives N = 100, below this site's own N_k = 101$"):
        check_announced_size(stats, 100, noised=False, own_num_samples=101)
    # noised: N may lie up to 5% of the announced size away, on either side, and below the site's own size
    assert NOISED_N_TOLERANCE == 0.05
    for announced in (96, 105):  # |100 - 96| = 4 <= 4.8; |100 - 105| = 5 <= 5.25
        check_announced_size(stats, announced, noised=True, own_num_samples=150)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "N_k = 106 from the sizes the sites report in clear (noised contributions: up to 5 apart)"
        ),
    ):
        check_announced_size(stats, 106, noised=True, own_num_samples=10)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "N_k = 94 from the sizes the sites report in clear (noised contributions: up to 5 apart)"
        ),
    ):
        check_announced_size(stats, 94, noised=True, own_num_samples=10)


def test_statistics_vector_check_bounds_on_both_sides():
    vec = check_statistics_vector("site-1", [4, 0, 4, 1.5], 4)  # a count equal to N_k is valid
    assert vec.dtype == np.float64 and vec.tolist() == [4.0, 0.0, 4.0, 1.5]
    for vector, message in (
        (["a", 1, 2], "site-1: statistics vector is not numeric"),
        ([1, 2], "site-1: statistics vector must be 4 finite numbers"),
        ([1, 2, 4, math.inf], "site-1: statistics vector must be 4 finite numbers"),
        ([5, 0, 4, 0], "site-1: statistics vector has negative counts or counts above N_k"),
        ([-1, 0, 4, 0], "site-1: statistics vector has negative counts or counts above N_k"),
        ([1, 0, -4, 0], "site-1: statistics vector has negative counts or counts above N_k"),
        (
            ["3", 0, 4, 0],
            "site-1: statistics vector is not numeric",
        ),  # NumPy would parse it; a site sends numbers
        ([True, 0, 4, 0], "site-1: statistics vector is not numeric"),
        ({"a": 1}, "site-1: statistics vector is not numeric"),
        (None, "site-1: statistics vector is not numeric"),
    ):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            check_statistics_vector("site-1", vector, 4)
    assert check_statistics_vector("site-1", np.array([1, 2, 4, 0]), 4).tolist() == [1.0, 2.0, 4.0, 0.0]


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("value", [-1.0, 6.0])
def test_every_class_count_is_checked_on_both_sides(position, value):
    """Three classes, N_k = 5: a count below 0 or above N_k is refused wherever it stands."""
    vector = [1.0, 2.0, 3.0, 5.0, 0.5]
    vector[position] = value
    with pytest.raises(
        ValueError, match="^site-2: statistics vector has negative counts or counts above N_k$"
    ):
        check_statistics_vector("site-2", vector, 5)
    vector[position] = 5.0  # equal to N_k: valid
    assert check_statistics_vector("site-2", vector, 5)[position] == 5.0


def test_a_contribution_without_a_vector_is_refused_naming_the_site():
    with pytest.raises(ValueError, match="^site-3: statistics vector must be 4 finite numbers$"):
        PlainExchange().check("site-3", {}, 4)
    with pytest.raises(ValueError, match="^site-3: statistics vector has negative counts"):
        PlainExchange().check("site-3", PlainExchange().encode(np.array([-1.0, 0.0, 4.0, 0.0])), 4)


def test_a_site_decodes_a_sum_only_with_its_quorum():
    exchange = PlainExchange(min_contributions=3)
    payload = exchange.sum({f"s{i}": exchange.encode(np.array([1.0, 2.0, 3.0])) for i in range(3)}, 3)
    assert payload[META_NUM_CONTRIBUTIONS] == 3
    np.testing.assert_array_equal(exchange.decode(payload), [3.0, 6.0, 9.0])  # exactly the minimum: decoded
    with pytest.raises(
        ValueError,
        match=re.escape(
            "statistics: the server's sum holds 2 contribution(s); this site's policy decodes a sum only with at least 3, so it is not decrypted"
        ),
    ):
        exchange.decode({**payload, META_NUM_CONTRIBUTIONS: 2})
    for bad in (True, 0, None, "3"):
        with pytest.raises(
            ValueError,
            match=f"^statistics: the server's sum lacks a valid {META_NUM_CONTRIBUTIONS}, got {re.escape(repr(bad))}$",
        ):
            PlainExchange(min_contributions=1).decode({**payload, META_NUM_CONTRIBUTIONS: bad})


def test_a_sum_of_one_image_decodes():
    """N = 1 is the smallest valid federation total: every count in 0..1."""
    stats = decode_sum(np.array([1.0, 0.0, 1.0, 3.0]))
    assert stats.num_samples == 1 and stats.class_counts.tolist() == [1, 0]
    assert stats.client_level_parameter == 3.0
    with pytest.raises(ValueError, match=r"N=0, counts=\[0, 0\]"):
        decode_sum(np.array([0.0, 0.0, 0.0, 0.0]))


def test_a_one_image_federation_announces_a_valid_size():
    """The announced sum of N_k is valid from 1 on (0 and below are refused above)."""
    check_announced_size(GlobalStats(np.array([1]), 1, 0.0), 1, noised=False, own_num_samples=1)


def test_a_negative_size_in_a_statistics_vector_is_refused_even_with_zero_counts():
    """v_k = [n_1..n_C, N_k, N_k c_k]: the N_k slot must not be negative either."""
    with pytest.raises(
        ValueError, match="^site-2: statistics vector has negative counts or counts above N_k$"
    ):
        check_statistics_vector("site-2", [0.0, 0.0, -5.0, 0.0], 4)


def test_statistics_vectors_come_back_as_float64_whatever_numbers_they_were_sent_as():
    vec = check_statistics_vector("site-2", [1, 2, 4, 3], 4)
    assert vec.dtype == np.float64 and vec.tolist() == [1.0, 2.0, 4.0, 3.0]
    exchange = PlainExchange(min_contributions=1)
    decoded = exchange.decode({"fedweigh_stats_vector": [3, 6, 9], META_NUM_CONTRIBUTIONS: 1})
    assert decoded.dtype == np.float64 and decoded.tolist() == [3.0, 6.0, 9.0]


def test_from_dict_accepts_large_counts_below_two_to_the_sixty_three():
    stats = GlobalStats.from_dict({**GOOD, "class_counts": [500, 2**40], "num_samples": 2**41}, "f.json")
    assert stats.class_counts.tolist() == [500, 2**40] and stats.class_counts.dtype == np.int64

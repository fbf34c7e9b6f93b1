"""The edges of the secure-sum quorum (fedweigh.server.quorum): the server's floor on both sides, a
site's announced minimum (every refused type and the bound), the repeated drop of sites whose demand
the federation cannot meet, the required count at and one below the boundary, and the exact reasons."""

from __future__ import annotations

import pytest

from fedweigh.protocol import ABSOLUTE_MIN
from fedweigh.server.quorum import Quorum, parse_minimum, secure_sum_quorum, server_floor


def test_the_absolute_minimum_is_two():
    assert ABSOLUTE_MIN == 2  # a sum of one contribution is that contribution


@pytest.mark.parametrize(
    ("configured", "size", "floor"),
    [
        (3, 10, 3),  # the configured value where the federation is large enough
        (3, 3, 3),  # at the federation's size
        (4, 3, 3),  # capped at the federation's size
        (1, 10, 2),  # never below the absolute minimum
        (0, 10, 2),
        (-5, 10, 2),
        (5, 1, 2),  # a one-site federation still needs two
        (7, 0, 2),
    ],
)
def test_server_floor_on_both_sides(configured, size, floor):
    assert server_floor(configured, size) == floor


def test_server_floor_takes_integral_strings_and_floats_as_ints():
    assert server_floor("4", "6") == 4
    assert server_floor(3.9, 10) == 3  # int() truncates


def test_parse_minimum_default_when_none():
    assert parse_minimum("site-1", None) == ABSOLUTE_MIN
    assert parse_minimum("site-1", None, default=5) == 5


@pytest.mark.parametrize("value", [1, 2, 3, 1000])
def test_parse_minimum_accepts_integers_from_one(value):
    assert parse_minimum("site-1", value) == value


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "3", [3], 1.5])
def test_parse_minimum_refuses_the_rest_naming_the_site(value):
    with pytest.raises(ValueError) as e:
        parse_minimum("site-7", value)
    assert str(e.value) == (
        f"site-7: its announced secure-sum minimum must be an integer >= 1, got {value!r}"
    )


def test_quorum_ok_is_the_absence_of_a_reason():
    assert Quorum(members=["a", "b"], required=2).ok
    assert not Quorum(members=[], required=3, reason="no").ok


def test_every_site_at_the_floor_is_summed_in_name_order():
    q = secure_sum_quorum({"c": 2, "a": 2, "b": 2}, 2)
    assert q == Quorum(members=["a", "b", "c"], required=2, dropped={}, reason="")


def test_required_is_the_largest_of_the_floor_and_the_members_minimums():
    assert secure_sum_quorum({"a": 2, "b": 2, "c": 2, "d": 2}, 3).required == 3
    assert secure_sum_quorum({"a": 4, "b": 2, "c": 2, "d": 2}, 3).required == 4
    assert secure_sum_quorum({"a": 2, "b": 2, "c": 2}, 1).required == 2  # a floor below 2 counts as 2


def test_a_minimum_equal_to_the_number_of_contributors_is_met():
    q = secure_sum_quorum({"a": 3, "b": 3, "c": 3}, 2)
    assert q.ok and q.members == ["a", "b", "c"] and q.required == 3 and q.dropped == {}


def test_a_minimum_one_above_the_contributors_drops_that_site_with_its_reason():
    q = secure_sum_quorum({"a": 4, "b": 2, "c": 2}, 2)
    assert q.ok and q.members == ["b", "c"] and q.required == 2
    assert q.dropped == {
        "a": "its site policy needs at least 4 contributions to a secure sum, only 3 were available"
    }


def test_dropping_a_site_can_drop_the_next_one_and_each_reason_gives_the_count_it_saw():
    # 5 contributors: e (6) is out; then 4 remain and d (5) is out; then 3 remain and c (3) stays
    q = secure_sum_quorum({"a": 2, "b": 2, "c": 3, "d": 5, "e": 6}, 2)
    assert q.ok and q.members == ["a", "b", "c"] and q.required == 3
    assert q.dropped == {
        "e": "its site policy needs at least 6 contributions to a secure sum, only 5 were available",
        "d": "its site policy needs at least 5 contributions to a secure sum, only 4 were available",
    }


def test_sites_dropped_in_one_pass_are_all_named():
    q = secure_sum_quorum({"a": 2, "b": 2, "c": 2, "x": 9, "y": 8}, 2)
    assert q.members == ["a", "b", "c"]
    assert set(q.dropped) == {"x", "y"} and "only 5 were available" in q.dropped["y"]


def test_too_few_after_the_drops_sums_nothing_and_names_the_strictest_demand_of_everyone():
    q = secure_sum_quorum({"a": 2, "b": 3, "c": 9}, 2)  # c out, then b out (3 > 2), a alone
    assert not q.ok and q.members == [] and q.required == 9
    assert q.reason == (
        "3 contribution(s), fewer than the 9 a secure sum needs (min_secure_sum and the sites' policies); "
        "nothing is summed, so nothing can be decrypted"
    )


def test_the_floor_is_checked_against_the_members_left():
    assert secure_sum_quorum({"a": 2, "b": 2, "c": 2}, 3).ok
    q = secure_sum_quorum({"a": 2, "b": 2}, 3)
    assert not q.ok and q.required == 3 and q.reason.startswith("2 contribution(s), fewer than the 3 ")


def test_one_contribution_is_never_summed_even_with_a_floor_of_one():
    q = secure_sum_quorum({"a": 1}, 1)
    assert not q.ok and q.required == 2 and q.members == []
    assert q.reason.startswith("1 contribution(s), fewer than the 2 ")


def test_no_contribution_at_all():
    q = secure_sum_quorum({}, 2)
    assert not q.ok and q.members == [] and q.required == 2
    assert q.reason.startswith("0 contribution(s), fewer than the 2 ")

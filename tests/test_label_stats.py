"""The server's collect step of the label statistics (``sum_statistics``), path by path: every way a
contribution is left out names its site and why, later sites are still read after one is left out,
and each way the phase sums nothing returns exactly what it says (no total, the length where known,
the sites left out, the reason)."""

from __future__ import annotations

import numpy as np

from fedweigh.histograms import META_LENGTH, PlainExchange
from fedweigh.protocol import ABSOLUTE_MIN, META_MIN_SECURE_SUM, META_REFUSED, META_SITE_ERROR
from fedweigh.server.label_stats import StatisticsSum, sum_statistics

EXCHANGE = PlainExchange(min_contributions=1)


def good(vector=(1.0, 2.0, 4.0, 3.0), **extra) -> dict:
    return {**EXCHANGE.encode(np.array(vector)), META_LENGTH: len(vector), **extra}


def summed(sites: list[str], length: int = 4) -> dict:
    return EXCHANGE.sum({s: good() for s in sites}, length)


def test_a_federation_of_valid_contributions_is_summed():
    payloads = {s: good() for s in ("a", "b", "c")}
    assert sum_statistics(EXCHANGE, payloads, 2) == StatisticsSum(
        summed(["a", "b", "c"]), 4, members=["a", "b", "c"]
    )


def test_each_kind_of_bad_contribution_is_left_out_naming_its_site_and_the_rest_are_summed():
    payloads = {
        "a-failed": {META_SITE_ERROR: "out of memory"},
        "b-refused": {META_REFUSED: "policy forbids plaintext statistics"},
        "c-bool": good(**{META_LENGTH: True}),
        "d-short": good(**{META_LENGTH: 2}),
        "e-min": good(**{META_MIN_SECURE_SUM: 0}),
        "f-list": ["not", "a", "mapping"],
        "x": good(),
        "y": good(),
        "z": good(),
    }
    got = sum_statistics(EXCHANGE, payloads, 2)
    assert got == StatisticsSum(
        summed(["x", "y", "z"]),
        4,
        members=["x", "y", "z"],
        excluded={
            "a-failed": "a-failed failed: out of memory",
            "b-refused": "b-refused refused the job: policy forbids plaintext statistics",
            "c-bool": f"c-bool: no valid {META_LENGTH} (got True)",
            "d-short": f"d-short: no valid {META_LENGTH} (got 2)",
            "e-min": "e-min: its announced secure-sum minimum must be an integer >= 1, got 0",
            "f-list": "f-list: its statistics result is not a mapping",
        },
    )


def test_a_length_of_three_is_the_smallest_valid_one():
    """One class: v_k = [n_1, N_k, N_k c_k]."""
    payloads = {s: good((1.0, 3.0, 2.0)) for s in ("a", "b")}
    got = sum_statistics(EXCHANGE, payloads, 2)
    assert got.length == 3 and got.members == ["a", "b"] and got.excluded == {}
    for bad in (3.0, "3", None):
        got = sum_statistics(
            EXCHANGE, {"a": good((1.0, 3.0, 2.0), **{META_LENGTH: bad}), "b": good((1.0, 3.0, 2.0))}, 1
        )
        assert got.excluded == {"a": f"a: no valid {META_LENGTH} (got {bad!r})"}, bad


def test_no_valid_contribution_sums_nothing_and_says_so():
    payloads = {"a": {META_SITE_ERROR: "crash"}, "b": {META_REFUSED: "no"}}
    assert sum_statistics(EXCHANGE, payloads, 2) == StatisticsSum(
        None,
        None,
        excluded={"a": "a failed: crash", "b": "b refused the job: no"},
        reason="no valid contribution",
    )


def test_sites_that_disagree_without_a_strict_majority_sum_nothing():
    payloads = {"a": good(), "b": good((1.0, 2.0, 1.0, 4.0, 3.0)), "c": {META_SITE_ERROR: "crash"}}
    assert sum_statistics(EXCHANGE, payloads, 2) == StatisticsSum(
        None,
        None,
        excluded={"c": "c failed: crash"},
        reason="the sites disagree on the number of classes (lengths {4: 1, 5: 1}), no strict majority",
    )


def test_a_minority_length_and_a_rejected_vector_are_left_out_naming_the_site():
    class NamelessCheck(PlainExchange):
        def check(self, site, payload, length):
            if site == "site-d":
                raise ValueError("a ciphertext is at another scale")
            super().check(site, payload, length)

    exchange = NamelessCheck(min_contributions=1)
    payloads = {
        "a": good(),
        "b": good(),
        "c": good((1.0, 2.0, 1.0, 4.0, 3.0)),  # the minority's length
        "site-d": good(),  # rejected by a check whose message does not name it
        "site-e": good((-1.0, 2.0, 4.0, 3.0)),  # rejected by a check whose message names it
        "f": good(),
    }
    got = sum_statistics(exchange, payloads, 2)
    assert got == StatisticsSum(
        exchange.sum({s: good() for s in ("a", "b", "f")}, 4),
        4,
        members=["a", "b", "f"],
        excluded={
            "c": "c: statistics vector of length 5, the majority of sites send 4",
            "site-d": "site-d: a ciphertext is at another scale",
            "site-e": "site-e: statistics vector has negative counts or counts above N_k",
        },
    )


def test_without_a_quorum_nothing_is_summed():
    payloads = {"a": good(**{META_MIN_SECURE_SUM: 5}), "b": good(), "c": {META_REFUSED: "no"}}
    required = max(3, ABSOLUTE_MIN, 5)
    assert sum_statistics(EXCHANGE, payloads, 3) == StatisticsSum(
        None,
        4,
        excluded={"c": "c refused the job: no"},
        reason=(
            f"2 contribution(s), fewer than the {required} a secure sum needs (min_secure_sum and the "
            "sites' policies); nothing is summed, so nothing can be decrypted"
        ),
    )


def test_a_site_asking_for_more_contributions_than_there_are_is_left_out_and_the_rest_summed():
    payloads = {"a": good(**{META_MIN_SECURE_SUM: 5}), "b": good(), "c": good(), "d": good()}
    assert sum_statistics(EXCHANGE, payloads, 2) == StatisticsSum(
        summed(["b", "c", "d"]),
        4,
        members=["b", "c", "d"],
        excluded={
            "a": "a: its site policy needs at least 5 contributions to a secure sum, only 4 were available"
        },
    )


def test_a_failing_sum_returns_its_reason_with_the_length_and_the_sites_left_out():
    class Failing(PlainExchange):
        def sum(self, site_payloads, length):
            raise RuntimeError("the context lost its keys")

    payloads = {"a": good(), "b": good(), "c": {META_REFUSED: "no"}}
    assert sum_statistics(Failing(min_contributions=1), payloads, 2) == StatisticsSum(
        None, 4, excluded={"c": "c refused the job: no"}, reason="the sum failed (the context lost its keys)"
    )

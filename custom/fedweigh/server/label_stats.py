"""The server's side of the label-statistics phase: check every site's contribution, sum the valid ones.

What a contribution is (the statistics vector v_k) and how it travels (plain or CKKS exchange) is in
:mod:`fedweigh.histograms`; the NVFlare tasks that drive the phase are :mod:`fedweigh.flare.statistics`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from fedweigh.histograms import META_LENGTH, StatisticsExchange
from fedweigh.protocol import META_MIN_SECURE_SUM, META_REFUSED, META_SITE_ERROR
from fedweigh.server.quorum import parse_minimum, secure_sum_quorum

__all__ = ["StatisticsSum", "sum_statistics"]


@dataclass
class StatisticsSum:
    """What the server made of one collect step: the payload to distribute (None: nothing may be
    summed, with ``reason``), the vector length, the sites summed and those left out with why."""

    total: dict | None
    length: int | None
    members: list[str] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    reason: str = ""


def sum_statistics(exchange: StatisticsExchange, payloads: Mapping[str, object], floor: int) -> StatisticsSum:
    """The server's side of the collect step: check every site's contribution, sum the valid ones.

    No single contribution can fail the phase: a site that refused, sent no valid length, a vector
    of a length the majority does not send, or a contribution ``exchange.check`` rejects (wrong
    size, wrong CKKS scale or level, ...) is left out with its reason. The length is the one a
    strict majority of the sites reports (the number of classes is not the server's to know). The
    sum needs a quorum (:func:`fedweigh.server.quorum.secure_sum_quorum`: ``floor`` and every
    contributor's announced minimum); without one, or without a majority length, nothing is summed.
    """
    excluded: dict[str, str] = {}
    lengths: dict[str, int] = {}
    minimums: dict[str, int] = {}
    for site, payload in sorted(payloads.items()):
        if not isinstance(payload, Mapping):
            excluded[site] = f"{site}: its statistics result is not a mapping"
            continue
        if payload.get(META_SITE_ERROR):
            excluded[site] = f"{site} failed: {payload.get(META_SITE_ERROR)}"
            continue
        if payload.get(META_REFUSED):
            excluded[site] = f"{site} refused the job: {payload.get(META_REFUSED)}"
            continue
        length = payload.get(META_LENGTH)
        if isinstance(length, bool) or not isinstance(length, int) or length < 3:
            excluded[site] = f"{site}: no valid {META_LENGTH} (got {length!r})"
            continue
        try:
            minimums[site] = parse_minimum(site, payload.get(META_MIN_SECURE_SUM))
        except ValueError as e:
            excluded[site] = str(e)
            continue
        lengths[site] = length
    if not lengths:
        return StatisticsSum(None, None, excluded=excluded, reason="no valid contribution")
    (length, votes), *rest = Counter(lengths.values()).most_common()
    if 2 * votes <= len(lengths):
        reason = f"the sites disagree on the number of classes (lengths {dict(Counter(lengths.values()))})"
        return StatisticsSum(None, None, excluded=excluded, reason=f"{reason}, no strict majority")
    valid: dict[str, int] = {}
    for site, site_length in lengths.items():
        if site_length != length:
            excluded[site] = (
                f"{site}: statistics vector of length {site_length}, the majority of sites send {length}"
            )
            continue
        try:
            exchange.check(site, dict(payloads[site]), length)  # type: ignore[arg-type]
        except ValueError as e:
            excluded[site] = str(e) if site in str(e) else f"{site}: {e}"
            continue
        valid[site] = minimums[site]
    quorum = secure_sum_quorum(valid, floor)
    for site, why in quorum.dropped.items():
        excluded[site] = f"{site}: {why}"
    if not quorum.ok:
        return StatisticsSum(None, length, excluded=excluded, reason=quorum.reason)
    try:
        total = exchange.sum({s: dict(payloads[s]) for s in quorum.members}, length)  # type: ignore[arg-type]
    except (ValueError, RuntimeError) as e:
        return StatisticsSum(None, length, excluded=excluded, reason=f"the sum failed ({e})")
    return StatisticsSum(total, length, members=quorum.members, excluded=excluded)

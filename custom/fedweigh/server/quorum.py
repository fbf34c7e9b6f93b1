"""How many contributions a secure sum needs before anyone may decrypt it.

A "sum" of one contribution is that contribution: every party that decrypts it learns one site's
histogram (statistics phase) or one site's update (encrypted model updates). So every secure sum
has a quorum, enforced twice:

- at the server, which sums only when at least ``floor`` contributions remain AND no contributing
  site asked for more contributions than the sum has (each site announces the minimum of its site
  policy, :class:`fedweigh.site.policy.SitePolicy`, with its contribution);
- at every site, which decrypts a sum only when the number of contributions the server reports
  (checked against the count slot of the ciphertext where the encoding has one) reaches the minimum
  of its own policy.

A site whose announced minimum cannot be met is left out of the sum rather than blocking it, so no
single site can stall the phase by asking for more contributions than the federation has.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fedweigh.protocol import ABSOLUTE_MIN

__all__ = ["ABSOLUTE_MIN", "Quorum", "parse_minimum", "secure_sum_quorum", "server_floor"]


def server_floor(configured: int, federation_size: int) -> int:
    """The server's own minimum: ``configured`` (the job's ``min_secure_sum``), at most the number of
    sites in the federation (a 2-site federation can only ever sum 2), never below :data:`ABSOLUTE_MIN`."""
    return max(ABSOLUTE_MIN, min(int(configured), int(federation_size)))


def parse_minimum(site: str, value: object, default: int = ABSOLUTE_MIN) -> int:
    """A site's announced minimum (an integer >= 1), or ``default`` when it announced none.

    Raises ValueError naming the site for anything else.
    """
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{site}: its announced secure-sum minimum must be an integer >= 1, got {value!r}")
    return value


@dataclass
class Quorum:
    """The outcome of :func:`secure_sum_quorum`."""

    members: list[str]
    required: int
    dropped: dict[str, str] = field(default_factory=dict)
    reason: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason


def secure_sum_quorum(minimums: Mapping[str, int], floor: int) -> Quorum:
    """Which contributions may be summed: ``minimums`` maps each valid contributor to the minimum
    number of contributions it accepts; ``floor`` is the server's own minimum.

    Sites whose minimum exceeds the number of contributors are left out (repeatedly, since leaving
    one out lowers the count); the sum may then go ahead when the rest reach ``floor``.
    """
    floor = max(ABSOLUTE_MIN, int(floor))
    members = set(minimums)
    dropped: dict[str, str] = {}
    everyone = sorted(members)
    while True:
        strict = {s for s in members if minimums[s] > len(members)}
        if not strict:
            break
        for s in sorted(strict):
            dropped[s] = (
                f"its site policy needs at least {minimums[s]} contributions to a secure sum, "
                f"only {len(members)} were available"
            )
        members -= strict
    required = max([floor, *(minimums[s] for s in members)])
    ordered = sorted(members)
    if len(ordered) >= required:
        return Quorum(members=ordered, required=required, dropped=dropped)
    # no sum at all: say so for everyone who contributed, with the strictest demand among them
    required = max([floor, *(minimums[s] for s in everyone)])
    reason = (
        f"{len(everyone)} contribution(s), fewer than the {required} a secure sum needs "
        "(min_secure_sum and the sites' policies); nothing is summed, so nothing can be decrypted"
    )
    return Quorum(members=[], required=required, reason=reason)

"""Label statistics shared before training: the statistics vector, its sum, and how sums travel.

Each site contributes one vector, its *statistics vector*::

    v_k = [n_{k,1}, ..., n_{k,C}, N_k, N_k * c_k]

(positives per class, sample count, and N_k times DAFL's client imbalance c_k, so that the sum gives
DAFL's c_client = sum_k N_k c_k / N; Li et al., DAFL). Every site learns sum_k v_k and decodes the
global histogram from it (:func:`decode_sum`).

How the contributions travel is a :class:`StatisticsExchange`: :class:`PlainExchange` sends v_k in
clear (research runs only: the server sees each hospital's disease prevalence);
:class:`fedweigh.secure.exchange.SecureExchange` sums CKKS ciphertexts so the server sees neither v_k
nor the sum. The NVFlare phase that drives an exchange is :mod:`fedweigh.flare.statistics`; the
benchmark sums the vectors in process.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from fedweigh.imbalance import client_imbalance
from fedweigh.protocol import ABSOLUTE_MIN

__all__ = [
    "META_ANNOUNCED_N",
    "META_EXCHANGE_ID",
    "META_MEMBERS",
    "META_LENGTH",
    "META_NOISED",
    "META_NUM_CONTRIBUTIONS",
    "META_VECTOR",
    "NOISED_N_TOLERANCE",
    "ExchangeBinding",
    "GlobalStats",
    "PlainExchange",
    "StatisticsExchange",
    "check_announced_size",
    "check_exchange_id",
    "check_statistics_vector",
    "decode_sum",
    "global_stats_of",
    "statistics_vector",
]

#: Meta key of a plaintext statistics vector (and of the plaintext sum).
META_VECTOR = "fedweigh_stats_vector"
#: Meta key of the statistics vector's length (C + 2), sent with every contribution and sum.
META_LENGTH = "fedweigh_stats_length"
#: Meta key of a sum: how many contributions it holds (checked by every site before it decodes).
META_NUM_CONTRIBUTIONS = "fedweigh_stats_num_contributions"
#: Meta key of the exchange id: a fresh random id the server announces with every ``collect`` step
#: and repeats with the sum it distributes (:class:`ExchangeBinding`).
META_EXCHANGE_ID = "fedweigh_stats_exchange_id"
#: Meta key of the sites the server summed, announced with the sum (checked against its binding tags).
META_MEMBERS = "fedweigh_stats_members"
#: Characters and length of a valid exchange id.
_EXCHANGE_ID = re.compile(r"[A-Za-z0-9_-]{16,128}")


@dataclass(frozen=True)
class ExchangeBinding:
    """What a site binds its contribution to, and checks a sum against: its own ``job_id`` (the
    site's, never the server's word), the ``exchange_id`` the server announced for this exchange
    (fresh and random per exchange) and the site's name. A sum decoded with a binding must repeat
    the exchange id; a secure sum must also carry the binding tags of exactly the members the server
    announces (:mod:`fedweigh.secure.exchange`), so that a stale, foreign or misstated sum is refused."""

    job_id: str
    exchange_id: str
    site: str

    def __post_init__(self) -> None:
        check_exchange_id(self.exchange_id)


def check_exchange_id(value: object) -> str:
    """``value`` if it is a valid exchange id (16 to 128 of ``[A-Za-z0-9_-]``); ValueError otherwise."""
    if not isinstance(value, str) or not _EXCHANGE_ID.fullmatch(value):
        raise ValueError(
            f"statistics: the server announced no valid exchange id ({META_EXCHANGE_ID}: 16 to 128 of "
            f"[A-Za-z0-9_-], got {value!r}); without one a sum cannot be bound to its exchange"
        )
    return value


@dataclass
class GlobalStats:
    """What every site knows after the statistics phase: the federation's label histogram
    (``class_counts``, positives per finding or samples per class), its size N and DAFL's
    c_client = sum_k N_k c_k / N (``client_level_parameter``).

    Sites hold it typed; its JSON form (:meth:`as_dict`, :meth:`from_dict`) exists only where it
    crosses a file or the NVFlare wire (:mod:`fedweigh.flare.statistics`).
    """

    class_counts: np.ndarray
    num_samples: int
    client_level_parameter: float

    def __post_init__(self) -> None:
        self.class_counts = np.asarray(self.class_counts)

    def as_dict(self) -> dict:
        """The JSON form: ``{"class_counts": [int, ...], "num_samples": int, "client_level_parameter": float}``."""
        return {
            "class_counts": [int(x) for x in self.class_counts],
            "num_samples": int(self.num_samples),
            "client_level_parameter": float(self.client_level_parameter),
        }

    @classmethod
    def from_dict(cls, data: object, source: str) -> GlobalStats:
        """The statistics of their JSON form (:meth:`as_dict`); ValueError naming ``source`` and the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: global statistics must be a JSON object, got {type(data).__name__}")
        missing = [k for k in ("class_counts", "num_samples", "client_level_parameter") if k not in data]
        if missing:
            raise ValueError(f"{source}: global statistics lack {', '.join(missing)}")
        counts, n, c_client = data["class_counts"], data["num_samples"], data["client_level_parameter"]
        if (
            not isinstance(counts, list)
            or not counts
            or not all(_is_int(x) and 0 <= x < 2**63 for x in counts)
        ):
            raise ValueError(
                f"{source}: class_counts must be a non-empty list of integers in [0, 2^63), got {counts!r}"
            )
        if not _is_int(n) or n < 1:
            raise ValueError(f"{source}: num_samples must be an integer >= 1, got {n!r}")
        if (
            isinstance(c_client, bool)
            or not isinstance(c_client, (int, float))
            or not math.isfinite(c_client)
        ):
            raise ValueError(f"{source}: client_level_parameter must be a finite number, got {c_client!r}")
        return cls(np.asarray(counts, dtype=np.int64), int(n), float(c_client))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def statistics_vector(class_counts: np.ndarray, num_samples: int) -> np.ndarray:
    """v_k = [n_{k,1..C}, N_k, N_k c_k] (float64)."""
    counts = np.asarray(class_counts, dtype=np.float64)
    c_k = client_imbalance(counts, num_samples)
    return np.concatenate([counts, [float(num_samples), float(num_samples) * c_k]])


def decode_sum(total: np.ndarray) -> GlobalStats:
    """Global statistics from sum_k v_k (rounded counts; c_client = sum N_k c_k / N)."""
    total = np.asarray(total, dtype=np.float64)
    if total.ndim != 1 or total.size < 3 or not np.isfinite(total).all():
        raise ValueError(f"implausible global statistics: the sum is not {max(total.size, 3)} finite numbers")
    counts = np.rint(total[:-2]).astype(np.int64)
    n = int(round(total[-2]))
    if n <= 0 or np.any(counts < 0) or np.any(counts > n):
        raise ValueError(
            f"implausible global statistics: N={n}, counts={counts.tolist()} (every count must lie in 0..N, N > 0)"
        )
    return GlobalStats(class_counts=counts, num_samples=n, client_level_parameter=float(total[-1]) / n)


#: Meta keys of the statistics phase's sum: the sum of N_k the server holds in clear (the sites'
#: reported training-set sizes, also what FedAvg weighs by) and whether a contribution was noised
#: (statistics DP), for :func:`check_announced_size`.
META_ANNOUNCED_N = "fedweigh_stats_announced_n"
META_NOISED = "fedweigh_stats_noised"
#: With statistics DP the N inside the sum is noised: |N - announced| may reach this share of N.
NOISED_N_TOLERANCE = 0.05


def check_announced_size(stats: GlobalStats, announced: object, noised: bool, own_num_samples: int) -> None:
    """A decoded sum against what the site knows: N equals the sum of N_k the server announces (the
    sizes the sites report in clear; within :data:`NOISED_N_TOLERANCE` x N when a contribution was
    noised) and is at least the site's own N_k. ValueError naming the mismatch otherwise: a forged
    contribution (e.g. counts inflated inside the ciphertext while the size reported in clear is
    honest)."""
    if isinstance(announced, bool) or not isinstance(announced, int) or announced <= 0:
        raise ValueError(f"the server's sum announces no valid sum of N_k (got {announced!r})")
    n = stats.num_samples
    allowed = NOISED_N_TOLERANCE * announced if noised else 0
    if abs(n - announced) > allowed:
        raise ValueError(
            f"the decoded sum gives N = {n:,}, the server holds sum N_k = {announced:,} from the sizes the "
            f"sites report in clear{' (noised contributions: up to ' + format(allowed, '.0f') + ' apart)' if noised else ''}: "
            "a contribution's counts were forged inside its ciphertext"
        )
    if not noised and n < own_num_samples:
        raise ValueError(f"the decoded sum gives N = {n:,}, below this site's own N_k = {own_num_samples:,}")


def global_stats_of(histograms: Iterable[tuple[np.ndarray, int]]) -> GlobalStats:
    """The global statistics of the sites' (class_counts, N_k): decode_sum(sum_k v_k)."""
    vectors = [statistics_vector(counts, n) for counts, n in histograms]
    if not vectors:
        raise ValueError("global statistics need at least one site's histogram")
    return decode_sum(np.sum(vectors, axis=0))


def _is_number_list(vector: object) -> bool:
    """A list, tuple or array of real numbers: what a site's encoding sends (a string such as "3" that
    NumPy would parse, or a boolean, is not a count)."""
    if isinstance(vector, np.ndarray):
        return vector.dtype.kind in "iuf"
    return isinstance(vector, (list, tuple)) and all(
        isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
        for x in vector
    )


def check_statistics_vector(site: str, vector: object, length: int) -> np.ndarray:
    """A plaintext v_k: a list of ``length`` finite numbers (not strings, not booleans), non-negative
    counts, no class count above N_k.

    Raises ValueError naming ``site`` otherwise.
    """
    if not _is_number_list(vector):
        raise ValueError(f"{site}: statistics vector is not numeric")
    vec = np.asarray(vector, dtype=np.float64)
    if vec.shape != (length,) or not np.isfinite(vec).all():
        raise ValueError(f"{site}: statistics vector must be {length} finite numbers")
    if np.any(vec[:-1] < 0) or np.any(vec[:-2] > vec[-2]):
        raise ValueError(f"{site}: statistics vector has negative counts or counts above N_k")
    return vec


class StatisticsExchange(ABC):
    """How contributions travel: the client side encodes/decodes, the server side checks and sums.

    ``min_contributions``: the fewest contributions a sum may hold before this party decodes it (a
    site: its policy's minimum, :mod:`fedweigh.server.quorum`).
    """

    mode: str = ""
    min_contributions: int = ABSOLUTE_MIN

    @abstractmethod
    def encode(self, vector: np.ndarray, binding: ExchangeBinding | None = None) -> dict:
        """The client's contribution, as result meta/params, bound to ``binding`` when given."""

    def check(self, site: str, payload: dict, length: int) -> None:
        """Server: raise ValueError naming ``site`` if its contribution is malformed (default: no check)."""
        return None

    @abstractmethod
    def sum(self, site_payloads: dict[str, dict], length: int) -> dict:
        """Server: the sum of the valid contributions (as a payload the clients can decode)."""

    @abstractmethod
    def decode(self, payload: dict, binding: ExchangeBinding | None = None) -> np.ndarray:
        """Client: the summed vector from the server's payload; with ``binding``, refused (ValueError)
        unless the sum is of that exchange."""

    def check_exchange(self, payload: Mapping, binding: ExchangeBinding | None) -> None:
        """Client: with ``binding``, the sum must repeat the exchange id this site contributed to."""
        if binding is None:
            return
        announced = payload.get(META_EXCHANGE_ID)
        if announced != binding.exchange_id:
            raise ValueError(
                f"statistics: the sum is not of this exchange (a stale or foreign sum): it names exchange "
                f"{announced!r}, {binding.site} contributed to exchange {binding.exchange_id!r} of job "
                f"{binding.job_id!r}"
            )

    def check_quorum(self, payload: Mapping) -> int:
        """Client, before decoding: the sum's number of contributions, at least ``min_contributions``."""
        count = payload.get(META_NUM_CONTRIBUTIONS)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"statistics: the server's sum lacks a valid {META_NUM_CONTRIBUTIONS}, got {count!r}"
            )
        if count < self.min_contributions:
            raise ValueError(
                f"statistics: the server's sum holds {count} contribution(s); this site's policy decodes a sum "
                f"only with at least {self.min_contributions}, so it is not decrypted"
            )
        return count


class PlainExchange(StatisticsExchange):
    """Contributions in clear (the server sees every site's histogram)."""

    mode = "plain"

    def __init__(self, min_contributions: int = ABSOLUTE_MIN) -> None:
        self.min_contributions = int(min_contributions)

    def encode(self, vector: np.ndarray, binding: ExchangeBinding | None = None) -> dict:
        # plain: bound by the exchange id only (the server sees every contribution anyway)
        return {META_VECTOR: [float(x) for x in vector]}

    def check(self, site: str, payload: dict, length: int) -> None:
        check_statistics_vector(site, payload.get(META_VECTOR, []), length)

    def sum(self, site_payloads: dict[str, dict], length: int) -> dict:
        total = np.zeros(length, dtype=np.float64)
        for payload in site_payloads.values():
            total += np.asarray(payload[META_VECTOR], dtype=np.float64)
        return {
            META_VECTOR: [float(x) for x in total],
            META_LENGTH: int(length),
            META_NUM_CONTRIBUTIONS: len(site_payloads),
        }

    def decode(self, payload: dict, binding: ExchangeBinding | None = None) -> np.ndarray:
        self.check_exchange(payload, binding)
        self.check_quorum(payload)
        return np.asarray(payload[META_VECTOR], dtype=np.float64)

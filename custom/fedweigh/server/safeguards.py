"""The round step's safeguards: what bounds a single site's influence on the global model.

:class:`Safeguards` holds a run's settings (checked once, by :func:`fedweigh.checks.check_server_values`);
the functions apply them to one round's results (docs/security.md lists the checks and the attacks
they were measured against):

- :func:`norm_scales`: an array of an update longer than ``update_norm_bound`` times the reference
  norm of the other sites' (:func:`norm_reference`) is scaled down to that bound (plaintext only);
- :func:`direction_outliers`: an update pointing away (cosine below ``min_update_cosine``) from a
  consensus of the other sites' updates is left out (three or more updates; plaintext only);
- :func:`cap_weights`: no site holds more than ``max_share`` of the round's weight
  (:func:`resolve_max_share`: half of it by default once three or more sites count);
- :class:`AcceptedDigests`: a result identical to one the site sent in an earlier round is a replay;
- :func:`plausible_counts`: a sample count far above, or a step count far from, the other sites'
  of the round is clipped (``ResultLimits.max_count_ratio``); :func:`step_floor` /
  :func:`step_ceiling`: a step count outside what the site's size makes plausible is clipped;
- ``declared_sizes`` (:mod:`fedweigh.server.declared`): a sample count above its declaration is clipped;
- :class:`AnnouncedCounts`: a sample count above what the site announced in the statistics phase is
  refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any

import numpy as np

from fedweigh.arrays import to_numpy
from fedweigh.checks import check_server_values
from fedweigh.errors import InvalidClientResult
from fedweigh.protocol import ABSOLUTE_MIN
from fedweigh.server.validation import ResultLimits

__all__ = [
    "AUTO_CAP_MIN_SITES",
    "DEFAULT_MAX_SHARE",
    "DEFAULT_MIN_UPDATE_COSINE",
    "DEFAULT_UPDATE_NORM_BOUND",
    "DIRECTION_MIN_PULL",
    "ROBUST_OPTIONS",
    "AcceptedDigests",
    "AnnouncedCounts",
    "Safeguards",
    "cap_weights",
    "direction_outliers",
    "auto_colluders",
    "norm_reference",
    "norm_scales",
    "reference_name",
    "objecting_sites",
    "params_digest",
    "pulls_against_others",
    "plausible_counts",
    "resolve_max_share",
    "step_ceiling",
    "step_floor",
    "update_cosines",
]

#: ``max_share="auto"`` (the default): no site may hold more than this share of a round's weight
#: once at least :data:`AUTO_CAP_MIN_SITES` sites count (with two, any unequal weighting gives one
#: of them the majority, and the cap would force equal weights).
DEFAULT_MAX_SHARE = 0.5
AUTO_CAP_MIN_SITES = 3
#: Default ``update_norm_bound``: every array of an update may be at most this many times the reference
#: norm of the same array in the other sites' updates of the round (larger ones are scaled down;
#: :func:`norm_reference`). At 1 the reference is an honest site's norm: no update moves an array
#: further than an honest site's update does (docs/security.md, "Bounded influence").
DEFAULT_UPDATE_NORM_BOUND = 1.0
#: Default ``min_update_cosine``: an update whose cosine with more than half of the other sites'
#: updates is below this, while those agree with each other, is left out (three or more updates,
#: plaintext; :func:`direction_outliers`).
DEFAULT_MIN_UPDATE_COSINE = 0.0
#: The direction check leaves an update out only when it pulls against the other sites' mean update
#: by at least this fraction of that mean's length (:func:`direction_outliers`, condition (c)): at 1,
#: an update that would undo the whole of the others' mean step. (It was 0.5 while the norm bound let
#: an update be 3 times the others' median; under label skew honest sites pull 0.5 to 0.75 late in
#: training, docs/security.md.)
DIRECTION_MIN_PULL = 1.0

#: The options of :class:`Safeguards` that a job sets (``limits`` is the server's own).
_OPTIONS = (
    "min_clients",
    "max_share",
    "update_norm_bound",
    "norm_colluders",
    "min_update_cosine",
    "min_secure_sum",
)
#: The robust options (:mod:`fedweigh.server.robust`; all off by default, plaintext only).
ROBUST_OPTIONS = ("aggregator", "trim", "krum_f", "array_cosine", "clip_norm", "nnm_f")


@dataclass(frozen=True)
class Safeguards:
    """The round step's checks, fixed for a run.

    Args:
        min_clients: fewest valid results for the global model to change.
        max_share: cap on any one site's share of the round's total weight: ``"auto"`` (default:
            :data:`DEFAULT_MAX_SHARE` once three or more sites count), a number in (0, 1], or None
            (no cap).
        update_norm_bound: scale every array of an update down to this many times the reference norm
            of the same array in the other sites' updates of the round (default
            :data:`DEFAULT_UPDATE_NORM_BOUND`; None: off), from three updates on (with two, nothing
            tells which length is the honest one). Plaintext only.
        norm_colluders: the reference (:func:`norm_reference`): the (f + 1)-th largest of the other
            sites' norms, f = this many sites acting with the judged one (``"auto"``, the default:
            :func:`auto_colluders`, floor((K - 1) / 4)), or ``"median"`` (their median).
        min_update_cosine: leave out an update whose cosine with more than half of the other sites'
            updates is below this while no two of those are below it with each other (default
            :data:`DEFAULT_MIN_UPDATE_COSINE`: one that opposes a consensus); from three updates on,
            plaintext only. None: off.
        min_secure_sum: under HE, the fewest updates an encrypted sum may hold (raised by the
            minimum each contributing site announces; :func:`fedweigh.server.quorum.secure_sum_quorum`).
        aggregator: ``"mean"`` (default: the scheme's weighted mean), ``"median"`` (weighted
            coordinate-wise median) or ``"trimmed_mean"`` (weighted trimmed mean, ``trim`` of the weight
            cut from each tail), both with the scheme's weights (:mod:`fedweigh.server.robust`).
        trim: the weight mass the trimmed mean cuts from each tail, in [0, 0.5) (default 0.25).
        krum_f: multi-Krum: keep the K - f updates closest to their neighbours, leave out the others
            (None: off).
        array_cosine: the direction check applied to each array alone (threshold, as
            ``min_update_cosine``): an update's arrays that point away from a consensus of the others'
            are left out (None: off).
        clip_norm: clip every update to this absolute L2 norm over all its floating-point arrays,
            min(1, C / ||Delta||) as Flower's fixed clipping (None: off).
        nnm_f: nearest-neighbour mixing before the location: each update replaced by the mean of its
            K - f nearest updates (:func:`fedweigh.server.robust.nearest_neighbour_mixing`; None: off).
        declared_sizes: the training-set size N_k of each site as the consortium declared it (site ->
            count; None: no declaration). A reported N_k above its site's declaration is clipped to it, and
            a site without one to the smallest declared size: reports buy no weight beyond it.
        limits: plausibility bounds on counts and scalars.
        source: who set the options, named by the error a bad one raises (not stored).

    Each option is checked here, once, by :func:`fedweigh.checks.check_server_values` (a
    :class:`~fedweigh.errors.ConfigError` naming ``source``, the option, the value and what is
    allowed); numbers are stored as floats.
    """

    min_clients: int = 1
    max_share: float | str | None = "auto"
    update_norm_bound: float | None = DEFAULT_UPDATE_NORM_BOUND
    min_update_cosine: float | None = DEFAULT_MIN_UPDATE_COSINE
    min_secure_sum: int = ABSOLUTE_MIN
    limits: ResultLimits = field(default_factory=ResultLimits)
    aggregator: str = "mean"
    trim: float = 0.25
    krum_f: int | None = None
    array_cosine: float | None = None
    clip_norm: float | None = None
    nnm_f: int | None = None
    declared_sizes: Mapping[str, int] | None = None
    norm_colluders: int | str = "auto"
    source: InitVar[str] = "round safeguards"

    def __post_init__(self, source: str) -> None:
        check_server_values(
            {name: getattr(self, name) for name in (*_OPTIONS, *ROBUST_OPTIONS, "declared_sizes")}, source
        )
        if self.declared_sizes is not None:
            object.__setattr__(
                self, "declared_sizes", {str(k): int(v) for k, v in self.declared_sizes.items()}
            )
        for name in (
            "max_share",
            "update_norm_bound",
            "min_update_cosine",
            "trim",
            "array_cosine",
            "clip_norm",
        ):
            value = getattr(self, name)
            if isinstance(value, (int, float)):
                object.__setattr__(self, name, float(value))

    @classmethod
    def off(cls, **given: Any) -> Safeguards:
        """No weight cap, no norm bound, no direction check (the schemes as their papers define them);
        ``given`` sets any option."""
        return cls(**{"max_share": None, "update_norm_bound": None, "min_update_cosine": None, **given})

    @property
    def robust(self) -> bool:
        """Whether any robust option (:data:`ROBUST_OPTIONS`) is on (they need plaintext updates)."""
        return (
            self.aggregator != "mean"
            or self.krum_f is not None
            or self.array_cosine is not None
            or self.clip_norm is not None
            or self.nnm_f is not None
        )

    def cap(self, num_sites: int) -> float | None:
        """The weight cap of a round in which ``num_sites`` sites count (:func:`resolve_max_share`)."""
        return resolve_max_share(self.max_share, num_sites)


def resolve_max_share(max_share: float | str | None, num_sites: int) -> float | None:
    """The cap :func:`cap_weights` applies in a round of ``num_sites``: ``"auto"`` is
    :data:`DEFAULT_MAX_SHARE` from :data:`AUTO_CAP_MIN_SITES` sites on, else none; None is none."""
    if max_share == "auto":
        return DEFAULT_MAX_SHARE if num_sites >= AUTO_CAP_MIN_SITES else None
    if max_share is None:
        return None
    return float(max_share)


def norm_reference(others: np.ndarray, colluders: int | str) -> np.ndarray:
    """Per array (column), the norm the bound is a multiple of, from the OTHER updates' norms (rows):
    the (f + 1)-th largest, f = ``colluders`` (``"auto"``: :func:`auto_colluders` of the round's K =
    rows + 1), or their median (``"median"``).

    Whoever the judged site is, at most f of the others acting with it can only fill the f largest
    places, so the (f + 1)-th largest is at most an honest site's norm: the bound is an honest update's
    length against up to f + 1 colluding sites, and lets an honest site's update through unless it is
    longer than the (f + 1)-th longest of the others'.
    """
    x = np.asarray(others, dtype=np.float64)
    if colluders == "median":
        return np.median(x, axis=0)
    f = auto_colluders(x.shape[0] + 1) if colluders == "auto" else int(colluders)
    ranked = -np.sort(-x, axis=0)  # descending per column
    return ranked[min(f, x.shape[0] - 1)]


def auto_colluders(num_updates: int) -> int:
    """``norm_colluders="auto"``: floor((K - 1) / 4) other sites acting with the judged one (0 up to 4
    sites: one attacker; 1 from 5 to 8: two colluders; a quarter of the sites from there)."""
    return max(0, (int(num_updates) - 1) // 4)


def reference_name(colluders: int | str, num_updates: int) -> str:
    """The reference of :func:`norm_reference` in words, for a round of ``num_updates``."""
    if colluders == "median":
        return "the median"
    f = auto_colluders(num_updates) if colluders == "auto" else int(colluders)
    rank = {0: "", 1: "2nd ", 2: "3rd "}.get(f, f"{f + 1}th ")
    return f"the {rank}largest norm"


def norm_scales(
    norms: np.ndarray, bound: float, colluders: int | str = "median", steps: np.ndarray | None = None
) -> np.ndarray:
    """Per update (row) and array (column), the factor (<= 1) that brings the array's norm within
    ``bound`` times the reference norm of the same array in the OTHER updates of the round
    (:func:`norm_reference`: their median, or their (f + 1)-th largest; leave-one-out, so the site
    being judged never sets its own bound; one update alone is left as it is). A 1-D ``norms`` is one
    array per update.

    ``steps`` (tau_k, each within what its declared size makes plausible): update j's norms count as
    ||Delta_j|| max(1, tau_k / tau_j) when judging site k: a site that takes more local steps, because
    it holds more data, may move the model as far as an honest site of its size would."""
    norms = np.asarray(norms, dtype=np.float64)
    n = norms.reshape(norms.shape[0], -1)  # one row per update
    tau = None if steps is None else np.maximum(np.asarray(steps, dtype=np.float64).reshape(-1), 1.0)
    scales = np.ones(n.shape)
    for k in range(n.shape[0]):
        others = np.delete(n, k, axis=0)
        if tau is not None:
            others = others * np.maximum(1.0, tau[k] / np.delete(tau, k))[:, None]
        if others.shape[0] == 0:
            continue
        limit = bound * norm_reference(others, colluders)
        over = n[k] > limit  # so n[k] > limit >= 0 where it divides
        scales[k, over] = limit[over] / n[k, over]
    return scales.reshape(norms.shape)


def update_cosines(gram: np.ndarray) -> np.ndarray:
    """cos(Delta_j, Delta_k) from the Gram matrix of the updates (a zero update points nowhere: its
    cosine with anything is 1, so it objects to nothing and nothing objects to it)."""
    g = np.asarray(gram, dtype=np.float64)
    norms = np.sqrt(np.maximum(np.diag(g), 0.0))
    denom = np.outer(norms, norms)
    cos = np.divide(g, denom, out=np.ones_like(g), where=denom > 0)
    np.fill_diagonal(cos, 1.0)
    return cos


def objecting_sites(gram: np.ndarray, threshold: float) -> np.ndarray:
    """Per update k, how many of the OTHER updates j it points away from: cos(Delta_k, Delta_j) below
    ``threshold`` (a zero update points nowhere and objects to nothing)."""
    return (update_cosines(gram) < threshold).sum(axis=1)


def direction_outliers(gram: np.ndarray, threshold: float, min_pull: float | None = None) -> list[int]:
    """The updates that point away from a consensus of the others, far enough to undo much of it.

    Update k is an outlier when (a) its cosine with more than half of the other updates is below
    ``threshold``, (b) the other updates agree among themselves: no pair of them has a cosine
    below ``threshold``, and (c) it pulls against the others' mean update m_-k at least ``min_pull``
    times that mean's length: <Delta_k, m_-k> <= -min_pull ||m_-k||^2 (default
    :data:`DIRECTION_MIN_PULL`; 0 drops the condition).

    Without (b), updates that scatter in all directions, as honest sites' do late in training or
    under strong label skew, would be left out at random (a round could lose every site); with it,
    only an update that opposes updates which agree with each other is left out. Without (c), a
    small honest site, whose few local steps point where its few images lead, is left out whenever
    it leans slightly away from the large sites (the demo lost its smallest site, and with
    ``min_clients`` equal to the number of sites whole rounds); an update that pulls against the
    others by less than half their mean step cannot reverse it, and its weight and the norm bound
    bound it further.
    """
    min_pull = DIRECTION_MIN_PULL if min_pull is None else float(min_pull)
    cos = update_cosines(gram)
    pulls = pulls_against_others(gram)
    below = cos < threshold
    n = cos.shape[0]
    out = []
    for k in range(n):
        others = [j for j in range(n) if j != k]
        if 2 * int(below[k, others].sum()) <= len(others):
            continue
        if below[np.ix_(others, others)].any():
            continue
        if pulls[k] >= min_pull * (1.0 - 1e-9):  # an exact reversal of the mean is 1, up to rounding
            out.append(k)
    return out


def pulls_against_others(gram: np.ndarray) -> np.ndarray:
    """Per update k, -<Delta_k, m_-k> / ||m_-k||^2 with m_-k the mean of the OTHER updates: how
    much of the others' mean step Delta_k would undo (0 where that mean is zero)."""
    g = np.asarray(gram, dtype=np.float64)
    n = g.shape[0]
    out = np.zeros(n)
    for k in range(n):
        others = [j for j in range(n) if j != k]
        if not others:
            continue
        pull = float(g[k, others].sum()) / len(others)  # <Delta_k, m_-k>
        mean_sq = float(g[np.ix_(others, others)].sum()) / len(others) ** 2  # ||m_-k||^2
        out[k] = -pull / mean_sq if mean_sq > 0 else 0.0
    return out


def plausible_counts(counts: np.ndarray, ratio: float, *, lower: bool) -> np.ndarray:
    """Per site, its count clipped to ``ratio`` x the median count of the OTHER sites of the round
    (leave-one-out: a site never sets its own bound), and with ``lower`` also to at least that
    median / ``ratio``; float64, one site alone is left as it is.

    Sample counts are clipped from above only (a smaller N_k only lowers the site's own weight);
    step counts both ways (FedNova weighs by 1 / tau_k, so a forged small tau_k raises the weight).
    """
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    out = c.copy()
    for k in range(c.size):
        others = np.delete(c, k)
        if others.size == 0:
            continue
        median = float(np.median(others))
        out[k] = min(out[k], ratio * median)
        if lower:
            out[k] = max(out[k], median / ratio)
    return out


def step_floor(steps: np.ndarray, sizes: np.ndarray, ratio: float = 1.0) -> np.ndarray:
    """Per site k, the fewest local steps its size N_k makes plausible next to the OTHER sites':
    floor(median_j(s_kj)) with s_kj = tau_j when N_k >= N_j, else tau_j N_k / (N_j ``ratio``)
    (0 for a site alone).

    An honest site takes tau = E ceil(N / B) steps, or a common cap: as many as a site of its size or
    smaller, and in proportion to its size, less the rounding of one batch per epoch, next to a larger
    one (``ratio`` leaves room for that rounding). FedNova weighs p_k / tau_k: with tau_k at least this
    floor, a forged tau_k (or a forged N_k, which lowers p_k with it) buys at most ``ratio`` times an
    honest site's p_j / tau_j.
    """
    tau = np.asarray(steps, dtype=np.float64).reshape(-1)
    n = np.asarray(sizes, dtype=np.float64).reshape(-1)
    out = np.zeros(tau.size)
    for k in range(tau.size):
        implied = [
            tau[j] if n[k] >= n[j] else tau[j] * n[k] / (n[j] * ratio)
            for j in range(tau.size)
            if j != k and n[j] > 0
        ]
        if implied:
            out[k] = float(np.floor(np.median(implied)))
    return out


def step_ceiling(steps: np.ndarray, sizes: np.ndarray, ratio: float = 1.0) -> np.ndarray:
    """Per site k, the most local steps its size N_k makes plausible next to the OTHER sites':
    ceil(median_j(s_kj)) with s_kj = tau_j when N_k <= N_j, else tau_j N_k ``ratio`` / N_j (infinite
    for a site alone): the mirror of :func:`step_floor`, which the norm bound reads with declared
    sizes (a site of that size may move the model that much further)."""
    tau = np.asarray(steps, dtype=np.float64).reshape(-1)
    n = np.asarray(sizes, dtype=np.float64).reshape(-1)
    out = np.full(tau.size, np.inf)
    for k in range(tau.size):
        implied = [
            tau[j] if n[k] <= n[j] else tau[j] * n[k] * ratio / n[j]
            for j in range(tau.size)
            if j != k and n[j] > 0
        ]
        if implied:
            out[k] = float(np.ceil(np.median(implied)))
    return out


def cap_weights(weights: np.ndarray, max_share: float) -> np.ndarray:
    """Bound any one site's share of the total weight by ``max_share`` (water-filling).

    Shares s = w / sum(w) above the cap are set to it and the excess is given to the other sites in
    proportion to their shares, repeated until no share exceeds the cap; the result is rescaled to the
    original sum (FedNova's weights need not sum to 1). A cap below 1/K cannot hold and becomes 1/K.
    This bounds the influence of a site that inflates its sample count or statistics. No weights, a
    total of zero or less, or a cap outside (0, 1) leave the weights as they are (as float64); a share
    within 1e-15 of the cap counts as at it.
    """
    w = np.asarray(weights, dtype=np.float64)
    total = float(w.sum())
    if w.size == 0 or total <= 0 or not 0 < max_share < 1:
        return w
    cap = max(max_share, 1.0 / w.size)
    s = w / total
    capped = np.zeros(w.size, dtype=bool)
    for _ in range(w.size):
        over = (s > cap + 1e-15) & ~capped
        if not over.any():
            break
        capped |= over
        free = ~capped
        excess = 1.0 - cap * capped.sum()
        base = s[free].sum()
        s[capped] = cap
        if free.any():
            s[free] = s[free] / base * excess if base > 0 else excess / free.sum()
    return s * total


def params_digest(params: Mapping[str, Any] | None) -> str:
    """sha256 over the names, dtypes, shapes and bytes of a result's arrays (to recognise a replay)."""
    h = hashlib.sha256()
    for key in sorted(params or {}):
        arr = np.ascontiguousarray(to_numpy((params or {})[key]))
        h.update(f"{key}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


class AnnouncedCounts:
    """Per site, the training-set size N_k it announced in the statistics phase (in the clear meta of
    its contribution); a training result reporting more than that is refused
    (:meth:`check`). Filled by whoever runs the statistics phase, read by the round step; a site
    that announced nothing is not checked."""

    def __init__(self, counts: Mapping[str, Any] | None = None) -> None:
        self._counts: dict[str, int] = {}
        for site, count in (counts or {}).items():
            self.note(site, count)

    def note(self, site: str, count: object) -> None:
        """Remember ``site``'s announced count (ignored unless a positive integer)."""
        if isinstance(count, (int, np.integer)) and not isinstance(count, bool) and count > 0:
            self._counts[str(site)] = int(count)

    def __len__(self) -> int:
        return len(self._counts)

    def check(self, site: str, num_samples: int) -> None:
        """InvalidClientResult when ``num_samples`` exceeds the count ``site`` announced."""
        announced = self._counts.get(site)
        if announced is not None and num_samples > announced:
            raise InvalidClientResult(
                f"{site}: num_samples={num_samples} exceeds the {announced} it announced in the "
                "statistics phase"
            )


class AcceptedDigests:
    """Per site, the digest (:func:`params_digest`) of every result the round step accepted, with its
    round: a later result with the same digest is a replay and is refused.

    One store serves a whole run: :class:`~fedweigh.server.rounds.RoundStep` keeps its own unless
    given one, and an adapter that builds a step per round (the stock-FedAvg aggregator) passes the
    same store to each.
    """

    def __init__(self) -> None:
        self._rounds: dict[str, dict[str, int]] = {}

    def admit(self, site: str, params: Mapping[str, Any] | None, round_index: int) -> None:
        """Remember ``site``'s result of ``round_index``; InvalidClientResult if it is a replay."""
        digest = params_digest(params)
        earlier = self._rounds.get(site, {}).get(digest)
        if earlier is not None:
            raise InvalidClientResult(
                f"{site}: its parameters are a replay of the result it sent in round {earlier}"
            )
        self._rounds.setdefault(site, {})[digest] = round_index

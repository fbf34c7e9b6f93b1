"""One federated round at the server, in one place: validate, weigh, cap, aggregate, record.

Every path that runs rounds calls :class:`RoundStep`: the NVFlare controller
(:class:`~fedweigh.flare.controller.FedweighController`), the stock-FedAvg aggregator
(:class:`~fedweigh.flare.aggregator.FedweighAggregator`), the encrypted path (its backend is
:class:`fedweigh.server.encrypted.EncryptedGlobalModel`) and the in-process benchmark. Per round t:

1. validate each site's :class:`ClientResult` (N_k, local steps, the scalars the scheme asked for
   within the scheme's ranges, the parameters or ciphertexts through the backend, and that it is
   not a replay of one of the site's earlier results); an invalid one is left out with its reason;
2. bound each update's influence: an update whose norm exceeds ``update_norm_bound`` times the
   median norm of the other sites' updates is scaled down to that bound (plaintext only: under HE
   the server cannot see norms);
3. w = scheme.weights(reports, theta_g^{t-1}, t, T), capped at ``max_share`` of the total per site
   (:func:`cap_weights`; by default half the round's weight once three or more sites count);
4. theta_g^t = backend.aggregate(...) = theta_g^{t-1} + sum_k w_k Delta_k (plaintext or CKKS; a
   CKKS sum needs a quorum of contributions, :mod:`fedweigh.server.quorum`);
5. a :class:`RoundOutcome` with the weights, the scheme's values, the excluded and bounded sites
   and the mean of the sites' metrics, which :class:`fedweigh.server.records.RoundRecorder` turns into the
   run's rows.

No single result can fail the round: every check excludes only the site that failed it, with the
reason. Fewer than ``min_clients`` valid results, or a scheme that cannot weight the round, leave
the global model unchanged (the outcome says so and why). docs/security.md lists the checks and the
attacks they were measured against.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fedweigh.arrays import Params, to_numpy, to_numpy_dict
from fedweigh.errors import InvalidClientResult
from fedweigh.protocol import META_MIN_SECURE_SUM, ZERO_WEIGHT
from fedweigh.server.quorum import ABSOLUTE_MIN, parse_minimum, secure_sum_quorum
from fedweigh.server.validation import ResultLimits, check_meta, check_params, finite_metrics
from fedweigh.weighting.base import ClientReport, WeightingScheme
from fedweigh.weighting.geometry import delta_gram64, delta_norms

__all__ = [
    "AUTO_CAP_MIN_SITES",
    "DEFAULT_MAX_SHARE",
    "DEFAULT_UPDATE_NORM_BOUND",
    "AggregationBackend",
    "ClientResult",
    "PlaintextBackend",
    "RoundOutcome",
    "RoundStep",
    "cap_weights",
    "check_max_share",
    "check_update_norm_bound",
    "mean_metrics",
    "norm_scales",
    "objecting_sites",
    "params_digest",
    "resolve_max_share",
    "sample_sites",
    "scheme_values",
]

logger = logging.getLogger("fedweigh.server.rounds")

#: ``max_share="auto"`` (the default): no site may hold more than this share of a round's weight
#: once at least :data:`AUTO_CAP_MIN_SITES` sites count (with two, any unequal weighting gives one
#: of them the majority, and the cap would force equal weights).
DEFAULT_MAX_SHARE = 0.5
AUTO_CAP_MIN_SITES = 3
#: Default ``update_norm_bound``: every array of an update may be at most this many times the median
#: norm of the same array in the other sites' updates of the round (larger ones are scaled down).
DEFAULT_UPDATE_NORM_BOUND = 3.0
#: Default ``min_update_cosine``: an update whose cosine with more than half of the other sites'
#: updates is below this, while those agree with each other, is left out (three or more updates,
#: plaintext; :func:`direction_outliers`).
DEFAULT_MIN_UPDATE_COSINE = 0.0


def resolve_max_share(max_share: float | str | None, num_sites: int) -> float | None:
    """The cap :func:`cap_weights` applies in a round of ``num_sites``: ``"auto"`` is
    :data:`DEFAULT_MAX_SHARE` from :data:`AUTO_CAP_MIN_SITES` sites on, else none; None is none."""
    if max_share == "auto":
        return DEFAULT_MAX_SHARE if num_sites >= AUTO_CAP_MIN_SITES else None
    if max_share is None:
        return None
    return float(max_share)


def check_max_share(max_share: object) -> float | str | None:
    """``max_share`` as a job may set it: "auto", None (no cap) or a number in (0, 1]."""
    if max_share == "auto" or max_share is None:
        return max_share  # type: ignore[return-value]
    if isinstance(max_share, bool) or not isinstance(max_share, (int, float)) or not 0.0 < max_share <= 1.0:
        raise ValueError(f"max_share must be 'auto', None or a number in (0, 1], got {max_share!r}")
    return float(max_share)


def check_update_norm_bound(bound: object) -> float | None:
    """``update_norm_bound`` as a job may set it: None (off) or a number >= 1."""
    if bound is None:
        return None
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not (1.0 <= bound < math.inf):
        raise ValueError(f"update_norm_bound must be None (off) or a finite number >= 1, got {bound!r}")
    return float(bound)


def check_min_update_cosine(value: object) -> float | None:
    """``min_update_cosine`` as a job may set it: None (off) or a number in [-1, 1]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1.0 <= value <= 1.0:
        raise ValueError(f"min_update_cosine must be None (off) or a number in [-1, 1], got {value!r}")
    return float(value)


def norm_scales(norms: np.ndarray, bound: float) -> np.ndarray:
    """Per update (row) and array (column), the factor (<= 1) that brings the array's norm within
    ``bound`` times the median norm of the same array in the OTHER updates of the round
    (leave-one-out, so the site being judged never sets its own bound and one site cannot raise it;
    one update alone is left as it is). A 1-D ``norms`` is one array per update."""
    norms = np.asarray(norms, dtype=np.float64)
    flat = norms.ndim == 1
    n = norms[:, None] if flat else norms
    scales = np.ones(n.shape)
    for k in range(n.shape[0]):
        others = np.delete(n, k, axis=0)
        if others.shape[0] == 0:
            continue
        limit = bound * np.median(others, axis=0)
        over = n[k] > limit
        with np.errstate(divide="ignore", invalid="ignore"):
            scales[k, over] = np.where(limit[over] > 0, limit[over] / n[k, over], 0.0)
    return scales[:, 0] if flat else scales


def update_cosines(gram: np.ndarray) -> np.ndarray:
    """cos(Delta_j, Delta_k) from the Gram matrix of the updates (a zero update points nowhere: its
    cosine with anything is 1, so it objects to nothing and nothing objects to it)."""
    g = np.asarray(gram, dtype=np.float64)
    norms = np.sqrt(np.maximum(np.diag(g), 0.0))
    denom = np.outer(norms, norms)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(denom > 0, g / np.where(denom > 0, denom, 1.0), 1.0)
    np.fill_diagonal(cos, 1.0)
    return cos


def objecting_sites(gram: np.ndarray, threshold: float) -> np.ndarray:
    """Per update k, how many of the OTHER updates j it points away from: cos(Delta_k, Delta_j) below
    ``threshold`` (a zero update points nowhere and objects to nothing)."""
    return (update_cosines(gram) < threshold).sum(axis=1)


def direction_outliers(gram: np.ndarray, threshold: float) -> list[int]:
    """The updates that point away from a consensus of the others.

    Update k is an outlier when (a) its cosine with more than half of the other updates is below
    ``threshold`` and (b) the other updates agree among themselves: no pair of them has a cosine
    below ``threshold``. Without (b), updates that scatter in all directions, as honest sites' do late
    in training or under strong label skew, would be left out at random (a round could lose every
    site); with it, only an update that opposes updates which agree with each other is left out.
    """
    cos = update_cosines(gram)
    below = cos < threshold
    n = cos.shape[0]
    out = []
    for k in range(n):
        others = [j for j in range(n) if j != k]
        if 2 * int(below[k, others].sum()) <= len(others):
            continue
        if not below[np.ix_(others, others)].any():
            out.append(k)
    return out


def params_digest(params: Mapping[str, Any] | None) -> str:
    """sha256 over the names, dtypes, shapes and bytes of a result's arrays (to recognise a replay)."""
    h = hashlib.sha256()
    for key in sorted(params or {}):
        arr = np.ascontiguousarray(to_numpy((params or {})[key]))
        h.update(f"{key}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def sample_sites(
    all_sites: Sequence[str], fraction: float, min_clients: int, seed: int, round_index: int
) -> list[str]:
    """Deterministic per-round sample of max(min_clients, ceil(fraction * K)) sites, in name order."""
    sites = sorted(all_sites)
    k = min(len(sites), max(min_clients, math.ceil(fraction * len(sites))))
    if k >= len(sites):
        return sites
    rng = random.Random(seed * 7_919 + round_index)
    return sorted(rng.sample(sites, k))


def mean_metrics(metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per key, the mean of the finite numeric values the sites reported (anything else is ignored)."""
    clean = [finite_metrics(m) for m in metrics]
    keys = sorted({k for m in clean for k in m})
    return {k: float(np.mean([m[k] for m in clean if k in m])) for k in keys if any(k in m for m in clean)}


def cap_weights(weights: np.ndarray, max_share: float) -> np.ndarray:
    """Bound any one site's share of the total weight by ``max_share`` (water-filling).

    Shares s = w / sum(w) above the cap are set to it and the excess is given to the other sites in
    proportion to their shares, repeated until no share exceeds the cap; the result is rescaled to the
    original sum (FedNova's weights need not sum to 1). A cap below 1/K cannot hold and becomes 1/K.
    This bounds the influence of a site that inflates its sample count or statistics.
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


def scheme_values(scheme: WeightingScheme) -> dict[str, float]:
    """The scalar entries of the scheme's last ``weights`` call (e.g. FedDRAW's lambda and beta)."""
    return {
        k: float(v)
        for k, v in (scheme.last_details or {}).items()
        if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
    }


@dataclass
class ClientResult:
    """One site's answer to a training task, as plain values (what NVFlare's ``FLModel`` carries).

    meta holds ``num_samples``, ``NUM_STEPS_CURRENT_ROUND`` and ``fedweigh_scalars``
    (:mod:`fedweigh.protocol`); params the trained parameters (plaintext) or the encrypted update.
    """

    site: str
    params: Mapping[str, Any] | None
    meta: Mapping[str, Any] | None
    metrics: Mapping[str, Any] | None = None


class AggregationBackend(ABC):
    """Where the global model lives and how a round's contributions are summed into it.

    :class:`PlaintextBackend` holds theta_g in clear; the CKKS backend
    (:class:`fedweigh.server.encrypted.EncryptedGlobalModel`) holds it as ciphertext.
    """

    #: True when client updates are encrypted (the scheme then weights from scalars only).
    encrypted: bool = False

    @abstractmethod
    def check_params(self, site: str, params: Mapping[str, Any] | None) -> Any:
        """A site's checked contribution; ValueError naming the site if it does not fit the model."""

    @abstractmethod
    def weigh(
        self,
        scheme: WeightingScheme,
        reports: Sequence[ClientReport],
        contributions: Sequence[Any],
        t: int,
        T: int,
    ) -> np.ndarray:
        """The scheme's weights for this round, from what this backend may show the scheme."""

    @abstractmethod
    def aggregate(
        self,
        scheme: WeightingScheme,
        reports: Sequence[ClientReport],
        contributions: Sequence[Any],
        weights: np.ndarray,
    ) -> Params:
        """theta_g += sum_k w_k Delta_k; returns the plaintext arrays the server now holds."""

    @abstractmethod
    def task_params(self) -> dict[str, Any]:
        """The global model as it is sent to the sites."""

    def task_meta(self) -> dict[str, Any]:
        """Extra task meta the sites need to read :meth:`task_params` (default: none)."""
        return {}

    def update_norms(self, contributions: Sequence[Any]) -> np.ndarray | None:
        """||Delta_k,l|| of every contribution k (rows) and floating-point array l (columns), or None
        when this backend cannot see them (HE)."""
        return None

    def update_gram(self, contributions: Sequence[Any]) -> np.ndarray | None:
        """G_jk = <Delta_j, Delta_k> of the contributions, or None when this backend cannot see them."""
        return None

    def scale_update(self, contribution: Any, factors: np.ndarray) -> Any:
        """The contribution with the update of its floating-point array l multiplied by
        ``factors[l]`` (only called when :meth:`update_norms` returned norms)."""
        raise NotImplementedError


class PlaintextBackend(AggregationBackend):
    """theta_g in clear at the server; the scheme sees the clients' parameters and aggregates them.

    ``global_params`` None (stock FedAvg before any global model is known): the first round starts
    from the plain mean of the round's valid client models, so that deltas are defined.
    """

    encrypted = False

    def __init__(self, global_params: Mapping[str, Any] | None):
        self.global_params: Params | None = None if global_params is None else to_numpy_dict(global_params)
        #: what results are checked against: theta_g, or the first valid result when theta_g is unknown
        self._reference: Params | None = self.global_params

    def check_params(self, site: str, params: Mapping[str, Any] | None) -> Params:
        checked = check_params(
            site, params, self._reference if self._reference is not None else (params or {})
        )
        if self._reference is None:
            self._reference = checked
        return checked

    def update_norms(self, contributions: Sequence[Params]) -> np.ndarray | None:
        if self.global_params is None:  # stock FedAvg's first round: no theta_g to measure from
            return None
        return delta_norms(self.global_params, contributions)

    def update_gram(self, contributions: Sequence[Params]) -> np.ndarray | None:
        if self.global_params is None:
            return None
        return delta_gram64(self.global_params, contributions)

    def scale_update(self, contribution: Params, factors: np.ndarray) -> Params:
        assert self.global_params is not None
        out = dict(contribution)
        keys = [k for k, g in self.global_params.items() if np.issubdtype(np.asarray(g).dtype, np.floating)]
        for key, factor in zip(keys, np.asarray(factors, dtype=np.float64).reshape(-1), strict=True):
            if factor < 1.0:
                g64 = np.asarray(self.global_params[key], dtype=np.float64)
                new = g64 + factor * (np.asarray(contribution[key], dtype=np.float64) - g64)
                out[key] = new.astype(np.asarray(contribution[key]).dtype)
        return out

    def _start(self, contributions: Sequence[Params]) -> Params:
        if self.global_params is None:
            first = contributions[0]
            self.global_params = {k: np.mean([c[k] for c in contributions], axis=0) for k in first}
        return self.global_params

    def weigh(self, scheme, reports, contributions, t, T):
        global_params = self._start(contributions)
        full = [replace(r, params=c) for r, c in zip(reports, contributions, strict=True)]
        return np.asarray(scheme.weights(full, global_params, t, T), dtype=np.float64)

    def aggregate(self, scheme, reports, contributions, weights):
        global_params = self._start(contributions)
        full = [replace(r, params=c) for r, c in zip(reports, contributions, strict=True)]
        new = {k: np.asarray(v) for k, v in scheme.aggregate(global_params, full, weights).items()}
        self.global_params = self._reference = new
        return new

    def task_params(self) -> dict[str, Any]:
        return dict(self.global_params or {})


@dataclass
class RoundOutcome:
    """What one round did: which sites counted, their weights, and whether the global model changed.

    ``params``: the plaintext arrays the server holds after the round (all of them in plaintext, the
    clear ones under HE), None when the model was left unchanged.
    """

    round_index: int
    reports: list[ClientReport] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    #: sites whose update was scaled down to the norm bound, with the norms
    bounded: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    params: Params | None = None
    reason: str = ""

    @property
    def updated(self) -> bool:
        return self.params is not None


class RoundStep:
    """The server's side of one round: validate, bound, weigh, cap, aggregate (module docstring).

    Args:
        scheme: the weighting scheme (keeps its own cross-round state).
        backend: plaintext or CKKS aggregation, holding the global model.
        num_rounds: T, for schedules.
        min_clients: fewest valid results for the global model to change.
        max_share: cap on any one site's share of the round's total weight: ``"auto"`` (default:
            :data:`DEFAULT_MAX_SHARE` once three or more sites count), a number in (0, 1], or None
            (no cap).
        limits: plausibility bounds on counts and scalars.
        update_norm_bound: scale an update down to this many times the median norm of the other
            sites' updates of the round (default :data:`DEFAULT_UPDATE_NORM_BOUND`; None: off).
            Plaintext only.
        min_update_cosine: leave out an update whose cosine with more than half of the other sites'
            updates is below this while no two of those are below it with each other (default
            :data:`DEFAULT_MIN_UPDATE_COSINE`: one that opposes a consensus,
            :func:`direction_outliers`); from three updates on, plaintext only. None: off.
        min_secure_sum: under HE, the fewest updates an encrypted sum may hold (raised by the
            minimum each contributing site announces; :func:`fedweigh.server.quorum.secure_sum_quorum`).
        log: where warnings about left-out sites go (the controller passes NVFlare's logger).
    """

    def __init__(
        self,
        scheme: WeightingScheme,
        backend: AggregationBackend,
        *,
        num_rounds: int,
        min_clients: int = 1,
        max_share: float | str | None = "auto",
        limits: ResultLimits | None = None,
        update_norm_bound: float | None = DEFAULT_UPDATE_NORM_BOUND,
        min_update_cosine: float | None = DEFAULT_MIN_UPDATE_COSINE,
        min_secure_sum: int = ABSOLUTE_MIN,
        log: Callable[[str], None] | None = None,
    ):
        if backend.encrypted:
            scheme.check_he()
        self.scheme = scheme
        self.backend = backend
        self.num_rounds = num_rounds
        self.min_clients = min_clients
        self.max_share = check_max_share(max_share)
        self.limits = limits or ResultLimits()
        self.update_norm_bound = check_update_norm_bound(update_norm_bound)
        self.min_update_cosine = check_min_update_cosine(min_update_cosine)
        self.min_secure_sum = max(ABSOLUTE_MIN, int(min_secure_sum))
        self.log = log or logger.warning
        #: per site, the digests of its accepted results and their rounds (replays are refused)
        self.seen_digests: dict[str, dict[str, int]] = {}
        self._quorum_required = self.min_secure_sum

    @property
    def scalars(self) -> tuple[str, ...]:
        """The scalars every client must report this round (more under HE)."""
        return self.scheme.scalars(encrypted=self.backend.encrypted)

    def plan(self, scheme_name: str, scheme_args: Mapping[str, Any]) -> dict:
        """What the server sends sites with each training task: the scheme, the scalars it needs from
        them, whether updates are encrypted, and the FedProx coefficient (0 unless the scheme is FedProx)."""
        return {
            "scheme": scheme_name,
            "scheme_args": dict(scheme_args),
            "scalars": list(self.scalars),
            "fedprox_mu": float(self.scheme.fedprox_mu),
            "he": bool(self.backend.encrypted),
        }

    def validate(self, result: ClientResult, round_index: int = 0) -> tuple[ClientReport, Any]:
        """(report without parameters, checked contribution) of one result; InvalidClientResult otherwise."""
        ranges = {name: self.scheme.scalar_range(name) for name in self.scalars}
        checked = check_meta(result.site, result.meta, self.scalars, self.limits, ranges)
        try:
            contribution = self.backend.check_params(result.site, result.params)
        except InvalidClientResult:
            raise
        except ValueError as e:
            raise InvalidClientResult(str(e)) from None
        digest = params_digest(result.params)
        earlier = self.seen_digests.get(result.site, {}).get(digest)
        if earlier is not None:
            raise InvalidClientResult(
                f"{result.site}: its parameters are a replay of the result it sent in round {earlier}"
            )
        self.seen_digests.setdefault(result.site, {})[digest] = round_index
        report = ClientReport(
            name=result.site,
            num_samples=checked.num_samples,
            num_steps=checked.num_steps,
            scalars=checked.scalars,
        )
        return report, contribution

    def _bound_norms(self, outcome: RoundOutcome, contributions: list[Any]) -> list[Any]:
        """Exclude updates whose norm is not finite; scale every array of the others to the bound."""
        if self.update_norm_bound is None or not contributions:
            return contributions
        norms = self.backend.update_norms(contributions)
        if norms is None:
            return contributions
        norms = np.asarray(norms, dtype=np.float64).reshape(len(contributions), -1)
        keep = [i for i in range(len(contributions)) if np.isfinite(norms[i]).all()]
        for i in range(len(contributions)):
            if i not in keep:
                site = outcome.reports[i].name
                outcome.excluded[site] = (
                    f"{site}: its update is too large to measure (norm overflows float64)"
                )
                self.log(f"round {outcome.round_index}: skipping result: {outcome.excluded[site]}")
        outcome.reports = [outcome.reports[i] for i in keep]
        contributions = [contributions[i] for i in keep]
        norms = norms[keep]
        scales = norm_scales(norms, self.update_norm_bound)
        out = []
        for report, contribution, row, factors in zip(
            outcome.reports, contributions, norms, scales, strict=True
        ):
            if (factors < 1.0).any():
                before = float(np.sqrt(np.sum(row**2)))
                after = float(np.sqrt(np.sum((row * factors) ** 2)))
                outcome.bounded[report.name] = (
                    f"update norm {before:.4g} scaled down to {after:.4g} ({int((factors < 1).sum())} of "
                    f"{factors.size} arrays above {self.update_norm_bound:g} x the median of the other sites')"
                )
                self.log(f"round {outcome.round_index}: {report.name}: {outcome.bounded[report.name]}")
                contribution = self.backend.scale_update(contribution, factors)
            out.append(contribution)
        return out

    def _check_directions(self, outcome: RoundOutcome, contributions: list[Any]) -> list[Any]:
        """Leave out the updates that point away from a consensus of the other sites' updates
        (``min_update_cosine``, :func:`direction_outliers`; from three updates on)."""
        if self.min_update_cosine is None or len(contributions) < AUTO_CAP_MIN_SITES:
            return contributions
        gram = self.backend.update_gram(contributions)
        if gram is None:
            return contributions
        gram = np.asarray(gram, dtype=np.float64)
        measurable = np.isfinite(gram).all(axis=1)
        finite = np.where(np.isfinite(gram), gram, 0.0)
        objections = objecting_sites(finite, self.min_update_cosine)
        outliers = set(direction_outliers(finite, self.min_update_cosine))
        others = len(contributions) - 1
        keep = []
        for i, (report, count) in enumerate(zip(outcome.reports, objections, strict=True)):
            if not measurable[i]:
                outcome.excluded[report.name] = (
                    f"{report.name}: its update is too large to measure (overflows float64)"
                )
                self.log(f"round {outcome.round_index}: skipping result: {outcome.excluded[report.name]}")
            elif i in outliers:
                outcome.excluded[report.name] = (
                    f"{report.name}: its update points away from {count} of the {others} other sites' updates, "
                    f"which agree with each other (cosine below min_update_cosine={self.min_update_cosine:g})"
                )
                self.log(f"round {outcome.round_index}: skipping result: {outcome.excluded[report.name]}")
            else:
                keep.append(i)
        outcome.reports = [outcome.reports[i] for i in keep]
        return [contributions[i] for i in keep]

    def _secure_quorum(
        self, outcome: RoundOutcome, contributions: list[Any], minimums: dict[str, int]
    ) -> list[Any]:
        """Under HE: the contributions a secure sum may hold; sets ``outcome.reason`` when too few."""
        quorum = secure_sum_quorum({r.name: minimums[r.name] for r in outcome.reports}, self.min_secure_sum)
        for site, why in quorum.dropped.items():
            outcome.excluded[site] = f"{site}: {why}"
            self.log(f"round {outcome.round_index}: leaving {site} out of the encrypted sum: {why}")
        keep = [i for i, r in enumerate(outcome.reports) if r.name in quorum.members]
        outcome.reports = [outcome.reports[i] for i in keep]
        self._quorum_required = quorum.required
        if not quorum.ok:
            outcome.reason = quorum.reason
        return [contributions[i] for i in keep]

    def run(
        self, round_index: int, results: Sequence[ClientResult], targets: Sequence[str] = ()
    ) -> RoundOutcome:
        """Validate, bound, weigh, cap and aggregate one round's results (``targets``: the sites asked).

        The results are taken in site order, not in the order they arrived: with three or more sites
        the float sums (the weights' normaliser, the aggregate, the mean metrics) depend on the order,
        and a run must record the same values whichever site answers first.
        """
        t = round_index
        results = sorted(results, key=lambda r: r.site)
        outcome = RoundOutcome(round_index=t)
        contributions: list[Any] = []
        valid_metrics = []
        minimums: dict[str, int] = {}
        for result in results:
            try:
                if any(r.name == result.site for r in outcome.reports):
                    raise InvalidClientResult(f"{result.site}: sent more than one result this round")
                if self.backend.encrypted:
                    meta = result.meta if isinstance(result.meta, Mapping) else {}
                    try:
                        minimums[result.site] = parse_minimum(result.site, meta.get(META_MIN_SECURE_SUM))
                    except ValueError as e:
                        raise InvalidClientResult(str(e)) from None
                report, contribution = self.validate(result, t)
            except InvalidClientResult as e:
                self.log(f"round {t}: skipping result: {e}")
                outcome.excluded[result.site] = str(e)
                continue
            outcome.reports.append(report)
            contributions.append(contribution)
            valid_metrics.append(result.metrics or {})
        answered = {r.site for r in results}
        for site in targets:
            if site not in answered:
                outcome.excluded[site] = "no result (failed, or no answer within train_timeout)"
                self.log(f"round {t}: {site} sent no valid result in time; left out of this round")
        if valid_metrics:
            outcome.metrics = mean_metrics(valid_metrics)
        contributions = self._bound_norms(outcome, contributions)
        contributions = self._check_directions(outcome, contributions)
        if self.backend.encrypted:
            contributions = self._secure_quorum(outcome, contributions, minimums)
        if not outcome.reason and len(outcome.reports) < self.min_clients:
            outcome.reason = (
                f"{len(outcome.reports)} valid result(s), fewer than min_clients={self.min_clients}"
            )
        if outcome.reason:
            self.log(f"round {t}: {outcome.reason}; the global model is left unchanged")
            return outcome
        try:
            w = self.backend.weigh(self.scheme, outcome.reports, contributions, t, self.num_rounds)
            cap = resolve_max_share(self.max_share, len(outcome.reports))
            if cap is not None:
                w = cap_weights(w, cap)
            if self.backend.encrypted:
                active = int(np.sum(np.abs(w) >= ZERO_WEIGHT))
                if active < self._quorum_required:
                    raise ValueError(
                        f"only {active} update(s) carry weight, fewer than the {self._quorum_required} an "
                        "encrypted sum needs"
                    )
            values = scheme_values(self.scheme)
            outcome.params = self.backend.aggregate(self.scheme, outcome.reports, contributions, w)
        except ValueError as e:
            outcome.reason = f"the scheme could not weight this round ({e})"
            self.log(f"round {t}: {outcome.reason}; global model unchanged")
            return outcome
        outcome.weights = {r.name: float(wk) for r, wk in zip(outcome.reports, w, strict=True)}
        outcome.values = values
        return outcome

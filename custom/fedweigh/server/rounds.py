"""One federated round at the server, in one place: validate, bound, weigh, cap, aggregate.

Every path that runs rounds calls :class:`RoundStep`: the shared round loop
(:func:`fedweigh.server.loop.run_rounds`, which the NVFlare controller
:class:`~fedweigh.flare.controller.FedweighController` and the in-process benchmark drive), the
stock-FedAvg aggregator (:class:`~fedweigh.flare.aggregator.FedweighAggregator`) and the encrypted
path (its backend is :class:`fedweigh.server.encrypted.EncryptedGlobalModel`). Per round t:

1. validate each site's :class:`ClientResult` (N_k, local steps, the scalars the scheme asked for
   within the scheme's ranges, the parameters or ciphertexts through the backend, N_k no more than
   the site announced in the statistics phase, and that it is not a replay of one of the site's
   earlier results); an invalid one is left out with its reason. Its metrics count under their own
   names only (a name of the server's record is refused with a logged reason);
2. bound the counts that drive weights: N_k to its declared size and to 100 x the median of the
   other sites', tau_k within 100 x of theirs either way and between what its size makes plausible;
3. bound each update's influence: every array of an update longer than ``update_norm_bound`` times
   the reference norm of the other sites' (their (f + 1)-th largest, ``norm_colluders``) is scaled
   down to that bound, and an update that points away from a consensus of the others, far enough to
   undo the whole of their mean step, is left out
   (plaintext only: under HE the server cannot see updates; :mod:`fedweigh.server.safeguards`);
4. w = scheme.weights(reports, theta_g^{t-1}, t, T) as a distribution (w / sum w), capped at
   ``max_share`` per site (:func:`~fedweigh.server.safeguards.cap_weights`; by default half the
   round's weight once three or more sites count);
5. theta_g^t = backend.aggregate(...) = theta_g^{t-1} + sum_k w_k Delta_k (plaintext or CKKS; a
   CKKS sum needs a quorum of contributions, :mod:`fedweigh.server.quorum`). In plaintext the
   aggregate is a candidate: its buffers are the median over the sites, and it becomes the global
   model only when it passes :func:`~fedweigh.server.model_check.model_problem` (finite arrays,
   non-negative BatchNorm variances, finite outputs on the server's probe batch); otherwise the
   site without which it passes is left out (leave-one-out) and the rest are aggregated;
6. a :class:`RoundOutcome` with the weights, the scheme's values, the excluded and bounded sites
   and the mean of the sites' metrics, which :class:`fedweigh.server.records.RoundRecorder` turns into the
   run's rows.

No single result can fail the round: every check excludes only the site that failed it, with the
reason. Fewer than ``min_clients`` valid results, safeguards that leave no strict majority of them,
an aggregate that fails its check however one site is left out, or a scheme that cannot weight the
round, leave the global model unchanged (the outcome says so and why). docs/security.md lists the checks and the
attacks they were measured against.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fedweigh.arrays import Params, to_numpy_dict
from fedweigh.errors import ConfigError, InvalidClientResult
from fedweigh.protocol import META_MIN_SECURE_SUM, ZERO_WEIGHT
from fedweigh.server.model_check import ModelProbe, buffer_keys, model_problem, robust_buffers
from fedweigh.server.quorum import parse_minimum, secure_sum_quorum
from fedweigh.server.robust import RobustAggregation, screen_updates
from fedweigh.server.safeguards import (
    AUTO_CAP_MIN_SITES,
    DIRECTION_MIN_PULL,
    ROBUST_OPTIONS,
    AcceptedDigests,
    AnnouncedCounts,
    Safeguards,
    cap_weights,
    direction_outliers,
    norm_scales,
    objecting_sites,
    plausible_counts,
    pulls_against_others,
    reference_name,
    step_ceiling,
    step_floor,
)
from fedweigh.server.validation import check_meta, check_params, check_site_metrics, finite_metrics
from fedweigh.weighting.base import ClientReport, WeightingScheme, as_distribution
from fedweigh.weighting.geometry import delta_gram64, delta_norms

__all__ = [
    "AggregationBackend",
    "ClientResult",
    "PlaintextBackend",
    "RoundOutcome",
    "RoundStep",
    "mean_metrics",
    "scheme_values",
]

logger = logging.getLogger("fedweigh.server.rounds")

#: An update whose norm the per-array bound lowered by at least this fraction is logged as scaled
#: (a warning); smaller trims are recorded and logged at info level.
SCALED_REPORT = 0.01


def mean_metrics(metrics: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per key, the mean of the finite numeric values the sites reported (anything else is ignored)."""
    clean = [finite_metrics(m) for m in metrics]
    keys = sorted({k for m in clean for k in m})
    return {k: float(np.mean([m[k] for m in clean if k in m])) for k in keys if any(k in m for m in clean)}


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

    def propose(
        self,
        scheme: WeightingScheme,
        reports: Sequence[ClientReport],
        contributions: Sequence[Any],
        weights: np.ndarray,
    ) -> Params:
        """theta_g + sum_k w_k Delta_k as plaintext arrays, without making it the global model (the
        round step checks it first, then :meth:`adopt`); only for backends that hold theta_g in clear."""
        raise NotImplementedError

    def adopt(self, params: Params) -> None:
        """Make ``params`` (from :meth:`propose`) the global model."""
        raise NotImplementedError

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


def _mean_array(arrays: Sequence[Any]) -> np.ndarray:
    """The element-wise mean of same-shaped arrays, in float64, cast back to their dtype (rounded
    for integers)."""
    dtype = np.asarray(arrays[0]).dtype
    mean = np.mean([np.asarray(a, dtype=np.float64) for a in arrays], axis=0)
    return (mean if np.issubdtype(dtype, np.floating) else np.rint(mean)).astype(dtype)


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
        """theta_g, or (none known yet) the element-wise mean of the round's valid models, each array
        in its own dtype (an integer buffer such as ``num_batches_tracked`` rounded)."""
        if self.global_params is None:
            self.global_params = {k: _mean_array([c[k] for c in contributions]) for k in contributions[0]}
        return self.global_params

    def weigh(self, scheme, reports, contributions, t, T):
        global_params = self._start(contributions)
        full = [replace(r, params=c) for r, c in zip(reports, contributions, strict=True)]
        return np.asarray(scheme.weights(full, global_params, t, T), dtype=np.float64)

    def propose(self, scheme, reports, contributions, weights):
        global_params = self._start(contributions)
        full = [replace(r, params=c) for r, c in zip(reports, contributions, strict=True)]
        return {k: np.asarray(v) for k, v in scheme.aggregate(global_params, full, weights).items()}

    def adopt(self, params: Params) -> None:
        self.global_params = self._reference = params

    def aggregate(self, scheme, reports, contributions, weights):
        new = self.propose(scheme, reports, contributions, weights)
        self.adopt(new)
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

    Every input is given here and fixed for the step's life (setting an attribute afterwards raises
    AttributeError); the scheme, the backend and the digest store keep their own state across rounds.

    Args:
        scheme: the weighting scheme (keeps its own cross-round state).
        backend: plaintext or CKKS aggregation, holding the global model.
        num_rounds: T, for schedules.
        safeguards: min_clients, the weight cap, the norm bound, the direction check, the secure-sum
            quorum and the plausibility limits (:class:`~fedweigh.server.safeguards.Safeguards`;
            default: its defaults).
        digests: the digests of the results accepted so far, to refuse replays (default: a new
            store; pass one to keep it across steps).
        announced: the sample counts the sites announced in the statistics phase (a result that
            reports more is refused); the statistics phase fills it (default: an empty store).
        probe: the job's architecture with the server's probe batch: a candidate global model must
            give finite outputs on it (:class:`~fedweigh.server.model_check.ModelProbe`); None:
            only the array checks of :func:`~fedweigh.server.model_check.model_problem`, buffers
            by name.
        log: where warnings about left-out sites go (the controller passes NVFlare's logger).
    """

    def __init__(
        self,
        scheme: WeightingScheme,
        backend: AggregationBackend,
        *,
        num_rounds: int,
        safeguards: Safeguards | None = None,
        digests: AcceptedDigests | None = None,
        announced: AnnouncedCounts | None = None,
        probe: ModelProbe | None = None,
        log: Callable[[str], None] | None = None,
    ):
        if backend.encrypted:
            scheme.check_he()
        if backend.encrypted and safeguards is not None and safeguards.robust:
            name = next(
                n for n in ROBUST_OPTIONS if n != "trim" and getattr(safeguards, n) not in (None, "mean")
            )
            raise ConfigError(
                "round safeguards",
                name,
                getattr(safeguards, name),
                "the robust options need plaintext updates: turn them off when updates are encrypted (he=True)",
            )
        self.scheme = scheme
        self.backend = backend
        self.num_rounds = num_rounds
        self.safeguards = safeguards if safeguards is not None else Safeguards()
        self.digests = digests if digests is not None else AcceptedDigests()
        self.announced = announced if announced is not None else AnnouncedCounts()
        self.probe = probe
        self.log = log or logger.warning
        self._fixed = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_fixed", False):
            raise AttributeError(f"RoundStep.{name} is fixed at construction: pass it to RoundStep(...)")
        object.__setattr__(self, name, value)

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
        checked = check_meta(result.site, result.meta, self.scalars, self.safeguards.limits, ranges)
        self.announced.check(result.site, checked.num_samples)
        try:
            contribution = self.backend.check_params(result.site, result.params)
        except InvalidClientResult:
            raise
        except ValueError as e:
            raise InvalidClientResult(str(e)) from None
        self.digests.admit(result.site, result.params, round_index)
        report = ClientReport(
            name=result.site,
            num_samples=checked.num_samples,
            num_steps=checked.num_steps,
            scalars=checked.scalars,
        )
        return report, contribution

    def _site_metrics(self, t: int, result: ClientResult) -> dict[str, float]:
        """The site's metrics that may go on the record: finite numbers under metric names that are
        not the server's (:func:`~fedweigh.server.validation.check_site_metrics`; the scheme's value
        names are reserved as well); each refused name is logged with the reason."""
        accepted, refused = check_site_metrics(result.site, result.metrics, set(scheme_values(self.scheme)))
        for why in refused.values():
            self.log(f"round {t}: {why}")
        return accepted

    def _bound_counts(self, outcome: RoundOutcome) -> None:
        """Bound the counts that drive weights (recorded under ``bounded``): N_k to its declared size
        (``declared_sizes``; an undeclared site to the smallest declared) and to at most
        ``max_count_ratio`` x the median of the other sites'; tau_k to within that factor of theirs
        either way (:func:`~fedweigh.server.safeguards.plausible_counts`) and to no fewer than its
        size makes plausible next to theirs (``min_step_ratio``,
        :func:`~fedweigh.server.safeguards.step_floor`)."""
        limits = self.safeguards.limits
        ratio, step_ratio = limits.max_count_ratio, limits.min_step_ratio
        declared = self.safeguards.declared_sizes
        several = len(outcome.reports) >= 2
        if not outcome.reports or (not several and declared is None):
            return
        notes: list[list[str]] = [[] for _ in outcome.reports]
        sizes = np.array([r.num_samples for r in outcome.reports], dtype=np.float64)
        if declared is not None:
            smallest = min(declared.values())
            for i, report in enumerate(outcome.reports):
                limit = declared.get(report.name, smallest)
                if sizes[i] > limit:
                    sizes[i] = limit
                    why = (
                        "its declared size"
                        if report.name in declared
                        else "undeclared: the smallest declared size"
                    )
                    notes[i].append(f"num_samples={report.num_samples} clipped to {limit} ({why})")
        if ratio is not None and several:
            plausible = np.floor(plausible_counts(sizes, ratio, lower=False))
            for i in np.flatnonzero(plausible < sizes):
                notes[i].append(
                    f"num_samples={outcome.reports[i].num_samples} clipped to {max(1, int(plausible[i]))} "
                    f"(at most {ratio:g} x the median of the other sites')"
                )
            sizes = np.minimum(sizes, plausible)
        raw_steps = np.array([r.num_steps for r in outcome.reports], dtype=np.float64)
        steps = raw_steps.copy()
        if ratio is not None and several:
            steps = np.ceil(plausible_counts(raw_steps, ratio, lower=True))
            for i in np.flatnonzero(steps != raw_steps):
                notes[i].append(
                    f"num_steps={outcome.reports[i].num_steps} clipped to {max(1, int(steps[i]))} (within "
                    f"{ratio:g} x the median of the other sites', either way)"
                )
        if step_ratio is not None and several:
            floor = step_floor(raw_steps, np.maximum(sizes, 1.0), step_ratio)
            for i in np.flatnonzero(floor > steps):
                notes[i].append(
                    f"num_steps={outcome.reports[i].num_steps} raised to {int(floor[i])} (fewer than its "
                    f"size makes plausible next to the other sites' step counts, min_step_ratio={step_ratio:g})"
                )
            steps = np.maximum(steps, floor)
        if declared is not None and step_ratio is not None and several:
            # with declared sizes, the most steps a site's size makes plausible: the norm bound reads them
            ceiling = step_ceiling(raw_steps, np.maximum(sizes, 1.0), step_ratio)
            for i in np.flatnonzero(ceiling < steps):
                notes[i].append(
                    f"num_steps={outcome.reports[i].num_steps} clipped to {int(ceiling[i])} (more than its "
                    f"declared size makes plausible next to the other sites' step counts, min_step_ratio={step_ratio:g})"
                )
            steps = np.minimum(steps, ceiling)
        reports = []
        for report, n, tau, changed in zip(outcome.reports, sizes, steps, notes, strict=True):
            if changed:
                self._note_bounded(outcome, report.name, "; ".join(changed))
                report = replace(report, num_samples=max(1, int(n)), num_steps=max(1, int(tau)))
            reports.append(report)
        outcome.reports = reports

    def _note_bounded(self, outcome: RoundOutcome, site: str, what: str, loud: bool = True) -> None:
        """Record under ``bounded`` what a safeguard bounded of ``site``'s result; log it as a warning
        when ``loud``, else at info level."""
        outcome.bounded[site] = f"{outcome.bounded[site]}; {what}" if site in outcome.bounded else what
        (self.log if loud else logger.info)(f"round {outcome.round_index}: {site}: {what}")

    def _bound_norms(self, outcome: RoundOutcome, contributions: list[Any]) -> list[Any]:
        """Exclude updates whose norm is not finite; scale every array of the others to the bound."""
        bound = self.safeguards.update_norm_bound
        if bound is None or not contributions:
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
        if len(contributions) < AUTO_CAP_MIN_SITES:
            # with two updates nothing tells which length is the honest one (as for the weight cap)
            return contributions
        # with declared sizes, steps are held to what each size makes plausible: the bound grows with them
        steps = (
            np.array([r.num_steps for r in outcome.reports], dtype=np.float64)
            if self.safeguards.declared_sizes is not None
            else None
        )
        scales = norm_scales(norms, bound, self.safeguards.norm_colluders, steps)
        out = []
        for report, contribution, row, factors in zip(
            outcome.reports, contributions, norms, scales, strict=True
        ):
            if (factors < 1.0).any():
                before = float(np.sqrt(np.sum(row**2)))
                after = float(np.sqrt(np.sum((row * factors) ** 2)))
                over = factors < 1.0
                arrays_before = float(np.sqrt(np.sum(row[over] ** 2)))
                arrays_after = float(np.sqrt(np.sum((row[over] * factors[over]) ** 2)))
                reference = reference_name(self.safeguards.norm_colluders, len(contributions))
                what = (
                    f"{int(over.sum())} of {factors.size} arrays above {bound:g} x {reference} of the other "
                    f"sites' scaled down to it (their norm {arrays_before:.4g} -> {arrays_after:.4g}; "
                    f"update norm {before:.6g} -> {after:.6g})"
                )
                # the log names a scaled update only when its norm fell by at least SCALED_REPORT;
                # smaller trims of a few arrays go to the record and the info log
                self._note_bounded(outcome, report.name, what, loud=after < (1.0 - SCALED_REPORT) * before)
                contribution = self.backend.scale_update(contribution, factors)
            out.append(contribution)
        return out

    def _check_directions(self, outcome: RoundOutcome, contributions: list[Any]) -> list[Any]:
        """Leave out the updates that point away from a consensus of the other sites' updates
        (``min_update_cosine``, :func:`~fedweigh.server.safeguards.direction_outliers`; from three
        updates on)."""
        threshold = self.safeguards.min_update_cosine
        if threshold is None or len(contributions) < AUTO_CAP_MIN_SITES:
            return contributions
        gram = self.backend.update_gram(contributions)
        if gram is None:
            return contributions
        gram = np.asarray(gram, dtype=np.float64)
        measurable = np.isfinite(gram).all(axis=1)
        finite = np.where(np.isfinite(gram), gram, 0.0)
        objections = objecting_sites(finite, threshold)
        outliers = set(direction_outliers(finite, threshold))
        pulls = pulls_against_others(finite)
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
                    f"which agree with each other (cosine below min_update_cosine={threshold:g}), and would "
                    f"undo {pulls[i]:.2g} x their mean update (from {DIRECTION_MIN_PULL:g} on)"
                )
                self.log(f"round {outcome.round_index}: skipping result: {outcome.excluded[report.name]}")
            else:
                keep.append(i)
        outcome.reports = [outcome.reports[i] for i in keep]
        return [contributions[i] for i in keep]

    def _screen(self, outcome: RoundOutcome, contributions: list[Any]) -> list[Any]:
        """The robust options that act before weighting (clipping, the per-array direction check,
        multi-Krum; :func:`fedweigh.server.robust.screen_updates`); plaintext only."""
        g = getattr(self.backend, "global_params", None)
        if not self.safeguards.robust or self.backend.encrypted or g is None or not contributions:
            return contributions
        screened = screen_updates(self.safeguards, g, [r.name for r in outcome.reports], contributions)
        for site, note in screened.bounded.items():
            outcome.bounded[site] = "; ".join(filter(None, (outcome.bounded.get(site), note)))
            self.log(f"round {outcome.round_index}: {site}: {note}")
        for site, why in screened.excluded.items():
            outcome.excluded[site] = why
            self.log(f"round {outcome.round_index}: skipping result: {why}")
        outcome.reports = [outcome.reports[i] for i in screened.keep]
        return screened.contributions

    def _secure_quorum(
        self, outcome: RoundOutcome, contributions: list[Any], minimums: dict[str, int]
    ) -> tuple[list[Any], int]:
        """Under HE: the contributions a secure sum may hold and the fewest it needs; sets
        ``outcome.reason`` when too few."""
        quorum = secure_sum_quorum(
            {r.name: minimums[r.name] for r in outcome.reports}, self.safeguards.min_secure_sum
        )
        for site, why in quorum.dropped.items():
            outcome.excluded[site] = f"{site}: {why}"
            self.log(f"round {outcome.round_index}: leaving {site} out of the encrypted sum: {why}")
        keep = [i for i, r in enumerate(outcome.reports) if r.name in quorum.members]
        outcome.reports = [outcome.reports[i] for i in keep]
        if not quorum.ok:
            outcome.reason = quorum.reason
        return [contributions[i] for i in keep], quorum.required

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
            valid_metrics.append(self._site_metrics(t, result))
        answered = {r.site for r in results}
        for site in targets:
            if site not in answered:
                outcome.excluded[site] = "no result (failed, or no answer within train_timeout)"
                self.log(f"round {t}: {site} sent no valid result in time; left out of this round")
        if valid_metrics:
            outcome.metrics = mean_metrics(valid_metrics)
        self._bound_counts(outcome)
        contributions = self._bound_norms(outcome, contributions)
        # min_clients counts the valid results, before the safeguards that judge a result against
        # the others leave any out (of those, a strict majority must remain: _quorum_left)
        min_clients = self.safeguards.min_clients
        if not outcome.reason and len(outcome.reports) < min_clients:
            outcome.reason = f"{len(outcome.reports)} valid result(s), fewer than min_clients={min_clients}"
        valid = len(outcome.reports)
        required = self.safeguards.min_secure_sum
        if not outcome.reason:
            contributions = self._check_directions(outcome, contributions)
            contributions = self._screen(outcome, contributions)
            if self.backend.encrypted:
                contributions, required = self._secure_quorum(outcome, contributions, minimums)
        if not outcome.reason:
            outcome.reason = self._quorum_left(outcome, valid)
        if outcome.reason:
            self.log(f"round {t}: {outcome.reason}; the global model is left unchanged")
            return outcome
        try:
            w = self.backend.weigh(self.scheme, outcome.reports, contributions, t, self.num_rounds)
            w = self._applied_weights(outcome.reports, w)
            if self.backend.encrypted:
                active = int(np.sum(np.abs(w) >= ZERO_WEIGHT))
                if active < required:
                    raise ValueError(
                        f"only {active} update(s) carry weight, fewer than the {required} an encrypted sum needs"
                    )
            values = scheme_values(self.scheme)
            if self.backend.encrypted:
                outcome.params = self.backend.aggregate(self._aggregator(), outcome.reports, contributions, w)
            else:
                w = self._checked_aggregate(outcome, contributions, w, valid)
        except ValueError as e:
            outcome.reason = f"the scheme could not weight this round ({e})"
            self.log(f"round {t}: {outcome.reason}; global model unchanged")
            return outcome
        if not outcome.updated:
            self.log(f"round {t}: {outcome.reason}; the global model is left unchanged")
            return outcome
        outcome.weights = {r.name: float(wk) for r, wk in zip(outcome.reports, w, strict=True)}
        outcome.values = values
        return outcome

    def _quorum_left(self, outcome: RoundOutcome, valid: int) -> str:
        """Why the sites the safeguards kept cannot make the round ("" when they can): a strict
        majority of the ``valid`` results must remain. When the safeguards left some out and a
        majority remains, the round goes ahead with the rest and says so."""
        kept = len(outcome.reports)
        if kept == valid:
            return ""
        if 2 * kept <= valid:
            return (
                f"the safeguards left out {valid - kept} of {valid} valid result(s); {kept} remain, "
                "not a majority of them"
            )
        self.log(
            f"round {outcome.round_index}: aggregating the {kept} remaining of {valid} valid results "
            f"({valid - kept} left out by the safeguards)"
        )
        return ""

    def _applied_weights(self, reports: Sequence[ClientReport], w: np.ndarray) -> np.ndarray:
        """The weights the round applies: the scheme's as a distribution, capped at ``max_share``."""
        w = as_distribution(w, [r.name for r in reports], scheme=self.scheme.name)
        cap = self.safeguards.cap(len(reports))
        return cap_weights(w, cap) if cap is not None else w

    def _aggregator(self) -> Any:
        """The scheme itself (the weighted mean), or the robust aggregation the safeguards name, with
        the scheme's weights (:mod:`fedweigh.server.robust`)."""
        if self.safeguards.aggregator == "mean":
            return self.scheme
        return RobustAggregation(self.scheme, self.safeguards.aggregator, self.safeguards.trim)

    def _candidate(
        self, reports: Sequence[ClientReport], contributions: Sequence[Any], w: np.ndarray
    ) -> tuple[Params | None, str | None]:
        """(aggregate with robust buffers, why it cannot become the global model or None)."""
        try:
            candidate = self.backend.propose(self._aggregator(), reports, contributions, w)
        except ValueError as e:
            return None, str(e)
        candidate = robust_buffers(candidate, contributions, buffer_keys(candidate, self.probe))
        return candidate, model_problem(candidate, self.probe)

    def _checked_aggregate(
        self, outcome: RoundOutcome, contributions: list[Any], w: np.ndarray, valid: int
    ) -> np.ndarray:
        """Aggregate, check the candidate (:mod:`fedweigh.server.model_check`) and adopt it; when it
        fails, leave out the one contribution without which it passes (leave-one-out) and adopt the
        rest's aggregate if a majority of the valid results remains. Returns the weights applied
        (``outcome.params`` stays None when nothing was adopted, with ``outcome.reason``)."""
        t = outcome.round_index
        candidate, problem = self._candidate(outcome.reports, contributions, w)
        if problem is None:
            self.backend.adopt(candidate)
            outcome.params = candidate
            return w
        self.log(f"round {t}: the aggregate fails the server's check ({problem}); looking for its cause")
        culprit = self._culprit(outcome.reports, contributions, w)
        if culprit is None:
            outcome.reason = (
                f"the aggregate fails the server's check ({problem}) and leaving out any one site does "
                "not mend it"
            )
            return w
        site = outcome.reports[culprit].name
        outcome.excluded[site] = (
            f"{site}: with its update the aggregate fails the server's check ({problem}); without it, "
            "it passes"
        )
        self.log(f"round {t}: skipping result: {outcome.excluded[site]}")
        keep = [i for i in range(len(outcome.reports)) if i != culprit]
        outcome.reports = [outcome.reports[i] for i in keep]
        contributions = [contributions[i] for i in keep]
        outcome.reason = self._quorum_left(outcome, valid)
        if outcome.reason:
            return w
        w = self._applied_weights(outcome.reports, w[keep])
        candidate, problem = self._candidate(outcome.reports, contributions, w)
        if problem is not None:
            outcome.reason = f"the aggregate of the other sites fails the server's check too ({problem})"
            return w
        self.backend.adopt(candidate)
        outcome.params = candidate
        return w

    def _culprit(
        self, reports: Sequence[ClientReport], contributions: Sequence[Any], w: np.ndarray
    ) -> int | None:
        """The contribution without which the aggregate passes its check (leave-one-out; the round's
        other weights renormalised and capped). Several: the one whose own model fails the check,
        else the largest update; none: None."""
        if len(reports) < 2:
            return None
        fixes = []
        for i in range(len(reports)):
            keep = [j for j in range(len(reports)) if j != i]
            rest = [reports[j] for j in keep]
            _, problem = self._candidate(
                rest, [contributions[j] for j in keep], self._applied_weights(rest, w[keep])
            )
            if problem is None:
                fixes.append(i)
        if len(fixes) <= 1:
            return fixes[0] if fixes else None
        broken = [i for i in fixes if model_problem(contributions[i], self.probe) is not None]
        if len(broken) == 1:
            return broken[0]
        norms = self.backend.update_norms([contributions[i] for i in fixes])
        if norms is None:
            return fixes[0]
        sizes = np.sqrt(np.sum(np.asarray(norms, dtype=np.float64) ** 2, axis=1))
        return fixes[int(np.argmax(sizes))]

"""One federated round at the server, in one place: validate, weigh, cap, aggregate, record.

Every path that runs rounds calls :class:`RoundStep`: the NVFlare controller
(:class:`~fedweigh.flare.controller.FedweighController`), the stock-FedAvg aggregator
(:class:`~fedweigh.flare.aggregator.FedweighAggregator`), the encrypted path (its backend is
:class:`fedweigh.secure.updates.EncryptedGlobalModel`) and the in-process benchmark. Per round t:

1. validate each site's :class:`ClientResult` (N_k, local steps, the scalars the scheme asked for,
   the parameters or ciphertexts through the backend); an invalid one is left out with its reason;
2. w = scheme.weights(reports, theta_g^{t-1}, t, T), capped at ``max_share`` of the total per site
   (:func:`cap_weights`);
3. theta_g^t = backend.aggregate(...) = theta_g^{t-1} + sum_k w_k Delta_k (plaintext or CKKS);
4. a :class:`RoundOutcome` with the weights, the scheme's values, the excluded sites and the mean of
   the sites' metrics, which :class:`fedweigh.records.RoundRecorder` turns into the run's rows.

Fewer than ``min_clients`` valid results, or a scheme that cannot weight the round, leave the
global model unchanged (the outcome says so and why).
"""

from __future__ import annotations

import logging
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fedweigh.arrays import Params, to_numpy_dict
from fedweigh.validation import InvalidClientResult, ResultLimits, check_meta, check_params, finite_metrics
from fedweigh.weighting.base import ClientReport, WeightingScheme

logger = logging.getLogger("fedweigh.rounds")


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
    (:class:`fedweigh.secure.updates.EncryptedGlobalModel`) holds it as ciphertext.
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
    metrics: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    params: Params | None = None
    reason: str = ""

    @property
    def updated(self) -> bool:
        return self.params is not None


class RoundStep:
    """The server's side of one round: validate, weigh, cap, aggregate (module docstring).

    Args:
        scheme: the weighting scheme (keeps its own cross-round state).
        backend: plaintext or CKKS aggregation, holding the global model.
        num_rounds: T, for schedules.
        min_clients: fewest valid results for the global model to change.
        max_share: cap on any one site's share of the round's total weight (None: no cap).
        limits: plausibility bounds on counts and scalars.
        log: where warnings about left-out sites go (the controller passes NVFlare's logger).
    """

    def __init__(
        self,
        scheme: WeightingScheme,
        backend: AggregationBackend,
        *,
        num_rounds: int,
        min_clients: int = 1,
        max_share: float | None = None,
        limits: ResultLimits | None = None,
        log: Callable[[str], None] | None = None,
    ):
        if backend.encrypted:
            scheme.check_he()
        self.scheme = scheme
        self.backend = backend
        self.num_rounds = num_rounds
        self.min_clients = min_clients
        self.max_share = max_share
        self.limits = limits or ResultLimits()
        self.log = log or logger.warning

    @property
    def scalars(self) -> tuple[str, ...]:
        """The scalars every client must report this round (more under HE)."""
        return self.scheme.scalars(encrypted=self.backend.encrypted)

    def plan(self, scheme_name: str, scheme_args: Mapping[str, Any]) -> dict:
        """What the server sends sites with each training task: the scheme, the scalars it needs from
        them, and the FedProx coefficient (0 unless the scheme is FedProx)."""
        return {
            "scheme": scheme_name,
            "scheme_args": dict(scheme_args),
            "scalars": list(self.scalars),
            "fedprox_mu": float(self.scheme.fedprox_mu),
        }

    def validate(self, result: ClientResult) -> tuple[ClientReport, Any]:
        """(report without parameters, checked contribution) of one result; InvalidClientResult otherwise."""
        checked = check_meta(result.site, result.meta, self.scalars, self.limits)
        try:
            contribution = self.backend.check_params(result.site, result.params)
        except InvalidClientResult:
            raise
        except ValueError as e:
            raise InvalidClientResult(str(e)) from None
        report = ClientReport(
            name=result.site,
            num_samples=checked.num_samples,
            num_steps=checked.num_steps,
            scalars=checked.scalars,
        )
        return report, contribution

    def run(
        self, round_index: int, results: Sequence[ClientResult], targets: Sequence[str] = ()
    ) -> RoundOutcome:
        """Validate, weigh, cap and aggregate one round's results (``targets``: the sites asked).

        The results are taken in site order, not in the order they arrived: with three or more sites
        the float sums (the weights' normaliser, the aggregate, the mean metrics) depend on the order,
        and a run must record the same values whichever site answers first.
        """
        t = round_index
        results = sorted(results, key=lambda r: r.site)
        outcome = RoundOutcome(round_index=t)
        contributions: list[Any] = []
        valid_metrics = []
        for result in results:
            try:
                report, contribution = self.validate(result)
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
        if len(outcome.reports) < self.min_clients:
            outcome.reason = (
                f"{len(outcome.reports)} valid result(s), fewer than min_clients={self.min_clients}"
            )
            self.log(f"round {t}: {outcome.reason}; the global model is left unchanged")
            return outcome
        try:
            w = self.backend.weigh(self.scheme, outcome.reports, contributions, t, self.num_rounds)
            if self.max_share is not None:
                w = cap_weights(w, self.max_share)
            values = scheme_values(self.scheme)
            outcome.params = self.backend.aggregate(self.scheme, outcome.reports, contributions, w)
        except ValueError as e:
            outcome.reason = f"the scheme could not weight this round ({e})"
            self.log(f"round {t}: {outcome.reason}; global model unchanged")
            return outcome
        outcome.weights = {r.name: float(wk) for r, wk in zip(outcome.reports, w, strict=True)}
        outcome.values = values
        return outcome


__all__ = [
    "AggregationBackend",
    "ClientResult",
    "PlaintextBackend",
    "RoundOutcome",
    "RoundStep",
    "cap_weights",
    "mean_metrics",
    "sample_sites",
    "scheme_values",
]

"""FedweighAggregator: a fedweigh scheme as an NVFlare ``ModelAggregator`` for stock workflows.

Plugs a weighting scheme into stock NVFlare workflows that accept a ``ModelAggregator``::

    from nvflare.app_opt.pt.recipes import FedAvgRecipe
    recipe = FedAvgRecipe(..., aggregator=FedweighAggregator(scheme="feddraw"))

Each round goes through the same :class:`fedweigh.server.rounds.RoundStep` as the fedweigh controller
(validate, weigh, cap at ``max_share``, aggregate). Stock ``FedAvg`` sends no plan and runs no
label-statistics phase, so this aggregator can feed only the schemes that weight from parameters,
sample counts and steps: FedAvg, FedProx (weights only; the clients' proximal term is theirs),
FedNova, FedAdp, IDA, FedAWA and FedDRAW. Schemes that need client-reported scalars or the global
label histogram (CBR, DAFL unless ``mode="size"``, FedDisco) are refused at construction
with the reason: use :class:`~fedweigh.flare.controller.FedweighController` (the fedweigh recipes) for
them. An invalid result is skipped with a logged reason; if fewer than ``min_clients`` valid results
remain, the previous global model is returned unchanged.

Each round's record (the sites' mean metrics of the model they received as ``global/<metric>`` at
step t - 1, each site's weight as ``weight/<site>`` and the scheme's values as ``scheme/<name>`` at
step t; fedweigh's round t is NVFlare's round t - 1) is fired as NVFlare's analytics event, as the
fedweigh controller does, for the receivers ``add_experiment_tracking(recipe, "tensorboard")`` adds.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.aggregators.model_aggregator import ModelAggregator
from nvflare.app_common.app_constant import AppConstants

from fedweigh.arrays import Params, to_numpy_dict
from fedweigh.flare.tracking import ServerAnalytics
from fedweigh.protocol import META_NUM_SAMPLES
from fedweigh.server.model_check import ModelProbe
from fedweigh.server.records import RoundRecorder
from fedweigh.server.rounds import ClientResult, PlaintextBackend, RoundStep
from fedweigh.server.safeguards import (
    DEFAULT_MIN_UPDATE_COSINE,
    DEFAULT_UPDATE_NORM_BOUND,
    AcceptedDigests,
    Safeguards,
)
from fedweigh.weighting import get_scheme
from fedweigh.weighting.base import WeightingScheme

__all__ = ["FedweighAggregator", "check_stock_compatible"]


def check_stock_compatible(scheme: WeightingScheme) -> None:
    """Raise ValueError naming the scheme if stock FedAvg cannot feed it (it needs a plan or statistics)."""
    needs = []
    if scheme.required_scalars:
        needs.append(f"client-reported scalars {list(scheme.required_scalars)}")
    if scheme.needs_global_histogram:
        needs.append("the global label histogram")
    if needs:
        raise ValueError(
            f"scheme {scheme.name!r} cannot run in stock NVFlare FedAvg through FedweighAggregator: it needs "
            f"{' and '.join(needs)}, which only the fedweigh controller asks the sites for. Use the fedweigh "
            "recipes (FedweighController) for it."
        )


class FedweighAggregator(ModelAggregator):
    """Aggregates one round's client models with a fedweigh weighting scheme.

    Args:
        scheme: registry name of the scheme (one that stock FedAvg can feed, see the module docstring).
        scheme_args: options of the scheme.
        num_rounds: total rounds (schedules such as FedDRAW's need it); None (default): the
            workflow's ``num_rounds`` (stock ``FedAvg``'s, read when the first round is aggregated).
            A value that differs from the workflow's, or a round beyond it, is logged as a warning.
        min_clients: minimum valid results to update the model.
        max_share: cap on any one site's share of a round's weight ("auto", a number in (0, 1], or
            None: no cap), as in the controller.
        update_norm_bound: bound on each update's norm relative to the others' (None: off), as in the
            controller.
        min_update_cosine: leave out an update opposing a consensus of the others (None: off), as in
            the controller.
    """

    def __init__(
        self,
        scheme: str = "fedavg",
        scheme_args: dict | None = None,
        num_rounds: int | None = None,
        min_clients: int = 1,
        max_share: float | str | None = "auto",
        update_norm_bound: float | None = DEFAULT_UPDATE_NORM_BOUND,
        min_update_cosine: float | None = DEFAULT_MIN_UPDATE_COSINE,
    ):
        super().__init__()
        # every option is checked once, by its rule in fedweigh.checks (ConfigError naming it)
        self._safeguards = Safeguards(
            min_clients, max_share, update_norm_bound, min_update_cosine, source="FedweighAggregator"
        )
        # NVFlare exports a component from the constructor arguments it keeps as self.<argument>
        self.scheme, self.scheme_args, self.num_rounds = scheme, dict(scheme_args or {}), num_rounds
        self.min_clients = min_clients
        self.max_share = self._safeguards.max_share
        self.update_norm_bound = self._safeguards.update_norm_bound
        self.min_update_cosine = self._safeguards.min_update_cosine
        #: digests of every site's accepted results (a replayed result is refused in any later round)
        self._digests = AcceptedDigests()
        self._scheme = get_scheme(scheme, **self.scheme_args)
        check_stock_compatible(self._scheme)
        self._results: list[FLModel] = []
        self._probe: ModelProbe | None | bool = False  # False: not looked up yet
        #: weights of the last aggregation, by site (for inspection and logging)
        self.last_weights: dict[str, float] = {}
        #: the round count the schedules use (``num_rounds``, else the workflow's once known)
        self._rounds: int | None = num_rounds
        self._warned_beyond = False
        #: the rounds' records (no files), their scalars fired as NVFlare analytics events
        self.recorder = RoundRecorder(None, scheme, sinks=[ServerAnalytics(self)], tensorboard=False)

    def accept_model(self, model: FLModel) -> None:
        self._results.append(model)

    def reset_stats(self) -> None:
        self._results = []

    def _global_params(self) -> Params | None:
        learnable = self.fl_ctx.get_prop(AppConstants.GLOBAL_MODEL) if self.fl_ctx else None
        if learnable is None:
            return None
        weights = learnable.get("weights") if isinstance(learnable, dict) else None
        return to_numpy_dict(weights) if weights else None

    @staticmethod
    def _client_result(model: FLModel) -> ClientResult:
        """Stock clients report NUM_STEPS_CURRENT_ROUND, often not N_k: it stands in for N_k then."""
        meta = dict(model.meta or {})
        meta.setdefault(META_NUM_SAMPLES, meta.get(FLMetaKey.NUM_STEPS_CURRENT_ROUND, 1))
        return ClientResult(
            site=str(meta.get("client_name", "?")), params=model.params, meta=meta, metrics=model.metrics
        )

    def _model_probe(self) -> ModelProbe | None:
        """The probe of candidate global models, from the job's ``persistor`` model when it has one
        (:class:`~fedweigh.server.model_check.ModelProbe`); None: the array checks only."""
        if self._probe is False:
            self._probe = None
            try:
                persistor = self.fl_ctx.get_engine().get_component("persistor") if self.fl_ctx else None
                model = getattr(persistor, "model", None)
                if model is not None:
                    self._probe = ModelProbe(model)
            except Exception as e:  # no engine, no persistor, or a model of unknown input shape
                self.info(f"candidate global models get the array checks only, no probe batch: {e}")
        return self._probe or None

    def _workflow(self) -> Any:
        """The workflow calling this aggregator: stock ``FedAvg`` holds it as its ``aggregator``
        argument and never hands it an FLContext, so it is the caller whose ``aggregator`` is this."""
        frame = inspect.currentframe()
        try:
            while frame is not None:
                owner = frame.f_locals.get("self")
                if owner is not self and getattr(owner, "aggregator", None) is self:
                    return owner
                frame = frame.f_back
            return None
        finally:
            del frame

    def _round_and_total(self) -> tuple[int, int]:
        """(this round, 1-based; the round count the schedules use), from the workflow's FLContext
        (``CURRENT_ROUND``, 0-based, and ``NUM_ROUNDS``) or attributes; warns once when the
        aggregator's ``num_rounds`` differs from the workflow's or the round passes it."""
        workflow = self._workflow()
        if self.fl_ctx is None and workflow is not None:
            self.fl_ctx = getattr(workflow, "fl_ctx", None)
        ctx = self.fl_ctx
        current = ctx.get_prop(AppConstants.CURRENT_ROUND) if ctx is not None else None
        if current is None:
            current = getattr(workflow, "current_round", None)
        workflow_rounds = ctx.get_prop(AppConstants.NUM_ROUNDS) if ctx is not None else None
        if workflow_rounds is None:
            workflow_rounds = getattr(workflow, "num_rounds", None)
        if self._rounds is None:
            self._rounds = int(workflow_rounds) if workflow_rounds else 1
            if not workflow_rounds:
                self.warning(
                    "FedweighAggregator: the workflow's num_rounds is unknown and none was given; the "
                    "schedules assume 1 round (pass num_rounds=)"
                )
        elif workflow_rounds and int(workflow_rounds) != self._rounds and not self._warned_beyond:
            self.warning(
                f"FedweighAggregator: num_rounds={self._rounds} but the workflow runs {int(workflow_rounds)} "
                "rounds; the schedules use num_rounds"
            )
            self._warned_beyond = True
        round_index = int(current or 0) + 1
        if round_index > self._rounds and not self._warned_beyond:
            self.warning(
                f"FedweighAggregator: round {round_index} exceeds num_rounds={self._rounds}; the schedules "
                f"stay at round {self._rounds}"
            )
            self._warned_beyond = True
        return min(self._rounds, round_index), self._rounds

    def aggregate_model(self) -> FLModel:
        results, self._results = self._results, []
        round_index, total = self._round_and_total()
        global_params = self._global_params()
        step = RoundStep(
            self._scheme,
            PlaintextBackend(global_params),
            num_rounds=total,
            safeguards=self._safeguards,
            digests=self._digests,
            probe=self._model_probe(),
            log=self.warning,
        )
        outcome = step.run(round_index, [self._client_result(r) for r in results])
        self.recorder.add_outcome(outcome)
        if not outcome.updated:
            return FLModel(params_type=ParamsType.FULL, params=global_params or {})
        self.last_weights = dict(outcome.weights)
        self.info(
            f"{self.scheme} weights: " + ", ".join(f"{k}={v:.3f}" for k, v in self.last_weights.items())
        )
        return FLModel(
            params_type=ParamsType.FULL, params={k: np.asarray(v) for k, v in (outcome.params or {}).items()}
        )

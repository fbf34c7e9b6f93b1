"""FedweighAggregator: a fedweigh scheme as an NVFlare ``ModelAggregator``.

Plugs any weighting scheme into stock NVFlare workflows that accept a ``ModelAggregator``::

    from nvflare.app_opt.pt.recipes import FedAvgRecipe
    recipe = FedAvgRecipe(..., aggregator=FedweighAggregator(scheme="cbr"))

Stock ``FedAvg`` does not send a plan, so schemes that need client-reported scalars (CBR, DAFL,
FedDisco, FedDRAW under HE) need :class:`~fedweigh.flare.controller.FedweighController`; schemes that
work from parameters and sample counts (FedAvg, FedNova, FedAdp, IDA, FedAWA, FedDRAW in plaintext)
work here. An invalid result is skipped with a logged reason; if fewer than ``min_clients`` valid
results remain, the previous global model is returned unchanged.
"""

from __future__ import annotations

import numpy as np
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.aggregators.model_aggregator import ModelAggregator
from nvflare.app_common.app_constant import AppConstants

from fedweigh.flare.validation import InvalidClientResult, ResultLimits, check_train_result


class FedweighAggregator(ModelAggregator):
    """Aggregates one round's client models with a fedweigh weighting scheme.

    Args:
        scheme: registry name of the scheme.
        scheme_args: options of the scheme.
        num_rounds: total rounds (schedules such as FedDRAW's need it).
        min_clients: minimum valid results to update the model.
    """

    def __init__(
        self,
        scheme: str = "fedavg",
        scheme_args: dict | None = None,
        num_rounds: int = 1,
        min_clients: int = 1,
    ):
        super().__init__()
        from fedweigh.weighting import get_scheme

        self.scheme = scheme
        self.scheme_args = dict(scheme_args or {})
        self.num_rounds = num_rounds
        self.min_clients = min_clients
        self._scheme = get_scheme(scheme, **self.scheme_args)
        self._results: list[FLModel] = []
        self._limits = ResultLimits()
        #: weights of the last aggregation, by site (for inspection and logging)
        self.last_weights: dict[str, float] = {}

    def accept_model(self, model: FLModel) -> None:
        self._results.append(model)

    def reset_stats(self) -> None:
        self._results = []

    def _global_params(self) -> dict[str, np.ndarray] | None:
        learnable = self.fl_ctx.get_prop(AppConstants.GLOBAL_MODEL) if self.fl_ctx else None
        if learnable is None:
            return None
        weights = learnable.get("weights") if isinstance(learnable, dict) else None
        if not weights:
            return None
        return {
            k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v) for k, v in weights.items()
        }

    def aggregate_model(self) -> FLModel:
        from fedweigh.weighting.base import ClientReport

        results, self._results = self._results, []
        current = int(self.fl_ctx.get_prop(AppConstants.CURRENT_ROUND, 0) or 0) if self.fl_ctx else 0
        round_index = min(self.num_rounds, current + 1)
        global_params = self._global_params()
        reference = global_params
        if reference is None and results:
            first = results[0].params or {}
            reference = {k: np.asarray(v) for k, v in first.items()}
        reports = []
        for r in results:
            meta = dict(r.meta or {})
            site = meta.get("client_name", "?")
            meta.setdefault("num_samples", meta.get(FLMetaKey.NUM_STEPS_CURRENT_ROUND, 1))
            try:
                params, n, steps, scalars = check_train_result(
                    site, r.params, meta, reference or {}, self._scheme.required_scalars, self._limits
                )
            except InvalidClientResult as e:
                self.warning(f"skipping result: {e}")
                continue
            reports.append(
                ClientReport(name=site, num_samples=n, num_steps=steps, scalars=scalars, params=params)
            )
        if len(reports) < self.min_clients or global_params is None and not reports:
            self.warning(
                f"{len(reports)} valid result(s) (< min_clients={self.min_clients}); model unchanged"
            )
            return FLModel(params_type=ParamsType.FULL, params=global_params or {})
        if global_params is None:
            # no global model in context: start from the plain mean so deltas are defined
            global_params = {k: np.mean([rep.params[k] for rep in reports], axis=0) for k in reference}
        weights = self._scheme.weights(reports, global_params, round_index, self.num_rounds)
        self.last_weights = {rep.name: float(w) for rep, w in zip(reports, weights, strict=True)}
        self.info(
            f"{self.scheme} weights: " + ", ".join(f"{k}={v:.3f}" for k, v in self.last_weights.items())
        )
        new_params = self._scheme.aggregate(global_params, reports, np.asarray(weights, dtype=float))
        return FLModel(params_type=ParamsType.FULL, params=new_params)

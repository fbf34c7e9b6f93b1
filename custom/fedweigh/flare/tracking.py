"""The server's round records as NVFlare analytics events, for the receivers of ``add_experiment_tracking``.

Each scalar of a round's record (:mod:`fedweigh.server.records`: ``global/<metric>``,
``weight/<site>``, ``scheme/<value>``, step = the round) leaves the server as NVFlare's own analytics
event: a local ``analytix_log_stats`` event carrying an analytics DXO (``AnalyticsDataType.SCALAR``,
TensorBoard syntax, ``global_step`` = round), exactly what ``nvflare.app_opt.tracking.tb.TBWriter``
sends. The receiver on the server records it under the server's name:

- ``TBAnalyticsReceiver`` (``add_experiment_tracking(recipe, "tensorboard")``, or the one a fedweigh
  recipe adds by default) writes ``<run>/tb_events/<server name>/``;
- NVFlare's stock ``MLflowReceiver`` opens runs for the clients only and listens to the clients' fed
  events only, and the stock ``WandBReceiver`` starts runs for the clients only; a fedweigh recipe
  therefore builds them as :class:`~fedweigh.flare.mlflow_tracking.ServerMLflowReceiver` (which also
  listens to the server's own events) and :class:`~fedweigh.flare.wandb_tracking.ServerWandBReceiver`
  with the same arguments, each with one more run, named after the server.

:func:`use_tracking_receivers` does both for a recipe's job before export or run: one TensorBoard
receiver on the server (the user's, when ``add_experiment_tracking`` added one, else fedweigh's
default) and MLflow and W&B receivers that take the server's records; :func:`track_server_records`
does the latter for a stock recipe.
"""

from __future__ import annotations

from typing import Any

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsDataType, LogWriterName
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.job_def import SERVER_SITE_NAME
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo
from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
from nvflare.job_config.api import FedJob

__all__ = [
    "ServerAnalytics",
    "server_mlflow_receiver",
    "server_wandb_receiver",
    "track_server_records",
    "use_tracking_receivers",
]

_STOCK_MLFLOW = ("nvflare.app_opt.tracking.mlflow.mlflow_receiver", "MLflowReceiver")
_STOCK_WANDB = ("nvflare.app_opt.tracking.wandb.wandb_receiver", "WandBReceiver")


class ServerAnalytics:
    """A :data:`~fedweigh.server.records.ScalarSink` that fires each scalar as NVFlare's analytics
    event from ``component`` (a server component: the controller, the aggregator).

    Args:
        component: the FLComponent that fires the event (its engine gives the event's context).
    """

    def __init__(self, component: FLComponent):
        self.component = component

    def __repr__(self) -> str:
        return f"NVFlare analytics events of {type(self.component).__name__}"

    def __call__(self, tag: str, value: float, step: int) -> None:
        dxo = create_analytic_dxo(
            tag=tag,
            value=float(value),
            data_type=AnalyticsDataType.SCALAR,
            writer=LogWriterName.TORCH_TB,
            global_step=int(step),
        )
        engine = _engine(self.component)
        with engine.new_context() as fl_ctx:
            send_analytic_dxo(self.component, dxo=dxo, fl_ctx=fl_ctx, event_type=ANALYTIC_EVENT_TYPE)


def _engine(component: FLComponent) -> Any:
    """The engine of a running server component (the controller's ``engine``, else its FLContext's)."""
    engine = getattr(component, "engine", None)
    if engine is None:
        fl_ctx = getattr(component, "fl_ctx", None)
        engine = fl_ctx.get_engine() if fl_ctx is not None else None
    if engine is None:
        raise RuntimeError(f"{type(component).__name__} has no engine yet: it runs outside an NVFlare job")
    return engine


def server_mlflow_receiver(receiver: Any) -> Any:
    """NVFlare's stock ``MLflowReceiver`` rebuilt as :class:`ServerMLflowReceiver` with the same
    arguments (and also the server's local analytics event)."""
    from fedweigh.flare.mlflow_tracking import ServerMLflowReceiver

    events = list(receiver.events)
    if ANALYTIC_EVENT_TYPE not in events:
        events.append(ANALYTIC_EVENT_TYPE)
    return ServerMLflowReceiver(
        tracking_uri=receiver.tracking_uri,
        kw_args=receiver.kw_args,
        artifact_location=receiver.artifact_location,
        events=events,
        buffer_flush_time=receiver.buff_flush_time,
    )


def server_wandb_receiver(receiver: Any) -> Any:
    """NVFlare's stock ``WandBReceiver`` rebuilt as :class:`ServerWandBReceiver` with the same arguments
    (it already listens to the server's local analytics event)."""
    from fedweigh.flare.wandb_tracking import ServerWandBReceiver

    return ServerWandBReceiver(
        wandb_args=receiver.wandb_args,
        mode=receiver.mode,
        events=receiver.events,
        process_timeout=receiver.process_timeout,
    )


def use_tracking_receivers(job: FedJob, default_tb: TBAnalyticsReceiver | None) -> None:
    """Before export or run: exactly one TensorBoard receiver on the server (a receiver that
    ``add_experiment_tracking`` added replaces ``default_tb``, the recipe's default, in its place and
    id), and every stock MLflow or W&B receiver there rebuilt by :func:`server_mlflow_receiver` or
    :func:`server_wandb_receiver`, so that it keeps a run for the server's records."""
    app = job._deploy_map.get(SERVER_SITE_NAME)
    if app is None:
        return
    components: dict[str, Any] = app.app_config.components
    if default_tb is not None:
        default_id = next((cid for cid, obj in components.items() if obj is default_tb), None)
        added = [
            cid
            for cid, obj in components.items()
            if isinstance(obj, TBAnalyticsReceiver) and obj is not default_tb
        ]
        if default_id is not None and added:
            components[default_id] = components.pop(added[0])
            app._oid_to_cid.pop(id(default_tb), None)
            app._oid_to_cid[id(components[default_id])] = default_id
    rebuild = {_STOCK_MLFLOW: server_mlflow_receiver, _STOCK_WANDB: server_wandb_receiver}
    for cid, obj in list(components.items()):
        build = rebuild.get((type(obj).__module__, type(obj).__name__))
        if build is not None:
            components[cid] = build(obj)
            app._oid_to_cid.pop(id(obj), None)
            app._oid_to_cid[id(components[cid])] = cid


def track_server_records(recipe: Any) -> None:
    """For a stock NVFlare recipe with :class:`~fedweigh.flare.aggregator.FedweighAggregator` (a
    fedweigh recipe does this itself): call after ``add_experiment_tracking(recipe, "mlflow" |
    "wandb")`` so that its receiver keeps a run for the aggregator's records."""
    use_tracking_receivers(recipe._job, None)

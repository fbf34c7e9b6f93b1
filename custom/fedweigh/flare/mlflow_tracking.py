"""NVFlare's MLflow receiver with a run for the server's own records (needs ``mlflow``).

NVFlare's stock ``MLflowReceiver`` on the server opens one MLflow run per client and records the
clients' fed analytics events only, so a record the server itself sends (the fedweigh controller's
or aggregator's ``global/*``, ``weight/*`` and ``scheme/*`` scalars, :mod:`fedweigh.flare.tracking`)
has no run and is refused. :class:`ServerMLflowReceiver` is that receiver, unchanged, plus one run
named after the server; a fedweigh recipe builds ``add_experiment_tracking(recipe, "mlflow")``'s
receiver as this class.
"""

from __future__ import annotations

from nvflare.apis.analytix import TrackConst
from nvflare.apis.fl_context import FLContext
from nvflare.app_opt.tracking.mlflow.mlflow_receiver import MLflowReceiver

__all__ = ["ServerMLflowReceiver"]


class ServerMLflowReceiver(MLflowReceiver):
    """``MLflowReceiver`` (same arguments) that also opens a run for the server, where the server's
    own analytics events (its identity as their origin) are recorded."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        kw_args: dict | None = None,
        artifact_location: str | None = None,
        events: list[str] | None = None,
        buffer_flush_time: int = 1,
    ):
        super().__init__(
            tracking_uri=tracking_uri,
            kw_args=kw_args,
            artifact_location=artifact_location,
            events=events,
            buffer_flush_time=buffer_flush_time,
        )
        self.buffer_flush_time = buffer_flush_time  # what a job export reads back

    def initialize(self, fl_ctx: FLContext) -> None:
        """The clients' runs (stock), then the server's run and buffer."""
        super().initialize(fl_ctx)
        server = fl_ctx.get_identity_name()
        if not server or server in self.run_ids:
            return
        self._mlflow_setup(
            self._get_artifact_location(self.artifact_location, fl_ctx),
            self.kw_args.get(TrackConst.EXPERIMENT_NAME, "FLARE FL Experiment"),
            self._get_tags(TrackConst.EXPERIMENT_TAGS, kwargs=self.kw_args),
            [server],
            fl_ctx,
        )
        self._init_buffer([server])

"""NVFlare's Weights & Biases receiver with a run for the server's own records (needs ``wandb``).

NVFlare's stock ``WandBReceiver`` on the server starts one W&B run per client and drops a record
whose origin is no client, so the server's own analytics events (the fedweigh controller's or
aggregator's ``global/*``, ``weight/*`` and ``scheme/*`` scalars, :mod:`fedweigh.flare.tracking`)
would be lost. :class:`ServerWandBReceiver` is that receiver, unchanged, plus one run named after the
server, in the same group; a fedweigh recipe builds ``add_experiment_tracking(recipe, "wandb", ...)``'s
receiver as this class.
"""

from __future__ import annotations

from nvflare.apis.fl_context import FLContext
from nvflare.app_opt.tracking.wandb import wandb_receiver
from nvflare.app_opt.tracking.wandb.wandb_receiver import WandBReceiver, WandBTask

__all__ = ["ServerWandBReceiver"]


class ServerWandBReceiver(WandBReceiver):
    """``WandBReceiver`` (same arguments) that also starts a run for the server, where the server's
    own analytics events (its identity as their origin) are logged."""

    def initialize(self, fl_ctx: FLContext) -> None:
        """The clients' runs (stock), then the server's: ``<server>-<job>-<name>`` in the clients' group."""
        run_name = self.wandb_args["name"]
        super().initialize(fl_ctx)
        server = fl_ctx.get_identity_name()
        if not server or server in self.queues:
            return
        group = self.wandb_args["group"]  # "<name>-<job id tag>", as the clients' runs
        job_tag = group[len(run_name) + 1 :]
        args = {
            **self.wandb_args,
            "name": f"{server}-{job_tag}-{run_name}",
            "config": {**self.wandb_args.get("config", {}), "client": server},
        }
        queue = wandb_receiver.Queue()
        queue.put(WandBTask(task_owner=server, task_type="init", task_data=args, step=0))
        self.queues[server] = queue
        process = wandb_receiver.Process(target=self._process_queue_tasks, args=(queue,))
        self.processes[server] = process
        process.start()

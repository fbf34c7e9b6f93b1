"""The fedweigh Client API script: one loop that trains, evaluates and reports statistics.

Run by NVFlare's ``ScriptRunner`` (the job's ``custom/fedweigh_client.py`` calls :func:`main`).
It dispatches on ``flare.get_task_name()``:

- ``train``: evaluate the received global model, train locally with the shared training code
  (:mod:`fedweigh.train`), send FULL parameters with ``NUM_STEPS_CURRENT_ROUND``, the sample count
  and the scalars the server's scheme asked for;
- ``validate``: evaluate the received global model only;
- ``stats``: answer the label-statistics phase (see :mod:`fedweigh.flare.statistics`);
- ``submit_model`` (cross-site evaluation, ``add_cross_site_evaluation(recipe)``): send this site's
  last local model; the models it is sent to validate are scored like ``validate``.

When a task's meta carries the HE layout (``fedweigh_he``, :mod:`fedweigh.secure.updates`), the
site decrypts the global model it receives (round 1: plaintext) with its client context, keeps the
decrypted model in ``fedweigh_he_global_<job id>.npz`` in its working folder (after the final
``validate`` task: theta_g^T), and sends Enc(theta_k - theta_g) instead of its parameters.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import nvflare.client as flare
import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.client.tracking import SummaryWriter

from fedweigh.arrays import Params
from fedweigh.data.site_config import resolve_site_data
from fedweigh.flare.keys import load_role_context
from fedweigh.flare.statistics import answer_statistics_task, load_cached_global_stats
from fedweigh.io import atomic_write_npz
from fedweigh.protocol import (
    META_HE,
    META_NUM_SAMPLES,
    META_NUM_STEPS,
    META_PLAN,
    META_SCALARS,
    TASK_STATS,
    TASK_TRAIN,
)
from fedweigh.site import ClientArgs, SiteTrainer, parse_args
from fedweigh.train import get_params, set_params

logger = logging.getLogger("fedweigh.client")

__all__ = ["ClientArgs", "main"]

#: Where a site keeps the decrypted global model under HE (in its working folder).
HE_SITE_MODEL_FILE = "fedweigh_he_global_{job_id}.npz"


def _he_decode(received: dict, he_meta: dict, reference: Params):
    """(decrypted global model, HE layout, client context) of a task under HE."""
    from fedweigh.secure.updates import decode_global  # TenSEAL: loaded only under HE

    ctx, _ = load_role_context("client")
    params, layout = decode_global(ctx, received, he_meta, reference)
    return params, layout, ctx


def _he_encode(ctx, params: Params, global_params: Params, layout) -> dict:
    """Enc(theta_k - theta_g) chunks and the clear arrays, as tensors for the Client API."""
    from fedweigh.secure.updates import encode_update  # TenSEAL: loaded only under HE

    return {k: torch.as_tensor(v) for k, v in encode_update(ctx, params, global_params, layout).items()}


def main(argv: list[str] | None = None) -> None:
    # DP-SGD's variable-size Poisson batches overflow oneDNN's default primitive cache (1024) on the
    # DenseNets and rebuild every convolution each step; it must be raised before the first convolution.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")
    logging.basicConfig(level=logging.INFO)
    args = parse_args(argv)
    flare.init()
    site_name = flare.get_site_name()
    site, test, num_sites = resolve_site_data(site_name, args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, num_sites))
    job_id = str(flare.get_job_id())
    trainer = SiteTrainer(site, test, args, threads=threads, job_id=job_id)
    trainer.global_stats = load_cached_global_stats(job_id)
    writer = SummaryWriter()
    last_local = None  # the model this site trained last (sent for cross-site evaluation)

    while flare.is_running():
        input_model = flare.receive()
        if input_model is None:
            break
        task = flare.get_task_name()
        plan = (input_model.meta or {}).get(META_PLAN, {}) or {}
        round_index = int(input_model.current_round or 0)
        he_meta = (input_model.meta or {}).get(META_HE) if task != TASK_STATS else None
        if he_meta:
            decrypted, he_layout, he_ctx = _he_decode(input_model.params, he_meta, get_params(trainer.model))
            atomic_write_npz(Path(HE_SITE_MODEL_FILE.format(job_id=job_id)), **decrypted)
            input_model.params = decrypted

        if task == TASK_STATS:
            flare.send(answer_statistics_task(trainer, input_model))
            continue

        if flare.is_submit_model():  # cross-site evaluation: this site's last local model
            local = last_local if last_local is not None else get_params(trainer.model)
            flare.send(
                FLModel(params={k: torch.as_tensor(v) for k, v in local.items()}, params_type=ParamsType.FULL)
            )
            continue

        if task != TASK_TRAIN:
            if input_model.params:
                set_params(trainer.model, input_model.params)
            metrics = trainer.evaluate()
            for key, value in metrics.items():
                writer.add_scalar(key, value, round_index)
            flare.send(FLModel(metrics=metrics, meta={META_NUM_SAMPLES: len(trainer.site.val)}))
            continue

        out = trainer.run_round(input_model.params, round_index, plan, total_rounds=input_model.total_rounds)
        last_local = None if he_meta else out.params
        if he_meta:
            params = _he_encode(he_ctx, out.params, input_model.params, he_layout)
        else:
            params = {k: torch.as_tensor(v) for k, v in out.params.items()}
        for key, value in out.metrics.items():
            writer.add_scalar(key, value, round_index)
        logger.info(
            "%s round %d: %d steps, loss %.4f, val_auc %.4f",
            site_name,
            round_index,
            out.num_steps,
            out.metrics["train_loss"],
            out.metrics.get("val_auc", float("nan")),
        )
        flare.send(
            FLModel(
                params=params,
                params_type=ParamsType.FULL,
                metrics=out.metrics,
                meta={
                    META_NUM_STEPS: out.num_steps,
                    META_NUM_SAMPLES: out.num_samples,
                    META_SCALARS: out.scalars,
                },
            )
        )


if __name__ == "__main__":
    main()

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
site decrypts the global model it receives (round 1: plaintext) with its client context, rounds it
to the job's ``he_precision_bits`` (:mod:`fedweigh.secure.precision`), keeps the decrypted model in ``fedweigh_he_global_<job id>.npz`` in its working folder (after the final
``validate`` task: theta_g^T), and sends Enc(theta_k - theta_g) instead of its parameters.

The site's privacy policy (:mod:`fedweigh.site.policy`, ``local/fedweigh_policy.json``) judges the job
before any task is answered: its DP settings at start, the statistics mode, encryption and the
scalars of each task. A job asking for less is refused: the site logs the reason and answers every
task with it (``fedweigh_refused``) instead of any data. DP budgets are keyed by the budget id the
server announces in the plan, and the site's epsilon ledger caps what all budgets spend together.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import nvflare.client as flare
import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.client.tracking import SummaryWriter

from fedweigh.arrays import Params
from fedweigh.errors import PolicyRefusal
from fedweigh.flare.keys import load_role_context
from fedweigh.flare.statistics import META_MODE, META_STEP, answer_statistics_task, load_cached_global_stats
from fedweigh.flare.task_loop import serve
from fedweigh.io import atomic_write_npz
from fedweigh.protocol import (
    META_HE,
    META_HE_REFUSED,
    META_MIN_SECURE_SUM,
    META_NUM_SAMPLES,
    META_NUM_STEPS,
    META_PLAN,
    META_REFUSED,
    META_REFUSED_JOB,
    META_SCALARS,
    TASK_STATS,
    TASK_TRAIN,
)
from fedweigh.site.args import ClientArgs, parse_args
from fedweigh.site.data_config import resolve_site_data
from fedweigh.site.he_guard import HEModelGuard
from fedweigh.site.policy import PrivacyGuard, PrivacyLedger, SitePolicy, ledger_path, load_site_policy
from fedweigh.site.trainer import SiteTrainer
from fedweigh.train import get_params, set_params

logger = logging.getLogger("fedweigh.client")

__all__ = ["ClientArgs", "ClientLoop", "follow_budget", "main", "refusal_model", "task_refusal"]

#: Where a site keeps the decrypted global model under HE (in its working folder).
HE_SITE_MODEL_FILE = "fedweigh_he_global_{job_id}.npz"


def _he_decode(
    received: dict, he_meta: dict, reference: Params, min_contributions: int, precision_bits: int | None
):
    """(decrypted global model, client context) of a task under HE
    (:class:`fedweigh.secure.updates.DecryptedGlobal`, rounded to the job's ``precision_bits``; its check
    slot is judged by the site's guard)."""
    from fedweigh.secure.updates import decrypt_global  # TenSEAL: loaded only under HE

    ctx, _ = load_role_context("client")
    return decrypt_global(ctx, received, he_meta, reference, min_contributions, precision_bits), ctx


def refusal_model(reason: str, whole_job: bool = True) -> FLModel:
    """A site's answer that carries no data, only its policy's reason for refusing."""
    # the Client API refuses a result without params or metrics
    return FLModel(
        metrics={"fedweigh_refused": 1.0}, meta={META_REFUSED: reason, META_REFUSED_JOB: whole_job}
    )


def follow_budget(trainer: SiteTrainer, guard: PrivacyGuard, plan: dict, job_id: str) -> str:
    """Key the site's DP accounts by the budget id the plan announces (the first job's id, kept by the
    server across ``resume_from``; this job's id when the plan names none): the DP-SGD accountant and
    the statistics release of a resumed run continue where the earlier job left them."""
    budget_id = str(plan.get("budget_id") or job_id)
    if budget_id != trainer.job_id:
        guard.budget_id = budget_id
        trainer.job_id = budget_id
        trainer.global_stats = trainer.global_stats or load_cached_global_stats(budget_id)
    return budget_id


def task_refusal(policy: SitePolicy, task: str, meta: dict, plan: dict, he_meta) -> str | None:
    """Why the site's policy refuses this task (None: it may be answered)."""
    if task == TASK_STATS and meta.get(META_STEP) == "collect":
        return policy.statistics_refusal(meta.get(META_MODE, "plain")) or (
            policy.task_refusal(plan, encrypted=bool(plan.get("he"))) if plan else None
        )
    if task == TASK_TRAIN:
        return policy.task_refusal(plan, encrypted=bool(he_meta))
    return None


class ClientLoop:
    """A site's answers to the tasks of one job: its trainer, its policy's judgement of the job, and
    the model it trained last (sent for cross-site evaluation)."""

    def __init__(self, args: ClientArgs):
        self.site_name = flare.get_site_name()
        site, test, num_sites = resolve_site_data(self.site_name, args)
        threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, num_sites))
        self.job_id = str(flare.get_job_id())
        #: the fractional bits every decrypted value is rounded to (fedweigh.secure.precision)
        self.precision_bits = args.he_precision_bits
        self.policy = load_site_policy()
        ledger = PrivacyLedger(ledger_path(self.site_name))
        self.guard = PrivacyGuard(self.policy, ledger, self.site_name, budget_id=self.job_id)
        self.trainer = SiteTrainer(
            site, test, args, threads=threads, job_id=self.job_id, privacy_guard=self.guard
        )
        self.trainer.global_stats = load_cached_global_stats(self.job_id)
        self.writer = SummaryWriter()
        logger.info("%s: site policy from %s: %s", self.site_name, self.policy.source, self.policy.as_dict())
        #: why the site refuses this job (None: it takes part); once refused, every task of the job is
        self.refused: str | None = self.policy.job_refusal(args)
        self.last_local: Params | None = None
        #: under HE: the checks on each decrypted global model and the last good one (a relaunched
        #: process of the job starts from the model it kept; its references build up again)
        self.he_guard = HEModelGuard(self.site_name)
        kept = Path(HE_SITE_MODEL_FILE.format(job_id=self.job_id))
        if kept.is_file():
            with np.load(kept) as npz:
                self.he_guard.last_good = {k: npz[k] for k in npz.files}

    def answer(self, input_model: FLModel) -> FLModel:
        """The answer to one task: its policy's refusal, or the statistics, model, metrics or training
        result it asks for."""
        task = flare.get_task_name()
        meta = input_model.meta or {}
        plan = meta.get(META_PLAN, {}) or {}
        follow_budget(self.trainer, self.guard, plan, self.job_id)
        he_meta = meta.get(META_HE) if task != TASK_STATS else None
        self.refused = self.refused or task_refusal(self.policy, task, meta, plan, he_meta)
        if self.refused:
            return self._refuse(self.refused)
        try:
            he = self._decrypt(input_model, he_meta) if he_meta else None
        except ValueError as e:  # e.g. a sum of fewer updates than this site's policy decrypts
            logger.error("%s: %s", self.site_name, e)
            return refusal_model(str(e), whole_job=False)
        if he is not None and he[2].refusal and task != TASK_TRAIN:
            answer = self._route(task, input_model, plan, he)
            answer.meta = {**(answer.meta or {}), META_HE_REFUSED: he[2].refusal}
            return answer
        return self._route(task, input_model, plan, he)

    def _route(self, task: str, input_model: FLModel, plan: dict, he) -> FLModel:
        """The answer to a task the site's policy allows (the model already decrypted under HE)."""
        if task == TASK_STATS:
            return self._statistics(input_model)
        if flare.is_submit_model():  # cross-site evaluation: this site's last local model
            local = self.last_local if self.last_local is not None else get_params(self.trainer.model)
            return FLModel(
                params={k: torch.as_tensor(v) for k, v in local.items()}, params_type=ParamsType.FULL
            )
        round_index = int(input_model.current_round or 0)
        if task != TASK_TRAIN:
            return self._evaluate(input_model, round_index)
        return self._train(input_model, plan, round_index, he)

    def _refuse(self, reason: str) -> FLModel:
        """Refuse the whole job for ``reason``: logged, and the answer to this and every later task."""
        self.refused = reason
        logger.error("%s refuses this job: %s", self.site_name, reason)
        return refusal_model(reason)

    def _decrypt(self, input_model: FLModel, he_meta: dict):
        """Under HE: decrypt the received global model, check it (:class:`fedweigh.site.he_guard.HEModelGuard`),
        put the model the site uses (the received one, or its last good one) in place and keep it in the
        working folder; returns (HE layout, client context, receipt)."""
        decrypted, ctx = _he_decode(
            input_model.params,
            he_meta,
            get_params(self.trainer.model),
            self.policy.min_secure_sum,
            self.precision_bits,
        )
        round_index = input_model.current_round
        receipt = self.he_guard.receive(
            decrypted, None if round_index is None else int(round_index) + 1, he_meta.get("steps")
        )
        atomic_write_npz(Path(HE_SITE_MODEL_FILE.format(job_id=self.job_id)), **receipt.use)
        input_model.params = dict(receipt.use)
        return decrypted.layout, ctx, receipt

    def _statistics(self, input_model: FLModel) -> FLModel:
        try:
            return answer_statistics_task(self.trainer, input_model, self.policy, self.precision_bits)
        except PolicyRefusal as e:  # the statistics release would break an epsilon cap
            return self._refuse(str(e))

    def _evaluate(self, input_model: FLModel, round_index: int) -> FLModel:
        """Metrics of the received global model on the site's validation split (and the test set)."""
        if input_model.params:
            set_params(self.trainer.model, input_model.params)
        metrics = self.trainer.evaluate()
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, round_index)
        return FLModel(metrics=metrics, meta={META_NUM_SAMPLES: len(self.trainer.site.val)})

    def _train(self, input_model: FLModel, plan: dict, round_index: int, he) -> FLModel:
        """One round of local training on the received global model, answered with the full model (or
        under HE its encrypted update), tau_k, N_k and the scheme's scalars."""
        try:
            out = self.trainer.run_round(
                input_model.params, round_index, plan, total_rounds=input_model.total_rounds
            )
        except PolicyRefusal as e:  # the round would break an epsilon cap of the site's policy
            return self._refuse(str(e))
        self.last_local = None if he else out.params
        if he:
            layout, ctx, receipt = he  # Enc(update) against the model the server holds, clipped
            encoded = self.he_guard.encode(ctx, out.params, receipt, layout, out.num_steps)
            params = {k: torch.as_tensor(v) for k, v in encoded.items()}
        else:
            params = {k: torch.as_tensor(v) for k, v in out.params.items()}
        # round t (one numbering with the server's log and rows): NVFlare's current_round is t - 1
        for key, value in out.metrics.items():
            self.writer.add_scalar(key, value, round_index + 1)
        logger.info(
            "%s round %d: %d steps, loss %.4f, val_auc %.4f",
            self.site_name,
            round_index + 1,
            out.num_steps,
            out.metrics.get("train_loss", float("nan")),  # not reported under DP-SGD
            out.metrics.get("val_auc", float("nan")),
        )
        meta = {
            META_NUM_STEPS: out.num_steps,
            META_NUM_SAMPLES: out.num_samples,
            META_SCALARS: out.scalars,
            META_MIN_SECURE_SUM: int(self.policy.min_secure_sum),
            **({META_HE_REFUSED: he[2].refusal} if he and he[2].refusal else {}),
        }
        return FLModel(params=params, params_type=ParamsType.FULL, metrics=out.metrics, meta=meta)


def main(argv: list[str] | None = None) -> None:
    """The client script: answer the job's tasks until the job ends (module docstring)."""
    # DP-SGD's variable-size Poisson batches overflow oneDNN's default primitive cache (1024) on the
    # DenseNets and rebuild every convolution each step; it must be raised before the first convolution.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")
    logging.basicConfig(level=logging.INFO)
    flare.init()
    serve(lambda: ClientLoop(parse_args(argv)).answer)


if __name__ == "__main__":
    main()

"""Your own Client API script under a fedweigh scheme: what it must report, and helpers that build it.

A fedweigh recipe built with ``train_script=`` (and ``model=``) runs your script at the sites instead
of fedweigh's. The server weighs each site's ``train`` result from the result's ``meta``; the
contract is:

================================  ========================================================================
meta key                          value
================================  ========================================================================
``num_samples``                   N_k, the site's training-set size (int >= 1); every scheme reads it
``NUM_STEPS_CURRENT_ROUND``       tau_k, the local optimiser steps of this round (int >= 0; FedNova)
``fedweigh_scalars``              the scalars the scheme asks for in the task's ``meta["fedweigh_plan"]``
                                  (``plan["scalars"]``, e.g. CBR's ``skew``), computed by the scheme's
                                  own client code (:func:`fedweigh.site.scalars.plan_scalars`, as at
                                  fedweigh's own sites) from the site's label counts and models
================================  ========================================================================

Send ``params`` as the FULL local model (``ParamsType.FULL``). :func:`result_meta` builds that meta;
``plan["fedprox_mu"]`` is FedProx's coefficient for your loss (0 for other schemes). FedDRAW's
``similarity="direction"`` compares your update with the global update since your previous training
round: :func:`result_meta` keeps the global model of each task it reports on for the next one (or
pass ``previous_global=``). Schemes whose
*loss* or weighting needs the global label histogram (FedDisco, DAFL) also send a ``stats`` task
first: answer it with :func:`answer_statistics` (your script receives it only when such a scheme
runs). A minimal loop::

    import nvflare.client as flare
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from fedweigh.flare.byo import answer_statistics, is_statistics_task, result_meta

    flare.init()
    while flare.is_running():
        received = flare.receive()
        if is_statistics_task():
            flare.send(answer_statistics(received, class_counts, len(train_set)))
            continue
        model.load_state_dict(received.params)
        steps = train_one_round(model)  # your training
        flare.send(FLModel(params=model.state_dict(), params_type=ParamsType.FULL,
                           meta=result_meta(received, num_samples=len(train_set), num_steps=steps,
                                            class_counts=class_counts, params=model.state_dict())))

``examples/byo_feddraw/`` is a complete script and job.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import nvflare.client as flare

from fedweigh.flare.statistics import GLOBAL_STATS_FILE, answer_statistics_task, load_cached_global_stats
from fedweigh.histograms import GlobalStats
from fedweigh.protocol import META_NUM_SAMPLES, META_NUM_STEPS, META_PLAN, META_SCALARS, TASK_STATS
from fedweigh.secure.dp_config import LOCAL_JOB_ID, StatsDPConfig
from fedweigh.secure.stats_release import HistogramReleaser, ReleasedHistogram
from fedweigh.site.policy import PrivacyGuard, PrivacyLedger, ledger_path, load_site_policy
from fedweigh.site.scalars import MODEL_SCALARS, plan_scalars, wanted_scalars
from fedweigh.weighting.base import ScalarContext

__all__ = ["answer_statistics", "global_statistics", "is_statistics_task", "plan_of", "result_meta"]

logger = logging.getLogger("fedweigh.byo")


def _as_numpy(params: Mapping[str, Any] | None) -> dict[str, np.ndarray] | None:
    if params is None:
        return None
    out = {}
    for key, value in params.items():
        if hasattr(value, "detach"):  # torch.Tensor
            value = value.detach().cpu().numpy()
        out[key] = np.asarray(value)
    return out


def _count_vector(class_counts: Any, what: str) -> np.ndarray:
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0 or not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise ValueError(
            f"{what}: class_counts must be a non-empty 1-D list of counts >= 0, got {class_counts!r}"
        )
    return counts


def plan_of(received: Any) -> dict:
    """The server's plan on a received task (``meta["fedweigh_plan"]``; empty when there is none)."""
    return dict((getattr(received, "meta", None) or {}).get(META_PLAN) or {})


class _ReceivedGlobal:
    """The global model of the last train task :func:`result_meta` reported on in this process, and
    the privacy budget id (the job) it came with: FedDRAW's ``similarity="direction"`` compares a
    site's update with the global update since its previous training round, as fedweigh's sites do
    (:attr:`fedweigh.site.trainer.SiteTrainer.previous_global`)."""

    def __init__(self) -> None:
        self.budget_id: str | None = None
        self.params: dict[str, np.ndarray] | None = None

    def previous(self, plan: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
        return self.params if self.budget_id == str(plan.get("budget_id")) else None

    def keep(self, plan: Mapping[str, Any], params: dict[str, np.ndarray] | None) -> None:
        self.budget_id = str(plan.get("budget_id"))
        self.params = None if params is None else {k: np.array(v, copy=True) for k, v in params.items()}


_RECEIVED = _ReceivedGlobal()


def _global_stats(value: GlobalStats | Mapping[str, Any] | None) -> GlobalStats | None:
    if value is None or isinstance(value, GlobalStats):
        return value
    return GlobalStats.from_dict(value, "result_meta: global_stats")


def result_meta(
    received: Any,
    *,
    num_samples: int,
    num_steps: int,
    class_counts: Any = None,
    params: Mapping[str, Any] | None = None,
    global_stats: GlobalStats | Mapping[str, Any] | None = None,
    previous_global: Mapping[str, Any] | None = None,
) -> dict:
    """The meta of a ``train`` result for the task ``received``: N_k, tau_k and the scheme's scalars
    (:func:`fedweigh.site.scalars.plan_scalars`, the function every fedweigh client calls).

    Args:
        received: the FLModel of the task (its ``meta`` holds the plan, its ``params`` the global model).
        num_samples: the site's training-set size N_k.
        num_steps: the local optimiser steps of this round tau_k.
        class_counts: per-class counts of the site's training labels (positives per finding for
            multi-label data); needed when the scheme's scalars come from them (CBR, DAFL).
        params: the local model after training; needed by schemes whose scalars compare models.
        global_stats: the global statistics, :func:`global_statistics` (None: no statistics phase).
        previous_global: the global model this site received in its previous training round (FedDRAW's
            ``similarity="direction"``); default: the one of the last task this process reported on
            in the same job (None in its first round).

    Raises ValueError naming the argument when a value cannot be reported or the scheme needs more.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise ValueError(f"result_meta: num_samples must be an integer >= 1, got {num_samples!r}")
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
        raise ValueError(f"result_meta: num_steps must be an integer >= 0, got {num_steps!r}")
    plan = plan_of(received)
    global_params = _as_numpy(getattr(received, "params", None))
    scalars: dict[str, float] = {}
    wanted = list(wanted_scalars(plan))
    if wanted:
        if class_counts is None:
            raise ValueError(
                f"result_meta: scheme {plan['scheme']!r} asks for {wanted}, computed from the site's label "
                "counts: pass class_counts= (per-class counts of the training labels)"
            )
        counts, released_n = _count_vector(class_counts, "result_meta"), int(num_samples)
        if not set(wanted) <= set(MODEL_SCALARS):  # a histogram scalar: from the site's release, never exact
            site_name, job_id = _job_identity()
            release = site_release(site_name, job_id, counts, released_n, plan.get("budget_id"))
            counts, released_n = np.asarray(release.class_counts), int(release.num_samples)
        ctx = ScalarContext(
            class_counts=counts,
            num_samples=released_n,
            global_stats=_global_stats(global_stats),
            params=_as_numpy(params),
            global_params=global_params,
            previous_global=_RECEIVED.previous(plan)
            if previous_global is None
            else _as_numpy(previous_global),
        )
        scalars = plan_scalars(plan, ctx, who="result_meta")
    _RECEIVED.keep(plan, global_params)
    return {META_NUM_SAMPLES: int(num_samples), META_NUM_STEPS: int(num_steps), META_SCALARS: scalars}


def is_statistics_task(task_name: str | None = None) -> bool:
    """Whether the current task (or ``task_name``) is the label-statistics phase."""
    if task_name is None:
        task_name = flare.get_task_name()
    return task_name == TASK_STATS


def _job_identity() -> tuple[str, str]:
    """(site name, job id) of the NVFlare job this process serves; ("site", LOCAL_JOB_ID) outside one."""
    try:
        return str(flare.get_site_name()), str(flare.get_job_id())
    except RuntimeError:  # no Client API context: an in-process call (a test, a notebook)
        return "site", LOCAL_JOB_ID


def site_release(
    site_name: str, job_id: str, class_counts: np.ndarray, num_samples: int, budget_id: str | None = None
) -> ReleasedHistogram:
    """The label histogram as it may leave this site: the site policy's statistics release, as fedweigh's
    own client makes it (:class:`fedweigh.secure.stats_release.HistogramReleaser`): noised with the
    policy's ``statistics_epsilon`` (delta 1e-5) unless the policy allows exact statistics (null), drawn
    once per budget (the release file in the working folder) and spent in the site's ledger. The
    multi-label sensitivity sqrt(C + 1) is used, which also covers a multi-class histogram (more noise
    than its sqrt(2) needs, never less)."""
    counts = np.asarray(class_counts)
    policy = load_site_policy()
    if policy.statistics_epsilon is None:
        return ReleasedHistogram(counts, int(num_samples), None, None)
    budget = str(budget_id or job_id)
    if job_id == LOCAL_JOB_ID:  # outside an NVFlare job: one release in memory, no ledger file
        return HistogramReleaser(StatsDPConfig(epsilon=policy.statistics_epsilon), site_name, job_id).release(
            counts, int(num_samples), "multilabel"
        )
    guard = PrivacyGuard(
        policy, PrivacyLedger(ledger_path(site_name)), site_name, budget_id=budget, job_id=job_id
    )
    releaser = HistogramReleaser(
        StatsDPConfig(epsilon=policy.statistics_epsilon), site_name, budget, guard=guard
    )
    return releaser.release(counts, int(num_samples), "multilabel")


class _StatisticsSite:
    """A user's site as the statistics phase sees it (:class:`fedweigh.flare.statistics.StatisticsSite`):
    its label histogram as the site policy lets it leave (:func:`site_release`)."""

    def __init__(self, site_name: str, job_id: str, release: ReleasedHistogram):
        self.site_name = site_name
        self.job_id = job_id
        self.global_stats: GlobalStats | None = None
        self.num_train = int(release.num_samples)
        self._release = release

    def released_statistics(self) -> ReleasedHistogram:
        return self._release


def answer_statistics(received: Any, class_counts: Any, num_samples: int, *, site_name: str | None = None):
    """The FLModel answering a ``stats`` task: the site's label histogram (collect step), or the
    acknowledgement of the global statistics (distribute step; then :func:`global_statistics`
    returns them in this process and later ones of the same job)."""
    site_name = site_name or flare.get_site_name()
    job_id = str(flare.get_job_id())
    counts = _count_vector(class_counts, "answer_statistics")
    budget_id = plan_of(received).get("budget_id")
    release = site_release(site_name, job_id, counts, int(num_samples), budget_id)
    site = _StatisticsSite(site_name, job_id, release)
    answer = answer_statistics_task(site, received)
    if site.global_stats is not None:
        logger.info("%s: global statistics kept in %s", site_name, GLOBAL_STATS_FILE.format(job_id=job_id))
    return answer


def global_statistics(job_id: str | None = None) -> GlobalStats | None:
    """The global label statistics this site received in job ``job_id`` (None before the phase);
    ValueError naming the file when what is kept there is not valid."""
    if job_id is None:
        job_id = str(flare.get_job_id())
    return load_cached_global_stats(job_id)

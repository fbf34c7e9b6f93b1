"""The label-statistics phase in NVFlare: sites learn the global label histogram before training.

The math (the statistics vector v_k, its sum, decoding, how sums travel) is in
:mod:`fedweigh.histograms` and :mod:`fedweigh.secure.exchange`; which contributions are summed is
:func:`fedweigh.server.label_stats.sum_statistics`. This module runs it as NVFlare tasks. The phase has two
steps, both sent as the ``stats`` task:

1. ``collect``: every site sends its contribution (or its site policy's refusal); the server checks
   and sums the valid ones when a quorum of them remains (:mod:`fedweigh.server.quorum`);
2. ``distribute``: the server returns the sum; every site checks that it holds at least the number
   of contributions its own policy demands, then derives the global statistics
   (:class:`fedweigh.histograms.GlobalStats`) and keeps them (the loss and the scheme's client
   scalars use them). Without a valid sum nothing is distributed: the sites train with their local
   statistics and the server's log says why.

A site also keeps them in its working folder (``fedweigh_global_stats_<job id>.json``, written and
read only here: :func:`keep_global_stats`, :func:`load_cached_global_stats`), so that a relaunched
process of the same job, or a script of your own (:func:`fedweigh.flare.byo.global_statistics`),
finds them.

Every exchange is bound to its job and to a fresh random exchange id the server announces with
``collect`` (:class:`fedweigh.histograms.ExchangeBinding`); the server announces the members it
summed with the sum. A site remembers the exchange id it contributed to (in this process) and
decodes only a sum of that exchange: in ``secure`` mode the sum's binding tags must equal those of
the announced members (:mod:`fedweigh.secure.exchange`), which the server cannot forge; in
``plain`` mode the sum must repeat the exchange id. A stale or foreign sum is refused, naming why.

What a site contributes is its released histogram (:meth:`StatisticsSite.released_statistics`):
by default one Gaussian release per job (the job's ``stats_dp_epsilon``, else the site policy's
``statistics_epsilon``), so that two exchanges whose members differ by one site do not reveal that
site's exact histogram.

``plain`` sends v_k in clear (research runs only: it reveals each hospital's disease prevalence to the
server and logs a warning), ``secure`` sums CKKS ciphertexts so the server sees neither v_k nor the sum.
A site takes part only in the modes its policy lists (:class:`fedweigh.site.policy.SitePolicy`).
"""

from __future__ import annotations

import json
import logging
import secrets
from pathlib import Path
from typing import Protocol

from nvflare.app_common.abstract.fl_model import FLModel

from fedweigh.flare.keys import role_context_provider
from fedweigh.histograms import (
    META_ANNOUNCED_N,
    META_EXCHANGE_ID,
    META_LENGTH,
    META_MEMBERS,
    META_NOISED,
    ExchangeBinding,
    GlobalStats,
    PlainExchange,
    StatisticsExchange,
    check_announced_size,
    decode_sum,
    statistics_vector,
)
from fedweigh.io import atomic_write_json
from fedweigh.protocol import (
    ABSOLUTE_MIN,
    META_MIN_SECURE_SUM,
    META_NUM_SAMPLES,
    META_PLAN,
    META_REFUSED,
    META_REFUSED_JOB,
    META_SITE_ERROR,
    TASK_STATS,
)
from fedweigh.secure.dp_config import job_site_path
from fedweigh.secure.exchange import SecureExchange
from fedweigh.secure.stats_release import ReleasedHistogram
from fedweigh.server.label_stats import sum_statistics
from fedweigh.site.policy import PERMISSIVE_DEFAULT, SitePolicy

__all__ = [
    "GLOBAL_STATS_FILE",
    "announced_size",
    "answer_statistics_task",
    "global_stats_path",
    "keep_global_stats",
    "load_cached_global_stats",
    "log_distribution",
    "make_exchange",
    "new_exchange_id",
    "run_statistics_phase",
]

logger = logging.getLogger("fedweigh.statistics")

META_STEP = "fedweigh_stats_step"
META_MODE = "fedweigh_stats_mode"
GLOBAL_STATS_FILE = "fedweigh_global_stats_{job_id}.json"


def make_exchange(
    mode: str, min_contributions: int = ABSOLUTE_MIN, precision_bits: int | None = None
) -> StatisticsExchange:
    """The exchange of statistics mode ``mode`` (``plain`` or ``secure``, with this process's keys);
    ``min_contributions``: the fewest contributions a sum may hold for this party to decode it;
    ``precision_bits``: the fractional bits a decrypted sum is rounded to (secure; None: the default)."""
    if mode == "plain":
        return PlainExchange(min_contributions)
    if mode == "secure":
        return SecureExchange(role_context_provider(), min_contributions, precision_bits)
    raise ValueError(f"statistics mode must be 'plain' or 'secure', got {mode!r}")


# ---------------------------------------------------------------------------------------- server
def run_statistics_phase(
    controller, sites: list[str], mode: str, floor: int = ABSOLUTE_MIN, plan=None
) -> dict:
    """Run collect + distribute through ``controller.ask_sites``; returns the raw collect results'
    meta by site (the controller reads refusals from it). Invalid, refusing or silent sites are
    left out with a logged reason; no contribution can fail the phase."""
    exchange = make_exchange(mode)
    if mode == "plain":
        controller.warning(
            "label statistics travel in clear (statistics='plain'): the server sees every site's label histogram"
        )
    exchange_id = new_exchange_id()
    task_meta = {
        META_STEP: "collect",
        META_MODE: mode,
        META_EXCHANGE_ID: exchange_id,
        **({META_PLAN: plan} if plan else {}),
    }
    results = controller.ask_sites(TASK_STATS, FLModel(params={}, meta=task_meta), sites, 1)
    errors = _site_errors(controller, results)
    payloads: dict[str, object] = {}
    for r in results:
        meta = r.meta if isinstance(r.meta, dict) else {}
        site = str(meta.get("client_name", "?"))
        payloads[site] = {**meta, **(r.params if isinstance(r.params, dict) else {})}
    outcome = sum_statistics(exchange, payloads, floor)
    for site, why in outcome.excluded.items():
        controller.warning(f"statistics: leaving {site} out: {why}")
    for site in sites:
        if site not in payloads and site not in errors:
            controller.warning(f"statistics: {site} sent no contribution in time; left out")
        elif site in errors and site not in payloads:
            controller.warning(f"statistics: leaving {site} out: {site} failed: {errors[site]}")
    if outcome.total is None:
        answered = set(payloads) | set(errors)
        if errors and answered <= set(errors):  # every site that answered failed: no run can follow
            first, why = next(iter(errors.items()))
            controller.fail_job(
                f"the statistics phase ended with no valid contribution: every site that answered failed "
                f"({len(errors)} of {len(sites)}); first error, {first}: {why}"
            )
            return payloads
        controller.warning(
            f"statistics ({mode}): nothing summed: {outcome.reason}; the sites train with their local statistics"
        )
        return payloads
    controller.info(f"statistics ({mode}): summed contributions of {len(outcome.members)} site(s)")
    distribute = {
        META_STEP: "distribute",
        META_MODE: mode,
        **({META_PLAN: plan} if plan else {}),
        **outcome.total,
        **announced_size(payloads, outcome.members),
        META_EXCHANGE_ID: exchange_id,
        META_MEMBERS: list(outcome.members),
    }
    answers = controller.ask_sites(TASK_STATS, FLModel(params={}, meta=distribute), sites, 1)
    log_distribution(controller, sites, answers, _site_errors(controller, answers))
    return payloads


def new_exchange_id() -> str:
    """A fresh random exchange id (128 bits from the OS, :mod:`secrets`), one per statistics exchange."""
    return secrets.token_hex(16)


def announced_size(payloads: dict[str, object], members: list[str]) -> dict:
    """What the server announces with the sum for the sites' check (:func:`fedweigh.histograms.check_announced_size`):
    the sum of the members' N_k as they report it in clear, and whether a contribution was noised."""
    sizes = [payloads[s].get(META_NUM_SAMPLES) for s in members if isinstance(payloads.get(s), dict)]  # type: ignore[union-attr]
    noised = any(isinstance(payloads.get(s), dict) and payloads[s].get(META_NOISED) for s in members)  # type: ignore[union-attr]
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
        return {}  # a member without a valid size: the sites then refuse the sum, naming it
    return {META_ANNOUNCED_N: int(sum(sizes)), **({META_NOISED: True} if noised else {})}


def log_distribution(controller, sites: list[str], answers: list[FLModel], errors: dict[str, str]) -> None:
    """Log every site's answer to the distributed sum: decoded, refused (with its reason) or none."""
    ok, refused = [], {}
    for r in answers:
        meta = r.meta if isinstance(r.meta, dict) else {}
        site = str(meta.get("client_name", "?"))
        if meta.get("ok"):
            ok.append(site)
        elif site not in errors:
            refused[site] = str(meta.get("error") or meta.get(META_REFUSED) or "no reason given")
    for site, why in {**refused, **errors}.items():
        controller.warning(f"statistics: {site} could not use the global statistics: {why}")
    silent = [s for s in sites if s not in ok and s not in refused and s not in errors]
    for site in silent:
        controller.warning(f"statistics: {site} did not answer the distributed sum in time")
    if ok:
        controller.info(f"statistics: {len(ok)} of {len(sites)} site(s) decoded the global statistics: {ok}")
    else:
        first = next(iter({**refused, **errors}.items()), None)
        controller.warning(
            "statistics: no site could use the summed statistics; they train with their local statistics"
            + (f" (first reason, {first[0]}: {first[1]})" if first else "")
        )


def _site_errors(controller, results: list[FLModel]) -> dict[str, str]:
    """The sites whose script failed on the task: the controller's record (errors sent and NVFlare return
    codes) when it keeps one, else the errors the results carry."""
    if hasattr(controller, "site_errors"):
        return controller.site_errors(results)
    out = {}
    for r in results:
        meta = r.meta if isinstance(r.meta, dict) else {}
        if meta.get(META_SITE_ERROR):
            out[str(meta.get("client_name", "?"))] = str(meta[META_SITE_ERROR])
    return out


# ---------------------------------------------------------------------------------------- client
class StatisticsSite(Protocol):
    """What the statistics phase needs of a site: its name and job, what it may release of its label
    histogram, its training-set size, and where the global statistics go (a
    :class:`fedweigh.site.trainer.SiteTrainer`, or a user's own script through :mod:`fedweigh.flare.byo`)."""

    site_name: str
    job_id: str
    global_stats: GlobalStats | None

    @property
    def num_train(self) -> int: ...

    def released_statistics(self) -> ReleasedHistogram: ...


#: The exchange each (site, job) of this process contributed to last: a sum is decoded only against it.
_CONTRIBUTED: dict[tuple[str, str], ExchangeBinding] = {}


def answer_statistics_task(
    trainer: StatisticsSite,
    input_model: FLModel,
    policy: SitePolicy = PERMISSIVE_DEFAULT,
    precision_bits: int | None = None,
) -> FLModel:
    """The client's answer to a ``stats`` task (collect or distribute). The caller has checked the
    task against the site's policy; ``policy.min_secure_sum`` is announced with the contribution and
    checked before a sum is decoded; a decrypted sum is rounded to ``precision_bits`` (the job's
    ``he_precision_bits``; None: the default). A collect step without a valid exchange id is refused;
    a sum is decoded only against the exchange this site contributed to in this process (module
    docstring), else refused naming why."""
    meta = input_model.meta or {}
    exchange = make_exchange(meta.get(META_MODE, "plain"), policy.min_secure_sum, precision_bits)
    asked = (trainer.site_name, str(trainer.job_id))
    if meta.get(META_STEP) == "collect":
        try:
            binding = ExchangeBinding(str(trainer.job_id), meta.get(META_EXCHANGE_ID), trainer.site_name)  # type: ignore[arg-type]
        except ValueError as e:  # no contribution to an exchange it could not tell from another
            logger.error("%s: %s", trainer.site_name, e)
            return FLModel(metrics={"stats_sent": 0.0}, meta={META_REFUSED: str(e), META_REFUSED_JOB: False})
        _CONTRIBUTED[asked] = binding
        # with statistics DP on, the site's one noised release; N_k c_k is derived from it
        # (post-processing), so everything sent here is covered by the same budget
        release = trainer.released_statistics()
        vector = statistics_vector(release.class_counts, release.num_samples)
        payload = exchange.encode(vector, binding)
        metrics = {"stats_sent": 1.0}  # the Client API refuses a result without params or metrics
        if release.epsilon is not None:
            metrics.update(stats_dp_epsilon=float(release.epsilon), stats_dp_delta=float(release.delta))
        return FLModel(
            metrics=metrics,
            meta={
                META_LENGTH: int(vector.size),
                META_NUM_SAMPLES: trainer.num_train,
                META_MIN_SECURE_SUM: int(policy.min_secure_sum),
                **({META_NOISED: True} if release.epsilon is not None else {}),
                **payload,
            },
        )
    try:
        binding = _CONTRIBUTED.get(asked)
        if binding is None:
            raise ValueError(
                f"statistics: {trainer.site_name} contributed to no statistics exchange of job {asked[1]!r} in "
                "this process, so it cannot tell whether the sum is of this exchange (a stale or foreign sum)"
            )
        stats = decode_sum(exchange.decode(meta, binding))
        check_announced_size(
            stats, meta.get(META_ANNOUNCED_N), bool(meta.get(META_NOISED)), trainer.num_train
        )
    except ValueError as e:  # too few contributions for this site's policy, or an inconsistent sum
        logger.error("%s: global statistics not decoded: %s", trainer.site_name, e)
        return FLModel(metrics={"stats_received": 0.0}, meta={"ok": False, "error": str(e)})
    trainer.global_stats = stats
    try:
        keep_global_stats(stats, trainer.job_id)
    except OSError as e:  # the in-memory copy still serves this process
        logger.warning("could not keep global statistics on disk: %s", e)
    logger.info("%s: global statistics received (N=%d)", trainer.site_name, stats.num_samples)
    return FLModel(metrics={"stats_received": 1.0}, meta={"ok": True})


def global_stats_path(budget_id: str) -> Path:
    """This budget's global-statistics file in the working folder; the id the server announces is
    reduced to ``[A-Za-z0-9_.-]`` (no folder can be named through it)."""
    return job_site_path(GLOBAL_STATS_FILE, budget_id, "")


def keep_global_stats(stats: GlobalStats, job_id: str) -> Path:
    """Write ``stats`` in their JSON form (:meth:`GlobalStats.as_dict`) to this job's file in the
    working folder; returns its path."""
    return atomic_write_json(global_stats_path(job_id), stats.as_dict())


def load_cached_global_stats(job_id: str) -> GlobalStats | None:
    """Global statistics kept by an earlier process of this client in the same job (relaunches);
    None when there are none. ValueError naming the file when it is not valid JSON or not global
    statistics (:meth:`GlobalStats.from_dict`)."""
    path = global_stats_path(job_id)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    return GlobalStats.from_dict(data, str(path))

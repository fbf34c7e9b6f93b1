"""The label-statistics phase in NVFlare: sites learn the global label histogram before training.

The math (the statistics vector v_k, its sum, decoding, how sums travel) is in
:mod:`fedweigh.label_stats` and :mod:`fedweigh.secure.exchange`; this module runs it as NVFlare tasks.
The phase has two steps, both sent as the ``stats`` task:

1. ``collect``: every site sends its contribution; the server checks and sums them.
2. ``distribute``: the server returns the sum; every site derives the global statistics and keeps
   them (the loss and the scheme's client scalars use them).

``plain`` sends v_k in clear (research runs only: it reveals each hospital's disease prevalence to the
server and logs a warning), ``secure`` sums CKKS ciphertexts so the server sees neither v_k nor the sum.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from nvflare.app_common.abstract.fl_model import FLModel

from fedweigh.flare.keys import role_context_provider
from fedweigh.label_stats import META_LENGTH, PlainExchange, StatisticsExchange, decode_sum, statistics_vector
from fedweigh.protocol import META_NUM_SAMPLES, TASK_STATS
from fedweigh.secure.exchange import SecureExchange
from fedweigh.site import SiteTrainer

logger = logging.getLogger("fedweigh.statistics")

META_STEP = "fedweigh_stats_step"
META_MODE = "fedweigh_stats_mode"
GLOBAL_STATS_FILE = "fedweigh_global_stats_{job_id}.json"


def make_exchange(mode: str) -> StatisticsExchange:
    """The exchange of statistics mode ``mode`` (``plain`` or ``secure``, with this process's keys)."""
    if mode == "plain":
        return PlainExchange()
    if mode == "secure":
        return SecureExchange(role_context_provider())
    raise ValueError(f"statistics mode must be 'plain' or 'secure', got {mode!r}")


# ---------------------------------------------------------------------------------------- server
def run_statistics_phase(controller, sites: list[str], mode: str) -> None:
    """Run collect + distribute through ``controller.ask_sites``; invalid or silent sites are skipped."""
    exchange = make_exchange(mode)
    if mode == "plain":
        controller.warning(
            "label statistics travel in clear (statistics='plain'): the server sees every site's label histogram"
        )
    results = controller.ask_sites(
        TASK_STATS, FLModel(params={}, meta={META_STEP: "collect", META_MODE: mode}), sites, 1
    )
    payloads: dict[str, dict] = {}
    lengths = set()
    for r in results:
        meta = r.meta or {}
        site = meta.get("client_name", "?")
        length = meta.get(META_LENGTH)
        if not isinstance(length, int) or length < 3:
            controller.warning(f"statistics: skipping {site}: no valid {META_LENGTH}")
            continue
        lengths.add(length)
        payloads[site] = {**meta, **(r.params or {})}
    if len(lengths) != 1:
        raise RuntimeError(f"statistics: sites disagree on the number of classes ({sorted(lengths)})")
    length = lengths.pop()
    valid: dict[str, dict] = {}
    for site, payload in payloads.items():
        try:
            exchange.check(site, payload, length)
            valid[site] = payload
        except ValueError as e:
            controller.warning(f"statistics: skipping {site}: {e}")
    total = exchange.sum(valid, length)
    controller.info(f"statistics ({mode}): summed contributions of {len(valid)} site(s)")
    controller.ask_sites(
        TASK_STATS, FLModel(params={}, meta={META_STEP: "distribute", META_MODE: mode, **total}), sites, 1
    )


# ---------------------------------------------------------------------------------------- client
def answer_statistics_task(trainer: SiteTrainer, input_model: FLModel) -> FLModel:
    """The client's answer to a ``stats`` task (collect or distribute)."""
    meta = input_model.meta or {}
    exchange = make_exchange(meta.get(META_MODE, "plain"))
    if meta.get(META_STEP) == "collect":
        # with statistics DP on, the site's one noised release; N_k c_k is derived from it
        # (post-processing), so everything sent here is covered by the same budget
        release = trainer.released_statistics()
        vector = statistics_vector(release.class_counts, release.num_samples)
        payload = exchange.encode(vector)
        metrics = {"stats_sent": 1.0}  # the Client API refuses a result without params or metrics
        if release.epsilon is not None:
            metrics.update(stats_dp_epsilon=float(release.epsilon), stats_dp_delta=float(release.delta))
        return FLModel(
            metrics=metrics,
            meta={META_LENGTH: int(vector.size), META_NUM_SAMPLES: len(trainer.site.train), **payload},
        )
    stats = decode_sum(exchange.decode(meta))
    trainer.global_stats = stats.as_dict()
    try:
        Path(GLOBAL_STATS_FILE.format(job_id=trainer.job_id)).write_text(json.dumps(trainer.global_stats))
    except OSError as e:  # the in-memory copy still serves this process
        logger.warning("could not keep global statistics on disk: %s", e)
    logger.info("%s: global statistics received (N=%d)", trainer.site_name, stats.num_samples)
    return FLModel(metrics={"stats_received": 1.0}, meta={"ok": True})


def load_cached_global_stats(job_id: str) -> dict | None:
    """Global statistics kept by an earlier process of this client in the same job (relaunches)."""
    path = Path(GLOBAL_STATS_FILE.format(job_id=job_id))
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
    return None


__all__ = [
    "GLOBAL_STATS_FILE",
    "answer_statistics_task",
    "load_cached_global_stats",
    "make_exchange",
    "run_statistics_phase",
]

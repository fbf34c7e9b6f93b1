"""The label-statistics phase: sites learn the global label histogram before training.

Each site contributes one vector, its *statistics vector*::

    v_k = [n_{k,1}, ..., n_{k,C}, N_k, N_k * c_k]

(positives per class, sample count, and N_k times DAFL's client imbalance c_k, so that the sum gives
DAFL's c_client = sum_k N_k c_k / N). The phase has two steps, both sent as the ``stats`` task:

1. ``collect``: every site sends its contribution; the server sums them.
2. ``distribute``: the server returns the sum; every site derives the global statistics and keeps
   them (the loss and the scheme's client scalars use them).

The exchange is an :class:`StatisticsExchange`; ``plain`` sends v_k in clear (research runs only:
it reveals each hospital's disease prevalence to the server and logs a warning), ``secure`` sums
encrypted vectors so the server sees neither v_k nor the sum.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedweigh.flare.constants import META_NUM_SAMPLES, META_SCALARS, TASK_STATS

logger = logging.getLogger("fedweigh.statistics")

META_STEP = "fedweigh_stats_step"
META_MODE = "fedweigh_stats_mode"
META_VECTOR = "fedweigh_stats_vector"
GLOBAL_STATS_FILE = "fedweigh_global_stats_{job_id}.json"


@dataclass
class GlobalStats:
    """What every site knows after the phase."""

    class_counts: np.ndarray
    num_samples: int
    client_level_parameter: float

    def as_dict(self) -> dict:
        return {
            "class_counts": [int(x) for x in self.class_counts],
            "num_samples": int(self.num_samples),
            "client_level_parameter": float(self.client_level_parameter),
        }


def statistics_vector(class_counts: np.ndarray, num_samples: int) -> np.ndarray:
    """v_k = [n_{k,1..C}, N_k, N_k c_k] (float64)."""
    from fedweigh.weighting.dafl import client_imbalance

    counts = np.asarray(class_counts, dtype=np.float64)
    c_k = client_imbalance(counts, num_samples)
    return np.concatenate([counts, [float(num_samples), float(num_samples) * c_k]])


def decode_sum(total: np.ndarray) -> GlobalStats:
    """Global statistics from sum_k v_k (rounded counts; c_client = sum N_k c_k / N)."""
    total = np.asarray(total, dtype=np.float64)
    counts = np.rint(total[:-2]).astype(np.int64)
    n = int(round(total[-2]))
    if n <= 0 or np.any(counts < 0):
        raise ValueError(f"implausible global statistics: N={n}, counts={counts.tolist()}")
    return GlobalStats(class_counts=counts, num_samples=n, client_level_parameter=float(total[-1]) / n)


class StatisticsExchange(ABC):
    """How contributions travel: the client side encodes/decodes, the server side sums."""

    mode: str = ""

    @abstractmethod
    def encode(self, vector: np.ndarray) -> dict:
        """The client's contribution, as result meta/params."""

    def check(self, site: str, payload: dict, length: int) -> None:
        """Server: raise ValueError naming ``site`` if its contribution is malformed (default: no check)."""
        return None

    @abstractmethod
    def sum(self, site_payloads: dict[str, dict], length: int) -> dict:
        """Server: the sum of the valid contributions (as a payload the clients can decode)."""

    @abstractmethod
    def decode(self, payload: dict) -> np.ndarray:
        """Client: the summed vector from the server's payload."""


class PlainExchange(StatisticsExchange):
    """Contributions in clear (the server sees every site's histogram)."""

    mode = "plain"

    def encode(self, vector: np.ndarray) -> dict:
        return {META_VECTOR: [float(x) for x in vector]}

    def check(self, site: str, payload: dict, length: int) -> None:
        try:
            vec = np.asarray(payload.get(META_VECTOR, []), dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{site}: statistics vector is not numeric") from None
        if vec.shape != (length,) or not np.isfinite(vec).all():
            raise ValueError(f"{site}: statistics vector must be {length} finite numbers")
        if np.any(vec[:-1] < 0) or np.any(vec[:-2] > vec[-2]):
            raise ValueError(f"{site}: statistics vector has negative counts or counts above N_k")

    def sum(self, site_payloads: dict[str, dict], length: int) -> dict:
        total = np.zeros(length, dtype=np.float64)
        for payload in site_payloads.values():
            total += np.asarray(payload[META_VECTOR], dtype=np.float64)
        return {META_VECTOR: [float(x) for x in total]}

    def decode(self, payload: dict) -> np.ndarray:
        return np.asarray(payload[META_VECTOR], dtype=np.float64)


def make_exchange(mode: str) -> StatisticsExchange:
    if mode == "plain":
        return PlainExchange()
    if mode == "secure":
        from fedweigh.flare.secure_statistics import SecureExchange

        return SecureExchange()
    raise ValueError(f"statistics mode must be 'plain' or 'secure', got {mode!r}")


# ---------------------------------------------------------------------------------------- server
def run_statistics_phase(controller, sites: list[str], mode: str) -> None:
    """Run collect + distribute through ``controller.ask_sites``; invalid or silent sites are skipped."""
    from nvflare.app_common.abstract.fl_model import FLModel

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
        length = meta.get("fedweigh_stats_length")
        if not isinstance(length, int) or length < 3:
            controller.warning(f"statistics: skipping {site}: no valid fedweigh_stats_length")
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
def answer_statistics_task(trainer, input_model):
    """The client's answer to a ``stats`` task (collect or distribute)."""
    from nvflare.app_common.abstract.fl_model import FLModel

    meta = input_model.meta or {}
    exchange = make_exchange(meta.get(META_MODE, "plain"))
    if meta.get(META_STEP) == "collect":
        from fedweigh.privacy import released_histogram

        # with statistics DP on (trainer.args.stats_dp_epsilon), the site's one noised release; N_k c_k is
        # derived from it (post-processing), so everything sent here is covered by the same budget
        counts, num_samples = released_histogram(trainer)
        vector = statistics_vector(counts, num_samples)
        payload = exchange.encode(vector)
        metrics = {"stats_sent": 1.0}  # the Client API refuses a result without params or metrics
        release = getattr(trainer, "stats_release", None)
        if release is not None:
            metrics.update(stats_dp_epsilon=float(release.epsilon), stats_dp_delta=float(release.delta))
        return FLModel(
            metrics=metrics,
            meta={
                "fedweigh_stats_length": int(vector.size),
                META_NUM_SAMPLES: len(trainer.site.train),
                **payload,
            },
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
    "GlobalStats",
    "META_SCALARS",
    "PlainExchange",
    "StatisticsExchange",
    "answer_statistics_task",
    "decode_sum",
    "run_statistics_phase",
    "statistics_vector",
]

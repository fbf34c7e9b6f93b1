"""A site's label histogram as it may be revealed: exact, or one Gaussian-noised release per job.

Releases are kept per *budget* (the ``job_id`` given here; the NVFlare client passes the budget id
the server announces, which survives ``resume_from``, so a resumed job reuses the release).

Without statistics DP a site reveals its exact histogram (n_1..n_C, N_k). With it
(:class:`fedweigh.secure.dp_config.StatsDPConfig`), the release is drawn by the Gaussian mechanism
(:func:`fedweigh.secure.gaussian.privatize_histogram`) ONCE per job and site, with noise from the OS
(never from the job's seed, which the server knows), and kept: in memory by the
:class:`HistogramReleaser` and, for an NVFlare job, in :data:`STATS_RELEASE_FILE` in the site's
working folder, so that a relaunched client or a repeated request sends the same release instead of
spending the budget again. A kept release made with another (epsilon, delta) or number of classes is
an error, never silently replaced. Everything the site derives from the release (the statistics
vector's N_k c_k, a scheme's client scalars) is post-processing and covered by the same budget.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedweigh.io import atomic_write_json
from fedweigh.secure.dp_config import LOCAL_JOB_ID, StatsDPConfig, job_site_path
from fedweigh.secure.file_checks import check_private_file
from fedweigh.secure.gaussian import HistogramRelease, privatize_histogram

__all__ = ["STATS_RELEASE_FILE", "HistogramReleaser", "ReleasedHistogram"]

logger = logging.getLogger("fedweigh.secure.stats_release")

#: File that keeps a site's noised label statistics for a job (released once, reused on relaunch).
STATS_RELEASE_FILE = "fedweigh_stats_dp_{job_id}_{site}.json"


@dataclass(frozen=True, eq=False)
class ReleasedHistogram:
    """What a site may reveal of its label histogram; ``epsilon``/``delta`` are None without DP."""

    class_counts: np.ndarray
    num_samples: int
    epsilon: float | None
    delta: float | None


class HistogramReleaser:
    """The once-per-job release of one site's label histogram (module docstring).

    Args:
        config: the job's statistics-DP settings; None releases the exact histogram.
        site_name: names the site in messages and in the release file.
        job_id: the NVFlare job; nothing is written for :data:`~fedweigh.secure.dp_config.LOCAL_JOB_ID`.
        folder: where the release file is kept (the client's working folder by default).
        guard: the site policy's epsilon caps (:class:`fedweigh.site.policy.PrivacyGuard`), asked before
            the one draw (it raises to refuse it) and told what the release spent.
    """

    def __init__(
        self,
        config: StatsDPConfig | None,
        site_name: str,
        job_id: str,
        folder: str | Path = ".",
        guard: Any = None,
    ) -> None:
        self.config = config
        self.site_name = site_name
        self.job_id = str(job_id)
        self.folder = Path(folder)
        self.guard = guard
        #: The DP release of this job and site (drawn here or reloaded from its file); None until then.
        self.drawn: HistogramRelease | None = None

    @property
    def path(self) -> Path | None:
        """The release file of this job and site (None for in-process runs)."""
        if self.job_id == LOCAL_JOB_ID:
            return None
        return job_site_path(STATS_RELEASE_FILE, self.job_id, self.site_name, self.folder)

    def release(
        self,
        class_counts: np.ndarray,
        num_samples: int,
        task: str,
        rng: np.random.Generator | None = None,
    ) -> ReleasedHistogram:
        """The histogram to reveal: exact without DP, else this job's one noised release.

        ``rng`` only serves a first draw (tests); it defaults to OS randomness.
        Raises ValueError when a kept release used another (epsilon, delta) or number of classes.
        """
        counts = np.asarray(class_counts)
        config = self.config
        if config is None:
            return ReleasedHistogram(counts, num_samples, None, None)
        release = self.drawn
        path = self.path
        if release is None and path is not None and path.is_file():
            check_private_file(
                path, f"{self.site_name}: statistics release", "anyone could replace what this site revealed"
            )
            release = HistogramRelease.from_dict(json.loads(path.read_text()))
            logger.info(
                "%s: reusing the label statistics released earlier in job %s", self.site_name, self.job_id
            )
        if release is not None and (
            release.epsilon != config.epsilon
            or release.delta != config.delta
            or release.class_counts.size != counts.size
        ):
            raise ValueError(
                f"{self.site_name}: the statistics released earlier in job {self.job_id} used "
                f"(epsilon={release.epsilon}, delta={release.delta}, {release.class_counts.size} classes), "
                f"the job now asks for (epsilon={config.epsilon}, delta={config.delta}, {counts.size} classes)"
            )
        if release is None:
            if self.guard is not None:
                # the site policy's delta bound and caps (reserved), before the draw
                self.guard.check("statistics", config.epsilon, delta=config.delta, num_samples=num_samples)
            release = privatize_histogram(counts, num_samples, task, config, rng)
            if path is not None:
                atomic_write_json(path, release.as_dict(), indent=1)
            logger.info(
                "%s: label statistics noised (Gaussian, sigma=%.3f, sensitivity=%.3f, epsilon=%g, delta=%g)",
                self.site_name,
                release.sigma,
                release.sensitivity,
                release.epsilon,
                release.delta,
            )
        self.drawn = release
        if self.guard is not None:
            self.guard.record("statistics", release.epsilon, release.delta)
        return ReleasedHistogram(release.class_counts, release.num_samples, release.epsilon, release.delta)

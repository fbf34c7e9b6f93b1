"""Differential-privacy settings of a job: DP-SGD on the model updates, Gaussian noise on the label statistics.

Two independent mechanisms, each with its own (epsilon, delta) budget (they compose: a site that uses
both has spent at most the sum of the epsilons and the sum of the deltas):

- :class:`DPConfig`: DP-SGD (Abadi et al., CCS 2016) on every local optimizer step, run by
  :class:`fedweigh.secure.dp_sgd.DPSGD` and accounted by :mod:`fedweigh.secure.accountant`;
- :class:`StatsDPConfig`: the Gaussian mechanism (:mod:`fedweigh.secure.gaussian`) on a site's label
  histogram, released once per job (:mod:`fedweigh.secure.stats_release`).

Both are derived from a site's :class:`fedweigh.site.args.ClientArgs` (its ``dp_*`` and ``stats_dp_*``
fields: ``ClientArgs.dp_config()``, ``ClientArgs.stats_dp_config()``), None when off.
Files a site keeps for a job (the DP-SGD account, the released histogram) are named by
:func:`job_site_path`; nothing is persisted for in-process runs (job id :data:`LOCAL_JOB_ID`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from fedweigh.errors import PrivacyBudgetExhausted

__all__ = [
    "ACCOUNTANTS",
    "DPConfig",
    "DP_MODES",
    "LOCAL_JOB_ID",
    "PrivacyBudgetExhausted",
    "STATS_MECHANISMS",
    "StatsDPConfig",
    "job_site_path",
]

#: Per-sample gradient implementations: fedweigh's own layer hooks ("fast"), and Opacus' modes.
DP_MODES: tuple[str, ...] = ("auto", "fast", "hooks", "functorch", "ghost")
ACCOUNTANTS: tuple[str, ...] = ("rdp", "prv")
STATS_MECHANISMS: tuple[str, ...] = ("analytic", "classic")
#: The job id of in-process runs (``SiteTrainer.job_id`` default): nothing is persisted for it.
LOCAL_JOB_ID = "local"


@dataclass
class DPConfig:
    """DP-SGD settings of a job.

    Exactly one of ``epsilon`` (the TOTAL budget over the job's planned rounds; the noise multiplier
    is derived from it) and ``noise_multiplier`` (sigma, fixed; epsilon then only grows with the
    steps taken) must be given.

    Args:
        epsilon: target epsilon for the whole job.
        delta: target delta; choose it below 1 / N_k (e.g. 1e-5 for sites of up to ~10^4 images).
        max_grad_norm: per-sample L2 clipping bound C.
        noise_multiplier: sigma, the noise std divided by C.
        accountant: ``"rdp"`` (Renyi DP) or ``"prv"`` (privacy random variables; tighter).
        mode: per-sample gradient implementation: ``"fast"`` (fedweigh's layer hooks, Conv2d/Linear/
            GroupNorm/InstanceNorm2d models), ``"hooks"``, ``"functorch"`` or ``"ghost"`` (Opacus'),
            or ``"auto"``: ``"fast"`` when the model has only supported layers, else ``"hooks"``.
    """

    epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    accountant: str = "rdp"
    mode: str = "auto"

    def __post_init__(self) -> None:
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "DPConfig: give exactly one of epsilon (total budget) and noise_multiplier, got "
                f"epsilon={self.epsilon}, noise_multiplier={self.noise_multiplier}"
            )
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"DPConfig.epsilon must be a positive finite number, got {self.epsilon}")
        if self.noise_multiplier is not None and not (
            self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)
        ):
            raise ValueError(f"DPConfig.noise_multiplier must be > 0, got {self.noise_multiplier}")
        if not 0 < self.delta < 1:
            raise ValueError(f"DPConfig.delta must be in (0, 1), got {self.delta}")
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ValueError(f"DPConfig.max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"DPConfig.accountant must be one of {ACCOUNTANTS}, got {self.accountant!r}")
        if self.mode not in DP_MODES:
            raise ValueError(f"DPConfig.mode must be one of {DP_MODES}, got {self.mode!r}")


@dataclass
class StatsDPConfig:
    """Gaussian noise on a site's label statistics: one release with budget (epsilon, delta).

    ``mechanism``: ``"analytic"`` (Balle and Wang 2018, exact, any epsilon) or ``"classic"``
    (sigma = Delta sqrt(2 ln(1.25/delta)) / epsilon, only for epsilon < 1).
    """

    epsilon: float
    delta: float = 1e-5
    mechanism: str = "analytic"

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"StatsDPConfig.epsilon must be a positive finite number, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"StatsDPConfig.delta must be in (0, 1), got {self.delta}")
        if self.mechanism not in STATS_MECHANISMS:
            raise ValueError(
                f"StatsDPConfig.mechanism must be one of {STATS_MECHANISMS}, got {self.mechanism!r}"
            )
        if self.mechanism == "classic" and self.epsilon >= 1:
            raise ValueError(
                f"StatsDPConfig: the classic Gaussian bound holds only for epsilon < 1, got {self.epsilon}; "
                "use mechanism='analytic'"
            )


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(text)) or "_"


def job_site_path(pattern: str, job_id: str, site_name: str, folder: str | Path = ".") -> Path:
    """``folder / pattern.format(job_id=..., site=...)``, both names reduced to ``[A-Za-z0-9_.-]``.

    Names the files a site keeps for one job (its DP-SGD account, its released label histogram).
    """
    return Path(folder) / pattern.format(job_id=_safe_name(job_id), site=_safe_name(site_name))

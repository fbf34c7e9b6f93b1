"""A site's privacy policy: what the hospital, not the job, lets a federation do with its data.

The policy is a JSON file the site keeps in its ``local/`` folder, next to its data settings
(``local/fedweigh_policy.json``; or the file named by ``FEDWEIGH_SITE_POLICY``). Every field is
optional; a missing one takes the default of the column that applies::

    {
      "statistics_modes": ["secure"],        # label-statistics exchanges the site takes part in
      "require_encrypted_updates": false,    # refuse jobs whose model updates travel in clear
      "require_dp": false,                   # refuse jobs without DP-SGD on the model updates
      "require_statistics_dp": false,        # refuse jobs without DP noise on the label statistics
      "statistics_epsilon": 1.0,             # epsilon of the site's statistics release when the job sets none (null: exact)
      "max_epsilon_per_job": 10.0,           # DP-SGD + statistics epsilon within one budget (null: no cap)
      "max_epsilon_total": 100.0,            # over every budget this site ever spent (null: no cap)
      "max_delta": 1e-5,                     # largest delta of any one DP release (and always < 1/N_k)
      "read_dirs": [],                       # folders a job may read `pretrained` from, besides its own
      "min_secure_sum": 3,                   # fewest contributions to any secure sum it decrypts
      "report_scalars": ["similarity", "skew", "imbalance", "discrepancy"]
    }

=========================  =========================  ============================================
field                      provisioned kit, no file   simulation / in-process, no file
=========================  =========================  ============================================
statistics_modes           ``["secure"]``             ``["plain", "secure"]``
require_encrypted_updates  false                      false
require_dp                 false                      false
require_statistics_dp      false                      false
statistics_epsilon         1.0                        1.0
max_epsilon_per_job        10.0                       none
max_epsilon_total          100.0                      none
max_delta                  1e-5                       1e-5
read_dirs                  ``[]`` (the job's own)     any folder
min_secure_sum             3                          2
report_scalars             all four                   all four
=========================  =========================  ============================================

The policy file is read only if the site's user alone can change it, as ssh's ``StrictModes``
judges its files (:func:`fedweigh.secure.file_checks.check_private_file`): after following links, it
must be owned by the site's user or root and not writable by its group or others, and the folders
holding it and every link to it must be writable by their owner (the site's user or root) only.
Anything else is refused with a :class:`PermissionError` naming the file, the problem and the fix.

A site whose startup kit is provisioned (it holds ``fed_client.json`` or ``rootCA.pem``) and that
has no policy file gets the left column; anything else (``nvflare simulator``, the benchmark) the
permissive right one, through the same code. A job asking for less than the policy is refused by
the site: it answers every task with the reason (``fedweigh_refused``) instead of any data, the site
and the server log it, and the server leaves the site out (and stops the job when too few sites
remain). fedweigh's client script applies the policy itself; the hospital's ``local/privacy.json``
applies it outside the job's code too, for jobs that bring their own (:mod:`fedweigh.flare.policy_filter`).

Epsilon is spent per *budget*: the id the server announces with every task (the first job's id,
kept across ``resume_from``), so a resumed run continues its account instead of starting again at
zero. The site keeps what each budget spent in its own ledger file (:class:`PrivacyLedger`), which
no job can reset and which is held to the same file check as the policy. Within a budget every job
keeps its own entry (its running total), and the entries ADD: ``max_epsilon_per_job`` caps a budget's
sum over its jobs (two jobs started under one budget id share that cap) and ``max_epsilon_total`` the
sum over every budget the site ever spent. DP-SGD kept in an accountant file is one entry per file,
which a resumed run continues rather than adds to (:mod:`fedweigh.site.ledger`). The ledger checks and
records under a lock shared by every process of the site, so jobs running at once cannot together
spend more than the caps.

Delta is bounded per release: a job's ``dp_delta`` and ``stats_dp_delta`` must be at most
``max_delta`` and below 1/N_k (N_k: the site's training images), the usual requirement that delta
be far smaller than the chance of singling out one record (Dwork & Roth 2014, sec. 2.3). A larger
delta buys less noise for the same epsilon: sigma grows with sqrt(2 ln(1.25/delta)).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from fedweigh.errors import PolicyRefusal
from fedweigh.protocol import ABSOLUTE_MIN, SITE_POLICY_ENV, SITE_POLICY_FILE
from fedweigh.secure.contexts import STARTUP_FOLDER, find_site_root, is_provisioned
from fedweigh.secure.file_checks import check_private_file
from fedweigh.site.ledger import MECHANISMS, PrivacyLedger
from fedweigh.weighting.base import KNOWN_SCALARS

__all__ = [
    "DEFAULT_MAX_DELTA",
    "LEDGER_FILE",
    "MECHANISMS",
    "PERMISSIVE_DEFAULT",
    "PROVISIONED_DEFAULT",
    "STATISTICS_MODES",
    "PolicyRefusal",
    "PrivacyGuard",
    "PrivacyLedger",
    "SitePolicy",
    "find_policy_file",
    "ledger_path",
    "load_site_policy",
]

#: Statistics exchanges a policy can name.
STATISTICS_MODES: tuple[str, ...] = ("plain", "secure")
#: The site's ledger of epsilon spent (in the site's workspace root, next to its DP-SGD accounts).
LEDGER_FILE = "fedweigh_privacy_ledger_{site}.json"
#: The largest delta of one DP release a policy allows unless it says otherwise.
DEFAULT_MAX_DELTA = 1e-5


@dataclass(frozen=True)
class SitePolicy:
    """What a site accepts (module docstring). ``source`` says where the policy came from."""

    statistics_modes: tuple[str, ...] = ("secure",)
    require_encrypted_updates: bool = False
    require_dp: bool = False
    require_statistics_dp: bool = False
    #: epsilon of the site's one Gaussian release of its label statistics when the job sets no
    #: ``stats_dp_epsilon`` (None: the site allows its exact statistics to leave it)
    statistics_epsilon: float | None = 1.0
    max_epsilon_per_job: float | None = 10.0
    max_epsilon_total: float | None = 100.0
    max_delta: float = DEFAULT_MAX_DELTA
    #: folders a job may read a ``pretrained`` checkpoint from, besides its own (None: any folder)
    read_dirs: tuple[str, ...] | None = ()
    min_secure_sum: int = 3
    report_scalars: tuple[str, ...] = KNOWN_SCALARS
    source: str = "built-in default"

    # ------------------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, raw: object, origin: str, base: SitePolicy | None = None) -> SitePolicy:
        """A policy from parsed JSON; a missing field keeps ``base``'s value (default: the
        provisioned default). ValueError naming ``origin`` and the field for anything invalid."""
        base = base or PROVISIONED_DEFAULT
        if not isinstance(raw, Mapping):
            raise ValueError(f"site policy {origin} must hold a JSON object, got {type(raw).__name__}")
        known = [f.name for f in fields(cls) if f.name != "source"]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"site policy {origin}: unknown field(s) {unknown}; known: {known}")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            values[name] = _check_field(origin, name, value)
        return replace(base, **values, source=origin)

    @classmethod
    def from_file(cls, path: str | Path, base: SitePolicy | None = None) -> SitePolicy:
        """The policy in ``path`` (missing fields: ``base``'s values), if only the site's user can change
        the file (module docstring): FileNotFoundError, PermissionError or ValueError naming the file."""
        path = Path(path)
        check_private_file(path, "site policy", "anyone could loosen it")
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise FileNotFoundError(f"site policy {path} does not exist") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"site policy {path} is not valid JSON: {e}") from e
        return cls.from_dict(raw, str(path), base)

    def as_dict(self) -> dict:
        """The policy as its file would hold it."""
        return {
            "statistics_modes": list(self.statistics_modes),
            "require_encrypted_updates": self.require_encrypted_updates,
            "require_dp": self.require_dp,
            "require_statistics_dp": self.require_statistics_dp,
            "statistics_epsilon": self.statistics_epsilon,
            "max_epsilon_per_job": self.max_epsilon_per_job,
            "max_epsilon_total": self.max_epsilon_total,
            "max_delta": self.max_delta,
            "read_dirs": None if self.read_dirs is None else list(self.read_dirs),
            "min_secure_sum": self.min_secure_sum,
            "report_scalars": list(self.report_scalars),
        }

    # ------------------------------------------------------------------------------ judging a job
    def _refuse(self, what: str) -> str:
        return f"{what} (site policy: {self.source})"

    def job_refusal(self, args: Any) -> str | None:
        """Why the site refuses a job with client arguments ``args`` (its DP settings), or None."""
        dp_epsilon = getattr(args, "dp_epsilon", None)
        dp_sigma = getattr(args, "dp_noise_multiplier", None)
        stats_epsilon = getattr(args, "stats_dp_epsilon", None)
        if self.require_dp and dp_epsilon is None and dp_sigma is None:
            return self._refuse(
                "the job trains without DP-SGD, and this site requires DP on its model updates"
            )
        # a job that sets no statistics epsilon gets the site's own statistics_epsilon (None: exact), which
        # the release itself checks against the caps and max_delta when (and if) the job has a statistics phase
        if self.require_statistics_dp and stats_epsilon is None and self.statistics_epsilon is None:
            return self._refuse(
                "the job releases the label statistics without DP noise, and this site requires it"
            )
        for name, active in (
            ("dp_delta", dp_epsilon is not None or dp_sigma is not None),
            ("stats_dp_delta", stats_epsilon is not None),
        ):
            delta = getattr(args, name, None)
            if active and (delta is None or not delta <= self.max_delta):
                return self._refuse(
                    f"the job asks for {name}={delta}, above this site's max_delta={self.max_delta:g}"
                )
        pretrained = getattr(args, "pretrained", None)
        if pretrained is not None and not self.may_read(pretrained):
            return self._refuse(
                f"the job reads the checkpoint pretrained={pretrained!r} from outside its own folder and this "
                f"site's read_dirs={list(self.read_dirs or [])}"
            )
        planned = float(dp_epsilon or 0.0) + float(stats_epsilon or 0.0)
        if self.max_epsilon_per_job is not None and planned > self.max_epsilon_per_job:
            return self._refuse(
                f"the job plans to spend epsilon {planned:g} (DP-SGD {dp_epsilon}, statistics {stats_epsilon}), "
                f"more than this site's max_epsilon_per_job={self.max_epsilon_per_job:g}"
            )
        return None

    def may_read(self, path: str | Path, workspace: str | Path | None = None) -> bool:
        """Whether a job may read ``path`` (links followed): inside ``workspace`` (default: the working
        folder, the job's own) or a folder of ``read_dirs``; any path when ``read_dirs`` is None."""
        if self.read_dirs is None:
            return True
        resolved = Path(os.path.expanduser(os.path.expandvars(str(path)))).resolve()
        folders = [Path(workspace if workspace is not None else Path.cwd()), *map(Path, self.read_dirs)]
        return any(resolved == f.resolve() or f.resolve() in resolved.parents for f in folders)

    def statistics_refusal(self, mode: object) -> str | None:
        """Why the site refuses a statistics exchange in ``mode``, or None."""
        if mode not in self.statistics_modes:
            return self._refuse(
                f"the job exchanges label statistics in mode {mode!r}; this site accepts only "
                f"{list(self.statistics_modes)}"
            )
        return None

    def task_refusal(self, plan: Mapping | None, encrypted: bool) -> str | None:
        """Why the site refuses a training task with ``plan`` (``encrypted``: the task carries the
        HE layout, so the site's update will be sent encrypted), or None."""
        plan = plan or {}
        if self.require_encrypted_updates and not encrypted:
            return self._refuse("the job sends model updates in clear; this site requires encrypted updates")
        if plan.get("he") and not encrypted:
            return self._refuse("the plan announces encrypted updates but the task carries no HE layout")
        asked = plan.get("scalars") or []
        if not isinstance(asked, (list, tuple)):
            return self._refuse(f"the plan's scalars must be a list, got {asked!r}")
        extra = [s for s in asked if s not in self.report_scalars]
        if extra:
            return self._refuse(
                f"the job asks for the scalar(s) {extra}; this site reports only {list(self.report_scalars)}"
            )
        return None


def _check_field(origin: str, name: str, value: object) -> Any:
    where = f"site policy {origin}: {name}"
    if name in ("require_encrypted_updates", "require_dp", "require_statistics_dp"):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if name in ("max_epsilon_per_job", "max_epsilon_total"):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
            raise ValueError(f"{where} must be a number >= 0 or null (no cap), got {value!r}")
        return float(value)
    if name == "statistics_epsilon":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
            raise ValueError(f"{where} must be a number > 0 or null (exact statistics), got {value!r}")
        return float(value)
    if name == "read_dirs":
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(d, str) and os.path.isabs(d) for d in value):
            raise ValueError(f"{where} must be a list of absolute folder paths or null (any), got {value!r}")
        return tuple(value)
    if name == "max_delta":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < 1):
            raise ValueError(f"{where} must be a number in (0, 1), got {value!r}")
        return float(value)
    if name == "min_secure_sum":
        if isinstance(value, bool) or not isinstance(value, int) or value < ABSOLUTE_MIN:
            raise ValueError(f"{where} must be an integer >= {ABSOLUTE_MIN}, got {value!r}")
        return value
    if name == "statistics_modes":
        if not isinstance(value, list) or any(m not in STATISTICS_MODES for m in value):
            raise ValueError(f"{where} must be a list of {list(STATISTICS_MODES)}, got {value!r}")
        return tuple(value)
    if name == "report_scalars":
        if not isinstance(value, list) or any(s not in KNOWN_SCALARS for s in value):
            raise ValueError(f"{where} must be a list of {list(KNOWN_SCALARS)}, got {value!r}")
        return tuple(value)
    raise ValueError(f"{where}: unknown field")  # pragma: no cover - from_dict checks the names first


#: A provisioned site without a policy file.
PROVISIONED_DEFAULT = SitePolicy(source="default policy of a provisioned site (no fedweigh_policy.json)")
#: Simulation and in-process runs without a policy file: every mode, no caps, sums of two or more.
PERMISSIVE_DEFAULT = SitePolicy(
    statistics_modes=STATISTICS_MODES,
    read_dirs=None,
    max_epsilon_per_job=None,
    max_epsilon_total=None,
    min_secure_sum=ABSOLUTE_MIN,
    source="permissive default (no fedweigh_policy.json and no provisioned startup kit: simulation)",
)


def find_policy_file(start: str | Path | None = None) -> Path | None:
    """The site's policy file: ``$FEDWEIGH_SITE_POLICY``, else ``local/fedweigh_policy.json`` in the
    site's workspace root (the nearest folder at or above ``start``, default the working directory,
    with a ``startup/`` folder) or in ``start`` itself."""
    env = os.environ.get(SITE_POLICY_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise FileNotFoundError(f"{SITE_POLICY_ENV}={env} does not name an existing file")
        return path
    here = Path(start if start is not None else Path.cwd())
    roots = [r for r in (find_site_root(here), here) if r is not None]
    for root in roots:
        candidate = Path(root) / "local" / SITE_POLICY_FILE
        if candidate.is_file():
            return candidate
    return None


def load_site_policy(start: str | Path | None = None) -> SitePolicy:
    """This site's policy: its file if it has one (missing fields: the provisioned defaults), else the
    provisioned default in a provisioned kit, else the permissive default (module docstring)."""
    path = find_policy_file(start)
    if path is not None:
        return SitePolicy.from_file(path)
    root = find_site_root(Path(start if start is not None else Path.cwd()))
    if root is not None and is_provisioned(Path(root) / STARTUP_FOLDER):
        return PROVISIONED_DEFAULT
    return PERMISSIVE_DEFAULT


# ---------------------------------------------------------------------------------------- guard
class PrivacyGuard:
    """The site policy's epsilon caps, checked before a DP mechanism spends and recorded after.

    DP-SGD (:class:`fedweigh.secure.dp_sgd.DPSGD`) and the statistics release
    (:class:`fedweigh.secure.stats_release.HistogramReleaser`) call :meth:`check` with the epsilon
    they would reach and :meth:`record` with what they reached, under :attr:`budget_id`. Each figure is
    the running total of one *account* of the budget: :attr:`job_id` (the NVFlare job this process
    serves) unless the caller names another (DP-SGD names its accountant file, which a resumed run
    continues). The caps are checked on sums over the budget's accounts (:mod:`fedweigh.site.ledger`).

    Args:
        budget_id: the budget spent from (the NVFlare client re-points it to the id the server announces).
        job_id: this process's job, the default account (default: ``budget_id`` as given here, which is
            the NVFlare job id where the client builds the guard).
    """

    def __init__(
        self,
        policy: SitePolicy,
        ledger: PrivacyLedger,
        site_name: str,
        budget_id: str,
        job_id: str | None = None,
    ) -> None:
        self.policy = policy
        self.ledger = ledger
        self.site_name = site_name
        self.budget_id = str(budget_id)
        self.job_id = str(job_id if job_id is not None else budget_id)
        #: (budget, account, mechanism) this guard reserved: their records overwrite its own entry
        self._reserved: set[tuple[str, str, str]] = set()

    def delta_refusal(self, mechanism: str, delta: float | None, num_samples: int | None) -> str | None:
        """Why ``mechanism`` may not release with ``delta`` on ``num_samples`` records, or None."""
        if delta is None or not math.isfinite(delta) or not 0 < delta <= self.policy.max_delta:
            return (
                f"{self.site_name}: {mechanism} asks for delta={delta}; this site allows 0 < delta <= "
                f"max_delta={self.policy.max_delta:g} (site policy: {self.policy.source})"
            )
        if num_samples is not None and num_samples > 0 and not delta < 1.0 / num_samples:
            return (
                f"{self.site_name}: {mechanism} asks for delta={delta:g}, not below 1/N_k = 1/{num_samples} "
                f"(a delta that large allows releasing one record outright; site policy: {self.policy.source})"
            )
        return None

    def check(
        self,
        mechanism: str,
        epsilon: float,
        *,
        delta: float | None,
        num_samples: int | None,
        account: str | None = None,
    ) -> None:
        """Raise :class:`PolicyRefusal` if ``mechanism`` reaching ``epsilon`` (the running total of
        ``account``, default :attr:`job_id`) with ``delta`` on ``num_samples`` records breaks the
        policy; otherwise reserve ``epsilon`` in the ledger, in the same locked transaction (so that no
        other job can spend it meanwhile)."""
        reason = self.delta_refusal(mechanism, delta, num_samples)
        if reason:
            raise PolicyRefusal(reason)
        account = self.job_id if account is None else str(account)

        def caps(job: float, total: float) -> None:
            cap = self.policy.max_epsilon_per_job
            if cap is not None and job > cap * (1 + 1e-9):
                raise PolicyRefusal(
                    f"{self.site_name}: {mechanism} would take budget {self.budget_id!r} to epsilon {job:.4g}, "
                    f"above this site's max_epsilon_per_job={cap:g} (site policy: {self.policy.source})"
                )
            cap = self.policy.max_epsilon_total
            if cap is not None and total > cap * (1 + 1e-9):
                raise PolicyRefusal(
                    f"{self.site_name}: {mechanism} would take the site's total epsilon to {total:.4g}, above "
                    f"its max_epsilon_total={cap:g} (spent so far: {_total(self.ledger.entries):.4g}; site policy: {self.policy.source})"
                )

        self.ledger.reserve(self.budget_id, mechanism, epsilon, delta, check=caps, account=account)
        self._reserved.add((self.budget_id, account, mechanism))

    def record(
        self, mechanism: str, epsilon: float, delta: float | None = None, account: str | None = None
    ) -> None:
        """What ``mechanism`` of ``account`` (default :attr:`job_id`) reached: overwrites the figure
        reserved by :meth:`check`. A figure this guard never reserved (a release kept from an earlier
        job of the budget and reused) is recorded only if no account of the budget holds it already."""
        account = self.job_id if account is None else str(account)
        reused = (self.budget_id, account, mechanism) not in self._reserved
        self.ledger.record(self.budget_id, mechanism, epsilon, delta, account, unless_held=reused)


def _total(entries: Mapping[str, Mapping[str, float]]) -> float:
    """The sum of every figure of ``entries`` (per budget and mechanism)."""
    return float(sum(sum(b.values()) for b in entries.values()))


def ledger_path(site_name: str, folder: str | Path = ".") -> Path:
    """Where a site keeps its privacy ledger (its workspace root when run by NVFlare)."""
    from fedweigh.secure.dp_config import job_site_path

    return job_site_path(LEDGER_FILE, "", site_name, folder)

"""A site's privacy ledger: the (epsilon, delta) each budget has spent, added over its jobs, safe under
concurrent jobs.

NVFlare runs several jobs at one site at once, each in its own process; all of them spend from the
same site total (``max_epsilon_total`` of :mod:`fedweigh.site.policy`). Every read-check-record is
one transaction under an exclusive lock on ``<ledger>.lock`` (``filelock``: ``fcntl.flock`` on POSIX,
``msvcrt.locking`` on Windows): the file is re-read inside the lock, the caps are checked against
what every job has spent so far, the new figure is written, and only then is the lock released.
So two jobs that each plan epsilon 8 under a total cap of 10 cannot both pass: the second sees the
first's 8.

What is added, what is overwritten. A budget (the id the server announces with every task, kept
across ``resume_from``) holds one entry per *account* and mechanism. An account is the job that
spent (its NVFlare job id; ``"local"`` in-process) or, for DP-SGD kept in a file, the accountant file
it continues (``accountant:<file name>``, :class:`fedweigh.secure.dp_sgd.DPSGD`). An account's
entry is its running total, overwritten by each record (recording the same job's figure again
counts nothing twice); different accounts ADD: a budget's epsilon is the sum over its accounts and
mechanisms, the site's total the sum over every budget (basic composition, Dwork & Roth 2014,
Thm 3.16; delta likewise). So two jobs that share a budget id spend the sum of what each spent, and a
resumed run, which continues the same accountant file, extends that one running total instead of
adding a second copy of its history.

A spend is *reserved* when it is checked (:meth:`PrivacyLedger.reserve`) and overwritten with what
was reached when it is recorded: a job that crashes between the two keeps the reserved figure,
which errs on the side of the patient (the noise may already have been drawn).

Every figure must be finite and >= 0: a ``NaN`` would switch every cap off (every comparison with
it is false) and a negative one would raise the cap, so a file holding either is refused, naming the
file and the entry. An existing ledger file is read only if the site's user alone can change it
(:func:`fedweigh.secure.file_checks.check_private_file`); the ledger writes it with mode 0600.

File layout (``"format": 2``)::

    {"format": 2, "budgets": {budget: {account: {mechanism: {"epsilon": e, "delta": d}}}}}

Older files, without ``"format"``, kept one figure per budget and mechanism
(``{budget: {mechanism: {"epsilon": e, "delta": d}}}``, or a bare epsilon before deltas were kept);
each such figure is read as one entry of the account :data:`BUDGET_ACCOUNT`.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

from fedweigh.io import atomic_write_json
from fedweigh.secure.file_checks import check_private_file

__all__ = [
    "BUDGET_ACCOUNT",
    "LEDGER_FORMAT",
    "LEDGER_LOCK_TIMEOUT_S",
    "MECHANISMS",
    "PrivacyLedger",
    "check_spend",
]

#: What a ledger entry records: DP-SGD on the model updates, and the label-statistics release.
MECHANISMS: tuple[str, ...] = ("dp_sgd", "statistics")
#: How long a job waits for another job's transaction on the ledger before giving up.
LEDGER_LOCK_TIMEOUT_S = 120.0
#: The layout this module writes (module docstring).
LEDGER_FORMAT = 2
#: The account of a figure recorded without naming one, and of every figure of an older ledger file.
BUDGET_ACCOUNT = "budget"

Entries = dict[str, dict[str, float]]
#: figure per budget, account and mechanism
Accounts = dict[str, dict[str, dict[str, float]]]


def check_spend(where: str, value: object, what: str = "epsilon") -> float:
    """``value`` as a float if it is a finite number >= 0, else ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {what} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{where}: {what} must be finite and >= 0, got {value!r}")
    return number


def _summed(accounts: Accounts) -> Entries:
    """Figure per budget and mechanism: the sum over the budget's accounts."""
    out: Entries = {}
    for budget, by_account in accounts.items():
        for spent in by_account.values():
            for mechanism, figure in spent.items():
                out.setdefault(budget, {})[mechanism] = out.get(budget, {}).get(mechanism, 0.0) + figure
    return out


class PrivacyLedger:
    """The epsilon and delta a site has spent, per budget, account and mechanism, in a JSON file (or memory).

    :attr:`accounts` holds every entry; :attr:`entries` and :attr:`deltas` are the per-budget sums
    (over accounts) by mechanism. Module docstring: what is added and what overwritten, the layout.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        self._thread_lock = threading.RLock()
        #: epsilon per budget, account and mechanism, as last read from the file (or recorded in memory)
        self.accounts: Accounts = {}
        #: delta per budget, account and mechanism (absent: not recorded)
        self.account_deltas: Accounts = {}
        self._file_lock = (
            None if self.path is None else FileLock(f"{self.path}.lock", timeout=LEDGER_LOCK_TIMEOUT_S)
        )
        if self.path is not None:
            with self._transaction(write=False):
                pass

    @property
    def entries(self) -> Entries:
        """Epsilon per budget and mechanism: the sum over the budget's accounts."""
        return _summed(self.accounts)

    @property
    def deltas(self) -> Entries:
        """Delta per budget and mechanism: the sum over the budget's accounts that recorded one."""
        return _summed(self.account_deltas)

    # ------------------------------------------------------------------------------ the file
    def _load(self) -> None:
        """Re-read the file (inside the lock); ValueError naming the file and entry if it is invalid,
        PermissionError if others than the site's user could have changed it."""
        assert self.path is not None
        if not self.path.is_file():
            self.accounts, self.account_deltas = {}, {}
            return
        check_private_file(self.path, "privacy ledger", "anyone could erase what this site has spent")
        try:
            raw = json.loads(self.path.read_text())
            layout = raw.get("format")
            items = raw["budgets"].items()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"privacy ledger {self.path} is unreadable ({e}); this site cannot tell what it has "
                "spent. Restore the file or move it aside deliberately."
            ) from None
        if layout not in (None, LEDGER_FORMAT):
            raise ValueError(
                f"privacy ledger {self.path} has format {layout!r}; this version reads format {LEDGER_FORMAT} "
                "and the older files without a format"
            )
        accounts: Accounts = {}
        deltas: Accounts = {}
        for budget, held in items:
            if not isinstance(held, dict):
                raise ValueError(
                    f"privacy ledger {self.path}: budget {budget!r} must hold an object, got {held!r}"
                )
            by_account = held if layout == LEDGER_FORMAT else {BUDGET_ACCOUNT: held}
            for account, spent in by_account.items():
                if not isinstance(spent, dict):
                    raise ValueError(
                        f"privacy ledger {self.path}: budget {budget!r}, account {account!r} must hold an "
                        f"object, got {spent!r}"
                    )
                for mechanism, figure in spent.items():
                    where = f"privacy ledger {self.path}: budget {budget!r}, {mechanism}"
                    if layout == LEDGER_FORMAT:
                        where = (
                            f"privacy ledger {self.path}: budget {budget!r}, account {account!r}, {mechanism}"
                        )
                    if isinstance(figure, dict):
                        epsilon, delta = figure.get("epsilon"), figure.get("delta")
                    else:  # an older ledger: the epsilon alone
                        epsilon, delta = figure, None
                    key = (str(budget), str(account))
                    accounts.setdefault(key[0], {}).setdefault(key[1], {})[str(mechanism)] = check_spend(
                        where, epsilon
                    )
                    if delta is not None:
                        deltas.setdefault(key[0], {}).setdefault(key[1], {})[str(mechanism)] = check_spend(
                            where, delta, "delta"
                        )
        self.accounts, self.account_deltas = accounts, deltas

    def _save(self) -> None:
        assert self.path is not None
        budgets = {
            budget: {
                account: {
                    mechanism: {
                        "epsilon": epsilon,
                        "delta": self.account_deltas.get(budget, {}).get(account, {}).get(mechanism),
                    }
                    for mechanism, epsilon in spent.items()
                }
                for account, spent in by_account.items()
            }
            for budget, by_account in self.accounts.items()
        }
        atomic_write_json(self.path, {"format": LEDGER_FORMAT, "budgets": budgets}, indent=1)

    def _snapshot(self) -> tuple[str, str]:
        return json.dumps(self.accounts, sort_keys=True), json.dumps(self.account_deltas, sort_keys=True)

    @contextmanager
    def _transaction(self, write: bool = True) -> Iterator[None]:
        """Hold the ledger exclusively (threads of this process and every other process), with the
        file's current content loaded; write it back on leaving if ``write`` and it changed."""
        with self._thread_lock:
            if self._file_lock is None:
                yield
                return
            with self._file_lock:
                self._load()
                before = self._snapshot()
                yield
                if write and self._snapshot() != before:
                    self._save()

    # ------------------------------------------------------------------------------ reading
    def _spent(self, budget_id: str | None) -> float:
        budgets = self.accounts.values() if budget_id is None else [self.accounts.get(budget_id, {})]
        return float(sum(sum(spent.values()) for b in budgets for spent in b.values()))

    def spent(self, budget_id: str | None = None) -> float:
        """Epsilon of one budget (all accounts and mechanisms), or of every budget when ``budget_id`` is None."""
        with self._transaction(write=False):
            return self._spent(budget_id)

    def delta_spent(self, budget_id: str | None = None) -> float:
        """Delta of one budget (all accounts and mechanisms), or of every budget when ``budget_id`` is None."""
        with self._transaction(write=False):
            held = self.account_deltas
            budgets = held.values() if budget_id is None else [held.get(budget_id, {})]
            return float(sum(sum(spent.values()) for b in budgets for spent in b.values()))

    def _projected(self, budget_id: str, mechanism: str, epsilon: float, account: str) -> tuple[float, float]:
        own = self.accounts.get(budget_id, {}).get(account, {}).get(mechanism, 0.0)
        budget = self._spent(budget_id) - own + float(epsilon)
        return budget, self._spent(None) - self._spent(budget_id) + budget

    def projected(
        self, budget_id: str, mechanism: str, epsilon: float, account: str = BUDGET_ACCOUNT
    ) -> tuple[float, float]:
        """(this budget's, all budgets') epsilon if ``mechanism`` of ``account`` under ``budget_id``
        stood at ``epsilon``."""
        with self._transaction(write=False):
            return self._projected(str(budget_id), mechanism, epsilon, str(account))

    def holds(self, budget_id: str, mechanism: str, epsilon: float) -> bool:
        """Whether an account of ``budget_id`` already holds ``mechanism`` at ``epsilon`` (a figure spent
        once and kept, such as a label-statistics release that a later job of the budget reuses)."""
        with self._transaction(write=False):
            return self._holds(str(budget_id), mechanism, float(epsilon))

    def _holds(self, budget_id: str, mechanism: str, epsilon: float) -> bool:
        return any(
            mechanism in spent and math.isclose(spent[mechanism], epsilon, rel_tol=1e-12, abs_tol=0.0)
            for spent in self.accounts.get(budget_id, {}).values()
        )

    # ------------------------------------------------------------------------------ spending
    def _set(self, budget_id: str, account: str, mechanism: str, epsilon: float, delta: float | None) -> None:
        self.accounts.setdefault(budget_id, {}).setdefault(account, {})[mechanism] = epsilon
        if delta is not None:
            self.account_deltas.setdefault(budget_id, {}).setdefault(account, {})[mechanism] = delta

    def _validated(
        self, budget_id: str, mechanism: str, epsilon: float, delta: float | None
    ) -> tuple[float, float | None]:
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
        where = f"privacy ledger {self.path or '(in memory)'}: budget {budget_id!r}, {mechanism}"
        return check_spend(where, epsilon), None if delta is None else check_spend(where, delta, "delta")

    def reserve(
        self,
        budget_id: str,
        mechanism: str,
        epsilon: float,
        delta: float | None = None,
        check: Callable[[float, float], None] | None = None,
        account: str = BUDGET_ACCOUNT,
    ) -> None:
        """In one locked transaction: ``check(budget's epsilon, site total)`` as they would stand with
        ``mechanism`` of ``account`` under ``budget_id`` at ``epsilon`` (it raises to refuse), then
        record it."""
        budget_id, account = str(budget_id), str(account)
        epsilon, delta = self._validated(budget_id, mechanism, epsilon, delta)
        with self._transaction():
            if check is not None:
                check(*self._projected(budget_id, mechanism, epsilon, account))
            self._set(budget_id, account, mechanism, epsilon, delta)

    def record(
        self,
        budget_id: str,
        mechanism: str,
        epsilon: float,
        delta: float | None = None,
        account: str = BUDGET_ACCOUNT,
        *,
        unless_held: bool = False,
    ) -> bool:
        """Set what ``mechanism`` of ``account`` under ``budget_id`` has reached (its running total, not
        an increment). ``unless_held``: record nothing if an account of the budget already holds
        ``mechanism`` at ``epsilon`` (:meth:`holds`, in the same transaction). Returns whether it recorded."""
        budget_id, account = str(budget_id), str(account)
        epsilon, delta = self._validated(budget_id, mechanism, epsilon, delta)
        with self._transaction():
            if unless_held and self._holds(budget_id, mechanism, epsilon):
                return False
            self._set(budget_id, account, mechanism, epsilon, delta)
            return True

"""A site's privacy ledger: the (epsilon, delta) each budget has spent, safe under concurrent jobs.

NVFlare runs several jobs at one site at once, each in its own process; all of them spend from the
same site total (``max_epsilon_total`` of :mod:`fedweigh.site.policy`). Every read-check-record is
one transaction under an exclusive lock on ``<ledger>.lock`` (``filelock``: ``fcntl.flock`` on POSIX,
``msvcrt.locking`` on Windows): the file is re-read inside the lock, the caps are checked against
what every job has spent so far, the new figure is written, and only then is the lock released.
So two jobs that each plan epsilon 8 under a total cap of 10 cannot both pass: the second sees the
first's 8.

A spend is *reserved* when it is checked (:meth:`PrivacyLedger.reserve`) and overwritten with what
was reached when it is recorded: a job that crashes between the two keeps the reserved figure,
which errs on the side of the patient (the noise may already have been drawn).

Entries are epsilon and delta per budget and mechanism; DP composes by summing both (basic
composition, Dwork & Roth 2014, Thm 3.16). Every figure must be finite and >= 0: a ``NaN`` would
switch every cap off (every comparison with it is false) and a negative one would raise the cap,
so a file holding either is refused, naming the file and the entry.
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

__all__ = ["LEDGER_LOCK_TIMEOUT_S", "MECHANISMS", "PrivacyLedger", "check_spend"]

#: What a ledger entry records: DP-SGD on the model updates, and the label-statistics release.
MECHANISMS: tuple[str, ...] = ("dp_sgd", "statistics")
#: How long a job waits for another job's transaction on the ledger before giving up.
LEDGER_LOCK_TIMEOUT_S = 120.0

Entries = dict[str, dict[str, float]]


def check_spend(where: str, value: object, what: str = "epsilon") -> float:
    """``value`` as a float if it is a finite number >= 0, else ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {what} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{where}: {what} must be finite and >= 0, got {value!r}")
    return number


class PrivacyLedger:
    """The epsilon and delta a site has spent, per budget id and mechanism, in a JSON file (or memory).

    File layout: ``{"budgets": {budget: {mechanism: {"epsilon": e, "delta": d}}}}`` (an older file
    holding bare epsilons is read too; its deltas are unknown: null). Entries are overwritten, not
    added: a budget's DP-SGD entry is its accountant's total so far and its statistics entry its one
    release, so recording the same figure twice changes nothing.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        self._thread_lock = threading.RLock()
        #: epsilon per budget and mechanism, as last read from the file (or recorded in memory)
        self.entries: Entries = {}
        #: delta per budget and mechanism (absent: not recorded)
        self.deltas: Entries = {}
        self._file_lock = (
            None if self.path is None else FileLock(f"{self.path}.lock", timeout=LEDGER_LOCK_TIMEOUT_S)
        )
        if self.path is not None:
            with self._transaction(write=False):
                pass

    # ------------------------------------------------------------------------------ the file
    def _load(self) -> None:
        """Re-read the file (inside the lock); ValueError naming the file and entry if it is invalid."""
        assert self.path is not None
        if not self.path.is_file():
            self.entries, self.deltas = {}, {}
            return
        try:
            budgets = json.loads(self.path.read_text())["budgets"]
            items = budgets.items()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(
                f"privacy ledger {self.path} is unreadable ({e}); this site cannot tell what it has "
                "spent. Restore the file or move it aside deliberately."
            ) from None
        entries: Entries = {}
        deltas: Entries = {}
        for budget, spent in items:
            if not isinstance(spent, dict):
                raise ValueError(
                    f"privacy ledger {self.path}: budget {budget!r} must hold an object, got {spent!r}"
                )
            for mechanism, figure in spent.items():
                where = f"privacy ledger {self.path}: budget {budget!r}, {mechanism}"
                if isinstance(figure, dict):
                    epsilon, delta = figure.get("epsilon"), figure.get("delta")
                else:  # an older ledger: the epsilon alone
                    epsilon, delta = figure, None
                entries.setdefault(str(budget), {})[str(mechanism)] = check_spend(where, epsilon)
                if delta is not None:
                    deltas.setdefault(str(budget), {})[str(mechanism)] = check_spend(where, delta, "delta")
        self.entries, self.deltas = entries, deltas

    def _save(self) -> None:
        assert self.path is not None
        budgets = {
            budget: {
                mechanism: {"epsilon": epsilon, "delta": self.deltas.get(budget, {}).get(mechanism)}
                for mechanism, epsilon in spent.items()
            }
            for budget, spent in self.entries.items()
        }
        atomic_write_json(self.path, {"budgets": budgets}, indent=1)

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
                before = (json.dumps(self.entries, sort_keys=True), json.dumps(self.deltas, sort_keys=True))
                yield
                after = (json.dumps(self.entries, sort_keys=True), json.dumps(self.deltas, sort_keys=True))
                if write and after != before:
                    self._save()

    # ------------------------------------------------------------------------------ reading
    def _spent(self, budget_id: str | None) -> float:
        budgets = self.entries.values() if budget_id is None else [self.entries.get(budget_id, {})]
        return float(sum(sum(b.values()) for b in budgets))

    def spent(self, budget_id: str | None = None) -> float:
        """Epsilon of one budget (all mechanisms), or of every budget when ``budget_id`` is None."""
        with self._transaction(write=False):
            return self._spent(budget_id)

    def delta_spent(self, budget_id: str | None = None) -> float:
        """Delta of one budget (all mechanisms), or of every budget when ``budget_id`` is None."""
        with self._transaction(write=False):
            budgets = self.deltas.values() if budget_id is None else [self.deltas.get(budget_id, {})]
            return float(sum(sum(b.values()) for b in budgets))

    def _projected(self, budget_id: str, mechanism: str, epsilon: float) -> tuple[float, float]:
        entry = {**self.entries.get(budget_id, {}), mechanism: float(epsilon)}
        job = float(sum(entry.values()))
        return job, self._spent(None) - self._spent(budget_id) + job

    def projected(self, budget_id: str, mechanism: str, epsilon: float) -> tuple[float, float]:
        """(this budget's, all budgets') epsilon if ``mechanism`` of ``budget_id`` stood at ``epsilon``."""
        with self._transaction(write=False):
            return self._projected(str(budget_id), mechanism, epsilon)

    # ------------------------------------------------------------------------------ spending
    def _set(self, budget_id: str, mechanism: str, epsilon: float, delta: float | None) -> None:
        self.entries.setdefault(budget_id, {})[mechanism] = epsilon
        if delta is not None:
            self.deltas.setdefault(budget_id, {})[mechanism] = delta

    def _validated(self, budget_id: str, mechanism: str, epsilon: float, delta: float | None):
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
    ) -> None:
        """In one locked transaction: ``check(budget's epsilon, site total)`` as they would stand with
        ``mechanism`` of ``budget_id`` at ``epsilon`` (it raises to refuse), then record it."""
        budget_id = str(budget_id)
        epsilon, delta = self._validated(budget_id, mechanism, epsilon, delta)
        with self._transaction():
            if check is not None:
                check(*self._projected(budget_id, mechanism, epsilon))
            self._set(budget_id, mechanism, epsilon, delta)

    def record(self, budget_id: str, mechanism: str, epsilon: float, delta: float | None = None) -> None:
        """Set what ``mechanism`` of ``budget_id`` has reached (its total, not an increment)."""
        budget_id = str(budget_id)
        epsilon, delta = self._validated(budget_id, mechanism, epsilon, delta)
        with self._transaction():
            self._set(budget_id, mechanism, epsilon, delta)

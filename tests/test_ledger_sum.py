"""The privacy ledger adds over the jobs of a budget (each job's entry its running total), and the
DP-SGD accountant re-reads its file under its lock, so processes sharing a budget id compose their
spends instead of overwriting them."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

from fedweigh.errors import PolicyRefusal
from fedweigh.site.ledger import BUDGET_ACCOUNT, PrivacyLedger
from fedweigh.site.policy import PrivacyGuard, SitePolicy

BUDGET = "budget-1"
CAP = 10.0
EACH = 8.0
DELTA = 1e-5


def spawn() -> multiprocessing.context.BaseContext:
    return multiprocessing.get_context("spawn")


def private_dir(tmp_path: Path) -> Path:
    os.chmod(tmp_path, 0o700)
    return tmp_path


# ---------------------------------------------------------------------------------- two jobs, one budget
def _spend(path: str, job_id: str, barrier, results) -> None:
    """One job of the budget, in its own process: check (reserve) epsilon 8, then record it."""
    guard = PrivacyGuard(
        SitePolicy(max_epsilon_per_job=CAP, max_epsilon_total=CAP, source="test"),
        PrivacyLedger(path),
        "site-1",
        BUDGET,
        job_id=job_id,
    )
    barrier.wait()
    try:
        guard.check("dp_sgd", EACH, delta=DELTA, num_samples=1000)
        guard.record("dp_sgd", EACH, DELTA)
        results.put((job_id, "spent"))
    except PolicyRefusal as e:
        results.put((job_id, str(e)))


def test_two_jobs_under_one_budget_id_cannot_together_exceed_the_caps(tmp_path):
    """Two jobs with one budget id, in two spawned processes, each plan epsilon 8 under a per-budget
    and a site total cap of 10: exactly one spends, the other is refused, and the ledger holds 8."""
    path = private_dir(tmp_path) / "ledger.json"
    ctx = spawn()
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_spend, args=(str(path), job, barrier, results)) for job in ("job-a", "job-b")
    ]
    for p in procs:
        p.start()
    outcome = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    spent = [job for job, what in outcome.items() if what == "spent"]
    assert len(spent) == 1, outcome
    refused = next(what for job, what in outcome.items() if job not in spent)
    assert f"budget {BUDGET!r} to epsilon 16" in refused and "max_epsilon_per_job=10" in refused
    ledger = PrivacyLedger(path)
    assert ledger.spent() == EACH and ledger.spent(BUDGET) == EACH
    assert ledger.accounts == {BUDGET: {spent[0]: {"dp_sgd": EACH}}}


def test_a_jobs_entry_is_its_running_total_and_jobs_add(tmp_path):
    ledger = PrivacyLedger(private_dir(tmp_path) / "ledger.json")
    a = PrivacyGuard(
        SitePolicy(max_epsilon_per_job=None, max_epsilon_total=None), ledger, "site-1", BUDGET, "job-a"
    )
    b = PrivacyGuard(a.policy, PrivacyLedger(ledger.path), "site-1", BUDGET, "job-b")
    a.check("dp_sgd", 2.0, delta=DELTA, num_samples=1000)
    a.record("dp_sgd", 3.0, DELTA)
    a.record("dp_sgd", 3.0, DELTA)  # the same running total again: counted once
    assert ledger.spent(BUDGET) == 3.0
    b.check("dp_sgd", 4.0, delta=DELTA, num_samples=1000)
    assert ledger.spent(BUDGET) == 7.0 and ledger.entries == {BUDGET: {"dp_sgd": 7.0}}
    assert ledger.delta_spent(BUDGET) == pytest.approx(2 * DELTA)
    ledger.record("budget-2", "statistics", 1.5, account="job-c")
    assert ledger.spent() == 8.5 and ledger.spent("budget-2") == 1.5
    assert ledger.projected(BUDGET, "dp_sgd", 5.0, account="job-a") == (9.0, 10.5)  # a's 3 -> 5
    assert ledger.projected(BUDGET, "dp_sgd", 5.0, account="job-d") == (12.0, 13.5)  # a new job adds
    raw = json.loads(ledger.path.read_text())
    assert raw["format"] == 2
    assert raw["budgets"][BUDGET] == {
        "job-a": {"dp_sgd": {"epsilon": 3.0, "delta": DELTA}},
        "job-b": {"dp_sgd": {"epsilon": 4.0, "delta": DELTA}},
    }


def test_the_caps_are_checked_on_the_sum_over_the_budgets_jobs():
    ledger = PrivacyLedger()
    policy = SitePolicy(max_epsilon_per_job=10.0, max_epsilon_total=None, source="test")
    PrivacyGuard(policy, ledger, "site-1", BUDGET, "job-a").check(
        "statistics", 4.0, delta=DELTA, num_samples=1000
    )
    b = PrivacyGuard(policy, ledger, "site-1", BUDGET, "job-b")
    b.check("dp_sgd", 6.0, delta=DELTA, num_samples=1000)  # 4 + 6 = 10: at the cap
    with pytest.raises(PolicyRefusal, match=f"budget {BUDGET!r} to epsilon 10.5"):
        b.check("dp_sgd", 6.5, delta=DELTA, num_samples=1000)


@pytest.mark.parametrize(
    "old",
    [
        {"budgets": {BUDGET: {"dp_sgd": 3.0, "statistics": 1.0}}},
        {"budgets": {BUDGET: {"dp_sgd": {"epsilon": 3.0, "delta": DELTA}, "statistics": {"epsilon": 1.0}}}},
    ],
)
def test_an_older_ledger_reads_each_budget_figure_as_one_entry(tmp_path, old):
    path = private_dir(tmp_path) / "ledger.json"
    path.write_text(json.dumps(old))
    os.chmod(path, 0o600)
    ledger = PrivacyLedger(path)
    assert ledger.accounts == {BUDGET: {BUDGET_ACCOUNT: {"dp_sgd": 3.0, "statistics": 1.0}}}
    ledger.record(BUDGET, "dp_sgd", 2.0, account="job-new")  # a later job adds its own entry
    assert PrivacyLedger(path).spent(BUDGET) == 6.0
    assert json.loads(path.read_text())["budgets"][BUDGET][BUDGET_ACCOUNT]["dp_sgd"]["epsilon"] == 3.0


def test_a_ledger_of_an_unknown_format_is_refused(tmp_path):
    path = private_dir(tmp_path) / "ledger.json"
    path.write_text(json.dumps({"format": 3, "budgets": {}}))
    with pytest.raises(ValueError, match=r"ledger\.json has format 3; this version reads format 2"):
        PrivacyLedger(path)


def test_a_release_reused_by_a_later_job_of_the_budget_is_not_counted_twice(tmp_path):
    """A resumed run reuses the budget's kept statistics release and records its figure again without
    a reservation: the figure is already held. A fresh draw (checked first) adds."""
    from fedweigh.secure.dp_config import StatsDPConfig
    from fedweigh.secure.stats_release import HistogramReleaser

    folder, ledger = private_dir(tmp_path), PrivacyLedger(tmp_path / "ledger.json")
    policy = SitePolicy(max_delta=0.1, max_epsilon_per_job=None, max_epsilon_total=None)
    for job in ("job-1", "job-2"):  # job-2 resumes job-1's budget
        guard = PrivacyGuard(policy, ledger, "site-1", BUDGET, job_id=job)
        releaser = HistogramReleaser(
            StatsDPConfig(epsilon=1.0, delta=1e-4), "site-1", BUDGET, folder, guard=guard
        )
        releaser.release(np.array([300, 700]), 1000, "multiclass")
    assert ledger.accounts == {BUDGET: {"job-1": {"statistics": 1.0}}}
    other = PrivacyGuard(policy, ledger, "site-1", BUDGET, job_id="job-3")
    other.check("statistics", 1.0, delta=1e-4, num_samples=1000)  # a second draw under the budget
    other.record("statistics", 1.0, 1e-4)
    assert ledger.spent(BUDGET) == 2.0


# ---------------------------------------------------------------------------------- the DP-SGD accountant
def _tiny_data(n: int = 8):
    from fedweigh.data.base import LabeledImages

    x = np.zeros((n, 1, 4, 4), dtype=np.float32)
    return LabeledImages(x, (np.arange(n) % 2).astype(np.int64), ("a", "b"), "multiclass")


def _dp(state: Path, ledger: Path, job_id: str):
    from fedweigh.secure.dp_config import DPConfig
    from fedweigh.secure.dp_sgd import DPSGD

    policy = SitePolicy(max_delta=0.1, max_epsilon_per_job=None, max_epsilon_total=None, source="test")
    guard = PrivacyGuard(policy, PrivacyLedger(ledger), "site-1", BUDGET, job_id=job_id)
    return DPSGD(DPConfig(noise_multiplier=1.0, delta=DELTA), state, site_name="site-1", seed=0, guard=guard)


def _round(dp, steps: int, taken: int | None = None):
    """Plan and book one round of ``steps`` steps without training (``taken``: the steps it took)."""
    from fedweigh.train import TrainConfig

    plan = dp._plan(_tiny_data(), TrainConfig(batch_size=2, epochs=1, max_steps=steps), None)
    return dp._book(plan, steps if taken is None else taken, "fast")


def _first_job(state: str, ledger: str) -> None:
    _round(_dp(Path(state), Path(ledger), "job-a"), 3)


def test_a_dp_sgd_accountant_in_a_second_process_sees_the_firsts_steps(tmp_path):
    """An accountant built before another process took steps on the same file re-reads the file
    before its next round: the round counts both, and the ledger holds one running total."""
    from fedweigh.secure.accountant import epsilon_for

    folder = private_dir(tmp_path)
    state, ledger = folder / "fedweigh_dp_sgd_budget-1_site-1.json", folder / "ledger.json"
    second = _dp(state, ledger, "job-b")  # built while the file does not exist yet
    # fork where there is one: the child inherits torch instead of importing it again (seconds)
    ctx = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )
    proc = ctx.Process(target=_first_job, args=(str(state), str(ledger)))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    report = _round(second, 2)
    q = report.sample_rate
    assert report.total_steps == 5 and report.history == [(1.0, q, 5)]
    assert json.loads(state.read_text())["history"] == [[1.0, q, 5]]
    assert report.epsilon == epsilon_for([(1.0, q, 5)], DELTA)
    held = PrivacyLedger(ledger)
    assert held.accounts == {BUDGET: {f"accountant:{state.name}": {"dp_sgd": report.epsilon}}}
    assert held.spent(BUDGET) == report.epsilon  # one running total, not eps(3 steps) + eps(5 steps)


def test_a_planned_round_is_reserved_in_the_accountant_file(tmp_path):
    """A process planning while another's round is under way counts that round's planned steps; the
    unused part of a reservation is given back when the round is booked."""
    folder = private_dir(tmp_path)
    state, ledger = folder / "account.json", folder / "ledger.json"
    a, b = _dp(state, ledger, "job-a"), _dp(state, ledger, "job-b")
    from fedweigh.train import TrainConfig

    plan_a = a._plan(_tiny_data(), TrainConfig(batch_size=2, epochs=1, max_steps=3), None)
    plan_b = b._plan(_tiny_data(), TrainConfig(batch_size=2, epochs=1, max_steps=2), None)
    q = plan_a.sample_rate
    assert json.loads(state.read_text())["history"] == [[1.0, q, 5]]  # both reservations held
    b._book(plan_b, 2, "fast")
    report = a._book(plan_a, 1, "fast")  # a took only 1 of its 3 planned steps
    assert report.history == [(1.0, q, 3)] and report.total_steps == 3
    assert PrivacyLedger(ledger).spent(BUDGET) == report.epsilon


def test_a_resumed_run_continues_the_accountants_running_total(tmp_path):
    """A new job of the budget continuing the accountant file extends its one ledger entry."""
    folder = private_dir(tmp_path)
    state, ledger = folder / "account.json", folder / "ledger.json"
    first = _round(_dp(state, ledger, "job-1"), 2)
    resumed = _round(_dp(state, ledger, "job-2"), 2)
    assert resumed.total_steps == 4 and resumed.epsilon > first.epsilon
    assert PrivacyLedger(ledger).spent(BUDGET) == resumed.epsilon


# ---------------------------------------------------------------------------------- release_steps
def test_releasing_no_steps_leaves_the_history_as_it_is():
    from fedweigh.secure.accountant import release_steps

    history = [(1.0, 0.1, 3), (2.0, 0.1, 0)]
    assert release_steps(history, 1.0, 0.1, 0) == history
    assert release_steps(history, 1.0, 0.1, -2) == history


def test_released_steps_come_only_from_entries_of_the_same_sigma_and_rate_latest_first():
    from fedweigh.secure.accountant import release_steps

    # the one entry to take from sits one place before the end; later entries differ in sigma or rate
    assert release_steps([(1.0, 0.1, 3), (2.0, 0.1, 2)], 1.0, 0.1, 2) == [(1.0, 0.1, 1), (2.0, 0.1, 2)]
    assert release_steps([(1.0, 0.1, 3), (1.0, 0.2, 2)], 1.0, 0.1, 1) == [(1.0, 0.1, 2), (1.0, 0.2, 2)]
    assert release_steps([(1.0, 0.1, 3)], 1.0, 0.1, 1) == [(1.0, 0.1, 2)]
    # an entry emptied is dropped, one left with a single step is kept
    assert release_steps([(1.0, 0.1, 2), (1.0, 0.1, 3)], 1.0, 0.1, 4) == [(1.0, 0.1, 1)]


def test_releasing_more_steps_than_recorded_names_a_changed_file():
    from fedweigh.secure.accountant import release_steps

    with pytest.raises(
        ValueError,
        match=r"^the DP-SGD accountant holds fewer than 4 steps at \(sigma=1\.0, q=0\.1\) to release: "
        r"its file was changed by something other than this site's DP-SGD$",
    ):
        release_steps([(1.0, 0.1, 3), (2.0, 0.1, 5)], 1.0, 0.1, 4)


def test_the_accountant_lock_waits_a_bounded_time(tmp_path):
    from fedweigh.secure.accountant import ACCOUNTANT_LOCK_TIMEOUT_S, accountant_lock

    lock = accountant_lock(tmp_path / "account.json")
    assert lock.lock_file == f"{tmp_path / 'account.json'}.lock"
    assert lock.timeout == ACCOUNTANT_LOCK_TIMEOUT_S == 120.0

"""The site's privacy ledger under concurrent jobs, its validation of entries, delta next to epsilon,
and the policy's delta bound on DP-SGD and the statistics release."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest

from fedweigh.errors import PolicyRefusal
from fedweigh.site.args import ClientArgs
from fedweigh.site.ledger import PrivacyLedger
from fedweigh.site.policy import PrivacyGuard, SitePolicy

JOBS = 3
CAP = 10.0
EACH = 8.0


class _SlowGuard(PrivacyGuard):
    """A guard that dawdles between reading the ledger and recording its spend: the window in which
    an unlocked read-check-record lets another job through."""

    def check(self, mechanism, epsilon, *, delta, num_samples):
        ledger = self.ledger
        reserve = ledger.reserve

        def slow_reserve(budget_id, mechanism, epsilon, delta=None, check=None, **account):
            def slow_check(job, total):
                time.sleep(0.3)
                if check is not None:
                    check(job, total)

            return reserve(budget_id, mechanism, epsilon, delta, check=slow_check, **account)

        ledger.reserve = slow_reserve
        try:
            super().check(mechanism, epsilon, delta=delta, num_samples=num_samples)
        finally:
            del ledger.reserve


def _job(path: str, budget: str, barrier, results) -> None:
    guard = _SlowGuard(
        SitePolicy(max_epsilon_per_job=None, max_epsilon_total=CAP), PrivacyLedger(path), "site-1", budget
    )
    barrier.wait()
    try:
        guard.check("dp_sgd", EACH, delta=1e-5, num_samples=1000)
        guard.record("dp_sgd", EACH, 1e-5)
        results.put((budget, "spent"))
    except PolicyRefusal as e:
        results.put((budget, str(e)))


def test_concurrent_jobs_cannot_exceed_the_sites_total_cap(tmp_path):
    """Three jobs in three processes, each planning epsilon 8 under a site total of 10, start at once:
    exactly one spends, the others are refused naming the total cap, and the file holds the one 8."""
    path = tmp_path / "ledger.json"
    ctx = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )
    barrier, results = ctx.Barrier(JOBS), ctx.Queue()
    procs = [ctx.Process(target=_job, args=(str(path), f"job-{i}", barrier, results)) for i in range(JOBS)]
    for p in procs:
        p.start()
    outcome = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    spent = [b for b, what in outcome.items() if what == "spent"]
    assert len(spent) == 1, outcome
    assert all("max_epsilon_total=10" in what for b, what in outcome.items() if b not in spent)
    ledger = PrivacyLedger(path)
    assert ledger.spent() == EACH <= CAP
    assert ledger.entries == {spent[0]: {"dp_sgd": EACH}}


@pytest.mark.parametrize("bad", ["NaN", "-1.0", "Infinity", '"8"'])
def test_an_entry_that_is_not_a_finite_spend_is_refused_naming_file_and_entry(tmp_path, bad):
    path = tmp_path / "ledger.json"
    good = '"job-1": {"dp_sgd": {"epsilon": 1.0, "delta": 1e-5}}'
    path.write_text('{"budgets": {' + good + ', "job-2": {"statistics": {"epsilon": ' + bad + "}}}}")
    with pytest.raises(ValueError, match=r"ledger\.json: budget 'job-2', statistics: epsilon must be") as e:
        PrivacyLedger(path)
    assert str(path) in str(e.value)
    path.write_text('{"budgets": {"job-1": {"dp_sgd": {"epsilon": 1.0, "delta": ' + bad + "}}}}")
    with pytest.raises(ValueError, match="budget 'job-1', dp_sgd: delta must be"):
        PrivacyLedger(path)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_recording_a_spend_that_is_not_finite_and_non_negative_is_refused(tmp_path, bad):
    ledger = PrivacyLedger(tmp_path / "ledger.json")
    with pytest.raises(ValueError, match="epsilon must be finite and >= 0"):
        ledger.record("job-1", "dp_sgd", bad)
    with pytest.raises(ValueError, match="delta must be finite and >= 0"):
        ledger.record("job-1", "dp_sgd", 1.0, bad)
    guard = PrivacyGuard(SitePolicy(), ledger, "site-1", "job-1")
    with pytest.raises(ValueError, match="epsilon must be finite"):
        guard.check("dp_sgd", bad, delta=1e-5, num_samples=100)
    assert ledger.entries == {} and not (tmp_path / "ledger.json").exists()


def test_delta_is_recorded_next_to_epsilon_and_an_older_ledger_still_reads(tmp_path):
    path = tmp_path / "ledger.json"
    guard = PrivacyGuard(SitePolicy(), PrivacyLedger(path), "site-1", "job-1")
    guard.check("statistics", 1.0, delta=1e-6, num_samples=100)
    guard.record("statistics", 1.0, 1e-6)
    guard.check("dp_sgd", 2.0, delta=1e-5, num_samples=100)
    raw = json.loads(path.read_text())
    assert raw["budgets"]["job-1"] == {
        "job-1": {  # the job's own account under its budget
            "statistics": {"epsilon": 1.0, "delta": 1e-6},
            "dp_sgd": {"epsilon": 2.0, "delta": 1e-5},  # reserved by the check, before any step
        }
    }
    assert PrivacyLedger(path).delta_spent("job-1") == pytest.approx(1.1e-5)
    path.write_text('{"budgets": {"job-0": {"dp_sgd": 3.0}}}')  # a ledger from before deltas were kept
    old = PrivacyLedger(path)
    assert old.entries == {"job-0": {"dp_sgd": 3.0}} and old.deltas == {}


def test_a_refused_check_reserves_nothing(tmp_path):
    path = tmp_path / "ledger.json"
    guard = PrivacyGuard(SitePolicy(max_epsilon_per_job=5.0), PrivacyLedger(path), "site-1", "job-1")
    with pytest.raises(PolicyRefusal):
        guard.check("dp_sgd", 6.0, delta=1e-5, num_samples=100)
    assert PrivacyLedger(path).spent() == 0.0


# ---------------------------------------------------------------------------------- the delta bound
def test_the_policy_bounds_delta_by_max_delta_and_one_over_n():
    guard = PrivacyGuard(SitePolicy(source="test"), PrivacyLedger(), "site-1", "job-1")
    guard.check("dp_sgd", 1.0, delta=1e-5, num_samples=1000)  # at max_delta (default 1e-5), below 1/N
    with pytest.raises(PolicyRefusal, match=r"delta=2e-05; this site allows 0 < delta <= max_delta=1e-05"):
        guard.check("dp_sgd", 1.0, delta=2e-5, num_samples=1000)
    with pytest.raises(PolicyRefusal, match="delta=None"):
        guard.check("statistics", 1.0, delta=None, num_samples=1000)
    loose = PrivacyGuard(SitePolicy(max_delta=0.5, source="test"), PrivacyLedger(), "site-1", "job-1")
    loose.check("statistics", 1.0, delta=0.2, num_samples=4)  # 0.2 < 1/4
    with pytest.raises(PolicyRefusal, match=r"not below 1/N_k = 1/5"):
        loose.check("statistics", 1.0, delta=0.2, num_samples=5)  # 0.2 = 1/5


def test_a_job_asking_for_a_large_delta_is_refused_at_start():
    strict = SitePolicy(require_dp=True, require_statistics_dp=True, source="test")
    assert strict.job_refusal(ClientArgs(dp_epsilon=4.0, stats_dp_epsilon=1.0)) is None
    refusal = strict.job_refusal(ClientArgs(dp_epsilon=4.0, dp_delta=0.5, stats_dp_epsilon=1.0))
    assert "dp_delta=0.5" in refusal and "max_delta=1e-05" in refusal
    refusal = strict.job_refusal(ClientArgs(dp_epsilon=4.0, stats_dp_epsilon=1.0, stats_dp_delta=0.5))
    assert "stats_dp_delta=0.5" in refusal
    # a delta is only judged for a mechanism the job turns on
    assert SitePolicy().job_refusal(ClientArgs(dp_delta=0.5)) is None
    with pytest.raises(ValueError, match="max_delta must be a number in \\(0, 1\\)"):
        SitePolicy.from_dict({"max_delta": 1.0}, "policy.json")


def test_dp_sgd_and_the_statistics_release_are_held_to_the_delta_bound(tmp_path):
    from test_privacy import SIZE, images

    from fedweigh.models import build_model
    from fedweigh.secure.dp_config import DPConfig, StatsDPConfig
    from fedweigh.secure.dp_sgd import DPSGD
    from fedweigh.secure.stats_release import HistogramReleaser
    from fedweigh.train import TrainConfig, get_params

    guard = PrivacyGuard(SitePolicy(max_delta=0.5), PrivacyLedger(), "site-1", "job-1")
    model = build_model("densenet_compact", 3, img_size=SIZE, norm="group", seed=0)
    before = get_params(model)
    dp = DPSGD(DPConfig(noise_multiplier=1.0, delta=0.05), None, site_name="site-1", guard=guard)
    with pytest.raises(PolicyRefusal, match="dp_sgd asks for delta=0.05, not below 1/N_k = 1/64"):
        dp.train_round(model, images(64), TrainConfig(batch_size=2, max_steps=2), total_rounds=1)
    assert all(np.array_equal(before[k], v) for k, v in get_params(model).items())
    dp = DPSGD(DPConfig(noise_multiplier=1.0, delta=0.01), None, site_name="site-1", guard=guard)
    dp.train_round(model, images(64), TrainConfig(batch_size=2, max_steps=2), total_rounds=1)  # 0.01 < 1/64
    assert guard.ledger.deltas == {"job-1": {"dp_sgd": 0.01}}

    releaser = HistogramReleaser(
        StatsDPConfig(epsilon=1.0, delta=0.2), "site-1", "job-1", folder=tmp_path, guard=guard
    )
    with pytest.raises(PolicyRefusal, match="statistics asks for delta=0.2, not below 1/N_k = 1/10"):
        releaser.release(np.array([3, 7]), 10, "multiclass")
    assert releaser.drawn is None and not list(Path(tmp_path).glob("*.json"))
    assert releaser.release(np.array([1, 3]), 4, "multiclass").delta == 0.2  # 0.2 < 1/4

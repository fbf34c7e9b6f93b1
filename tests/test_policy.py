"""The site privacy policy (fedweigh.site.policy): the hospital's file, its defaults, what it refuses, the
epsilon ledger, and a refusal through the real client script and controller in the simulator."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from simulation import TINY_CLIENT

from fedweigh.errors import PolicyRefusal
from fedweigh.protocol import SITE_POLICY_ENV
from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import (
    PERMISSIVE_DEFAULT,
    PROVISIONED_DEFAULT,
    PrivacyGuard,
    PrivacyLedger,
    SitePolicy,
    load_site_policy,
)


def _kit(root: Path, provisioned: bool) -> Path:
    (root / "startup").mkdir(parents=True)
    (root / "local").mkdir()
    if provisioned:
        (root / "startup" / "fed_client.json").write_text("{}")
    return root


# ---------------------------------------------------------------------------------- the file
def test_defaults_depend_on_the_kit(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_POLICY_ENV, raising=False)
    hospital = _kit(tmp_path / "hospital-a", provisioned=True)
    assert load_site_policy(hospital) == PROVISIONED_DEFAULT
    assert PROVISIONED_DEFAULT.statistics_modes == ("secure",) and PROVISIONED_DEFAULT.min_secure_sum == 3
    assert (PROVISIONED_DEFAULT.max_epsilon_per_job, PROVISIONED_DEFAULT.max_epsilon_total) == (10.0, 100.0)
    simulated = _kit(tmp_path / "site-1", provisioned=False)
    assert load_site_policy(simulated) == PERMISSIVE_DEFAULT
    assert (
        PERMISSIVE_DEFAULT.statistics_modes == ("plain", "secure") and PERMISSIVE_DEFAULT.min_secure_sum == 2
    )
    # the site's job processes run in subfolders of the kit: the same policy is found from there
    job_app = hospital / "job-1" / "app_hospital-a"
    job_app.mkdir(parents=True)
    assert load_site_policy(job_app) == PROVISIONED_DEFAULT


def test_the_hospitals_file_wins_and_missing_fields_keep_the_strict_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_POLICY_ENV, raising=False)
    hospital = _kit(tmp_path / "hospital-a", provisioned=False)
    path = hospital / "local" / "fedweigh_policy.json"
    path.write_text(json.dumps({"require_encrypted_updates": True, "min_secure_sum": 4}))
    policy = load_site_policy(hospital)
    assert policy.require_encrypted_updates and policy.min_secure_sum == 4
    assert policy.statistics_modes == ("secure",) and policy.source == str(path)
    monkeypatch.setenv(SITE_POLICY_ENV, str(path))
    assert load_site_policy(tmp_path) == policy
    monkeypatch.setenv(SITE_POLICY_ENV, str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match=SITE_POLICY_ENV):
        load_site_policy(tmp_path)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        ("[1]", "must hold a JSON object"),
        ('{"statistics_mode": ["secure"]}', r"unknown field\(s\) \['statistics_mode'\]"),
        ('{"statistics_modes": ["encrypted"]}', "statistics_modes must be a list of"),
        ('{"min_secure_sum": 1}', "min_secure_sum must be an integer >= 2"),
        ('{"max_epsilon_total": -1}', "max_epsilon_total must be a number >= 0 or null"),
        ('{"require_dp": "yes"}', "require_dp must be true or false"),
        ('{"report_scalars": ["histogram"]}', "report_scalars must be a list of"),
    ],
)
def test_a_bad_policy_file_is_named_with_its_field(tmp_path, content, message):
    path = tmp_path / "fedweigh_policy.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as e:
        SitePolicy.from_file(path)
    assert str(path) in str(e.value)


def test_the_cli_shows_the_policy_a_site_runs_under(tmp_path, monkeypatch, capsys):
    from fedweigh.cli import main

    monkeypatch.delenv(SITE_POLICY_ENV, raising=False)
    hospital = _kit(tmp_path / "hospital-a", provisioned=True)
    assert main(["policy", str(hospital)]) == 0
    out = capsys.readouterr().out
    assert "default policy of a provisioned site" in out and '"min_secure_sum": 3' in out
    (hospital / "local" / "fedweigh_policy.json").write_text('{"min_secure_sum": "three"}')
    assert main(["policy", str(hospital)]) == 2
    out = capsys.readouterr().out
    assert "fedweigh_policy.json: min_secure_sum must be an integer" in out


# ---------------------------------------------------------------------------------- judging jobs
def test_job_refusals_name_what_the_job_lacks():
    strict = SitePolicy(
        require_dp=True,
        require_statistics_dp=True,
        statistics_epsilon=None,
        max_epsilon_per_job=5.0,
        source="test",
    )
    assert "without DP-SGD" in strict.job_refusal(ClientArgs())
    assert "without DP noise" in strict.job_refusal(ClientArgs(dp_epsilon=3.0))
    assert strict.job_refusal(ClientArgs(dp_epsilon=3.0, stats_dp_epsilon=1.0)) is None
    refusal = strict.job_refusal(ClientArgs(dp_epsilon=4.5, stats_dp_epsilon=1.0))
    assert (
        "epsilon 5.5" in refusal and "max_epsilon_per_job=5" in refusal and "(site policy: test)" in refusal
    )
    assert PERMISSIVE_DEFAULT.job_refusal(ClientArgs(dp_epsilon=1000.0, stats_dp_epsilon=1.0)) is None


def test_task_refusals():
    policy = PROVISIONED_DEFAULT
    assert "mode 'plain'" in policy.statistics_refusal("plain")
    assert policy.statistics_refusal("secure") is None
    assert PERMISSIVE_DEFAULT.statistics_refusal("plain") is None
    he_only = SitePolicy(require_encrypted_updates=True)
    assert "in clear" in he_only.task_refusal({"scalars": []}, encrypted=False)
    assert he_only.task_refusal({"scalars": ["similarity"], "he": True}, encrypted=True) is None
    no_skew = SitePolicy(report_scalars=("similarity",))
    assert "['skew']" in no_skew.task_refusal({"scalars": ["skew"]}, encrypted=False)
    assert "no HE layout" in policy.task_refusal({"he": True}, encrypted=False)


# ---------------------------------------------------------------------------------- epsilon ledger
def test_the_ledger_caps_each_budget_and_the_site_total(tmp_path):
    path = tmp_path / "ledger.json"
    policy = SitePolicy(max_epsilon_per_job=5.0, max_epsilon_total=8.0)
    first = PrivacyGuard(policy, PrivacyLedger(path), "hospital-a", "job-1")
    first.check("statistics", 1.0, delta=1e-5, num_samples=1000)
    first.record("statistics", 1.0)
    first.check("dp_sgd", 4.0, delta=1e-5, num_samples=1000)  # 1 + 4 = 5: at the per-job cap
    first.record("dp_sgd", 4.0)
    with pytest.raises(PolicyRefusal, match="budget 'job-1' to epsilon 5.5.*max_epsilon_per_job=5"):
        first.check("dp_sgd", 4.5, delta=1e-5, num_samples=1000)
    # another job (a new budget) later: the file remembers the 5 spent, the total cap holds
    second = PrivacyGuard(policy, PrivacyLedger(path), "hospital-a", "job-2")
    assert second.ledger.spent() == 5.0
    second.check("dp_sgd", 3.0, delta=1e-5, num_samples=1000)
    with pytest.raises(PolicyRefusal, match="total epsilon to 8.5.*max_epsilon_total=8"):
        second.check("dp_sgd", 3.5, delta=1e-5, num_samples=1000)
    path.write_text("garbage")
    with pytest.raises(ValueError, match="unreadable"):
        PrivacyLedger(path)


def test_dp_sgd_and_the_statistics_release_ask_the_guard_before_spending(tmp_path):
    from test_privacy import SIZE, images

    from fedweigh.models import build_model
    from fedweigh.secure.dp_config import DPConfig, StatsDPConfig
    from fedweigh.secure.dp_sgd import DPSGD
    from fedweigh.secure.stats_release import HistogramReleaser
    from fedweigh.train import TrainConfig, get_params

    guard = PrivacyGuard(SitePolicy(max_epsilon_per_job=0.5), PrivacyLedger(), "site-1", "job-1")
    dp = DPSGD(DPConfig(noise_multiplier=1.0), None, site_name="site-1", guard=guard)
    model = build_model("densenet_compact", 3, img_size=SIZE, norm="group", seed=0)
    before = get_params(model)
    with pytest.raises(PolicyRefusal, match="dp_sgd would take budget 'job-1'"):
        dp.train_round(model, images(64), TrainConfig(batch_size=2, max_steps=50), total_rounds=1)
    after = get_params(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # refused before any step
    assert dp.total_steps == 0 and guard.ledger.spent() == 0.0

    ok = PrivacyGuard(SitePolicy(max_epsilon_per_job=50.0), PrivacyLedger(), "site-1", "job-1")
    dp = DPSGD(DPConfig(noise_multiplier=1.0), None, site_name="site-1", guard=ok)
    _, report = dp.train_round(model, images(64), TrainConfig(batch_size=2, max_steps=2), total_rounds=1)
    assert ok.ledger.entries == {"job-1": {"dp_sgd": report.epsilon}}

    releaser = HistogramReleaser(StatsDPConfig(epsilon=1.0), "site-1", "job-1", folder=tmp_path, guard=guard)
    releaser.guard = PrivacyGuard(SitePolicy(max_epsilon_per_job=0.5), PrivacyLedger(), "site-1", "job-1")
    with pytest.raises(PolicyRefusal, match="statistics would take"):
        releaser.release(np.array([3, 4]), 10, "multiclass")
    assert releaser.drawn is None and not list(tmp_path.glob("*.json"))


# ---------------------------------------------------------------------------------- in the simulator
@pytest.mark.slow
def test_a_site_refuses_a_job_asking_for_less_and_the_job_says_why(tmp_path):
    """Every site's policy accepts only secure statistics; the job asks for plain ones: each site
    refuses (no histogram is sent), the server logs who refused and why, and ends the job."""
    from fedweigh.cli import simulator_command
    from fedweigh.flare.recipes import FedBBRecipe

    policy = tmp_path / "fedweigh_policy.json"
    policy.write_text(json.dumps({"statistics_modes": ["secure"]}))
    recipe = FedBBRecipe(
        name="plain_fedbb", num_rounds=2, min_clients=2, client=TINY_CLIENT, statistics="plain"
    )
    recipe.export(str(tmp_path / "jobs"))
    workspace = tmp_path / "ws"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SITE_POLICY_ENV: str(policy)}
    proc = subprocess.run(
        simulator_command(tmp_path / "jobs" / "plain_fedbb", workspace, 2),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    logs = {
        p.relative_to(workspace).as_posix(): p.read_text(errors="replace") for p in workspace.rglob("log.txt")
    }
    server_log = "\n".join(text for name, text in logs.items() if name.startswith("server/"))
    reason = "the job exchanges label statistics in mode 'plain'; this site accepts only ['secure']"
    for site in ("site-1", "site-2"):
        assert f"{site} refuses this job under its site policy: {reason}" in server_log, proc.stderr[-2000:]
        site_log = "\n".join(text for name, text in logs.items() if name.startswith(f"{site}/"))
        assert f"{site} refuses this job: {reason}" in site_log
    assert "refused by site policy" in server_log and "fewer than min_clients=2" in server_log
    assert "statistics (plain): summed" not in server_log and "round 1/2" not in server_log

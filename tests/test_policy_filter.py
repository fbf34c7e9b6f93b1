"""The site policy enforced by NVFlare at the site, outside the job's code (fedweigh.flare.policy_filter):
jobs with their own code, fedweigh's site-installed jobs, each task and each result."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from fedweigh.flare.jobs import INSTALLED_EXECUTOR
from fedweigh.flare.policy_filter import (
    SitePolicyEnforcer,
    SitePolicyResultFilter,
    job_code_refusal,
    strip_result,
)
from fedweigh.protocol import META_HE, META_PLAN, META_REFUSED, META_SCALARS
from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import SitePolicy


def _app(root: Path, executor: str, args: dict, custom: bool) -> Path:
    app = root / "app_site-1"
    (app / "config").mkdir(parents=True)
    config = {
        "format_version": 2,
        "executors": [{"tasks": ["*"], "executor": {"path": executor, "args": args}}],
    }
    (app / "config" / "config_fed_client.json").write_text(json.dumps(config))
    if custom:
        (app / "custom").mkdir()
        (app / "custom" / "train.py").write_text("print('my own training')\n")
    return app


BYO = ("nvflare.app_common.executors.client_api_executor.ClientAPIExecutor", {"task_script_path": "train.py"})


def _installed(args: ClientArgs) -> tuple[str, dict]:
    return INSTALLED_EXECUTOR, {"task_script_args": args.to_argv()}


# ---------------------------------------------------------------------------------- the job
def test_a_job_with_its_own_code_is_refused_where_the_policy_needs_trusted_code(tmp_path):
    strict = SitePolicy(require_dp=True, source="hospital policy")
    byo = _app(tmp_path / "byo", *BYO, custom=True)
    reason = job_code_refusal(strict, byo)
    assert (
        "runs its own client code" in reason
        and "DP-SGD" in reason
        and "(site policy: hospital policy)" in reason
    )
    # the same code is accepted where the policy needs nothing that only trusted code can show
    assert job_code_refusal(SitePolicy(), byo) is None
    # fedweigh's executor name with a custom/ folder beside it is still the job's code
    disguised = _app(tmp_path / "disguised", *_installed(ClientArgs(dp_epsilon=4.0)), custom=True)
    assert "runs its own client code" in job_code_refusal(strict, disguised)


def test_a_site_installed_job_is_judged_by_its_arguments(tmp_path):
    strict = SitePolicy(require_dp=True, max_epsilon_per_job=5.0, source="p")
    ok = _app(tmp_path / "ok", *_installed(ClientArgs(dp_epsilon=4.0, norm="group")), custom=False)
    assert job_code_refusal(strict, ok) is None
    greedy = _app(tmp_path / "greedy", *_installed(ClientArgs(dp_epsilon=8.0, norm="group")), custom=False)
    assert "max_epsilon_per_job=5" in job_code_refusal(strict, greedy)
    no_dp = _app(tmp_path / "no_dp", *_installed(ClientArgs()), custom=False)
    assert "without DP-SGD" in job_code_refusal(strict, no_dp)
    big_delta = _app(tmp_path / "delta", *_installed(ClientArgs(dp_epsilon=4.0, dp_delta=0.5)), custom=False)
    assert "max_delta" in job_code_refusal(strict, big_delta)


# ---------------------------------------------------------------------------------- tasks and results
class _Engine:
    def __init__(self, root: Path) -> None:
        self.root = root

    def fire_event(self, event_type, fl_ctx):
        pass

    def get_workspace(self):
        return SimpleNamespace(get_root_dir=lambda: str(self.root), get_app_dir=lambda job_id: str(self.root))


def _ctx(app: Path) -> FLContext:
    ctx = FLContext()
    ctx.set_prop(FLContextKey.APP_ROOT, str(app), private=True, sticky=False)
    ctx.get_engine = lambda: _Engine(app)  # type: ignore[method-assign]
    ctx.get_identity_name = lambda: "site-1"  # type: ignore[method-assign]
    ctx.get_job_id = lambda: "job-1"  # type: ignore[method-assign]
    return ctx


def _task(task: str, meta: dict) -> Shareable:
    return DXO(DataKind.WEIGHTS, {"w": [1.0]}, meta=meta).to_shareable()


def _result(scalars: dict) -> Shareable:
    return DXO(DataKind.WEIGHTS, {"w": [2.0]}, meta={META_SCALARS: scalars, "num_samples": 10}).to_shareable()


def _run_task(
    enforcer: SitePolicyEnforcer, ctx: FLContext, task: str, meta: dict, result: Shareable
) -> Shareable:
    ctx.set_prop(FLContextKey.TASK_NAME, task, private=True, sticky=False)
    ctx.set_prop(FLContextKey.TASK_DATA, _task(task, meta), private=True, sticky=False)
    enforcer.handle_event(EventType.BEFORE_TASK_DATA_FILTER, ctx)
    ctx.set_prop(FLContextKey.TASK_RESULT, result, private=True, sticky=False)
    enforcer.handle_event(EventType.BEFORE_TASK_RESULT_FILTER, ctx)
    return result


@pytest.fixture
def policy_file(tmp_path):
    path = tmp_path / "fedweigh_policy.json"
    path.write_text(json.dumps({"report_scalars": ["skew"], "require_encrypted_updates": False}))
    return path


def test_a_task_asking_for_less_is_answered_with_the_reason_only(tmp_path, policy_file):
    app = _app(tmp_path / "job", *BYO, custom=True)
    enforcer = SitePolicyEnforcer(policy_file=str(policy_file))
    ctx = _ctx(app)
    enforcer.handle_event(EventType.START_RUN, ctx)
    assert enforcer.job_refusal is None
    sent = _run_task(
        enforcer, ctx, "train", {META_PLAN: {"scalars": ["similarity"]}}, _result({"similarity": 0.9})
    )
    dxo = from_shareable(sent)
    assert "w" not in dxo.data and "['similarity']" in dxo.meta[META_REFUSED]
    # once refused, every later task of the job is refused too, whatever it asks
    later = _run_task(enforcer, ctx, "train", {META_PLAN: {"scalars": []}}, _result({}))
    assert META_REFUSED in from_shareable(later).meta and "w" not in from_shareable(later).data


def test_scalars_the_policy_does_not_allow_are_stripped_from_a_result(tmp_path, policy_file):
    app = _app(tmp_path / "job", *BYO, custom=True)
    enforcer = SitePolicyEnforcer(policy_file=str(policy_file))
    ctx = _ctx(app)
    enforcer.handle_event(EventType.START_RUN, ctx)
    # the task asks only for skew; the job's own script sends more than it was asked for
    sent = _run_task(
        enforcer, ctx, "train", {META_PLAN: {"scalars": ["skew"]}}, _result({"skew": 0.2, "similarity": 0.9})
    )
    dxo = from_shareable(sent)
    assert dxo.meta[META_SCALARS] == {"skew": 0.2} and dxo.data == {"w": [2.0]}
    assert strip_result(SitePolicy(), _result({"skew": 0.1})) == []


def test_encrypted_updates_required_refuses_a_task_in_clear(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"require_encrypted_updates": True}))
    app = _app(tmp_path / "job", *BYO, custom=True)
    enforcer = SitePolicyEnforcer(policy_file=str(path))
    ctx = _ctx(app)
    enforcer.handle_event(EventType.START_RUN, ctx)
    sent = _run_task(enforcer, ctx, "train", {META_PLAN: {}}, _result({}))
    assert "in clear" in from_shareable(sent).meta[META_REFUSED]
    enforcer = SitePolicyEnforcer(policy_file=str(path))
    enforcer.handle_event(EventType.START_RUN, ctx)
    sent = _run_task(enforcer, ctx, "train", {META_PLAN: {"he": True}, META_HE: {"keys": ["w"]}}, _result({}))
    assert META_REFUSED not in from_shareable(sent).meta


def test_a_refused_job_sends_nothing_but_the_reason(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"require_dp": True}))
    app = _app(tmp_path / "job", *BYO, custom=True)
    enforcer = SitePolicyEnforcer(policy_file=str(path))
    ctx = _ctx(app)
    enforcer.handle_event(EventType.START_RUN, ctx)
    assert "runs its own client code" in enforcer.job_refusal
    sent = _run_task(enforcer, ctx, "train", {META_PLAN: {}}, _result({}))
    dxo = from_shareable(sent)
    assert "w" not in dxo.data and "runs its own client code" in dxo.meta[META_REFUSED]


def test_the_scope_result_filter_judges_the_job_and_strips(tmp_path, policy_file):
    app = _app(tmp_path / "job", *BYO, custom=True)
    filt = SitePolicyResultFilter(policy_file=str(policy_file))
    out = filt.process(_result({"skew": 0.2, "similarity": 0.9}), _ctx(app))
    assert from_shareable(out).meta[META_SCALARS] == {"skew": 0.2}
    strict = tmp_path / "strict.json"
    strict.write_text(json.dumps({"require_statistics_dp": True}))
    out = SitePolicyResultFilter(policy_file=str(strict)).process(_result({}), _ctx(app))
    assert "statistics DP" in from_shareable(out).meta[META_REFUSED] and "w" not in from_shareable(out).data


# ---------------------------------------------------------------------------------- in the simulator
@pytest.mark.slow
def test_a_job_with_its_own_script_is_refused_by_the_sites_privacy_json(tmp_path):
    """examples/byo_feddraw (its own client script, which knows nothing of the site policy) at two sites
    whose local/privacy.json adds the enforcer and whose policy requires DP-SGD: both sites refuse the
    job outside its code, the server names them and the reason, and no result of the script is used."""
    import os
    import subprocess
    import sys

    from fedweigh.cli import simulator_command
    from fedweigh.flare.provision import PRIVACY_CONFIG
    from fedweigh.protocol import SITE_POLICY_ENV

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "custom"), os.environ.get("PYTHONPATH", "")])
    example = root / "examples" / "byo_feddraw"
    cmd = [sys.executable, "job.py", "--out", str(tmp_path / "jobs"), "--rounds", "1", "--sites", "2"]
    subprocess.run(cmd, cwd=example, env=env, check=True, timeout=300)
    workspace = tmp_path / "ws"
    (workspace / "local").mkdir(parents=True)  # the simulator copies it into every site's local/
    (workspace / "local" / "privacy.json").write_text(json.dumps(PRIVACY_CONFIG))
    policy = tmp_path / "fedweigh_policy.json"
    policy.write_text(json.dumps({"require_dp": True}))
    env[SITE_POLICY_ENV] = str(policy)
    proc = subprocess.run(
        simulator_command(tmp_path / "jobs" / "byo_feddraw", workspace, 2),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    logs = {
        p.relative_to(workspace).as_posix(): p.read_text(errors="replace") for p in workspace.rglob("log.txt")
    }
    server_log = "\n".join(text for name, text in logs.items() if name.startswith("server/"))
    reason = "the job runs its own client code"
    for site in ("site-1", "site-2"):
        site_log = "\n".join(text for name, text in logs.items() if name.startswith(f"{site}/"))
        assert f"{site} refuses this job: {reason}" in site_log, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"{site} refuses this job under its site policy: {reason}" in server_log
        assert f"skipping result: {site} refused under its site policy" in server_log
    assert "0 valid result(s), fewer than min_clients=2" in server_log

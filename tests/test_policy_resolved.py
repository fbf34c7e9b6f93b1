"""The site policy judged on the client configuration NVFlare resolves, in the site's parent process
before a job launches (fedweigh.flare.site_authorizer), and stripping wherever a result carries a scalar.

The parent-process tests drive NVFlare's own code path: a real ``ClientEngine`` (the site's parent
process object), NVFlare's ``DeployProcessor`` (the handler of the server's deploy request) and
``ClientEngine.start_app`` -> ``JobExecutor.start_app`` -> ``get_job_launcher`` (BEFORE_JOB_LAUNCH).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.job_launcher_spec import JobLauncherSpec, add_launcher
from nvflare.apis.shareable import Shareable
from nvflare.apis.workspace import Workspace
from nvflare.fuel.utils.zip_utils import zip_directory_to_bytes
from nvflare.private.admin_defs import Message
from nvflare.private.defs import RequestHeader, TrainingTopic
from nvflare.private.fed.client.client_engine import ClientEngine
from nvflare.private.fed.client.training_cmds import DeployProcessor
from nvflare.private.fed.utils.app_deployer import AppDeployer

from fedweigh.flare.jobs import INSTALLED_EXECUTOR
from fedweigh.flare.policy_filter import job_code_refusal, strip_result
from fedweigh.flare.site_authorizer import JobPolicyAuthorizer, RefusedJobLauncher
from fedweigh.protocol import META_SCALARS
from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import SitePolicy

SITE = "hospital-a"
BYO_EXECUTOR = "nvflare.app_common.executors.client_api_executor.ClientAPIExecutor"
STRICT = SitePolicy(require_dp=True, source="hospital policy")
LEGIT_ARGS = {"task_script_args": ClientArgs(dp_epsilon=4.0, norm="group").to_argv()}

#: The component of the security review: it keeps the result after the task and puts it back after the
#: site's result filters, so the in-job enforcer's replacement is undone.
RESTORER = """
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey


class Restorer(FLComponent):
    def __init__(self):
        super().__init__()
        self.kept = None

    def handle_event(self, event_type, fl_ctx):
        result = fl_ctx.get_prop(FLContextKey.TASK_RESULT)
        if event_type == EventType.AFTER_TASK_EXECUTION:
            self.kept = dict(result)
        elif event_type == EventType.AFTER_TASK_RESULT_FILTER and self.kept is not None:
            result.clear()
            result.update(self.kept)
"""


def _write_app(app: Path, config: dict | str, custom: dict[str, str] | None = None) -> Path:
    (app / "config").mkdir(parents=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (app / "config" / "config_fed_client.json").write_text(text)
    for name, source in (custom or {}).items():
        (app / "custom").mkdir(exist_ok=True)
        (app / "custom" / name).write_text(source)
    return app


def _executors(path: str, args: dict) -> list[dict]:
    return [{"tasks": ["*"], "executor": {"path": path, "args": dict(args)}}]


def _legit() -> dict:
    return {"format_version": 2, "executors": _executors(INSTALLED_EXECUTOR, LEGIT_ARGS)}


def _byoc_restorer() -> tuple[dict, dict[str, str]]:
    config = _legit()
    config["components"] = [{"id": "restorer", "path": "restorer.Restorer", "args": {}}]
    return config, {"restorer.py": RESTORER}


# ---------------------------------------------------------------------------------- the resolved config
def test_an_executor_list_behind_a_variable_is_judged_as_resolved(tmp_path):
    config = {
        "format_version": 2,
        "ex": _executors(BYO_EXECUTOR, {"task_script_path": "t.py"}),
        "executors": "{ex}",
    }
    reason = job_code_refusal(STRICT, _write_app(tmp_path / "job" / "app_x", config))
    assert reason is not None and BYO_EXECUTOR in reason and "DP-SGD" in reason


def test_an_executor_behind_a_variable_is_refused_not_an_error(tmp_path):
    config = {
        "format_version": 2,
        "e": {"path": BYO_EXECUTOR, "args": {"task_script_path": "t.py"}},
        "executors": [{"tasks": ["*"], "executor": "{e}"}],
    }
    reason = job_code_refusal(STRICT, _write_app(tmp_path / "job" / "app_x", config))
    assert reason is not None and BYO_EXECUTOR in reason


def test_a_component_or_filter_besides_the_installed_executor_is_refused(tmp_path):
    config = _legit()
    config["task_result_filters"] = [{"tasks": ["*"], "filters": [{"path": "evil.Filter", "args": {}}]}]
    reason = job_code_refusal(STRICT, _write_app(tmp_path / "f" / "app_x", config))
    assert reason is not None and "evil.Filter" in reason
    # and a non-fedweigh class hidden in the installed executor's arguments
    nested = _legit()
    nested["executors"][0]["executor"]["args"]["task_script_args"] = {"path": BYO_EXECUTOR}
    assert "task_script_args" in (
        job_code_refusal(STRICT, _write_app(tmp_path / "n" / "app_x", nested)) or ""
    )


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        json.dumps({"format_version": 2, "executors": "{missing}"}),
        json.dumps({"format_version": 3, "executors": _executors(INSTALLED_EXECUTOR, LEGIT_ARGS)}),
        json.dumps({"format_version": 2}),
    ],
    ids=["malformed", "unresolved-reference", "wrong-format-version", "no-executor"],
)
def test_a_config_nvflare_would_not_build_is_refused(tmp_path, text):
    reason = job_code_refusal(SitePolicy(source="lenient"), _write_app(tmp_path / "job" / "app_x", text))
    assert reason is not None and "cannot be read or resolved" in reason


def test_a_legit_fedweigh_job_is_accepted_and_judged_by_its_arguments(tmp_path):
    assert job_code_refusal(STRICT, _write_app(tmp_path / "ok" / "app_x", _legit())) is None
    greedy = {
        "format_version": 2,
        "e": {"path": INSTALLED_EXECUTOR, "args": {"task_script_args": "--norm group"}},
    }
    greedy["executors"] = [{"tasks": ["*"], "executor": "{e}"}]
    assert "without DP-SGD" in (
        job_code_refusal(STRICT, _write_app(tmp_path / "no_dp" / "app_x", greedy)) or ""
    )


# ---------------------------------------------------------------------------------- the parent process
class _RecordingLauncher(JobLauncherSpec):
    """The site's job launcher: records a launch instead of starting a process."""

    def __init__(self) -> None:
        super().__init__()
        self.launched: list[str] = []

    def launch_job(self, job_meta, fl_ctx):
        self.launched.append(job_meta["job_id"])
        raise RuntimeError("recorded")

    def handle_event(self, event_type, fl_ctx):
        if event_type == "_before_job_launch":
            add_launcher(self, fl_ctx)


class _Cell:
    """The parent's communication cell, as far as launching a job asks it."""

    def get_internal_listener_url(self) -> str:
        return "tcp://localhost:0"

    def get_internal_listener_params(self) -> dict:
        return {}


def _site(tmp_path: Path, components: dict) -> tuple[ClientEngine, Path]:
    ws = tmp_path / "ws"
    (ws / "startup").mkdir(parents=True)
    (ws / "local").mkdir()
    (ws / "local" / "fedweigh_policy.json").write_text(json.dumps({"require_dp": True}))
    client = SimpleNamespace(
        client_name=SITE,
        components=components,
        client_args={},
        secure_train=False,
        token="t",
        token_signature="s",
        ssid="i",
        cell=_Cell(),
    )
    engine = ClientEngine(client, SimpleNamespace(workspace=str(ws), set=[]), rank=0)
    engine.fl_ctx_mgr.private_stickers.update(
        {
            FLContextKey.SERVER_CONFIG: [{"service": {"scheme": "grpc", "target": "localhost:1"}}],
            FLContextKey.WORKSPACE_OBJECT: Workspace(str(ws), SITE),
        }
    )
    return engine, ws


def _deploy(engine: ClientEngine, app: Path, job_id: str) -> Message:
    request = Message(topic=TrainingTopic.DEPLOY, body=zip_directory_to_bytes(str(app), ""))
    request.set_header(RequestHeader.JOB_ID, job_id)
    request.set_header(RequestHeader.JOB_META, {"job_id": job_id})
    request.set_header(RequestHeader.APP_NAME, "app")
    return DeployProcessor().process(request, engine)


def _start(engine: ClientEngine, job_id: str) -> str:
    try:
        return engine.start_app(job_id, job_meta={"job_id": job_id})
    except RuntimeError as e:
        return str(e)


def test_the_parent_process_refuses_the_deployment_of_a_refused_job(tmp_path):
    launcher = _RecordingLauncher()
    engine, ws = _site(tmp_path, {"process_launcher": launcher, "app_deployer": JobPolicyAuthorizer()})
    config = {
        "format_version": 2,
        "ex": _executors(BYO_EXECUTOR, {"task_script_path": "t.py"}),
        "executors": "{ex}",
    }
    reply = _deploy(engine, _write_app(tmp_path / "byo", config), "job-byo")
    assert "refuses job job-byo" in str(reply.body) and BYO_EXECUTOR in str(reply.body)
    assert not (ws / "job-byo").exists()  # nothing left to launch
    assert "does not exist" in _start(engine, "job-byo") and launcher.launched == []
    # the same site deploys and launches a job its policy accepts
    assert "deployed" in str(_deploy(engine, _write_app(tmp_path / "ok", _legit()), "job-ok").body)
    assert _start(engine, "job-ok") == "recorded" and launcher.launched == ["job-ok"]


def test_the_byoc_result_restorer_never_launches_at_a_refusing_site(tmp_path):
    # NVFlare's default deployer puts the job on disk; the authorizer stops it at BEFORE_JOB_LAUNCH
    launcher = _RecordingLauncher()
    engine, ws = _site(tmp_path, {"process_launcher": launcher, "fedweigh_policy": JobPolicyAuthorizer()})
    config, custom = _byoc_restorer()
    reply = _deploy(engine, _write_app(tmp_path / "byoc", config, custom), "job-byoc")
    assert (
        "deployed" in str(reply.body)
        and (ws / "job-byoc" / f"app_{SITE}" / "custom" / "restorer.py").is_file()
    )
    message = _start(engine, "job-byoc")
    assert "refuses job job-byoc" in message and "custom/" in message
    assert launcher.launched == []  # no job process: the restorer's code never runs at this site


def test_a_site_listing_the_authorizer_first_still_does_not_launch_a_refused_job(tmp_path):
    launcher = _RecordingLauncher()
    engine, _ = _site(tmp_path, {"fedweigh_policy": JobPolicyAuthorizer(), "process_launcher": launcher})
    config, custom = _byoc_restorer()
    _deploy(engine, _write_app(tmp_path / "byoc", config, custom), "job-byoc")
    assert "Exactly one job launcher" in _start(engine, "job-byoc") and launcher.launched == []


def test_an_unreadable_policy_refuses_every_job(tmp_path):
    engine, ws = _site(tmp_path, {"app_deployer": JobPolicyAuthorizer()})
    (ws / "local" / "fedweigh_policy.json").write_text("{broken")
    reply = _deploy(engine, _write_app(tmp_path / "ok", _legit()), "job-ok")
    assert "policy cannot be read" in str(reply.body)


def test_the_refused_launcher_raises_the_reason():
    with pytest.raises(RuntimeError, match="refuses job j1: because"):
        RefusedJobLauncher("because").launch_job({"job_id": "j1"}, None)


def test_nvflares_own_deployer_is_what_deploys(tmp_path):
    assert isinstance(JobPolicyAuthorizer()._deployer, AppDeployer)


# ---------------------------------------------------------------------------------- stripping
POLICY = SitePolicy(report_scalars=("skew",))


def _result(dxo: DXO) -> Shareable:
    return dxo.to_shareable()


def test_a_forbidden_scalar_under_another_meta_key_is_removed():
    result = _result(
        DXO(
            DataKind.WEIGHTS,
            {"w": 1.0},
            {
                META_SCALARS: {"similarity": 0.9, "skew": 0.1},
                "mine": {"similarity": 0.9, "note": "x"},
                "imbalance": 2.0,
            },
        )
    )
    removed = strip_result(POLICY, result)
    meta = result["DXO"]["meta"]
    assert meta[META_SCALARS] == {"skew": 0.1} and meta["mine"] == {"note": "x"} and "imbalance" not in meta
    assert len(removed) == 3


def test_a_forbidden_scalar_in_a_nested_collection_dxo_is_removed():
    inner = DXO(DataKind.METRICS, {"discrepancy": 0.3, "acc": 0.8}, {META_SCALARS: {"similarity": 0.9}})
    result = _result(DXO(DataKind.COLLECTION, {"inner": inner}, {}))
    strip_result(POLICY, result)
    kept = result["DXO"]["data"]["inner"]
    assert kept.data == {"acc": 0.8} and kept.meta[META_SCALARS] == {}


def test_forbidden_scalars_as_metrics_data_and_headers_are_removed():
    result = _result(DXO(DataKind.METRICS, {"similarity": 0.9, "skew": 0.2}, {}))
    result.set_header("smuggled", {"imbalance": 1.0})
    strip_result(POLICY, result)
    assert result["DXO"]["data"] == {"skew": 0.2} and result.get_header("smuggled") == {}


def test_a_result_too_deep_to_check_is_refused():
    deep: dict = {}
    node = deep
    for _ in range(100):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ValueError, match="cannot be checked"):
        strip_result(POLICY, _result(DXO(DataKind.METRICS, {"a": 1.0}, {"deep": deep})))


# ---------------------------------------------------------------------------------- provisioning
def test_allow_fedweigh_adds_the_authorizer_to_site_kits_only(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "allow_fedweigh", Path(__file__).parents[1] / "provisioning" / "allow_fedweigh.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for kit, startup in (("site", "fed_client.json"), ("server", "fed_server.json")):
        (tmp_path / kit / "local").mkdir(parents=True)
        (tmp_path / kit / "startup").mkdir()
        (tmp_path / kit / "startup" / startup).write_text("{}")
        (tmp_path / kit / "local" / "resources.json.default").write_text(json.dumps({"class_allow_list": []}))
        module.allow(tmp_path / kit, module.allow_list_entries())
        module.allow(tmp_path / kit, module.allow_list_entries())  # twice changes nothing
    site = json.loads((tmp_path / "site" / "local" / "resources.json").read_text())
    assert [c["path"] for c in site["components"]] == ["fedweigh.flare.site_authorizer.JobPolicyAuthorizer"]
    assert "components" not in json.loads((tmp_path / "server" / "local" / "resources.json").read_text())

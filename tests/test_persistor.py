"""The server's model persistor (fedweigh.flare.persistor): no unpickling and no path outside the job,
whatever the job's arguments say; the shipped jobs and the allow-list use it instead of the stock one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext

from fedweigh.flare.persistor import SERVER_READ_DIRS_ENV, FedweighModelPersistor, check_server_path

REPO = Path(__file__).resolve().parents[1]
MODEL = {"path": "torch.nn.Linear", "args": {"in_features": 3, "out_features": 2}}


class _Payload:
    """A pickle that runs code when unpickled: it creates the file it names."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _ctx(app_root: Path) -> FLContext:
    ctx = FLContext()
    ctx.set_prop(FLContextKey.APP_ROOT, str(app_root), private=True, sticky=False)
    return ctx


def _persistor(monkeypatch, **args) -> tuple[FedweighModelPersistor, list[str]]:
    panics: list[str] = []
    persistor = FedweighModelPersistor(model=dict(MODEL), **args)
    monkeypatch.setattr(persistor, "system_panic", lambda reason, fl_ctx: panics.append(reason))
    monkeypatch.setattr(persistor, "log_error", lambda fl_ctx, msg, fire_event=True: None)
    monkeypatch.setattr(persistor, "log_exception", lambda fl_ctx, msg, fire_event=True: None)
    return persistor, panics


@pytest.fixture
def provisioned_server(tmp_path, monkeypatch):
    """The server's process runs in a provisioned kit: only its workspace and listed folders are readable."""
    root = tmp_path / "server"
    (root / "startup").mkdir(parents=True)
    (root / "startup" / "fed_server.json").write_text("{}")
    app = root / "job-1" / "app_server"
    (app / "custom").mkdir(parents=True)
    monkeypatch.chdir(root)
    monkeypatch.delenv(SERVER_READ_DIRS_ENV, raising=False)
    return app


def test_the_job_cannot_ask_for_unpickling_or_for_paths_outside(tmp_path):
    with pytest.raises(ValueError, match="load_weights_only=False refused"):
        FedweighModelPersistor(model=MODEL, load_weights_only=False)
    for name in ("/etc/cron.d/x", "../../x.pt", "sub/x.pt", ".."):
        with pytest.raises(ValueError, match="global_model_file_name must be a plain file name"):
            FedweighModelPersistor(model=MODEL, global_model_file_name=name)
        with pytest.raises(ValueError, match="best_global_model_file_name must be a plain file name"):
            FedweighModelPersistor(model=MODEL, best_global_model_file_name=name)
    with pytest.raises(ValueError, match="leaves the job's custom/ folder"):
        FedweighModelPersistor(model=MODEL, source_ckpt_file_full_name="../../../secret.pt")
    assert FedweighModelPersistor(model=MODEL).load_weights_only is True


def test_a_pickled_checkpoint_runs_no_code(provisioned_server, monkeypatch):
    marker = provisioned_server.parent / "code_ran"
    torch.save({"weight": _Payload(marker)}, provisioned_server / "custom" / "model.pt")
    persistor, panics = _persistor(monkeypatch, source_ckpt_file_full_name="model.pt")
    ctx = _ctx(provisioned_server)
    persistor._initialize(ctx)
    assert persistor.load_model(ctx) is None and panics == ["cannot load model checkpoint"]
    assert not marker.exists()
    # what the stock persistor's load_weights_only=false, which a job could set, would have done
    from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor

    stock = PTFileModelPersistor(
        model=dict(MODEL), source_ckpt_file_full_name="model.pt", load_weights_only=False
    )
    monkeypatch.setattr(stock, "system_panic", lambda reason, fl_ctx: None)
    stock._initialize(ctx)
    with pytest.raises(AttributeError):  # the payload ran, then left no tensor behind
        stock.load_model(ctx)
    assert marker.exists()


def test_an_absolute_checkpoint_must_be_in_a_folder_the_server_lists(
    provisioned_server, tmp_path, monkeypatch
):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    linear = torch.nn.Linear(3, 2)
    torch.save(linear.state_dict(), outside / "w.pt")
    persistor, panics = _persistor(monkeypatch, source_ckpt_file_full_name=str(outside / "w.pt"))
    ctx = _ctx(provisioned_server)
    persistor._initialize(ctx)
    with pytest.raises(PermissionError, match=f"outside the job's workspace.*{SERVER_READ_DIRS_ENV}"):
        persistor.load_model(ctx)
    assert panics and "source_ckpt_file_full_name" in panics[0]
    monkeypatch.setenv(SERVER_READ_DIRS_ENV, str(outside))
    persistor, panics = _persistor(monkeypatch, source_ckpt_file_full_name=str(outside / "w.pt"))
    persistor._initialize(ctx)
    learnable = persistor.load_model(ctx)
    assert not panics and set(learnable["weights"]) == {"weight", "bias"}


def test_the_model_files_stay_in_the_app_folder(provisioned_server, monkeypatch):
    """A job's environment.json checkpoint folder is the remaining way to aim the writes elsewhere."""
    persistor, panics = _persistor(monkeypatch)
    ctx = _ctx(provisioned_server)
    from nvflare.app_common.app_constant import AppConstants

    ctx.set_prop(AppConstants.LOG_DIR, "/tmp", private=True, sticky=False)
    with pytest.raises(PermissionError, match="the checkpoint folder '/tmp' is outside the job's app folder"):
        persistor._initialize(ctx)
    assert panics


def test_pretrained_and_resume_from_are_limited_to_listed_folders(provisioned_server, tmp_path, monkeypatch):
    persistor, panics = FedweighModelPersistor(model={**MODEL, "args": {"pretrained": "/etc/passwd"}}), []
    monkeypatch.setattr(persistor, "system_panic", lambda reason, fl_ctx: panics.append(reason))
    monkeypatch.setattr(persistor, "log_error", lambda fl_ctx, msg, fire_event=True: None)
    with pytest.raises(PermissionError, match="pretrained='/etc/passwd' is outside"):
        persistor._initialize(_ctx(provisioned_server))
    with pytest.raises(PermissionError, match="resume_from='/etc' is outside"):
        check_server_path("/etc", "resume_from")
    inside = provisioned_server / "state"
    assert check_server_path(inside, "resume_from", provisioned_server) == inside.resolve()
    escaping = provisioned_server / ".." / ".." / "startup"
    with pytest.raises(PermissionError):
        check_server_path(escaping, "resume_from", provisioned_server)
    monkeypatch.setenv(SERVER_READ_DIRS_ENV, str(tmp_path / "runs"))
    assert check_server_path(tmp_path / "runs" / "a", "resume_from") == (tmp_path / "runs" / "a").resolve()


def test_a_simulation_workspace_reads_any_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(SERVER_READ_DIRS_ENV, raising=False)
    assert check_server_path("/etc", "resume_from") == Path("/etc").resolve()


def test_the_controller_refuses_a_resume_from_outside(provisioned_server):
    from fedweigh.flare.controller import FedweighController

    with pytest.raises(PermissionError, match="resume_from='/etc' is outside"):
        FedweighController(num_rounds=2, resume_from="/etc")


def test_jobs_and_the_allow_list_use_the_safe_persistor():
    allow = json.loads((REPO / "provisioning" / "resources.json").read_text())["class_allow_list"]
    assert "fedweigh.flare.persistor.FedweighModelPersistor" in allow
    assert not any("PTFileModelPersistor" in entry for entry in allow)
    paths = set()
    for config in (REPO / "jobs").rglob("config_fed_server.json"):
        for comp in json.loads(config.read_text())["components"]:
            paths.add(comp["path"])
    assert "fedweigh.flare.persistor.FedweighModelPersistor" in paths
    assert not any(p.endswith("PTFileModelPersistor") for p in paths)

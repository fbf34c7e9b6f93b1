"""The server's round records reach NVFlare's experiment tracking: analytics events with the records'
tags and values, one TensorBoard receiver per recipe, and MLflow's receiver takes them too."""

from __future__ import annotations

import importlib
import json
import math
import re
import sys
import types
from pathlib import Path
from queue import Empty

import numpy as np
import pytest
from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsData, AnalyticsDataType
from nvflare.apis.dxo import from_shareable
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey, ProcessType, ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
from nvflare.recipe.utils import add_experiment_tracking
from simulation import TINY_CLIENT, run_recipe_in_simulator

from fedweigh.flare.aggregator import FedweighAggregator
from fedweigh.flare.recipes import FedDRAWRecipe
from fedweigh.flare.tracking import ServerAnalytics
from fedweigh.server.records import RoundRecorder, load_rows

SERVER = "server"
#: What provisioning/allow_fedweigh.py adds to a server's class allow-list.
ALLOW_LIST = json.loads((Path(__file__).parents[1] / "provisioning" / "resources.json").read_text())[
    "class_allow_list"
]


class _Engine:
    """The part of NVFlare's server engine the event path uses: new contexts (identity: the server)
    and ``fire_event`` to every component, as the engine's own dispatch does."""

    def __init__(self, components: list[FLComponent], clients: tuple[str, ...] = ("site-1", "site-2")):
        self.components = components
        self.clients = [types.SimpleNamespace(name=c) for c in clients]

    def new_context(self) -> FLContext:
        ctx = FLContext()
        ctx.set_prop(ReservedKey.ENGINE, self, private=True, sticky=False)
        ctx.set_prop(ReservedKey.PROCESS_TYPE, ProcessType.SERVER_JOB, private=True, sticky=False)
        ctx.set_prop(ReservedKey.IDENTITY_NAME, SERVER, private=False, sticky=False)
        ctx.set_prop(ReservedKey.RUN_NUM, "job", private=False, sticky=False)
        return ctx

    def fire_event(self, event_type: str, fl_ctx: FLContext) -> None:
        for c in self.components:
            c.handle_event(event_type, fl_ctx)

    def get_clients(self):
        return self.clients

    def get_workspace(self):
        return self.workspace


class _Capture(FLComponent):
    """Every analytics event the server fires: (tag, value, step, data type, origin)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, float, int, AnalyticsDataType, str]] = []

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == ANALYTIC_EVENT_TYPE:
            data = AnalyticsData.from_dxo(from_shareable(fl_ctx.get_prop(FLContextKey.EVENT_DATA)))
            self.seen.append((data.tag, data.value, data.step, data.data_type, fl_ctx.get_identity_name()))


def _expected(rows: list[dict]) -> set[tuple[str, float, int]]:
    """The scalars of the JSON rows, at their row's round: each weight as weight/<site>, each other
    finite number under its own name (:func:`_named` strips the events' global/ or scheme/)."""
    out = set()
    for row in rows:
        for key, value in row.items():
            if key == "weights":
                out |= {(f"weight/{s}", w, row["round"]) for s, w in value.items()}
            elif isinstance(value, float) and math.isfinite(value):
                out.add((key, value, row["round"]))
    return out


def _named(tag: str) -> str:
    prefix, _, name = tag.partition("/")
    assert prefix in ("global", "scheme", "weight"), tag
    return tag if prefix == "weight" else name


def test_recorded_rows_are_fired_as_analytics_events_with_the_rows_values(tmp_path):
    """Tag names, step = round and values equal the JSON record's; the origin is the server."""
    capture = _Capture()
    sender = FLComponent()
    sender.engine = _Engine([capture])
    rec = RoundRecorder(tmp_path, "feddraw", sinks=[ServerAnalytics(sender)], tensorboard=False)
    rec.set_site_metrics(0, {"val_auc": 0.5, "test_gm": float("nan")})
    rec.set_round(1, {"site-1": 0.7, "site-2": 0.3}, {"lambda": 0.25, "round_seconds": 1.5})
    rec.set_site_metrics(1, {"val_auc": 0.625})
    rec.flush()
    rows = load_rows(tmp_path / "fedweigh_metrics.json")
    sent = {(tag, value, step) for tag, value, step, _, _ in capture.seen}
    assert {(_named(t), v, s) for t, v, s in sent} == _expected(rows)
    assert ("weight/site-1", 0.7, 1) in sent and ("global/val_auc", 0.625, 1) in sent
    assert ("scheme/lambda", 0.25, 1) in sent
    assert {t for t, *_ in capture.seen}.isdisjoint({"global/test_gm"})  # NaN: in the JSON, not sent
    assert len(capture.seen) == len(sent)  # each once
    assert {(kind, origin) for *_, kind, origin in capture.seen} == {(AnalyticsDataType.SCALAR, SERVER)}
    assert not (tmp_path / "tb_events").exists()  # the controller's rows leave through the events only


def test_fedweigh_aggregator_fires_each_rounds_weights_and_metrics():
    """FedweighAggregator in stock FedAvg: weight/<site> and scheme/* at fedweigh's round t
    (NVFlare's round t - 1), the sites' mean metrics of the model they received at step t - 1."""
    capture = _Capture()
    agg = FedweighAggregator(scheme="fedavg", num_rounds=3, min_update_cosine=None)
    engine = _Engine([capture])
    ctx = engine.new_context()
    g = FLModel(params_type=ParamsType.FULL, params={"w": np.zeros(3, np.float32)})
    ctx.set_prop(AppConstants.GLOBAL_MODEL, FLModelUtils.to_model_learnable(g), private=True, sticky=False)
    ctx.set_prop(AppConstants.CURRENT_ROUND, 1, private=True, sticky=False)
    agg.fl_ctx = ctx
    for site, n, auc in (("site-1", 30, 0.5), ("site-2", 10, 0.75)):
        agg.accept_model(
            FLModel(
                params={"w": np.full(3, 0.1, np.float32)},
                metrics={"val_auc": auc},
                meta={"client_name": site, "num_samples": n},
            )
        )
    agg.aggregate_model()
    sent = {tag: (value, step) for tag, value, step, *_ in capture.seen}
    assert sent["weight/site-1"] == (agg.last_weights["site-1"], 2) and sent["weight/site-2"][1] == 2
    assert sent["weight/site-1"][0] == pytest.approx(0.75)  # FedAvg: 30 of 40 samples
    assert sent["global/val_auc"] == (pytest.approx(0.625), 1)
    assert sent == {
        **{f"weight/{s}": (w, 2) for s, w in agg.recorder.rows[-1]["weights"].items()},
        **{k: v for k, v in sent.items() if not k.startswith("weight/")},
    }


def _server_components(job_dir: Path) -> list[dict]:
    config = json.loads((job_dir / "app" / "config" / "config_fed_server.json").read_text())
    return config["components"]


def test_a_recipe_has_one_tensorboard_receiver_with_or_without_add_experiment_tracking(tmp_path):
    plain = FedDRAWRecipe(name="tb_default", min_clients=2, num_rounds=1, client=TINY_CLIENT)
    tracked = FedDRAWRecipe(name="tb_tracked", min_clients=2, num_rounds=1, client=TINY_CLIENT)
    add_experiment_tracking(tracked, "tensorboard", {"tb_folder": "tracked_tb"})
    for recipe in (plain, tracked):
        recipe.export(str(tmp_path))
        recipe.export(str(tmp_path / "again"))  # exporting twice changes nothing
    tb = TBAnalyticsReceiver.__module__ + ".TBAnalyticsReceiver"
    for name, folder in (("tb_default", "tb_events"), ("tb_tracked", "tracked_tb")):
        for root in (tmp_path, tmp_path / "again"):
            receivers = [c for c in _server_components(root / name) if c["path"] == tb]
            # exactly one, the user's when add_experiment_tracking added one, under NVFlare's id
            assert [(c["id"], c.get("args", {}).get("tb_folder", "tb_events")) for c in receivers] == [
                ("receiver", folder)
            ], name


def test_the_guides_tracking_example_runs_as_written(tmp_path, monkeypatch):
    """docs/deploy.md, "Experiment tracking": its code exports a job with one TensorBoard receiver."""
    guide = (Path(__file__).parents[1] / "docs" / "deploy.md").read_text()
    section = guide.split("### Experiment tracking", 1)[1]
    (block,) = re.findall(r"```python\n(.*?)```", section.split("\n### ", 1)[0], re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/deploy.md", "exec"), {})  # noqa: S102 - the guide's own code
    tb = TBAnalyticsReceiver.__module__ + ".TBAnalyticsReceiver"
    assert [c["id"] for c in _server_components(tmp_path / "jobs" / "feddraw") if c["path"] == tb] == [
        "receiver"
    ]


@pytest.fixture
def fake_mlflow(monkeypatch):
    """A stand-in for the ``mlflow`` package (not installed here): its client records every run and
    every ``log_batch``, so NVFlare's own MLflowReceiver code runs unchanged against it."""
    runs: dict[str, str] = {}
    logged: list[tuple[str, object]] = []

    class Client:
        def get_experiment_by_name(self, name):
            return types.SimpleNamespace(experiment_id="0")

        def create_run(self, experiment_id, run_name, tags):
            runs[run_name] = f"run-{len(runs)}"
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id=runs[run_name]))

        def log_batch(self, run_id, metrics, params, tags):
            logged.extend((run_id, m) for m in metrics)

        def set_terminated(self, run_id):
            pass

    mlflow = types.ModuleType("mlflow")
    mlflow.set_tracking_uri = lambda uri: None
    entities = types.ModuleType("mlflow.entities")
    entities.Metric = lambda key, value, timestamp, step: (key, value, step)
    entities.Param = entities.RunTag = lambda key, value: (key, value)
    tracking = types.ModuleType("mlflow.tracking")
    client = types.ModuleType("mlflow.tracking.client")
    client.MlflowClient = Client
    for name, module in {
        "mlflow": mlflow,
        "mlflow.entities": entities,
        "mlflow.tracking": tracking,
        "mlflow.tracking.client": client,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    for name in ("nvflare.app_opt.tracking.mlflow.mlflow_receiver", "fedweigh.flare.mlflow_tracking"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return runs, logged


def _record_one_round(engine) -> None:
    """The controller's records of round 1 (weights 0.6/0.4, lambda 0.5, val_auc 0.7), fired as analytics
    events through ``engine``."""
    sender = FLComponent()
    sender.engine = engine
    rec = RoundRecorder(None, "feddraw", sinks=[ServerAnalytics(sender)], tensorboard=False)
    rec.set_round(1, {"site-1": 0.6, "site-2": 0.4}, {"lambda": 0.5})
    rec.set_metrics(1, {"val_auc": 0.7})


def test_add_experiment_tracking_mlflow_records_the_servers_rows(tmp_path, fake_mlflow):
    """``add_experiment_tracking(recipe, "mlflow")`` on a fedweigh recipe: the exported receiver opens
    a run for the server too and records the controller's events there (NVFlare's stock receiver keeps
    runs for the clients only and refuses them)."""
    runs, logged = fake_mlflow
    recipe = FedDRAWRecipe(name="mlflow_job", min_clients=2, num_rounds=1, client=TINY_CLIENT)
    add_experiment_tracking(recipe, "mlflow")
    recipe.export(str(tmp_path))
    (receiver,) = [c for c in _server_components(tmp_path / "mlflow_job") if "mlflow" in c["path"].lower()]
    assert receiver["path"] == "fedweigh.flare.mlflow_tracking.ServerMLflowReceiver"
    assert receiver["path"] in ALLOW_LIST  # a provisioned server with fedweigh's allow-list builds it
    assert ANALYTIC_EVENT_TYPE in receiver["args"]["events"]
    assert TBAnalyticsReceiver.__module__ + ".TBAnalyticsReceiver" in {
        c["path"] for c in _server_components(tmp_path / "mlflow_job")
    }  # fedweigh's default TensorBoard receiver stays beside it

    # the exported receiver, built as the server builds it, with the controller's events
    from fedweigh.flare.mlflow_tracking import ServerMLflowReceiver

    mlflow_receiver = ServerMLflowReceiver(**receiver["args"])
    engine = _Engine([mlflow_receiver])
    engine.workspace = types.SimpleNamespace(
        get_run_dir=lambda job: str(tmp_path), get_result_root=lambda j: ""
    )
    mlflow_receiver.handle_event("_start_run", engine.new_context())
    _record_one_round(engine)
    mlflow_receiver.handle_event("_end_run", engine.new_context())
    server_run = next(rid for name, rid in runs.items() if name.startswith(f"{SERVER}-"))
    assert sorted(m for rid, m in logged if rid == server_run) == sorted(
        [
            ("weight/site-1", 0.6, 1),
            ("weight/site-2", 0.4, 1),
            ("scheme/lambda", 0.5, 1),
            ("global/val_auc", 0.7, 1),
        ]
    )
    assert {name.split("-")[0] + "-" + name.split("-")[1] for name in runs if name.startswith("site")} == {
        "site-1",
        "site-2",
    }  # the clients' runs as before


def test_track_server_records_gives_a_stock_recipes_mlflow_receiver_a_server_run(tmp_path, fake_mlflow):
    """Stock FedAvgRecipe with FedweighAggregator: after add_experiment_tracking(recipe, "mlflow"),
    track_server_records(recipe) builds its receiver as ServerMLflowReceiver, arguments kept."""
    from dataclasses import asdict

    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe

    from fedweigh.flare.recipes import CLIENT_SCRIPT, ModelSpec
    from fedweigh.flare.tracking import track_server_records

    recipe = FedAvgRecipe(
        name="stock_tracked",
        model={"class_path": "fedweigh.models.base.FedweighNet", "args": asdict(ModelSpec())},
        min_clients=2,
        num_rounds=2,
        train_script=CLIENT_SCRIPT,
        aggregator=FedweighAggregator(scheme="feddraw"),
    )
    add_experiment_tracking(recipe, "mlflow", {"kw_args": {"run_name": "mine"}})
    track_server_records(recipe)
    recipe.export(str(tmp_path))
    (receiver,) = [c for c in _server_components(tmp_path / "stock_tracked") if "mlflow" in c["path"].lower()]
    assert receiver["path"] == "fedweigh.flare.mlflow_tracking.ServerMLflowReceiver"
    assert receiver["args"]["kw_args"]["run_name"] == "mine"
    assert ANALYTIC_EVENT_TYPE in receiver["args"]["events"]


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in for the ``wandb`` package (not installed here), and W&B's run processes not started:
    what NVFlare's WandBReceiver puts on each run's queue is what the run would log."""
    started: list[object] = []

    class Process:
        def __init__(self, target, args):
            self.args = args

        def start(self):
            started.append(self)

        def join(self, timeout=None):
            pass

        def terminate(self):
            pass

    wandb = types.ModuleType("wandb")
    wandb.login = wandb.init = wandb.log = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    for name in ("nvflare.app_opt.tracking.wandb.wandb_receiver", "fedweigh.flare.wandb_tracking"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    # imported anew (not ``from package import module``, which returns the package's attribute: a module
    # object of an earlier import in this process, e.g. an earlier pytest session, that nothing else uses)
    wandb_receiver = importlib.import_module("nvflare.app_opt.tracking.wandb.wandb_receiver")

    monkeypatch.setattr(wandb_receiver, "Process", Process)
    monkeypatch.setattr(wandb_receiver.time, "sleep", lambda s: None)
    return started


def test_add_experiment_tracking_wandb_logs_the_servers_rows(tmp_path, fake_wandb):
    """``add_experiment_tracking(recipe, "wandb", ...)`` on a fedweigh recipe: the exported receiver
    starts a run for the server too and queues the controller's scalars for it (NVFlare's stock
    receiver starts runs for the clients only and drops them)."""
    recipe = FedDRAWRecipe(name="wandb_job", min_clients=2, num_rounds=1, client=TINY_CLIENT)
    args = {"project": "p", "group": "g", "job_type": "train", "name": "feddraw"}
    add_experiment_tracking(recipe, "wandb", {"wandb_args": args})
    recipe.export(str(tmp_path))
    (receiver,) = [c for c in _server_components(tmp_path / "wandb_job") if "wandb" in c["path"].lower()]
    assert receiver["path"] == "fedweigh.flare.wandb_tracking.ServerWandBReceiver"
    assert receiver["path"] in ALLOW_LIST

    from fedweigh.flare.wandb_tracking import ServerWandBReceiver

    wandb_receiver = ServerWandBReceiver(**receiver["args"])
    engine = _Engine([wandb_receiver])
    wandb_receiver.handle_event("_start_run", engine.new_context())
    _record_one_round(engine)
    assert sorted(wandb_receiver.queues) == ["server", "site-1", "site-2"]
    queue = wandb_receiver.queues[SERVER]
    init, *logs = [queue.get(timeout=10) for _ in range(5)]
    with pytest.raises(Empty):  # nothing else
        queue.get(timeout=0.5)
    assert init.task_type == "init" and init.task_data["name"].startswith("server-")
    assert init.task_data["group"] == wandb_receiver.wandb_args["group"]  # the clients' group
    assert sorted((t.task_type, *t.task_data.items(), t.step) for t in logs) == sorted(
        [
            ("log", ("weight/site-1", 0.6), 1),
            ("log", ("weight/site-2", 0.4), 1),
            ("log", ("scheme/lambda", 0.5), 1),
            ("log", ("global/val_auc", 0.7), 1),
        ]
    )
    assert len(fake_wandb) == 3  # one run per client and the server's


@pytest.mark.slow
def test_tensorboard_tracking_gets_every_rounds_server_rows_in_the_simulator(tmp_path):
    """A 2-round FedDRAW run with ``add_experiment_tracking(recipe, "tensorboard")``: the server's
    TensorBoard folder holds global/<metric> and weight/<site> for every round, equal to the JSON rows."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = FedDRAWRecipe(name="tracked", min_clients=2, num_rounds=2, client=TINY_CLIENT)
    add_experiment_tracking(recipe, "tensorboard")
    rows, app = run_recipe_in_simulator(recipe, tmp_path, 2)
    tb_root = app.parent / "tb_events"
    sites = {"site-1", "site-2"}
    (server_dir,) = [p for p in tb_root.iterdir() if p.is_dir() and p.name not in sites]
    events = EventAccumulator(str(server_dir))
    events.Reload()
    scalars = {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
    named = {(_named(t), s): v for (t, s), v in scalars.items()}
    expected = _expected(rows)
    assert {(t, s) for t, _, s in expected} == set(named) and len(named) == len(scalars)
    for tag, value, step in expected:
        assert named[(tag, step)] == pytest.approx(value, rel=1e-6), (tag, step)
    for r in (1, 2):
        assert {f"weight/{s}" for s in sites} <= {t for t, s in scalars if s == r}
    for r in (0, 1, 2):
        assert ("global/val_auc", r) in scalars
    assert not (app / "tb_events").exists()  # no second copy beside the receiver's

"""`fedweigh demo`: runs the FedDRAW job in the simulator and prints the global model's AUC/GM by round."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import fedweigh.cli as cli
from fedweigh.server.records import RoundRecorder

ROWS = [  # what the controller records: metrics of the global model after each round, weights
    {"round": 0, "test_auc": 0.5012, "test_gm": 0.0, "val_auc": 0.4987, "val_gm": 0.0},
    {"round": 1, "test_auc": 0.6123, "test_gm": 0.2345, "val_auc": 0.6011, "val_gm": 0.25},
    {"round": 2, "test_auc": 0.7345, "test_gm": 0.5432, "val_auc": float("nan"), "val_gm": 0.5},
]


def _fake_simulator(calls: list, rc: int = 0):
    """Stands in for `nvflare simulator`: records the call and leaves a run's records in the workspace."""

    def run_simulator(job_dir: Path, workspace: Path, n_clients: int, *_, **__) -> int:
        calls.append((Path(job_dir), Path(workspace), n_clients))
        if rc == 0:
            app = Path(workspace) / "server" / "simulate_job" / "app_server"
            recorder = RoundRecorder(app, "feddraw")
            for row in ROWS:
                recorder.set_metrics(row["round"], {k: v for k, v in row.items() if k != "round"})
            recorder.set_round(1, {"site-1": 0.5, "site-2": 0.5}, {})
            recorder.flush()
            recorder.plot()
            recorder.close()
            (app / "FL_global_model.pt").write_bytes(b"model")
        return rc

    return run_simulator


def test_demo_runs_the_feddraw_job_and_prints_the_round_table(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(cli, "run_simulator_with_progress", _fake_simulator(calls))
    assert cli.main(["demo", "--workspace", str(tmp_path / "ws")]) == 0
    ((job, workspace, clients),) = calls
    assert job == Path(cli.__file__).resolve().parents[2] / "jobs" / "synthcxr_feddraw"
    assert (job / "meta.json").is_file() and workspace == tmp_path / "ws" and clients == 4

    out = capsys.readouterr().out
    lines = out.splitlines()
    header = lines.index("round  test_auc  test_gm   val_auc   val_gm    model")
    table = [line.split() for line in lines[header + 1 : header + 1 + len(ROWS)]]
    for cells, row in zip(table, ROWS, strict=True):
        assert int(cells[0]) == row["round"]
        for cell, key in zip(cells[1:5], ("test_auc", "test_gm", "val_auc", "val_gm"), strict=True):
            if math.isnan(row[key]):
                assert cell == "-"
            else:
                assert float(cell) == pytest.approx(row[key], abs=5e-5), key
    assert "final test macro AUC 0.7345; GM 0.5432 at threshold 0.5" in out
    app = tmp_path / "ws" / "server" / "simulate_job" / "app_server"
    assert f"metrics:  {app / 'fedweigh_metrics.json'}" in out
    assert f"plot:     {app / 'fedweigh_client_weights.png'}" in out
    assert f"model:    {app / 'FL_global_model.pt'}" in out


def test_demo_outside_a_source_checkout_exports_its_job_first(tmp_path, monkeypatch, capsys):
    """pip-installed fedweigh run from any folder: no jobs/ there, so the demo exports its job from the
    catalogue's recipe under ./workspaces/jobs and runs that (the exported job is the checkout's)."""
    import json

    calls: list = []
    monkeypatch.setattr(cli, "run_simulator_with_progress", _fake_simulator(calls))
    monkeypatch.setattr(cli, "_repo_jobs_dir", lambda: tmp_path / "jobs")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--workspace", str(tmp_path / "ws")]) == 0
    ((job, _, clients),) = calls
    assert job == tmp_path / "workspaces" / "jobs" / "synthcxr_feddraw" and clients == 4
    out = capsys.readouterr().out
    assert f"exported it to {job}" in out and "final test macro AUC" in out
    shipped = Path(cli.__file__).resolve().parents[2] / "jobs" / "synthcxr_feddraw"
    for name in ("meta.json", "app/config/config_fed_server.json", "app/config/config_fed_client.json"):
        assert json.loads((job / name).read_text()) == json.loads((shipped / name).read_text()), name


def test_demo_reports_a_failed_run_and_a_missing_job(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(cli, "run_simulator_with_progress", _fake_simulator(calls, rc=3))
    assert cli.main(["demo", "--workspace", str(tmp_path / "ws")]) == 3
    assert "the simulator run failed (exit code 3)" in capsys.readouterr().out
    assert cli.main(["demo", "--job", str(tmp_path / "nojob")]) == 2
    assert "is not an NVFlare job folder" in capsys.readouterr().out
    assert len(calls) == 1

"""``fedweigh demo``: one line per round on the terminal, the simulator's logs in a file it names."""

from __future__ import annotations

import json
import sys
import textwrap

import fedweigh.cli as cli

FAKE_SIMULATOR = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    app = Path(sys.argv[1]) / "server" / "simulate_job" / "app_server"
    app.mkdir(parents=True, exist_ok=True)
    rows = [{"round": 0, "val_auc": 0.5}]
    for r in (1, 2):
        print("INFO - a very long simulator log line", r, flush=True)
        rows.append({"round": r, "test_auc": 0.6 + r / 10, "val_auc": 0.55, "test_gm": 0.2,
                     "weights": {"site-1": 0.25, "site-2": 0.75}})
        (app / "fedweigh_metrics.json").write_text(json.dumps({"scheme": "feddraw", "rounds": rows}))
        time.sleep(0.3)
    print("ERROR - something the log keeps", file=sys.stderr)
    """
)


def _job(tmp_path):
    job = tmp_path / "job"
    (job / "app" / "config").mkdir(parents=True)
    (job / "meta.json").write_text("{}")
    server = {"workflows": [{"id": "controller", "args": {"num_rounds": 2}}], "components": []}
    (job / "app" / "config" / "config_fed_server.json").write_text(json.dumps(server))
    return job


def test_demo_prints_rounds_and_keeps_the_logs_in_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        cli,
        "simulator_command",
        lambda job, ws, n, threads=None: [sys.executable, "-c", FAKE_SIMULATOR, str(ws)],
    )
    workspace = tmp_path / "ws"
    rc = cli.main(["demo", "--job", str(_job(tmp_path)), "--workspace", str(workspace), "--clients", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    log = tmp_path / "ws.log"
    assert f"simulator log: {log}" in out
    assert (
        "round 1/2:  test AUC 0.7000  val AUC 0.5500  model updated, weights site-1 0.25 site-2 0.75" in out
    )
    assert "round 2/2:  test AUC 0.8000" in out
    assert "very long simulator log line" not in out
    assert "very long simulator log line" in log.read_text() and "something the log keeps" in log.read_text()
    assert "GM 0.2000 at threshold 0.5" in out


def test_stale_metrics_of_an_earlier_run_are_not_shown(tmp_path, monkeypatch, capsys):
    workspace = tmp_path / "ws"
    old = workspace / "server" / "simulate_job" / "app_server"
    old.mkdir(parents=True)
    (old / "fedweigh_metrics.json").write_text(json.dumps({"rounds": [{"round": 7, "test_auc": 0.1}]}))
    import os

    os.utime(old / "fedweigh_metrics.json", (1, 1))
    monkeypatch.setattr(
        cli,
        "simulator_command",
        lambda job, ws, n, threads=None: [sys.executable, "-c", "import sys; sys.exit(3)"],
    )
    rc = cli.main(["demo", "--job", str(_job(tmp_path)), "--workspace", str(workspace)])
    out = capsys.readouterr().out
    assert rc == 3
    assert "round 7" not in out
    assert f"the simulator run failed (exit code 3); see {tmp_path / 'ws.log'}" in out

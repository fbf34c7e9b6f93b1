"""`fedweigh demo` tells what happened: a line per scored round saying whether the model changed and
why not, the final model it scores, GM at 0.5 labelled as such, and skipped rounds not interpolated."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import fedweigh.cli as cli  # noqa: E402
from fedweigh.plots import plot_client_weights  # noqa: E402
from fedweigh.server.records import RoundRecorder  # noqa: E402

KEPT = {
    "round": 3,
    "test_auc": 0.7,
    "val_auc": 0.6,
    "global_updated": False,
    "excluded": {"site-1": "update norm 9.1 over the bound 3.0", "site-2": "no result"},
}


def test_a_round_that_kept_the_model_says_so_and_why():
    line = cli.format_progress(KEPT, 5)
    assert line.startswith("round 3/5:  test AUC 0.7000  val AUC 0.6000  model unchanged, round 2's kept")
    assert "site-1: update norm 9.1 over the bound 3.0; site-2: no result" in line
    updated = {"round": 2, "test_auc": 0.7, "global_updated": True, "weights": {"site-1": 0.4, "site-2": 0.6}}
    assert cli.format_progress(updated, 5).endswith("model updated, weights site-1 0.40 site-2 0.60")
    assert "not scored" in cli.format_progress({"round": 4, "weights": {"site-1": 1.0}}, 5)
    table = cli.format_round_table([{"round": 0, "test_auc": 0.5}, {**updated}, KEPT])
    assert [line.split()[-1] for line in table.splitlines()[1:]] == ["initial", "updated", "kept"]


PROGRESS = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    app = Path(sys.argv[1]) / "server" / "simulate_job" / "app_server"
    app.mkdir(parents=True, exist_ok=True)
    def write(rows):
        (app / "fedweigh_metrics.json").write_text(json.dumps({"scheme": "feddraw", "rounds": rows}))
        time.sleep(0.6)
    w = {"site-1": 0.5, "site-2": 0.5}
    write([{"round": 0}, {"round": 1, "weights": w, "global_updated": True}])  # round 1 not scored yet
    write([{"round": 0, "val_auc": 0.5}, {"round": 1, "weights": w, "global_updated": True, "val_auc": 0.6},
           {"round": 2, "global_updated": False, "excluded": {"site-1": "no result"}}])
    write([{"round": 0, "val_auc": 0.5}, {"round": 1, "weights": w, "global_updated": True, "val_auc": 0.6},
           {"round": 2, "global_updated": False, "excluded": {"site-1": "no result"}, "val_auc": 0.6}])
    """
)


def test_progress_prints_each_round_once_when_it_is_scored(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        cli, "simulator_command", lambda job, ws, n, threads=None: [sys.executable, "-c", PROGRESS, str(ws)]
    )
    job = tmp_path / "job"
    (job / "app" / "config").mkdir(parents=True)
    (job / "meta.json").write_text("{}")
    server = {"workflows": [{"id": "controller", "args": {"num_rounds": 2}}]}
    (job / "app" / "config" / "config_fed_server.json").write_text(json.dumps(server))
    rc = cli.run_simulator_with_progress(job, tmp_path / "ws", 2, tmp_path / "ws.log", poll_s=0.2)
    assert rc == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("round ")]
    assert lines == [
        "round 1/2:  val AUC 0.6000  model updated, weights site-1 0.50 site-2 0.50",
        "round 2/2:  val AUC 0.6000  model unchanged, round 1's kept (site-1: no result)",
    ]


def test_the_demo_names_the_final_model_it_scores_not_the_best_pick(tmp_path, monkeypatch, capsys):
    def fake_simulator(job_dir: Path, workspace: Path, n_clients: int, *_, **__) -> int:
        app = Path(workspace) / "server" / "simulate_job" / "app_server"
        recorder = RoundRecorder(app, "feddraw")
        recorder.set_metrics(0, {"test_auc": 0.5})
        recorder.set_round(1, {"site-1": 0.5, "site-2": 0.5}, {})
        recorder.set_metrics(1, {"test_auc": 0.6})
        recorder.flush()
        recorder.close()
        (app / "FL_global_model.pt").write_bytes(b"final")
        (app / "best_FL_global_model.pt").write_bytes(b"best")
        return 0

    monkeypatch.setattr(cli, "run_simulator_with_progress", fake_simulator)
    monkeypatch.setattr(cli, "youden_report", lambda *a: (_ for _ in ()).throw(ValueError("skipped here")))
    assert cli.main(["demo", "--workspace", str(tmp_path / "ws")]) == 0
    out = capsys.readouterr().out
    app = tmp_path / "ws" / "server" / "simulate_job" / "app_server"
    assert (
        f"model:    {app / 'FL_global_model.pt'} (the global model after round 1 of 5, the table's last row)"
        in out
    )
    assert f"best:     {app / 'best_FL_global_model.pt'} (NVFlare's model selector" in out


@pytest.fixture
def kept_figures(monkeypatch):
    close = plt.close
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    yield figures
    for fig in figures:
        close(fig)


def test_the_metric_plot_labels_gm_at_half_and_shows_gm_at_youden(tmp_path, kept_figures):
    recorder = RoundRecorder(tmp_path, "feddraw")
    for t, (auc, gm) in enumerate([(0.5, 0.0), (0.7, 0.1), (0.79, 0.18)]):
        recorder.set_metrics(t, {"test_auc": auc, "test_gm": gm, "val_auc": auc, "val_gm": gm})
    recorder.plot(youden=(2, 0.68))
    (fig,) = [f for f in kept_figures if f.axes[0].get_ylabel() == "macro score"]
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "test GM at threshold 0.5" in labels and "test_gm" not in labels
    assert "test GM at Youden thresholds (final model)" in labels
    star = next(line for line in ax.get_lines() if line.get_label().startswith("test GM at Youden"))
    assert list(star.get_xdata()) == [2] and list(star.get_ydata()) == [0.68]


def test_a_skipped_round_is_shaded_and_not_interpolated(tmp_path, kept_figures):
    weights = [{"site-1": 0.2, "site-2": 0.8}, {"site-1": 0.6, "site-2": 0.4}, {"site-1": 0.5, "site-2": 0.5}]
    plot_client_weights([1, 2, 4], weights, tmp_path / "w.png", skipped=[3])
    (fig,) = kept_figures
    ax = fig.axes[0]
    assert "no aggregation (model kept)" in [t.get_text() for t in ax.get_legend().get_texts()]
    bands = [c for c in ax.collections if c.get_paths()]
    for band in bands:  # no band spans round 3
        xs = [x for p in band.get_paths() for x in p.vertices[:, 0]]
        assert not (min(xs) < 3 < max(xs)), (min(xs), max(xs))

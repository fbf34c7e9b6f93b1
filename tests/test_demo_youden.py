"""`fedweigh demo` scores GM at per-finding Youden thresholds chosen on validation, next to GM at 0.5."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from simulation import TINY_CLIENT

import fedweigh.cli as cli
from fedweigh.flare.recipes import FedDRAWRecipe
from fedweigh.metrics import geometric_mean, youden_thresholds
from fedweigh.server.records import RoundRecorder
from fedweigh.site.data_config import resolve_site_data
from fedweigh.site.trainer import build_site_model
from fedweigh.train import TrainConfig, get_params, predict, train_local


@pytest.fixture(scope="module")
def job_and_model(tmp_path_factory):
    """A two-site job of the tiny SynthCXR setting and a global model trained a few steps on site-1."""
    root = tmp_path_factory.mktemp("youden")
    FedDRAWRecipe(name="tiny", min_clients=2, client=TINY_CLIENT).export(str(root / "jobs"))
    site, test, _ = resolve_site_data("site-1", TINY_CLIENT)
    model = build_site_model(TINY_CLIENT, test)
    train_local(model, site.train, TrainConfig(max_steps=20, batch_size=16, lr=3e-3))
    path = root / "FL_global_model.pt"
    torch.save({"model": {k: torch.as_tensor(v) for k, v in get_params(model).items()}}, path)
    return root / "jobs" / "tiny", path, model


def test_thresholds_come_from_the_sites_validation_images(job_and_model):
    job, path, model = job_and_model
    report = cli.youden_report(job, path, 2)
    splits = [resolve_site_data(f"site-{k}", TINY_CLIENT) for k in (1, 2)]
    val_labels = np.concatenate([s.val.labels for s, _, _ in splits])
    val_scores = np.concatenate([predict(model, s.val) for s, _, _ in splits])
    test = splits[0][1]
    expected = youden_thresholds(val_labels, val_scores)
    on_test = youden_thresholds(test.labels, predict(model, test))
    assert not np.allclose(expected, on_test)  # choosing them on the test set would show
    assert list(report["thresholds"].values()) == pytest.approx(expected.tolist(), abs=1e-6)
    assert list(report["thresholds"]) == list(test.class_names)
    assert report["val_images"] == len(val_labels)
    one_way = [n for n, c in zip(test.class_names, val_labels.T, strict=True) if c.min() == c.max()]
    assert one_way and report["at_default"] == one_way
    assert all(report["thresholds"][n] == 0.5 for n in one_way)
    test_scores = predict(model, test)
    assert report["gm_youden"] == pytest.approx(
        geometric_mean(test.labels, test_scores, expected)[0], abs=1e-9
    )
    assert report["gm_05"] == pytest.approx(geometric_mean(test.labels, test_scores, 0.5)[0], abs=1e-9)
    assert report["gm_youden"] > report["gm_05"]  # 0.5 is far off for rare findings


def test_demo_prints_gm_at_youden_next_to_gm_at_half(job_and_model, tmp_path, monkeypatch, capsys):
    job, path, _ = job_and_model

    def fake_simulator(job_dir: Path, workspace: Path, n_clients: int, *_, **__) -> int:
        app = Path(workspace) / "server" / "simulate_job" / "app_server"
        recorder = RoundRecorder(app, "feddraw")
        recorder.set_metrics(1, {"test_auc": 0.61, "test_gm": 0.1, "val_auc": 0.6})
        recorder.flush()
        recorder.close()
        (app / "FL_global_model.pt").write_bytes(path.read_bytes())
        return 0

    monkeypatch.setattr(cli, "run_simulator_with_progress", fake_simulator)
    assert cli.main(["demo", "--job", str(job), "--workspace", str(tmp_path / "ws"), "--clients", "2"]) == 0
    out = capsys.readouterr().out
    report = cli.youden_report(job, path, 2)
    text = cli.format_youden(report)
    assert text in out
    assert all(len(x) <= 110 for x in text.splitlines()), text  # not one 600-character line
    line = text
    assert f"GM {report['gm_youden']:.4f} at per-finding Youden thresholds" in line
    assert f"the sites' {report['val_images']} validation images, never the test set" in line
    assert f"GM {report['gm_05']:.4f} at threshold 0.5" in line
    assert f"0.5 for {len(report['at_default'])} finding(s) validation shows only one way" in line
    first = next(iter(report["thresholds"]))
    assert f"{first} {report['thresholds'][first]:.3f}" in line


def test_demo_says_why_gm_at_youden_is_missing(tmp_path, monkeypatch, capsys):
    def fake_simulator(job_dir: Path, workspace: Path, *_, **__) -> int:
        app = Path(workspace) / "server" / "simulate_job" / "app_server"
        recorder = RoundRecorder(app, "feddraw")
        recorder.set_metrics(1, {"test_auc": 0.61, "test_gm": 0.1})
        recorder.flush()
        recorder.close()
        (app / "FL_global_model.pt").write_bytes(b"not a model")
        return 0

    monkeypatch.setattr(cli, "run_simulator_with_progress", fake_simulator)
    assert cli.main(["demo", "--workspace", str(tmp_path / "ws")]) == 0
    assert "GM at Youden thresholds: not computed (" in capsys.readouterr().out

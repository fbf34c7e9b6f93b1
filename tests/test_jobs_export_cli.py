"""``fedweigh jobs export --min-clients N [--bundle|--site-installed] --out DIR [JOB...]``: jobs for a
real federation (e.g. the three hospitals of provisioning/project.yml) without writing Python."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fedweigh.cli import main
from fedweigh.flare.jobs import INSTALLED_EXECUTOR, export_jobs

ROOT = Path(__file__).resolve().parents[1]


def _hospitals() -> int:
    project = (ROOT / "provisioning" / "project.yml").read_text()
    return len(re.findall(r"^\s+type:\s*client\s*$", project, re.M))


def _min_clients(job: Path) -> tuple[int, int]:
    meta = json.loads((job / "meta.json").read_text())
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    controller = next(w for w in server["workflows"] if w["id"] == "controller")
    return meta["min_clients"], controller["args"]["min_clients"]


def test_site_installed_jobs_for_the_shipped_project(tmp_path, capsys):
    n = _hospitals()
    assert n == 3
    out = tmp_path / "jobs"
    rc = main(
        ["jobs", "export", "--min-clients", str(n), "--site-installed", "--out", str(out), "synthcxr_feddraw"]
    )
    assert rc == 0
    assert capsys.readouterr().out.strip() == f"exported {out / 'synthcxr_feddraw'}"
    job = out / "synthcxr_feddraw"
    assert _min_clients(job) == (3, 3)
    assert not (job / "app" / "custom").exists()
    client = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    assert client["executors"][0]["executor"]["path"] == INSTALLED_EXECUTOR
    assert sorted(p.name for p in out.iterdir()) == ["synthcxr_feddraw"]


def test_bundled_jobs_carry_the_package(tmp_path):
    out = tmp_path / "jobs"
    assert (
        main(["jobs", "export", "--min-clients", "2", "--bundle", "--out", str(out), "synthcxr_fedbb"]) == 0
    )
    job = out / "synthcxr_fedbb"
    assert _min_clients(job) == (2, 2)
    assert (job / "app" / "custom" / "fedweigh" / "checks.py").is_file()


def test_without_min_clients_the_catalogue_size_is_kept(tmp_path):
    (job,) = export_jobs(tmp_path, ["synthcxr_feddraw"])
    assert _min_clients(job) == (4, 4)


def test_min_clients_needs_out(capsys):
    assert main(["jobs", "export", "--min-clients", "3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: --min-clients 3 needs --out DIR")


@pytest.mark.parametrize("value", ["0", "-1", "three"])
def test_bad_min_clients_is_refused_by_the_parser(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as info:
        main(["jobs", "export", "--min-clients", value, "--out", str(tmp_path)])
    assert info.value.code == 2
    assert "--min-clients: must be an integer >= 1" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_export_jobs_refuses_bad_min_clients(tmp_path):
    with pytest.raises(ValueError, match="min_clients must be an integer >= 1, got 0"):
        export_jobs(tmp_path, ["synthcxr_feddraw"], min_clients=0)


def test_deploy_guide_commands_export_jobs_for_the_shipped_hospitals(tmp_path, monkeypatch):
    """Every ``fedweigh jobs export`` line of docs/deploy.md runs as written (from a scratch folder)
    and gives jobs that wait for exactly the hospitals of provisioning/project.yml."""
    import shlex

    guide = (ROOT / "docs" / "deploy.md").read_text()
    commands = [line.split() for line in guide.splitlines() if line.startswith("fedweigh jobs export ")]
    assert len(commands) >= 2
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert main(argv[1:]) == 0, shlex.join(argv)
        out = Path(argv[argv.index("--out") + 1])
        for name in [a for a in argv[3:] if not a.startswith("-") and a != str(out) and not a.isdigit()]:
            assert _min_clients(tmp_path / out / name) == (_hospitals(), _hospitals()), argv


def test_export_sets_rounds_scenario_architecture_and_image_size(tmp_path, capsys):
    argv = ["jobs", "export", "--rounds", "2", "--scenario", "label-a0.5", "--arch", "vit", "--size", "48"]
    assert main([*argv, "--out", str(tmp_path), "synthcxr_fedavg"]) == 0
    job = tmp_path / "synthcxr_fedavg" / "app" / "config"
    server = json.loads((job / "config_fed_server.json").read_text())
    controller = next(w for w in server["workflows"] if w["id"] == "controller")
    assert controller["args"]["num_rounds"] == 2
    persistor = next(c for c in server["components"] if c["id"] == "persistor")
    assert persistor["args"]["model"]["args"]["arch"] == "vit"
    assert persistor["args"]["model"]["args"]["img_size"] == 48
    client = json.loads((job / "config_fed_client.json").read_text())
    script_args = client["executors"][0]["executor"]["args"]["task_script_args"].split()
    assert script_args[script_args.index("--scenario") + 1] == "label-a0.5"
    assert script_args[script_args.index("--arch") + 1] == "vit"
    assert script_args[script_args.index("--size") + 1] == "48"
    # a misspelt scenario is the recipe's one-line error; options need --out like --min-clients
    capsys.readouterr()
    assert main(["jobs", "export", "--scenario", "iid-5", "--out", str(tmp_path), "synthcxr_fedavg"]) == 2
    assert "scenario = 'iid-5' (str) is not allowed; choose one of iid-4" in capsys.readouterr().err
    assert main(["jobs", "export", "--rounds", "3"]) == 2
    assert capsys.readouterr().err.startswith("error: --rounds 3 needs --out DIR")

"""Bad inputs a first hour meets, each answered in one line naming the field (before anything runs)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

import fedweigh.cli as cli
from fedweigh.data.pools import load_pool, loader_option_names
from fedweigh.data.scenario_file import load_scenario_file
from fedweigh.errors import ConfigError, DatasetFormatError, ScenarioFileError
from fedweigh.site.args import ClientArgs
from fedweigh.site.data_config import SiteDataConfig


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, text
    return lines[0]


# -- loader options --------------------------------------------------------------------------------
def test_loader_options_are_the_loaders_own_parameters():
    assert loader_option_names("chexpert") == ("uncertainty", "frontal_only", "findings", "workers")
    assert loader_option_names("chestmnist") == ("task", "class_names")
    assert loader_option_names("synthcxr") == ("cache_dir",)
    assert loader_option_names("digits") == ()


def test_a_misspelt_loader_option_is_refused_when_the_recipe_is_built():
    from fedweigh.flare.recipes import FedDRAWRecipe

    client = ClientArgs(dataset="chexpert", data_path="/data/chexpert", loader_options={"uncertanty": "ones"})
    with pytest.raises(ConfigError) as e:
        FedDRAWRecipe(name="cx", min_clients=2, client=client)
    message = str(e.value)
    assert "loader_options.uncertanty" in message and "did you mean 'uncertainty'?" in message
    assert "\n" not in message


def test_a_misspelt_loader_option_in_a_site_config_is_refused_at_site_start(tmp_path):
    path = tmp_path / "fedweigh_site.json"
    path.write_text(json.dumps({"dataset": "digits", "loader_options": {"cache": "/tmp"}}))
    with pytest.raises(
        ConfigError, match=r"site data config .*: loader_options.cache = .*digits's loader takes no options"
    ):
        SiteDataConfig.from_file(path)
    # and by load_pool itself, whoever calls it (the bench, the site's data resolution)
    with pytest.raises(ConfigError, match="loader_options.cach_dir .* did you mean 'cache_dir'"):
        load_pool("synthcxr", num_images=10, cach_dir=str(tmp_path))


# -- a corrupt archive -----------------------------------------------------------------------------
def test_a_corrupt_npz_is_named_without_numpys_pickle_advice(tmp_path):
    from fedweigh.data.chestmnist import load_medmnist_npz

    path = tmp_path / "chestmnist_64.npz"
    path.write_bytes(os.urandom(4096)[:1] + b"garbage" + os.urandom(512))
    with pytest.raises(DatasetFormatError) as e:
        load_medmnist_npz(path)
    message = str(e.value)
    assert str(path) in message and "not an .npz archive" in message
    assert "pickle" not in message


# -- scenario files --------------------------------------------------------------------------------
def _scenario(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    return path


def test_a_prevalence_typo_in_a_scenario_file_is_named_at_load(tmp_path):
    from fedweigh.bench.config import make_config

    path = _scenario(
        tmp_path,
        "name: mine\nsites:\n  - {share: 0.5, labels: {prevalence: {efusion: 0.2}}}\n  - {share: 0.5}\n",
    )
    with pytest.raises(ScenarioFileError) as e:
        make_config("smoke", "synthcxr", scenario_files=[path])
    message = str(e.value)
    assert message.startswith("scenario file mine.yaml: sites[0].labels.prevalence:")
    assert "did you mean 'effusion'?" in message and 'got "efusion"' in message
    assert load_scenario_file(path).name == "mine"  # without a dataset's names nothing to check


def test_shares_that_do_not_sum_to_one_are_warned_about(tmp_path):
    path = _scenario(tmp_path, "name: mine\nsites:\n  - {share: 0.6}\n  - {share: 0.5}\n")
    with pytest.warns(UserWarning, match=r"mine.yaml: sites\[\*\].share sum to 1.1, not 1"):
        load_scenario_file(path)
    ok = _scenario(tmp_path, "name: mine\nsites:\n  - {share: 0.7}\n  - {share: 0.3}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_scenario_file(ok)


# -- too few sites ---------------------------------------------------------------------------------
def test_demo_with_fewer_sites_than_the_jobs_min_clients_stops_before_the_simulator(monkeypatch, capsys):
    def never(*_, **__):
        raise AssertionError("the simulator must not start")

    monkeypatch.setattr(cli, "run_simulator_with_progress", never)
    assert cli.main(["demo", "--clients", "3"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: --clients 3: job synthcxr_feddraw needs at least 4 sites")
    assert "fedweigh jobs export --min-clients 3 --out my_jobs synthcxr_feddraw" in line


def test_a_recipe_run_in_fewer_sites_than_min_clients_is_refused_before_deploying(tmp_path, monkeypatch):
    from nvflare.recipe import SimEnv

    from fedweigh.flare.recipes import FedDRAWRecipe

    env = SimEnv(num_clients=3, workspace_root=str(tmp_path))
    monkeypatch.setattr(env, "deploy", lambda job: pytest.fail("deployed"))
    recipe = FedDRAWRecipe(name="four", min_clients=4)
    with pytest.raises(
        ConfigError, match="min_clients = 4 .* SimEnv runs 3 sites; build the recipe with min_clients=3"
    ):
        recipe.execute(env)


# -- one file, one verdict -------------------------------------------------------------------------
def test_site_check_never_says_valid_and_then_error(tmp_path, capsys):
    bad = tmp_path / "chestmnist_28.npz"
    bad.write_bytes(b"not an archive at all")
    config = tmp_path / "fedweigh_site.json"
    config.write_text(json.dumps({"dataset": "chestmnist", "data_path": str(bad), "size": 28}))
    assert cli.main(["site", "check", str(config), "--load"]) == 2
    out, err = capsys.readouterr()
    assert "valid" not in out
    line = _one_line(err)
    assert line.startswith(f"error: {config}: the data it names cannot be read: {bad}: not an .npz archive")
    assert cli.main(["site", "check", str(config)]) == 0  # without --load: the settings only, said so
    assert "its data not read (--load reads them)" in capsys.readouterr().out


def test_demo_of_a_stock_nvflare_job_does_not_report_a_failure(tmp_path, monkeypatch, capsys):
    job = tmp_path / "hello-pt"
    (job / "app" / "config").mkdir(parents=True)
    (job / "meta.json").write_text(
        json.dumps({"name": "hello-pt", "min_clients": 2, "deploy_map": {"app": ["@ALL"]}})
    )
    workflow = {
        "id": "fedavg",
        "path": "nvflare.app_common.workflows.fedavg.FedAvg",
        "args": {"num_rounds": 2},
    }
    (job / "app" / "config" / "config_fed_server.json").write_text(json.dumps({"workflows": [workflow]}))
    monkeypatch.setattr(cli, "run_simulator_with_progress", lambda *a, **k: 0)
    assert cli.main(["demo", "--job", str(job), "--clients", "2", "--workspace", str(tmp_path / "ws")]) == 0
    out = capsys.readouterr().out
    assert "failed" not in out and "exit code 0" in out and "not a fedweigh job" in out
    # a fedweigh job that left no metrics is an error, named as such
    fedweigh_job = tmp_path / "mine"
    (fedweigh_job / "app" / "config").mkdir(parents=True)
    (fedweigh_job / "meta.json").write_text((job / "meta.json").read_text())
    workflow = {"id": "controller", "path": "fedweigh.flare.controller.FedweighController", "args": {}}
    (fedweigh_job / "app" / "config" / "config_fed_server.json").write_text(
        json.dumps({"workflows": [workflow]})
    )
    assert (
        cli.main(["demo", "--job", str(fedweigh_job), "--clients", "2", "--workspace", str(tmp_path / "w2")])
        == 1
    )
    assert "wrote no fedweigh_metrics.json" in capsys.readouterr().out

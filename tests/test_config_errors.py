"""Bad settings are refused before a run, with one error naming the source, field, value and what is allowed."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fedweigh.checks import check_client_args
from fedweigh.errors import ConfigError
from fedweigh.site.args import ClientArgs, parse_args
from fedweigh.site.data_config import SiteDataConfig

BAD_CLIENT_OPTIONS = [
    ("scenario", "iid4", "iid-4"),
    ("loss", "focall", "focal"),
    ("arch", "densenet", "densenet121"),
    ("optimizer", "adamw", "sgd"),
    ("norm", "layer", "group"),
    ("dataset", "mnist", "chestmnist"),
    ("epochs", -1, "integer >= 1"),
    ("epochs", 0, "integer >= 1"),
    ("batch_size", 0, "integer >= 1"),
    ("lr", -0.1, "number > 0"),
    ("size", "64", "integer >= 8"),
    ("dp_epsilon", -1.0, "number > 0"),
    ("dp_delta", 1.5, "in (0, 1)"),
    ("stats_dp_epsilon", 0.0, "number > 0"),
    ("dp_accountant", "gdp", "rdp"),
    ("device", "gpu", "cuda:N"),
    ("num_images", 0, "integer >= 1"),
    ("loss_options", {"gama": 2.0}, "gamma"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), BAD_CLIENT_OPTIONS)
def test_bad_client_option_is_refused_naming_field_value_and_allowed(field, value, allowed):
    loss = "focal" if field == "loss_options" else "default"
    args = replace(ClientArgs(loss=loss), **{field: value})
    with pytest.raises(ConfigError) as info:
        check_client_args(args, "recipe 'x': client options")
    message = str(info.value)
    assert message.startswith("recipe 'x': client options: ")
    assert f"{field} = {value!r}" in message
    assert allowed in message
    assert "\n" not in message


def test_dataset_with_files_needs_a_data_path():
    with pytest.raises(ConfigError, match=r"data_path = None .*'chestmnist' needs the path"):
        check_client_args(ClientArgs(dataset="chestmnist"))
    # a path from an environment variable is expanded at the site, so it is accepted here
    check_client_args(ClientArgs(dataset="chestmnist", data_path="$FEDWEIGH_CHESTMNIST"))


def test_valid_client_options_pass():
    check_client_args(ClientArgs())
    check_client_args(ClientArgs(loss="focal", loss_options={"gamma": 2.0}, optimizer="sgd", device="cuda:1"))


def test_recipe_refuses_bad_client_options_when_built():
    from fedweigh.flare.recipes import FedDRAWRecipe

    with pytest.raises(ConfigError, match=r"recipe 'bad': client options: scenario = 'iid4'"):
        FedDRAWRecipe(name="bad", client=ClientArgs(scenario="iid4"))
    with pytest.raises(ConfigError, match=r"recipe 'bad': num_rounds = 0 .*integer >= 1"):
        FedDRAWRecipe(name="bad", num_rounds=0)
    with pytest.raises(ConfigError, match=r"recipe 'bad': statistics = 'yes'"):
        FedDRAWRecipe(name="bad", statistics="yes")


def test_client_script_refuses_bad_arguments_at_start():
    with pytest.raises(ConfigError, match=r"client script arguments: optimizer = 'adamw'"):
        parse_args(["--optimizer", "adamw"])
    with pytest.raises(ConfigError, match=r"client script arguments: epochs = -2"):
        parse_args(["--epochs", "-2"])
    assert parse_args(["--epochs", "2"]).epochs == 2


def _site_config(tmp_path, **fields):
    path = tmp_path / "fedweigh_site.json"
    path.write_text(json.dumps(fields))
    return path


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"dataset": "chestmnist", "data_path": "/d.npz", "size": "64"}, "size = '64' (str) is not allowed"),
        ({"dataset": "chestmnist"}, "data_path = None is not allowed"),
        ({"dataset": "chestmnist", "data_path": "/d.npz", "val_fraction": 1.0}, "val_fraction = 1.0"),
        ({"dataset": "cxr"}, "dataset = 'cxr' (str) is not allowed; choose one of synthcxr"),
        ({"data_path": "/d.npz"}, "dataset = None is not allowed; the field is required"),
        ({"dataset": "synthcxr", "sise": 64}, "field(s) = ['sise'] is not allowed; known fields:"),
        ({"dataset": "synthcxr", "loader_options": "zeros"}, "loader_options = 'zeros' (str)"),
    ],
)
def test_bad_site_config_names_file_field_and_value(tmp_path, fields, expected):
    path = _site_config(tmp_path, **fields)
    with pytest.raises(ConfigError) as info:
        SiteDataConfig.from_file(path)
    assert str(info.value).startswith(f"site data config {path}: ")
    assert expected in str(info.value)


def test_good_site_config_is_read(tmp_path):
    cfg = SiteDataConfig.from_file(_site_config(tmp_path, dataset="chestmnist", data_path="/d.npz", size=64))
    assert cfg.size == 64 and cfg.dataset == "chestmnist"

"""NVFlare 2.9 recipe habits on fedweigh recipes: the model's three forms, initial_model, key_metric,
per-site config and the stock arguments, each working or refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from monai.networks.nets import DenseNet121
from nvflare.recipe import set_per_site_config

from fedweigh.errors import ConfigError
from fedweigh.flare.recipes import FedDRAWRecipe

SCRIPT = "examples/byo_feddraw/train.py"
DENSENET = {"spatial_dims": 2, "in_channels": 1, "out_channels": 14}


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch, request):
    monkeypatch.chdir(request.config.rootpath)


def _server_config(recipe, tmp_path) -> dict:
    recipe.export(str(tmp_path))
    return json.loads((tmp_path / recipe._job.name / "app" / "config" / "config_fed_server.json").read_text())


def _persistor_model(config: dict) -> dict:
    (persistor,) = [c for c in config["components"] if c["id"] == "persistor"]
    return persistor["args"]["model"]


def test_a_monai_densenet_module_is_refused_with_the_dict_to_give(tmp_path):
    with pytest.raises(ConfigError) as e:
        FedDRAWRecipe(name="dn", min_clients=2, train_script=SCRIPT, model=DenseNet121(**DENSENET))
    message = str(e.value)
    assert "\n" not in message and "DenseNet121(**{}) does not build" in message
    fix = message.split("pass model=")[1].split(" with the arguments")[0]
    form = json.loads(fix)
    assert form["class_path"] == "monai.networks.nets.densenet.DenseNet121"
    assert form["args"] == {"spatial_dims": "...", "in_channels": "...", "out_channels": "..."}
    # the form it names, filled in, builds and is exported in NVFlare's job form
    form["args"] = DENSENET
    recipe = FedDRAWRecipe(name="dn", min_clients=2, train_script=SCRIPT, model=form)
    assert _persistor_model(_server_config(recipe, tmp_path)) == {
        "path": "monai.networks.nets.densenet.DenseNet121",
        "args": DENSENET,
    }


@pytest.mark.parametrize("key", ["class_path", "path"])
def test_both_dict_forms_are_taken_and_a_bad_one_is_one_line(key, tmp_path):
    recipe = FedDRAWRecipe(
        name="d",
        min_clients=2,
        train_script=SCRIPT,
        model={key: "monai.networks.nets.DenseNet121", "args": DENSENET},
    )
    assert _persistor_model(_server_config(recipe, tmp_path))["path"] == "monai.networks.nets.DenseNet121"
    with pytest.raises(ConfigError, match="missing 1 required positional argument: 'in_channels'"):
        FedDRAWRecipe(
            name="d",
            min_clients=2,
            train_script=SCRIPT,
            model={key: "monai.networks.nets.DenseNet121", "args": {"spatial_dims": 2, "out_channels": 14}},
        )
    with pytest.raises(ConfigError, match="cannot import no_such_package.Net here"):
        FedDRAWRecipe(name="d", min_clients=2, train_script=SCRIPT, model={key: "no_such_package.Net"})


class _Wide(torch.nn.Module):
    """A network that keeps no copy of ``width``: NVFlare exports it with args {}, and _Wide() is narrower."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.fc = torch.nn.Linear(3, width)


class _Kept(torch.nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.width = width
        self.fc = torch.nn.Linear(3, width)


def test_a_module_is_rebuilt_from_its_exported_arguments_and_a_mismatch_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        FedDRAWRecipe(name="w", min_clients=2, train_script=SCRIPT, model=_Wide(8))
    message = str(e.value)
    assert "_Wide(**{}) is another network (fc.bias: (8,) given, (4,) rebuilt)" in message
    assert '"args": {}' in message and "\n" not in message
    recipe = FedDRAWRecipe(name="k", min_clients=2, train_script=SCRIPT, model=_Kept(8))
    assert recipe.model_spec.width == 8


def test_initial_model_is_models_other_name_and_not_both():
    a = FedDRAWRecipe(name="i", min_clients=2, train_script=SCRIPT, initial_model=_Kept(6))
    assert isinstance(a.model_spec, _Kept) and a.model_spec.width == 6
    with pytest.raises(ConfigError, match="give model= or initial_model=, not both"):
        FedDRAWRecipe(name="i", min_clients=2, train_script=SCRIPT, model=_Kept(), initial_model=_Kept())


def test_key_metric_reaches_the_model_selector(tmp_path):
    config = _server_config(FedDRAWRecipe(name="km", min_clients=2, key_metric="val_gm"), tmp_path)
    selectors = [c for c in config["components"] if c["args"].get("key_metric")]
    assert [c["args"]["key_metric"] for c in selectors] == ["val_gm"]
    with pytest.raises(ConfigError, match="key_metric_mode = 'lowest'"):
        FedDRAWRecipe(name="km", min_clients=2, key_metric_mode="lowest")


def test_per_site_config_and_stock_only_arguments_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="per_site_config .* local/fedweigh_site.json"):
        FedDRAWRecipe(name="p", min_clients=2, per_site_config={"site-1": {"train_args": "--lr 0.1"}})
    recipe = FedDRAWRecipe(name="p", min_clients=2)
    with pytest.raises(ConfigError, match="per_site_config = \\['site-1'\\] .* local/fedweigh_site.json"):
        set_per_site_config(recipe, {"site-1": {"train_args": "--lr 0.1"}})
    with pytest.raises(ConfigError, match="patience = 3 .* stop_after="):
        FedDRAWRecipe(name="p", min_clients=2, patience=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'pateince'"):
        FedDRAWRecipe(name="p", min_clients=2, pateince=3)

"""NVFlare's names for the same settings: ``encrypt_layers`` (FedAvgRecipeWithHE) and ``fedprox_mu``
(FedProxRecipe); the old names still work and warn."""

from __future__ import annotations

import json
import warnings

import pytest

from fedweigh.errors import ConfigError
from fedweigh.flare.recipes import BaselineRecipe, FedDRAWRecipe, FedweighRecipe


def _controller_args(recipe, tmp_path) -> dict:
    recipe.export(str(tmp_path))
    server = json.loads((tmp_path / recipe.name / "app/config/config_fed_server.json").read_text())
    return next(w for w in server["workflows"] if w["id"] == "controller")["args"]


def test_encrypt_layers_is_the_recipe_argument(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name does not warn
        recipe = FedDRAWRecipe(
            name="enc", min_clients=2, he=True, encrypt_layers=["last:2", "net.class_layers.*"]
        )
    assert _controller_args(recipe, tmp_path)["he_layers"] == ["last:2", "net.class_layers.*"]


def test_he_layers_is_a_deprecated_alias(tmp_path):
    with pytest.warns(FutureWarning, match=r"recipe 'old': he_layers is deprecated; use encrypt_layers"):
        recipe = FedDRAWRecipe(name="old", min_clients=2, he=True, he_layers=["last:2"])
    assert _controller_args(recipe, tmp_path)["he_layers"] == ["last:2"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"he_layers": ["a"], "encrypt_layers": ["b"]}, r"he_layers = \['a'\] .*give encrypt_layers alone"),
        (
            {"encrypt_layers": "conv"},
            r"encrypt_layers = 'conv' \(str\) .*regular-expression string is not supported",
        ),
    ],
)
def test_encrypt_layers_refuses(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ConfigError, match=f"recipe 'x': {message}"):
            FedDRAWRecipe(name="x", min_clients=2, he=True, **kwargs)


def test_fedprox_mu_is_the_recipe_argument(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe = BaselineRecipe(baseline="fedprox", name="prox", min_clients=2, fedprox_mu=0.05)
        inside = BaselineRecipe(
            baseline="fedprox", name="prox2", min_clients=2, scheme_args={"fedprox_mu": 0.02}
        )
        base = FedweighRecipe(name="prox3", scheme="fedprox", min_clients=2, fedprox_mu=0.03)
    assert _controller_args(recipe, tmp_path)["scheme_args"] == {"client_mu": 0.05}
    assert _controller_args(inside, tmp_path)["scheme_args"] == {"client_mu": 0.02}
    assert _controller_args(base, tmp_path)["scheme_args"] == {"client_mu": 0.03}


def test_client_mu_is_a_deprecated_alias(tmp_path):
    with pytest.warns(
        FutureWarning, match=r"recipe 'fedprox': scheme_args\['client_mu'\] is deprecated; use fedprox_mu="
    ):
        recipe = BaselineRecipe(baseline="fedprox", min_clients=2, scheme_args={"client_mu": 0.05})
    assert _controller_args(recipe, tmp_path)["scheme_args"] == {"client_mu": 0.05}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: FedDRAWRecipe(name="x", min_clients=2, fedprox_mu=0.1),
            r"fedprox_mu = 0.1 .*FedProx's coefficient; scheme 'feddraw' has none",
        ),
        (
            lambda: BaselineRecipe(baseline="fedprox", name="x", min_clients=2, fedprox_mu=-1.0),
            r"fedprox_mu = -1.0 .*a number >= 0",
        ),
        (
            lambda: BaselineRecipe(
                baseline="fedprox", name="x", min_clients=2, fedprox_mu=0.1, scheme_args={"client_mu": 0.2}
            ),
            r"scheme_args\['client_mu'\] = 0.2 .*give fedprox_mu alone",
        ),
    ],
)
def test_fedprox_mu_refuses(make, message):
    with pytest.raises(ConfigError, match=f"recipe 'x': {message}"):
        make()

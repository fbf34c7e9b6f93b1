"""NVFlare's ``add_cross_site_evaluation(recipe)`` on fedweigh recipes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from nvflare.recipe.utils import add_cross_site_evaluation
from simulation import TINY_CLIENT, run_recipe_in_simulator

from fedweigh.flare.recipes import FedDRAWRecipe


def _server_paths(job_dir) -> list[str]:
    config = json.loads((job_dir / "app" / "config" / "config_fed_server.json").read_text())
    return [c["path"] for c in config["workflows"] + config["components"]]


def test_cross_site_evaluation_is_added_after_training(tmp_path):
    recipe = FedDRAWRecipe(name="cse", min_clients=2, num_rounds=1, client=TINY_CLIENT)
    add_cross_site_evaluation(recipe)
    recipe.export(str(tmp_path))
    paths = _server_paths(tmp_path / "cse")
    controller = paths.index("fedweigh.flare.controller.FedweighController")
    cse = paths.index("nvflare.app_common.workflows.cross_site_model_eval.CrossSiteModelEval")
    assert controller < cse
    assert "nvflare.app_opt.pt.file_model_locator.PTFileModelLocator" in paths


def test_cross_site_evaluation_is_refused_under_he_before_anything_is_added(tmp_path):
    recipe = FedDRAWRecipe(name="cse_he", min_clients=2, num_rounds=1, client=TINY_CLIENT, he=True)
    with pytest.raises(ValueError, match=r"recipe 'cse_he': cross-site evaluation .*he=True"):
        add_cross_site_evaluation(recipe)
    recipe.export(str(tmp_path))
    assert not any("CrossSiteModelEval" in p for p in _server_paths(tmp_path / "cse_he"))


@pytest.mark.slow
def test_cross_site_evaluation_runs_in_the_simulator(tmp_path):
    """Each site scores the global model and both sites' last local models; the sites' metrics
    stream to the server's TensorBoard."""
    client = replace(TINY_CLIENT, scenario="iid-4")
    recipe = FedDRAWRecipe(name="cse_run", min_clients=2, num_rounds=1, client=client)
    add_cross_site_evaluation(recipe)
    run_recipe_in_simulator(recipe, tmp_path, 2)
    (results,) = tmp_path.rglob("cross_val_results.json")
    table = json.loads(results.read_text())
    assert sorted(table) == ["site-1", "site-2"]
    for scores in table.values():
        assert {"site-1", "site-2"} <= set(scores)
        assert any(k.startswith("SRV_") for k in scores)
        for metrics in scores.values():
            assert 0.0 <= metrics["val_auc"] <= 1.0
    # the sites' metrics reached the server's TensorBoard folder in its run folder (one per site),
    # next to the controller's round records (under the server's name)
    (server_app,) = (p for p in tmp_path.rglob("app_server") if p.is_dir())
    for site in ("site-1", "site-2"):
        assert list((server_app.parent / "tb_events" / site).glob("events.out.tfevents.*")), site
    assert list((server_app.parent / "tb_events" / "simulator_server").glob("events.out.tfevents.*"))

"""A MONAI Bundle as a site's training (fedweigh.flare.monai_bundle, its recipe in
fedweigh.flare.monai_bundle_recipe): MonaiAlgo under a fedweigh scheme."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedweigh.errors import BundleError, ConfigError
from fedweigh.flare.monai_bundle import BundleSite, label_counts, parse_overrides
from fedweigh.flare.monai_bundle_recipe import MonaiBundleRecipe, bundle_network
from fedweigh.weighting import get_scheme
from fedweigh.weighting.base import ClientReport, ScalarContext

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "monai_bundle"
BUNDLE = EXAMPLE / "bundle"


def _write_site_data(root: Path, site: str, num_train: int, num_val: int) -> Path:
    sys.path.insert(0, str(EXAMPLE))
    try:
        from make_data import write_site_data
    finally:
        sys.path.remove(str(EXAMPLE))
    return write_site_data(root, site, num_train, num_val)


def test_label_counts_of_class_indices_and_multi_hot_vectors():
    items = [{"image": "a.png", "label": c} for c in (0, 2, 2, 3)]
    assert label_counts(items, "label", 4, "x").tolist() == [1, 0, 2, 1]
    hot = [{"label": [1, 0, 1]}, {"label": [0, 0, 1]}]
    assert label_counts(hot, "label", None, "x").tolist() == [1, 0, 2]


@pytest.mark.parametrize(
    ("items", "num_classes", "message"),
    [
        ([{"label": 1}], None, "labels are class indices: pass num_classes"),
        ([{"label": 4}], 4, "item 0 has label 4, not a class 0..3"),
        ([{"image": "a.png"}], 4, "item 0 has no 'label'"),
        ([{"label": [1, 2]}], None, "a 0/1 vector of one length"),
        ([{"label": [1, 0]}], 3, "labels have 2 entries, num_classes is 3"),
        ([], 2, "the training data list is empty"),
    ],
)
def test_label_counts_name_what_is_wrong(items, num_classes, message):
    with pytest.raises(BundleError, match=f"where: .*{message}"):
        label_counts(items, "label", num_classes, "where")


def test_overrides_read_json_and_name_the_site():
    assert parse_overrides(["dataset_dir=/data/{site}", "num_classes=3", "lr=x"], "site-2") == {
        "dataset_dir": "/data/site-2",
        "num_classes": 3,
        "lr": "x",
    }
    with pytest.raises(BundleError, match="override 'oops': expected KEY=VALUE"):
        parse_overrides(["oops"], "site-1")


def test_bundle_site_trains_counts_and_evaluates(tmp_path):
    """One site's bundle through MonaiAlgo: N_k and the label counts from its data list, the steps
    MONAI ran, a changed model; FedProx's term changes what it learns."""
    data = _write_site_data(tmp_path, "site-1", 12, 4)
    labels = [item["label"] for item in json.loads((data / "datalist.json").read_text())["training"]]
    site = BundleSite(
        BUNDLE,
        "site-1",
        eval_config="configs/evaluate.json",
        overrides={"dataset_dir": str(data)},
        num_classes=4,
    )
    assert site.num_samples == 12
    assert site.class_counts.tolist() == np.bincount(labels, minlength=4).tolist()
    start = bundle_network(BUNDLE).state_dict()
    torch.manual_seed(0)
    params, steps = site.train_round(start, 0.0)
    assert steps == 2  # 12 images in batches of 8, one local epoch
    assert any(not torch.equal(params[k], start[k]) for k in start)
    assert set(site.evaluate(params)) == {"val_auc"}
    assert site.trainer.loss_function is site.bundle_loss
    site.train_round(start, 0.5)
    assert (
        site.trainer.loss_function is not site.bundle_loss
    )  # the bundle's loss + (mu / 2)||theta - theta_g||^2
    site.finalize()


def test_recipe_ships_the_bundle_and_its_network(tmp_path):
    recipe = MonaiBundleRecipe(
        bundle_root=BUNDLE,
        method="fedbb",
        name="bundle_job",
        min_clients=2,
        num_classes=4,
        overrides={"dataset_dir": "/data/{site}"},
    )
    recipe.export(str(tmp_path))
    app = tmp_path / "bundle_job" / "app"
    assert (app / "custom" / "bundle" / "configs" / "train.json").is_file()
    # the client script (NVFlare finds it by name under custom/) and nothing of MONAI, installed at the sites
    shipped = sorted(str(p.relative_to(app / "custom")) for p in (app / "custom").rglob("*") if p.is_file())
    assert [p for p in shipped if not p.startswith("bundle/")] == ["fedweigh/flare/monai_bundle_client.py"]
    client = json.loads((app / "config" / "config_fed_client.json").read_text())
    args = client["executors"][0]["executor"]["args"]
    assert args["task_script_path"] == "monai_bundle_client.py"
    assert args["task_script_args"].split() == [
        "--bundle-root",
        "bundle",
        "--train-config",
        "configs/train.json",
        "--local-epochs",
        "1",
        "--label-key",
        "label",
        "--eval-config",
        "configs/evaluate.json",
        "--num-classes",
        "4",
        "--override",
        "dataset_dir=/data/{site}",
    ]
    server = json.loads((app / "config" / "config_fed_server.json").read_text())
    persistor = next(c for c in server["components"] if c["id"] == "persistor")
    assert persistor["args"]["model"] == {
        "path": "monai.networks.nets.classifier.Classifier",
        "args": {"in_shape": [1, 16, 16], "classes": 4, "channels": [4, 8], "strides": [2, 2]},
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"bundle_root": "no_such_bundle"},
            "bundle_root = 'no_such_bundle' .*a bundle folder with configs/train.json",
        ),
        ({"bundle_root": str(BUNDLE), "local_epochs": 0}, "local_epochs = 0 .*an integer >= 1"),
        (
            {"bundle_root": str(BUNDLE), "overrides": {"dataset_dir": "/my data"}},
            "overrides\\['dataset_dir'\\] = '/my data' .*a value without spaces",
        ),
    ],
)
def test_recipe_refuses_a_bad_bundle(kwargs, message):
    with pytest.raises(ConfigError, match=f"recipe 'x': {message}"):
        MonaiBundleRecipe(name="x", min_clients=2, **kwargs)


@pytest.mark.slow
def test_bundle_sites_under_cbr_in_the_simulator(tmp_path, monkeypatch):
    """The example bundle at two sites for two rounds under FedBB's CBR weights in `nvflare simulator`:
    each round's weights are CBR's weights of the sites' data-list sizes and label skews, and the
    global model moves away from the bundle's initial network."""
    from simulation import run_recipe_in_simulator, saved_float_params

    sizes = {"site-1": 24, "site-2": 40}
    counts = {}
    for site, n in sizes.items():
        data = _write_site_data(tmp_path / "data", site, n, 8)
        labels = [i["label"] for i in json.loads((data / "datalist.json").read_text())["training"]]
        counts[site] = np.bincount(labels, minlength=4)
    torch.manual_seed(0)
    initial = bundle_network(BUNDLE)
    monkeypatch.chdir(tmp_path)
    torch.save(initial.state_dict(), "start.pt")
    recipe = MonaiBundleRecipe(
        bundle_root=BUNDLE,
        method="fedbb",
        name="bundle_cbr",
        initial_ckpt="start.pt",
        num_rounds=2,
        min_clients=2,
        num_classes=4,
        overrides={"dataset_dir": f"{tmp_path / 'data'}/{{site}}"},
        min_update_cosine=None,
    )
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "custom"), os.environ.get("PYTHONPATH", "")])}
    rows, _ = run_recipe_in_simulator(recipe, tmp_path, 2, timeout=300, env=env)
    rounds = [r for r in rows if r["round"] >= 1]
    assert len(rounds) == 2
    cbr = get_scheme("cbr")
    reports = [
        ClientReport(
            site,
            n,
            scalars=cbr.client_scalars(ScalarContext(class_counts=counts[site].astype(float), num_samples=n)),
        )
        for site, n in sizes.items()
    ]
    expected = dict(zip(sizes, cbr.weights(reports, None, 1, 2), strict=True))
    for r in rounds:
        assert r["global_updated"] is True and r["excluded"] == {}, r
        assert r["weights"] == pytest.approx(expected, rel=1e-9), r
    (saved,) = (tmp_path / "ws").rglob("FL_global_model.pt")
    final = saved_float_params(saved)
    start = {k: v.numpy() for k, v in initial.state_dict().items() if v.is_floating_point()}
    assert set(final) == set(start)
    assert any(not np.allclose(final[k], start[k]) for k in start)

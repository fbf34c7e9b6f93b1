import json

import numpy as np
import pytest

from fedweigh.data.base import LabeledImages
from fedweigh.site.args import ClientArgs, parse_args
from fedweigh.site.data_config import SiteDataConfig, find_site_config, split_train_val


def test_client_args_round_trip_through_the_command_line():
    args = ClientArgs(
        dataset="chestmnist",
        scenario="label-a0.5",
        data_path="/d/x.npz",
        size=64,
        loss="pnb",
        loss_options={"mu": 4},
        max_steps=3,
        eval_test=False,
    )
    import shlex

    assert parse_args(shlex.split(args.to_argv())) == args
    assert ClientArgs().to_argv() == ""


def test_site_config_from_workspace_local_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDWEIGH_SITE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert find_site_config(tmp_path) is None
    (tmp_path / "local").mkdir()
    path = tmp_path / "local" / "fedweigh_site.json"
    path.write_text(json.dumps({"dataset": "chestmnist", "data_path": "/data/c.npz", "size": 64}))
    assert find_site_config(tmp_path) == path
    cfg = SiteDataConfig.from_file(path)
    assert (cfg.dataset, cfg.data_path, cfg.size) == ("chestmnist", "/data/c.npz", 64)


def test_site_config_env_must_exist(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDWEIGH_SITE_CONFIG", str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match="FEDWEIGH_SITE_CONFIG"):
        find_site_config()


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"data_path": "/x"}', "dataset"),
        ('{"dataset": "x", "size2": 1}', "size2"),
        ("[1]", "JSON object"),
        ('{"dataset": "synthcxr", "val_fraction": 1.5}', "val_fraction"),
    ],
)
def test_bad_site_config_names_file_and_field(tmp_path, content, message):
    path = tmp_path / "fedweigh_site.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as e:
        SiteDataConfig.from_file(path)
    assert str(path) in str(e.value)


def test_train_val_split_is_disjoint_and_deterministic():
    data = LabeledImages(
        np.zeros((50, 1, 4, 4), np.float32), np.arange(50) % 3, ("a", "b", "c"), "multiclass"
    )
    data.images[:, 0, 0, 0] = np.arange(50)
    tr, va = split_train_val(data, 0.2, seed=1)
    tr2, va2 = split_train_val(data, 0.2, seed=1)
    ids_tr, ids_va = set(tr.images[:, 0, 0, 0]), set(va.images[:, 0, 0, 0])
    assert len(va) == 10 and len(tr) == 40 and not ids_tr & ids_va
    assert np.array_equal(va.images, va2.images)


def test_data_path_variables_are_expanded_at_the_site(tmp_path, monkeypatch):
    """docs/deploy.md: `$VARIABLES` in a site's data_path are expanded at the site; an unset one is named."""
    from fixtures_data import write_medmnist_npz

    from fedweigh.site.data_config import resolve_site_data

    data = tmp_path / "data"
    data.mkdir()
    raw = write_medmnist_npz(data / "chest.npz", sizes=(20, 4, 6))
    site_dir = tmp_path / "hospital-a"
    (site_dir / "local").mkdir(parents=True)
    config = {"dataset": "chestmnist", "data_path": "$FEDWEIGH_TEST_DATA/chest.npz", "size": 28}
    (site_dir / "local" / "fedweigh_site.json").write_text(json.dumps(config))
    monkeypatch.delenv("FEDWEIGH_SITE_CONFIG", raising=False)
    monkeypatch.setenv("FEDWEIGH_TEST_DATA", str(data))

    site, test, num_sites = resolve_site_data("hospital-a", ClientArgs(), workspace=site_dir)
    assert num_sites == 1 and len(test) == 6
    assert len(site.train) + len(site.val) == len(raw["train_images"]) + len(raw["val_images"])

    monkeypatch.delenv("FEDWEIGH_TEST_DATA")
    with pytest.raises(ValueError, match=r"\$FEDWEIGH_TEST_DATA/chest.npz.*not set"):
        resolve_site_data("hospital-a", ClientArgs(), workspace=site_dir)


def test_job_data_path_variables_are_expanded_in_simulation(tmp_path, monkeypatch):
    """The jobs chestmnist_feddraw / chexpert_feddraw name their data as $FEDWEIGH_CHESTMNIST etc."""
    from fixtures_data import write_medmnist_npz

    from fedweigh.site.data_config import resolve_site_data

    write_medmnist_npz(tmp_path / "chest.npz", sizes=(40, 8, 6))
    monkeypatch.delenv("FEDWEIGH_SITE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDWEIGH_CHESTMNIST", str(tmp_path / "chest.npz"))
    args = ClientArgs(dataset="chestmnist", data_path="$FEDWEIGH_CHESTMNIST", size=28, scenario="iid-4")
    site, test, num_sites = resolve_site_data("site-2", args)
    assert num_sites == 4 and len(test) == 6 and len(site.train) > 0
    monkeypatch.delenv("FEDWEIGH_CHESTMNIST")
    with pytest.raises(ValueError, match="FEDWEIGH_CHESTMNIST.*not set"):
        resolve_site_data("site-2", args)

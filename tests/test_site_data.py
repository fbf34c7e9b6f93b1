import json

import numpy as np
import pytest

from fedweigh.data.base import LabeledImages
from fedweigh.data.site_config import SiteDataConfig, find_site_config, split_train_val
from fedweigh.site import ClientArgs, parse_args


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

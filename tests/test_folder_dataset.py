"""``images_csv``: a folder of PNG/JPEG images with a CSV of labels, read through MONAI transforms."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedweigh.data import load_pool
from fedweigh.errors import ConfigError, FolderFormatError
from fedweigh.site.args import ClientArgs
from fedweigh.site.data_config import SiteDataConfig, load_site_from_config


def _write_folder(root, n=10, header="path,Effusion,Edema,split", bad_row=None):
    """n images (PNG for even i, RGB JPEG for odd i), 40 x 60 px, bright top-left 10 x 20 block."""
    from PIL import Image

    (root / "img").mkdir(parents=True, exist_ok=True)
    rows = [header]
    for i in range(n):
        a = np.zeros((40, 60), np.uint8)
        a[:10, :20] = 255
        ext = "jpg" if i % 2 else "png"
        img = Image.fromarray(np.stack([a] * 3, -1) if i % 2 else a)
        img.save(root / "img" / f"{i}.{ext}")
        rows.append(f"img/{i}.{ext},{i % 2},{(i // 2) % 2},{'test' if i >= n - 2 else 'train'}")
    if bad_row is not None:
        rows.append(bad_row)
    csv = root / "labels.csv"
    csv.write_text("\n".join(rows) + "\n")
    return csv


OPTIONS = {"label_columns": ["Effusion", "Edema"], "split_column": "split"}


def test_png_and_jpeg_load_resized_grey_in_unit_range_keeping_orientation(tmp_path):
    csv = _write_folder(tmp_path)
    pool, test = load_pool("images_csv", str(csv), size=16, **OPTIONS)
    assert pool.images.shape == (8, 1, 16, 16) and test.images.shape == (2, 1, 16, 16)
    assert pool.images.dtype == np.float32
    assert pool.images.min() == 0.0 and pool.images.max() == 1.0
    assert pool.class_names == ("Effusion", "Edema") and pool.task == "multilabel"
    np.testing.assert_array_equal(pool.labels[:4], [[0, 0], [1, 0], [0, 1], [1, 1]])
    for image in (pool.images[0, 0], pool.images[1, 0]):  # PNG and RGB JPEG alike
        bright = image > 0.5
        assert bright[:3, :4].all() and not bright[5:, :].any() and not bright[:, 7:].any()


def test_without_split_column_a_seeded_fraction_is_held_out(tmp_path):
    csv = _write_folder(tmp_path)
    pool, test = load_pool("images_csv", str(csv), size=8, label_columns=["Edema"], test_fraction=0.3)
    assert (len(pool), len(test)) == (7, 3)
    again, _ = load_pool("images_csv", str(csv), size=8, label_columns=["Edema"], test_fraction=0.3)
    np.testing.assert_array_equal(pool.images, again.images)


def test_multiclass_column(tmp_path):
    csv = _write_folder(tmp_path, header="path,Effusion,Edema,split")
    pool, _ = load_pool(
        "images_csv", str(csv), size=8, label_columns=["Edema"], task="multiclass", class_names=["no", "yes"]
    )
    assert pool.task == "multiclass" and pool.labels.dtype == np.int64 and pool.class_names == ("no", "yes")


@pytest.mark.parametrize(
    ("bad_row", "options", "message"),
    [
        ("img/missing.png,0,1,train", OPTIONS, r"line 12, column 'path': image .*missing.png' not found"),
        ("img/0.png,2,1,train", OPTIONS, r"line 12, column 'Effusion': label 2 is not 0 or 1"),
        ("img/0.png,yes,1,train", OPTIONS, r"line 12, column 'Effusion': label 'yes' is not a number"),
        (
            None,
            {**OPTIONS, "label_columns": ["Efusion"]},
            r"column\(s\) \['Efusion'\] not found; the CSV has",
        ),
    ],
)
def test_bad_csv_names_file_line_and_column(tmp_path, bad_row, options, message):
    csv = _write_folder(tmp_path, bad_row=bad_row)
    with pytest.raises(FolderFormatError, match=message) as info:
        load_pool("images_csv", str(csv), size=8, **options)
    assert str(csv) in str(info.value)


def test_site_config_reads_the_folder(tmp_path):
    csv = _write_folder(tmp_path)
    config = tmp_path / "fedweigh_site.json"
    config.write_text(
        json.dumps({"dataset": "images_csv", "data_path": str(csv), "size": 16, "loader_options": OPTIONS})
    )
    site, test = load_site_from_config("hospital-a", SiteDataConfig.from_file(config))
    assert len(site.train) + len(site.val) == 8 and len(test) == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"loader_options.label_columns = None .*label column names"),
        ({"label_columns": "Edema"}, r"loader_options.label_columns = 'Edema'"),
        ({"label_columns": ["a"], "task": "multiclass"}, r"loader_options.class_names = None"),
        ({"label_columns": ["a"], "colour": "grey"}, r"loader_options = .*images_csv takes label_columns"),
    ],
)
def test_bad_loader_options_are_refused_before_the_run(tmp_path, options, message):
    config = tmp_path / "fedweigh_site.json"
    config.write_text(
        json.dumps({"dataset": "images_csv", "data_path": "/d/labels.csv", "loader_options": options})
    )
    with pytest.raises(ConfigError, match=f"site data config {config}: {message}"):
        SiteDataConfig.from_file(config)
    from fedweigh.flare.recipes import FedDRAWRecipe

    client = ClientArgs(dataset="images_csv", data_path="$DATA", loader_options=options)
    with pytest.raises(ConfigError, match=f"recipe 'x': client options: {message}"):
        FedDRAWRecipe(name="x", client=client)


def test_recipe_sizes_the_model_from_the_label_columns(tmp_path):
    from fedweigh.flare.recipes import FedDRAWRecipe

    client = ClientArgs(
        dataset="images_csv", data_path="$DATA", loader_options={"label_columns": ["a", "b", "c"]}
    )
    assert FedDRAWRecipe(name="x", client=client).model_spec.num_classes == 3

"""Real-format loaders: MedMNIST npz, CheXpert csv + images, scikit-learn digits, and load_pool."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from fixtures_data import (
    CHEXPERT_COLUMNS,
    chexpert_row,
    simple_chexpert,
    write_chexpert_tree,
    write_csv,
    write_image,
    write_medmnist_npz,
)

from fedweigh.data import (
    CHEST_FINDINGS,
    CHEXPERT_FINDINGS,
    CHEXPERT_PATHOLOGIES,
    DatasetFormatError,
    dataset_info,
    find_medmnist_file,
    load_chexpert,
    load_digits_dataset,
    load_medmnist_npz,
    load_pool,
    resize_images,
)

# --------------------------------------------------------------------------------------------- MedMNIST


def test_chestmnist_npz_reads_all_splits_exactly(tmp_path):
    path = tmp_path / "chestmnist.npz"
    raw = write_medmnist_npz(path, sizes=(12, 4, 6))
    splits = load_medmnist_npz(path)
    assert set(splits) == {"train", "val", "test"}
    for split, n in (("train", 12), ("val", 4), ("test", 6)):
        data = splits[split]
        assert data.images.shape == (n, 1, 28, 28) and data.images.dtype == np.float32
        np.testing.assert_array_equal(data.images[:, 0], raw[f"{split}_images"].astype(np.float32) / 255.0)
        np.testing.assert_array_equal(data.labels, raw[f"{split}_labels"].astype(np.float32))
        assert data.task == "multilabel" and data.class_names == CHEST_FINDINGS
        assert data.meta["split"] == split and data.meta["source"] == str(path)


def test_npz_resize_keeps_constant_images_and_range(tmp_path):
    path = tmp_path / "chestmnist_64.npz"
    flat = np.full((3, 64, 64), 200, dtype=np.uint8)
    write_medmnist_npz(path, sizes=(3, 2, 2), resolution=64, train_images=flat)
    for size in (16, 128):
        data = load_medmnist_npz(path, size=size)["train"]
        assert data.images.shape == (3, 1, size, size)
        np.testing.assert_allclose(data.images, 200 / 255, atol=1e-6)
    other = load_medmnist_npz(path, size=16)["val"]
    assert other.images.min() >= 0.0 and other.images.max() <= 1.0


def test_resize_is_antialiased():
    # a one-pixel checkerboard down-sampled 4x must average to grey, not alias to black or white
    checker = (np.indices((32, 32)).sum(axis=0) % 2).astype(np.float32)[None, None]
    small = resize_images(checker, 8)
    assert small.shape == (1, 1, 8, 8)
    np.testing.assert_allclose(small, 0.5, atol=0.02)


def test_rgb_multiclass_npz_is_grey_with_inferred_classes(tmp_path):
    path = tmp_path / "bloodmnist.npz"
    raw = write_medmnist_npz(path, sizes=(8, 3, 3), rgb=True, multiclass=5)
    data = load_medmnist_npz(path)["train"]
    assert data.task == "multiclass" and data.class_names == ("0", "1", "2", "3", "4")
    assert data.labels.dtype == np.int64 and data.labels.shape == (8,)
    np.testing.assert_array_equal(data.labels, np.arange(8) % 5)
    r, g, b = (raw["train_images"][0, 5, 7, c] / 255.0 for c in range(3))
    assert data.images[0, 0, 5, 7] == pytest.approx(0.299 * r + 0.587 * g + 0.114 * b, abs=1e-6)


def test_npz_task_override_and_class_names(tmp_path):
    path = tmp_path / "pneumoniamnist.npz"
    write_medmnist_npz(path, sizes=(6, 2, 2), multiclass=2)
    binary = load_medmnist_npz(path, task="multilabel", class_names=("pneumonia",))["test"]
    assert binary.task == "multilabel" and binary.labels.shape == (2, 1)
    np.testing.assert_array_equal(binary.labels[:, 0], [0.0, 1.0])
    with pytest.raises(ValueError, match="1 class names given for 2 classes"):
        load_medmnist_npz(path, class_names=("only",))


def test_find_medmnist_file_prefers_matching_resolution(tmp_path):
    for name in ("chestmnist.npz", "chestmnist_64.npz", "chestmnist_224.npz"):
        (tmp_path / name).write_bytes(b"")
    assert find_medmnist_file(tmp_path, 64).name == "chestmnist_64.npz"
    assert find_medmnist_file(tmp_path, 28).name == "chestmnist.npz"
    assert find_medmnist_file(tmp_path, 100).name == "chestmnist_224.npz"
    assert find_medmnist_file(tmp_path, 512).name == "chestmnist_224.npz"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no chestmnist.npz"):
        find_medmnist_file(empty, 28)


def test_npz_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.npz"):
        load_medmnist_npz(tmp_path / "nothere.npz")


def test_npz_not_an_archive(tmp_path):
    text = tmp_path / "notes.npz"
    text.write_text("this is not a zip archive")
    with pytest.raises(DatasetFormatError, match=r"notes\.npz: not an \.npz archive"):
        load_medmnist_npz(text)
    single = tmp_path / "array.npz"
    with single.open("wb") as f:
        np.save(f, np.zeros(3))
    with pytest.raises(DatasetFormatError, match=r"array\.npz: is a single \.npy array"):
        load_medmnist_npz(single)


def test_npz_missing_keys_are_named(tmp_path):
    path = tmp_path / "partial.npz"
    np.savez(path, train_images=np.zeros((2, 28, 28), np.uint8), train_labels=np.zeros((2, 14), np.uint8))
    with pytest.raises(DatasetFormatError) as err:
        load_medmnist_npz(path)
    message = str(err.value)
    assert str(path) in message
    for key in ("val_images", "val_labels", "test_images", "test_labels"):
        assert key in message
    assert "'train_images'" not in message.split("found")[0]


def test_npz_length_mismatch(tmp_path):
    path = tmp_path / "mismatch.npz"
    write_medmnist_npz(path, sizes=(5, 2, 2), val_labels=np.zeros((3, 14), np.uint8))
    with pytest.raises(
        DatasetFormatError, match=r"mismatch\.npz: val_images has 2 rows but val_labels has 3"
    ):
        load_medmnist_npz(path)


@pytest.mark.parametrize(
    ("key", "array", "problem"),
    [
        ("train_images", np.zeros((4, 28, 28), np.int32), "must be uint8"),
        ("train_images", np.zeros((4, 28, 28, 28), np.uint8), "3-D MedMNIST volumes"),
        ("train_images", np.full((4, 28, 28), 2.0, np.float32), r"must lie in \[0, 1\]"),
        ("train_labels", np.full((4, 14), 3, np.uint8), "must be 0 or 1"),
        ("train_labels", np.zeros((4, 2, 7), np.uint8), "must have shape"),
    ],
)
def test_npz_wrong_dtype_or_shape(tmp_path, key, array, problem):
    path = tmp_path / "bad.npz"
    write_medmnist_npz(path, sizes=(4, 2, 2), **{key: array})
    with pytest.raises(DatasetFormatError, match=problem) as err:
        load_medmnist_npz(path)
    assert str(path) in str(err.value) and key in str(err.value)


# --------------------------------------------------------------------------------------------- CheXpert


@pytest.fixture
def tiny_chexpert(tmp_path):
    """Three train rows with hand-chosen labels (PNG, grey 10 / 20 / 30) and one valid row."""
    train = [
        chexpert_row(
            "CheXpert-v1.0-small/train/patient00001/study1/view1_frontal.png",
            "Frontal",
            **{"Atelectasis": "1.0", "Cardiomegaly": "-1.0", "Edema": "0.0", "Pleural Effusion": "-1.0"},
        ),
        chexpert_row(
            "CheXpert-v1.0-small/train/patient00001/study1/view2_lateral.png",
            "Lateral",
            **{"Atelectasis": "-1.0", "Cardiomegaly": "0.0", "Edema": "1.0", "No Finding": "1.0"},
        ),
        chexpert_row("CheXpert-v1.0-small/train/patient00002/study1/view1_frontal.png", "Frontal"),
    ]
    valid = [chexpert_row("CheXpert-v1.0-small/valid/patient64541/study1/view1_frontal.png", Edema="1.0")]
    return write_chexpert_tree(tmp_path, train, valid)


NAN = np.nan
# Atelectasis, Cardiomegaly, Consolidation, Edema, Pleural Effusion (the default CHEXPERT_FINDINGS order)
EXPECTED = {
    "ones": [[1, 1, 0, 0, 1], [1, 0, 0, 1, 0], [0, 0, 0, 0, 0]],
    "zeros": [[1, 0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0]],
    "ignore": [[1, NAN, 0, 0, NAN], [NAN, 0, 0, 1, 0], [0, 0, 0, 0, 0]],
}


@pytest.mark.parametrize("policy", ["ones", "zeros", "ignore"])
def test_chexpert_uncertainty_policies(tiny_chexpert, policy):
    data = load_chexpert(tiny_chexpert, "train", size=8, uncertainty=policy)
    assert data.class_names == CHEXPERT_FINDINGS
    assert data.task == "multilabel" and data.labels.dtype == np.float32
    np.testing.assert_array_equal(data.labels, np.array(EXPECTED[policy], dtype=np.float32))
    assert data.meta["uncertainty"] == policy


def test_chexpert_images_grey_resized_in_csv_order(tiny_chexpert):
    data = load_chexpert(tiny_chexpert, "train", size=8)
    assert data.images.shape == (3, 1, 8, 8) and data.images.dtype == np.float32
    for i, grey in enumerate((10, 20, 30)):
        np.testing.assert_allclose(data.images[i], grey / 255.0, atol=1e-6)


def test_chexpert_frontal_only_findings_and_max_images(tiny_chexpert):
    frontal = load_chexpert(tiny_chexpert, "train", size=8, frontal_only=True)
    assert len(frontal) == 2
    np.testing.assert_allclose(frontal.images[:, 0, 0, 0], [10 / 255, 30 / 255], atol=1e-6)
    picked = load_chexpert(tiny_chexpert, "train", size=8, findings=("Edema", "No Finding"), max_images=2)
    assert picked.class_names == ("Edema", "No Finding")
    np.testing.assert_array_equal(picked.labels, [[0, 0], [1, 1]])
    assert len(load_chexpert(tiny_chexpert, "train", size=8, findings=CHEXPERT_PATHOLOGIES).class_names) == 13
    valid = load_chexpert(tiny_chexpert, "valid", size=8)
    np.testing.assert_array_equal(valid.labels, [[0, 0, 0, 1, 0]])


def test_chexpert_forgiving_roots(tiny_chexpert):
    base = tiny_chexpert.parent
    assert len(load_chexpert(base, "train", size=8)) == 3  # folder above the release folder
    renamed = base / "my-chexpert"
    shutil.move(str(tiny_chexpert), renamed)  # csv Paths still start with CheXpert-v1.0-small/
    data = load_chexpert(renamed, "train", size=8)
    np.testing.assert_allclose(data.images[2], 30 / 255, atol=1e-6)


def test_chexpert_jpeg_decoding(tmp_path):
    rows = [
        chexpert_row(f"CheXpert-v1.0-small/train/patient0000{i}/study1/view1_frontal.jpg") for i in range(2)
    ]
    release = write_chexpert_tree(tmp_path, rows, rows[:1])
    data = load_chexpert(release, "train", size=4)
    np.testing.assert_allclose(data.images[:, 0].mean(axis=(1, 2)), [10 / 255, 20 / 255], atol=3 / 255)


def test_chexpert_missing_folder_and_csv(tmp_path):
    with pytest.raises(FileNotFoundError, match="CheXpert folder not found"):
        load_chexpert(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match=r"valid\.csv not found"):
        load_chexpert(tmp_path, "valid")


def test_chexpert_missing_columns_are_listed(tmp_path):
    columns = tuple(c for c in CHEXPERT_COLUMNS if c not in ("Edema", "Frontal/Lateral"))
    write_csv(tmp_path / "train.csv", [chexpert_row("x.png")], columns)
    with pytest.raises(DatasetFormatError) as err:
        load_chexpert(tmp_path, frontal_only=True)
    message = str(err.value)
    assert str(tmp_path / "train.csv") in message
    assert "missing columns ['Edema', 'Frontal/Lateral']" in message


def test_chexpert_missing_image_names_path_and_line(tiny_chexpert):
    (tiny_chexpert / "train/patient00001/study1/view2_lateral.png").unlink()
    with pytest.raises(DatasetFormatError) as err:
        load_chexpert(tiny_chexpert, size=8)
    message = str(err.value)
    assert f"{tiny_chexpert / 'train.csv'} line 3" in message
    assert "view2_lateral.png" in message and "not found" in message


def test_chexpert_unreadable_image(tiny_chexpert):
    (tiny_chexpert / "train/patient00002/study1/view1_frontal.png").write_bytes(b"not an image")
    with pytest.raises(
        DatasetFormatError, match=r"train\.csv line 4: cannot read image .*view1_frontal\.png"
    ):
        load_chexpert(tiny_chexpert, size=8)


def test_chexpert_bad_label_value(tmp_path):
    write_image(tmp_path / "a.png", 50)
    write_csv(tmp_path / "train.csv", [chexpert_row("a.png"), chexpert_row("a.png", Edema="2.0")])
    with pytest.raises(DatasetFormatError, match=r"train\.csv line 3: column 'Edema' has 2\.0"):
        load_chexpert(tmp_path, size=4)
    write_csv(tmp_path / "train.csv", [chexpert_row("a.png", Cardiomegaly="yes")])
    with pytest.raises(DatasetFormatError, match="line 2: column 'Cardiomegaly' has 'yes'"):
        load_chexpert(tmp_path, size=4)


def test_chexpert_bad_arguments(tiny_chexpert):
    with pytest.raises(ValueError, match="split must be"):
        load_chexpert(tiny_chexpert, split="test")
    with pytest.raises(ValueError, match="uncertainty must be one of"):
        load_chexpert(tiny_chexpert, uncertainty="maybe")


# --------------------------------------------------------------------------------------------- digits


def test_digits_native_and_upsampled():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    native = load_digits_dataset(size=8)
    np.testing.assert_allclose(native.images[:, 0], bunch.images / 16.0, atol=1e-6)
    data = load_digits_dataset(size=32)
    assert data.images.shape == (1797, 1, 32, 32) and data.task == "multiclass"
    assert data.class_names == tuple("0123456789")
    np.testing.assert_array_equal(data.labels, bunch.target)
    assert data.images.min() >= 0.0 and data.images.max() <= 1.0
    # bilinear up-sampling keeps the mean intensity (up to the border)
    np.testing.assert_allclose(
        data.images.mean(axis=(1, 2, 3)), native.images.mean(axis=(1, 2, 3)), atol=0.02
    )


# --------------------------------------------------------------------------------------------- load_pool


def test_load_pool_digits_stratified_holdout():
    pool, test = load_pool("digits", size=8, seed=3)
    assert len(pool) + len(test) == 1797 and len(test) == 360
    counts = np.bincount(test.labels, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # 20% of 174..183 per class
    again, _ = load_pool("digits", size=8, seed=3)
    np.testing.assert_array_equal(pool.images, again.images)
    small, _ = load_pool("digits", size=8, seed=3, num_images=100)
    assert len(small) == 100


def test_load_pool_chestmnist_pools_train_and_val(tmp_path):
    raw = write_medmnist_npz(tmp_path / "chestmnist.npz", sizes=(12, 4, 6))
    pool, test = load_pool("chestmnist", tmp_path, size=28)  # a folder is accepted
    assert len(pool) == 16 and len(test) == 6
    np.testing.assert_array_equal(pool.labels[12:], raw["val_labels"])
    capped_pool, capped_test = load_pool("chestmnist", tmp_path / "chestmnist.npz", size=28, num_images=10)
    assert len(capped_pool) == 10 and len(capped_test) == 2


def test_load_pool_chexpert_uses_valid_as_test(tmp_path):
    release = simple_chexpert(tmp_path, n_train=10, n_valid=4)
    pool, test = load_pool("chexpert", release, size=8, uncertainty="zeros")
    assert len(pool) == 10 and len(test) == 4
    assert set(np.unique(pool.labels)) <= {0.0, 1.0}
    assert len(load_pool("chexpert", release, size=8, num_images=5)[0]) == 5


def test_load_pool_errors_name_the_flag_and_datasets():
    with pytest.raises(ValueError, match="needs a data path: pass --data-path"):
        load_pool("chestmnist")
    with pytest.raises(ValueError, match="CheXpert folder"):
        load_pool("chexpert")
    with pytest.raises(ValueError, match="unknown dataset 'mnist'; known datasets: synthcxr, chestmnist"):
        load_pool("mnist")


def test_dataset_info():
    assert dataset_info("digits")["task"] == "multiclass" and dataset_info("digits")["num_classes"] == 10
    assert dataset_info("synthcxr")["class_names"] == CHEST_FINDINGS
    assert dataset_info("chexpert")["class_names"] == CHEXPERT_FINDINGS
    assert dataset_info("chestmnist")["needs_data_path"] is True

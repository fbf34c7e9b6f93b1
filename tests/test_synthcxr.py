"""SynthCXR: shapes, determinism, label statistics, per-finding patterns, cache."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedweigh.data import synthcxr
from fedweigh.data.base import CHEST_FINDINGS
from fedweigh.data.synthcxr import (
    PREVALENCE,
    SYNTHCXR_DEFAULT_SIZE,
    SYNTHCXR_VERSION,
    generate_synthcxr,
    load_synthcxr,
    render_synthcxr,
    sample_synthcxr_labels,
    save_sample_grid,
    synthcxr_cache_path,
)

K = len(CHEST_FINDINGS)


@pytest.fixture(scope="module")
def labels_20k() -> np.ndarray:
    return sample_synthcxr_labels(20_000, seed=0)


@pytest.fixture(scope="module")
def counterfactual() -> dict[str, np.ndarray]:
    """Per finding: images of 48 patients with only that finding minus the same patients with none."""
    n = 48
    normal = render_synthcxr(np.zeros((n, K), np.float32), size=32, seed=5)
    diffs = {}
    for k, finding in enumerate(CHEST_FINDINGS):
        y = np.zeros((n, K), np.float32)
        y[:, k] = 1.0
        diffs[finding] = (render_synthcxr(y, size=32, seed=5) - normal)[:, 0].astype(np.float64)
    return diffs


def test_default_size_and_prevalence_keys() -> None:
    assert SYNTHCXR_DEFAULT_SIZE == 32
    assert tuple(PREVALENCE) == CHEST_FINDINGS
    assert tuple(synthcxr.FACTOR_LOADINGS) == CHEST_FINDINGS
    assert tuple(synthcxr.FINDING_PATTERNS) == CHEST_FINDINGS
    assert {name for name, _ in synthcxr._PAINTERS} | {"cardiomegaly", "emphysema"} == set(CHEST_FINDINGS)
    assert all(0.0 < p < 0.5 for p in PREVALENCE.values())


@pytest.mark.parametrize("size", [28, 32, 64])
def test_shapes_dtype_range(size: int) -> None:
    data = generate_synthcxr(40, size=size, seed=1)
    assert data.images.shape == (40, 1, size, size) and data.images.dtype == np.float32
    assert data.labels.shape == (40, K) and data.labels.dtype == np.float32
    assert data.images.min() >= 0.0 and data.images.max() <= 1.0
    assert set(np.unique(data.labels)) <= {0.0, 1.0}
    assert data.task == "multilabel" and data.class_names == CHEST_FINDINGS
    assert data.meta == {"dataset": "synthcxr", "size": size, "seed": 1}
    # Dark lungs and air outside the body, bright mediastinum/abdomen: a real dynamic range.
    assert data.images.std() > 0.1


def test_default_size_is_32() -> None:
    assert generate_synthcxr(3).images.shape == (3, 1, 32, 32)


def test_deterministic_across_calls_and_blocks() -> None:
    a = generate_synthcxr(600, seed=3)  # crosses the 512-row block boundary
    b = generate_synthcxr(600, seed=3)
    assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)


def test_rows_do_not_depend_on_n() -> None:
    small = generate_synthcxr(300, seed=4)
    large = generate_synthcxr(700, seed=4)
    assert np.array_equal(small.images, large.images[:300])
    assert np.array_equal(small.labels, large.labels[:300])


def test_different_seeds_differ() -> None:
    a = generate_synthcxr(50, seed=0)
    b = generate_synthcxr(50, seed=1)
    assert not np.array_equal(a.labels, b.labels)
    assert np.abs(a.images - b.images).mean() > 0.01


def test_labels_are_sampled_first_and_size_free() -> None:
    labels = sample_synthcxr_labels(600, seed=2)
    assert np.array_equal(labels, generate_synthcxr(600, size=32, seed=2).labels)
    assert np.array_equal(labels[:40], generate_synthcxr(40, size=28, seed=2).labels)
    assert np.array_equal(labels[:40], generate_synthcxr(40, size=64, seed=2).labels)


def test_prevalence_matches_targets(labels_20k: np.ndarray) -> None:
    n = labels_20k.shape[0]
    observed = labels_20k.mean(axis=0)
    for k, finding in enumerate(CHEST_FINDINGS):
        p = PREVALENCE[finding]
        tolerance = 5.0 * math.sqrt(p * (1.0 - p) / n)  # 5 binomial standard errors
        assert abs(observed[k] - p) <= tolerance, f"{finding}: {observed[k]:.4f} vs target {p:.4f}"


def test_long_tail_and_no_finding_fraction(labels_20k: np.ndarray) -> None:
    observed = dict(zip(CHEST_FINDINGS, labels_20k.mean(axis=0), strict=True))
    assert observed["hernia"] < 0.005
    assert observed["infiltration"] == max(observed.values())
    assert 0.10 < observed["infiltration"] < 0.25
    no_finding = float((labels_20k.sum(axis=1) == 0).mean())
    assert 0.50 < no_finding < 0.62, no_finding
    assert (labels_20k.sum(axis=1) >= 2).mean() > 0.08  # multi-label rows are common


@pytest.mark.parametrize(
    ("given", "finding"),
    [
        ("effusion", "atelectasis"),
        ("effusion", "cardiomegaly"),
        ("effusion", "edema"),
        ("mass", "nodule"),
        ("consolidation", "pneumonia"),
        ("fibrosis", "pleural"),
    ],
)
def test_cooccurrence(labels_20k: np.ndarray, given: str, finding: str) -> None:
    g = labels_20k[:, CHEST_FINDINGS.index(given)] > 0
    f = labels_20k[:, CHEST_FINDINGS.index(finding)] > 0
    assert f[g].mean() > 2.0 * f.mean(), (
        f"P({finding}|{given})={f[g].mean():.3f}, P({finding})={f.mean():.3f}"
    )


def test_every_finding_changes_the_image(counterfactual: dict[str, np.ndarray]) -> None:
    for finding, diff in counterfactual.items():
        per_image_peak = np.abs(diff).reshape(len(diff), -1).max(axis=1)
        assert per_image_peak.min() > 0.05, f"{finding}: some patient shows almost no pattern"
        visible_pixels = (np.abs(diff) > 0.03).sum(axis=(1, 2))
        assert visible_pixels.mean() >= 5, f"{finding}: pattern covers too few pixels"


def test_patterns_go_where_they_should(counterfactual: dict[str, np.ndarray]) -> None:
    d = counterfactual
    size = d["edema"].shape[-1]
    top, bottom = slice(0, size // 2), slice(size // 2, size)
    left, right = slice(0, size // 2), slice(size // 2, size)
    # darker: more air (pneumothorax also draws a thin bright pleural line)
    assert d["emphysema"].mean() < -0.01
    assert d["pneumothorax"].mean() < 0.0
    assert d["pneumothorax"].reshape(len(d["pneumothorax"]), -1).min(axis=1).max() < -0.02
    # brighter: opacities
    for finding in ("atelectasis", "effusion", "infiltration", "mass", "nodule", "pneumonia", "consolidation",
                    "edema", "fibrosis", "pleural", "cardiomegaly"):  # fmt: skip
        brighter, darker = d[finding].clip(min=0).sum(), -d[finding].clip(max=0).sum()
        assert brighter > 3 * darker, finding
    # effusion and pneumonia: lower zones
    for finding in ("effusion", "pneumonia"):
        assert d[finding][:, bottom].mean() > 3 * abs(d[finding][:, top].mean()), finding
    # edema: bilateral and symmetric on average
    ratio = d["edema"][:, :, left].mean() / d["edema"][:, :, right].mean()
    assert 0.6 < ratio < 1.6
    # cardiomegaly: widens the heart (lower half, towards the image right = patient's left)
    card = d["cardiomegaly"]
    assert card[:, bottom, right].mean() > 3 * abs(card[:, top].mean())
    # hernia: a bright rounded opacity with a dark gas cap, low in the midline
    hern = d["hernia"]
    mid = slice(size // 2 - 5, size // 2 + 5)
    assert hern[:, bottom, mid].max(axis=(1, 2)).min() > 0.05
    assert hern[:, bottom, mid].min(axis=(1, 2)).max() < -0.05
    assert np.abs(hern[:, top]).max() < 0.01


def test_patterns_are_distinct(counterfactual: dict[str, np.ndarray]) -> None:
    names = list(counterfactual)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            da, db = counterfactual[a], counterfactual[b]
            num = np.linalg.norm((da - db).reshape(len(da), -1), axis=1)
            den = np.maximum(
                np.linalg.norm(da.reshape(len(da), -1), axis=1),
                np.linalg.norm(db.reshape(len(db), -1), axis=1),
            )
            assert np.median(num / den) > 0.5, f"{a} and {b} draw nearly the same pattern"


def test_render_rejects_bad_labels_and_sizes() -> None:
    with pytest.raises(ValueError, match="labels must have shape"):
        render_synthcxr(np.zeros((3, 13), np.float32))
    with pytest.raises(ValueError, match="size must be an int >= 28"):
        generate_synthcxr(3, size=16)
    with pytest.raises(ValueError, match="n must be a non-negative int"):
        generate_synthcxr(-1)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        sample_synthcxr_labels(3, seed=-2)


def test_zero_images() -> None:
    data = generate_synthcxr(0)
    assert data.images.shape == (0, 1, 32, 32) and data.labels.shape == (0, K)


def test_cache_round_trip(tmp_path, monkeypatch) -> None:
    first = load_synthcxr(30, size=28, seed=7, cache_dir=tmp_path)
    path = synthcxr_cache_path(30, 28, 7, tmp_path)
    assert path.exists() and f"v{SYNTHCXR_VERSION}" in path.name and "n30" in path.name
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind

    def fail(*args, **kwargs):
        raise AssertionError("the cached file should have been read")

    monkeypatch.setattr(synthcxr, "generate_synthcxr", fail)
    second = load_synthcxr(30, size=28, seed=7, cache_dir=tmp_path)
    assert np.array_equal(first.images, second.images) and np.array_equal(first.labels, second.labels)
    assert second.meta == {"dataset": "synthcxr", "size": 28, "seed": 7}
    assert second.class_names == CHEST_FINDINGS and second.task == "multilabel"


def test_corrupt_cache_is_regenerated(tmp_path) -> None:
    path = synthcxr_cache_path(20, 32, 0, tmp_path)
    path.write_bytes(b"not an npz file")
    with pytest.warns(UserWarning, match="regenerating"):
        data = load_synthcxr(20, seed=0, cache_dir=tmp_path)
    expected = generate_synthcxr(20, seed=0)
    assert np.array_equal(data.images, expected.images)
    assert np.array_equal(load_synthcxr(20, seed=0, cache_dir=tmp_path).labels, expected.labels)


def test_mismatched_cache_is_regenerated(tmp_path) -> None:
    path = synthcxr_cache_path(20, 32, 0, tmp_path)
    np.savez(path, images=np.zeros((5, 1, 32, 32), np.float32), labels=np.zeros((5, K), np.float32),
             version=np.int64(SYNTHCXR_VERSION))  # fmt: skip
    with pytest.warns(UserWarning, match="expected float32"):
        data = load_synthcxr(20, seed=0, cache_dir=tmp_path)
    assert data.images.shape == (20, 1, 32, 32)


def test_default_cache_dir_from_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FEDWEIGH_CACHE", str(tmp_path / "c"))
    assert synthcxr_cache_path(1, 32, 0).parent == tmp_path / "c"
    monkeypatch.delenv("FEDWEIGH_CACHE")
    assert synthcxr_cache_path(1, 32, 0).parent.name == "fedweigh"


def test_save_sample_grid(tmp_path) -> None:
    data = generate_synthcxr(10, seed=0)
    out = save_sample_grid(data.images, data.labels, tmp_path / "grid.png", ncols=5)
    blob = out.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(blob) < 200_000

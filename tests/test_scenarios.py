"""Scenario catalogue, partitions, acquisition shift and federation building."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from fixtures_data import simple_chexpert, write_medmnist_npz

from fedweigh.data import (
    SCENARIOS,
    AcquisitionProfile,
    Scenario,
    apply_acquisition_shift,
    build_federation,
    get_scenario,
    list_scenarios,
    load_pool,
    partition_indices,
    primary_labels,
    scenario_table,
    site_label_divergence,
    site_profile,
)
from fedweigh.data.scenarios import _largest_remainder, min_site_size
from fedweigh.data.synthcxr import sample_synthcxr_labels


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDWEIGH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def digit_labels() -> np.ndarray:
    from sklearn.datasets import load_digits

    return load_digits().target.astype(np.int64)


@pytest.fixture(scope="module")
def cxr_labels() -> np.ndarray:
    return sample_synthcxr_labels(2000, seed=0)


# ------------------------------------------------------------------------------------------ catalogue


def test_catalogue_has_twelve_named_scenarios():
    assert len(SCENARIOS) == 12 and len(list_scenarios()) == 12
    names = [s.name for s in list_scenarios()]
    assert len(set(names)) == 12 and all(re.fullmatch(r"[a-z0-9.]+(-[a-z0-9.]+)*", n) for n in names)
    assert {s.num_sites for s in list_scenarios()} == {4, 8, 50}
    assert {s.partition for s in list_scenarios()} == {"iid", "quantity", "label", "quantity+label"}
    assert sum(s.shift > 0 for s in list_scenarios()) >= 3
    many = get_scenario("many-50")
    assert many.num_sites == 50 and many.sample_fraction == 0.1
    assert get_scenario("iid-4").site_names == ["site-1", "site-2", "site-3", "site-4"]


def test_unknown_scenario_lists_known_names():
    with pytest.raises(KeyError, match="unknown scenario 'nope'; known scenarios: iid-4, quantity-a1.0"):
        get_scenario("nope")


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"partition": "label"}, "needs alpha > 0"),
        ({"partition": "iid", "alpha": 0.5}, "takes no alpha"),
        ({"partition": "quantity+label", "alpha": 0.5}, "needs quantity_alpha"),
        ({"partition": "random"}, "partition must be one of"),
        ({"partition": "iid", "sample_fraction": 0.0}, "sample_fraction"),
        ({"partition": "iid", "shift": -1.0}, "shift must be"),
        ({"partition": "iid", "num_sites": 0}, "num_sites"),
    ],
)
def test_scenario_validation(kwargs, problem):
    args = {"name": "custom", "description": "", "num_sites": 3, **kwargs}
    with pytest.raises(ValueError, match=problem):
        Scenario(**args)


def test_scenario_table_has_one_line_per_scenario():
    lines = scenario_table().splitlines()
    assert len(lines) == 13 and lines[0].split()[:3] == ["name", "sites", "partition"]
    many = next(line for line in lines if line.startswith("many-50"))
    assert many.split()[:6] == ["many-50", "50", "quantity+label", "0.5", "1", "0"] and "10% (5)" in many


# ------------------------------------------------------------------------------------------ partitions


def test_primary_label_is_rarest_positive_or_no_finding():
    labels = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 0, 1], [np.nan, 1, 0]], dtype=np.float32)
    # positives per column (NaN is not positive): 3, 2, 1
    np.testing.assert_array_equal(primary_labels(labels, "multilabel"), [1, 3, 0, 2, 1])
    np.testing.assert_array_equal(primary_labels(np.array([2, 0, 1]), "multiclass"), [2, 0, 1])


def test_largest_remainder_and_minimum_size():
    np.testing.assert_array_equal(_largest_remainder(np.array([0.1, 0.3, 0.6]), 1000), [100, 300, 600])
    np.testing.assert_array_equal(_largest_remainder(np.array([1.0, 1.0, 1.0]), 10), [4, 3, 3])
    assert min_site_size(20_000, 4) == 32 and min_site_size(600, 50) == 6 and min_site_size(10, 5) == 2
    with pytest.raises(ValueError, match="cannot give 8 sites"):
        min_site_size(10, 8)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_partitions_are_disjoint_covering_deterministic_and_large_enough(name, digit_labels, cxr_labels):
    scenario = get_scenario(name)
    for labels, task in ((digit_labels, "multiclass"), (cxr_labels, "multilabel")):
        parts = partition_indices(labels, task, scenario, seed=7)
        assert len(parts) == scenario.num_sites
        joined = np.concatenate(parts)
        np.testing.assert_array_equal(np.sort(joined), np.arange(len(labels)))  # disjoint and covering
        assert min(len(p) for p in parts) >= min_site_size(len(labels), scenario.num_sites)
        again = partition_indices(labels, task, scenario, seed=7)
        assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
        other = partition_indices(labels, task, scenario, seed=8)
        assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_minimum_site_size_is_32_for_large_pools(cxr_labels):
    for name in ("quantity-a0.3", "label-a0.1", "label-8"):
        parts = partition_indices(cxr_labels, "multilabel", get_scenario(name), seed=0)
        assert min(len(p) for p in parts) >= 32


def _size_spread(labels, task, scenario, seeds=range(8)) -> float:
    """Mean over seeds of the coefficient of variation of site sizes."""
    spreads = []
    for seed in seeds:
        sizes = np.array([len(p) for p in partition_indices(labels, task, scenario, seed)])
        spreads.append(sizes.std() / sizes.mean())
    return float(np.mean(spreads))


def test_quantity_skew_spreads_site_sizes(cxr_labels):
    iid = _size_spread(cxr_labels, "multilabel", get_scenario("iid-4"))
    mild = _size_spread(cxr_labels, "multilabel", get_scenario("quantity-a1.0"))
    strong = _size_spread(cxr_labels, "multilabel", get_scenario("quantity-a0.3"))
    assert iid == 0.0  # 2000 rows over 4 sites: 500 each
    assert 0.2 < mild < strong


def _mean_js(labels, task, scenario, seeds=range(6)) -> float:
    return float(
        np.mean(
            [
                site_label_divergence(labels, task, partition_indices(labels, task, scenario, s)).mean()
                for s in seeds
            ]
        )
    )


@pytest.mark.parametrize("which", ["digits", "synthcxr"])
def test_label_skew_grows_as_alpha_shrinks(which, digit_labels, cxr_labels):
    labels, task = (digit_labels, "multiclass") if which == "digits" else (cxr_labels, "multilabel")
    js = {
        name: _mean_js(labels, task, get_scenario(name))
        for name in ("iid-4", "label-a1.0", "label-a0.5", "label-a0.1")
    }
    assert js["iid-4"] < 0.02
    assert js["iid-4"] < js["label-a1.0"] < js["label-a0.5"] < js["label-a0.1"]
    # quantity skew alone leaves the label mix alone
    assert _mean_js(labels, task, get_scenario("quantity-a0.3")) < js["label-a1.0"] / 2


def test_label_skew_on_digits_leaves_sites_missing_classes(digit_labels):
    parts = partition_indices(digit_labels, "multiclass", get_scenario("label-a0.1"), seed=0)
    present = [np.unique(digit_labels[p]).size for p in parts]
    assert min(present) < 10  # with alpha 0.1 at least one site lacks some digits


def test_site_label_divergence_hand_computed():
    labels = np.array([0, 0, 1, 1])
    js = site_label_divergence(labels, "multiclass", [np.array([0, 1]), np.array([0, 2])])
    # site 1 is all class 0 vs pool (1/2, 1/2): M = (3/4, 1/4); JS = (log2(4/3) + (1/2 log2(2/3) + 1/2 log2 2)) / 2
    expected = 0.5 * (np.log2(4 / 3) + 0.5 * np.log2(2 / 3) + 0.5 * np.log2(2))
    np.testing.assert_allclose(js, [expected, 0.0], atol=1e-12)


# ------------------------------------------------------------------------------------------ acquisition shift


def test_identity_profile_leaves_images_unchanged():
    images = np.random.default_rng(0).random((5, 2, 8, 8), dtype=np.float32)
    assert site_profile(0, strength=0.0).is_identity
    np.testing.assert_array_equal(apply_acquisition_shift(images, site_profile(0, 0.0), seed=1), images)


def test_contrast_offset_gamma_hand_computed():
    images = np.array([0.5, 0.7, 0.2, 0.0], dtype=np.float32).reshape(1, 1, 2, 2)
    out = apply_acquisition_shift(images, AcquisitionProfile(contrast=2.0, gamma=2.0, offset=0.1), seed=0)
    # (x - 0.5) * 2 + 0.6, clipped, squared: 0.5 -> 0.36; 0.7 -> 1.0 -> 1; 0.2 -> 0 -> 0; 0.0 -> 0
    np.testing.assert_allclose(out.reshape(-1), [0.36, 1.0, 0.0, 0.0], atol=1e-6)
    assert out.dtype == np.float32


def test_blur_acts_on_spatial_axes_only():
    images = np.zeros((2, 2, 9, 9), dtype=np.float32)
    images[0, 0, 4, 4] = 1.0
    images[1, 1] = 0.5
    out = apply_acquisition_shift(images, AcquisitionProfile(blur_sigma=1.0), seed=0)
    assert out[0, 0, 4, 4] < 1.0 and out[0, 0, 4, 5] > 0.0  # spread within its own image and channel
    np.testing.assert_array_equal(out[0, 1], 0.0)
    np.testing.assert_array_equal(out[1, 0], 0.0)
    np.testing.assert_allclose(out[1, 1], 0.5, atol=1e-6)  # a constant image stays constant
    assert out[0, 0].sum() == pytest.approx(1.0, abs=1e-5)  # blur preserves mass


def test_noise_level_and_determinism():
    images = np.full((4, 1, 32, 32), 0.5, dtype=np.float32)
    profile = AcquisitionProfile(noise_std=0.05)
    a = apply_acquisition_shift(images, profile, seed=3)
    assert (a - 0.5).std() == pytest.approx(0.05, rel=0.05)
    np.testing.assert_array_equal(a, apply_acquisition_shift(images, profile, seed=3))
    assert not np.array_equal(a, apply_acquisition_shift(images, profile, seed=4))


def test_site_profiles_are_deterministic_diverse_and_scale_with_strength():
    profiles = [site_profile(k, 1.0, seed=0) for k in range(8)]
    assert profiles == [site_profile(k, 1.0, seed=0) for k in range(8)]
    contrasts = [p.contrast for p in profiles]
    assert len(set(np.round(contrasts, 6))) == 8 and max(contrasts) - min(contrasts) > 0.3
    for p in profiles:
        assert 0.70 <= p.contrast <= 1.42 and 0.70 <= p.gamma <= 1.42 and abs(p.offset) <= 0.06
        assert 0 <= p.noise_std <= 0.03 and 0 <= p.blur_sigma <= 0.8
    half = site_profile(3, 0.5, seed=0)
    assert abs(np.log(half.contrast)) == pytest.approx(abs(np.log(profiles[3].contrast)) / 2)
    assert site_profile(3, 1.0, seed=1) != profiles[3]


# ------------------------------------------------------------------------------------------ federations


def test_synthcxr_federation_layout():
    fed = build_federation("label-a0.5", num_images=600, seed=0)
    assert fed.scenario == "label-a0.5" and fed.sample_fraction == 1.0
    assert [s.name for s in fed.sites] == ["site-1", "site-2", "site-3", "site-4"]
    assert sum(len(s.train) + len(s.val) for s in fed.sites) == 600 and len(fed.test) == 120
    for s in fed.sites:
        n = len(s.train) + len(s.val)
        assert len(s.val) == max(1, round(0.1 * n)) and s.train.images.shape[1:] == (1, 32, 32)
        assert s.train.meta["site"] == s.name and s.train.task == "multilabel"
    pool, test = load_pool("synthcxr", num_images=600, seed=0)
    parts = partition_indices(pool.labels, pool.task, get_scenario("label-a0.5"), seed=0)
    site2 = fed.site("site-2")
    np.testing.assert_array_equal(
        np.sort(np.concatenate([site2.train.labels, site2.val.labels]), axis=0),
        np.sort(pool.labels[parts[1]], axis=0),
    )
    np.testing.assert_array_equal(fed.test.images, test.images)  # no shift: test untouched


def test_federation_is_deterministic_and_many50_samples_a_tenth():
    a = build_federation("many-50", "digits", size=8, seed=2)
    b = build_federation("many-50", "digits", size=8, seed=2)
    assert len(a.sites) == 50 and a.sample_fraction == 0.1
    assert a.sites[-1].name == "site-50"
    for x, y in zip(a.sites, b.sites, strict=True):
        np.testing.assert_array_equal(x.train.images, y.train.images)
        np.testing.assert_array_equal(x.val.labels, y.val.labels)
    assert min(len(s.train) + len(s.val) for s in a.sites) >= min_site_size(1437, 50)


def test_shift_changes_each_sites_image_statistics():
    plain = build_federation("iid-4", "digits", size=16, seed=0)
    shifted = build_federation("shift-4", "digits", size=16, seed=0)  # same iid partition, plus shift
    deltas = []
    for p, s in zip(plain.sites, shifted.sites, strict=True):
        np.testing.assert_array_equal(p.train.labels, s.train.labels)
        deltas.append(s.train.images.mean() - p.train.images.mean())
        profile = site_profile(int(s.name.split("-")[1]) - 1, 1.0, seed=0)
        gamma_free = AcquisitionProfile(profile.contrast, 1.0, 0.0, profile.blur_sigma, profile.offset)
        expect = apply_acquisition_shift(p.train.images, gamma_free, seed=0) ** profile.gamma
        assert np.abs(s.train.images - expect).mean() < 2 * profile.noise_std + 1e-3
    assert np.ptp(deltas) > 0.02  # the sites moved by different amounts
    assert not np.allclose(plain.test.images, shifted.test.images)
    np.testing.assert_array_equal(plain.test.labels, shifted.test.labels)


def test_shifted_test_images_mix_the_site_profiles():
    plain = build_federation("iid-4", "digits", size=8, seed=1)
    shifted = build_federation("shift-4", "digits", size=8, seed=1)
    profiles = [site_profile(k, 1.0, seed=1) for k in range(4)]
    noise_free = np.stack(
        [apply_acquisition_shift(plain.test.images, replace(p, noise_std=0.0), 0) for p in profiles]
    )
    errors = np.abs(noise_free - shifted.test.images[None]).mean(axis=(2, 3, 4))  # (site, image)
    # each test image is its plain version under one site's profile, up to that profile's noise
    # (mean |N(0, s^2)| = 0.8 s, less after clipping; 1.2 s allows for 64-pixel sampling error)
    bounds = np.array([1.2 * p.noise_std for p in profiles])[:, None] + 1e-3
    assert np.all((errors <= bounds).any(axis=0))
    owner = (errors / bounds).argmin(axis=0)
    counts = np.bincount(owner, minlength=4)
    assert counts.min() > 0.15 * len(owner)  # every site's profile appears in the global test set


def test_real_format_federations(tmp_path):
    write_medmnist_npz(tmp_path / "chestmnist.npz", sizes=(40, 8, 10))
    fed = build_federation("label-a0.5", "chestmnist", data_path=tmp_path / "chestmnist.npz", size=16)
    assert sum(len(s.train) + len(s.val) for s in fed.sites) == 48 and len(fed.test) == 10
    release = simple_chexpert(tmp_path, n_train=16, n_valid=4)
    fed = build_federation(
        "quantity-shift", "chexpert", data_path=release, size=8, loader_options={"uncertainty": "zeros"}
    )
    assert sum(len(s.train) + len(s.val) for s in fed.sites) == 16 and len(fed.test) == 4
    with pytest.raises(ValueError, match="pass --data-path"):
        build_federation("iid-4", "chexpert")

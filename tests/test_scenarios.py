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
from fedweigh.data.scenarios import (
    SiteLabels,
    _largest_remainder,
    domain_shares,
    flip_labels,
    min_site_size,
)
from fedweigh.data.shift import degraded_profile
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


def test_catalogue_has_fifteen_named_scenarios():
    assert len(SCENARIOS) == 15 and len(list_scenarios()) == 15
    names = [s.name for s in list_scenarios()]
    assert len(set(names)) == 15 and all(re.fullmatch(r"[a-z0-9.]+(-[a-z0-9.]+)*", n) for n in names)
    assert {s.num_sites for s in list_scenarios()} == {4, 8, 50}
    assert {s.partition for s in list_scenarios()} == {"iid", "quantity", "label", "quantity+label", "sites"}
    assert sum(s.has_shift for s in list_scenarios()) == 4
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
    assert len(lines) == 16 and lines[0].split()[:3] == ["name", "sites", "partition"]
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


# ------------------------------------------------------------------ per-site heterogeneity (sites partition)


def test_removed_scenario_says_why_and_where_it_went():
    with pytest.raises(KeyError, match="label-shift.*label-a0.5's.*examples/scenarios/label-shift.yaml"):
        get_scenario("label-shift")


def test_flip_labels_keeps_the_histogram_and_flips_the_stated_fraction():
    rng = np.random.default_rng(0)
    labels = (rng.random((400, 3)) < [0.5, 0.1, 0.02]).astype(np.float32)
    labels[0, 0] = np.nan
    flipped = flip_labels(labels, "multilabel", 0.3, np.random.default_rng(1), 3)
    np.testing.assert_array_equal(np.nansum(flipped, axis=0), np.nansum(labels, axis=0))  # histogram kept
    assert np.isnan(flipped[0, 0])
    for c in range(3):
        positives = np.flatnonzero(labels[:, c] == 1)
        assert int((flipped[positives, c] == 0).sum()) == round(0.3 * len(positives))
    digits = np.arange(100) % 10
    noisy = flip_labels(digits, "multiclass", 0.25, np.random.default_rng(1), 10)
    assert int((noisy != digits).sum()) == 25 and noisy.min() >= 0 and noisy.max() <= 9


def test_noisy_large_flips_site1_training_labels_only():
    fed = build_federation("noisy-large", num_images=600, size=28, seed=0)
    pool, _ = load_pool("synthcxr", num_images=600, size=28, seed=0)
    row_of = {image.tobytes(): i for i, image in enumerate(pool.images)}
    parts = partition_indices(pool.labels, pool.task, get_scenario("noisy-large"), 0, pool.class_names)
    assert [len(p) for p in parts] == [330, 90, 90, 90]  # 55 / 15 / 15 / 15 % of 600
    for k, site in enumerate(fed.sites):
        for split in (site.train, site.val):
            clean = pool.labels[[row_of[image.tobytes()] for image in split.images]]
            wrong = (split.labels != clean).sum(axis=0)
            if k == 0 and split is site.train:  # per finding: round(0.3 P_c) positives and as many negatives
                np.testing.assert_array_equal(wrong, 2 * np.round(0.3 * clean.sum(axis=0)))
                np.testing.assert_array_equal(split.labels.sum(axis=0), clean.sum(axis=0))
                assert wrong.sum() > 0 and split.meta["label_noise"] == 0.3
            else:  # validation labels and the other sites stay clean
                assert wrong.sum() == 0


def test_rare_small_site_is_richer_in_rare_findings():
    pool, _ = load_pool("synthcxr", num_images=2000, size=28, seed=0)
    parts = partition_indices(pool.labels, pool.task, get_scenario("rare-small"), 0, pool.class_names)
    assert [len(p) for p in parts] == [200, 600, 600, 600]
    groups = primary_labels(pool.labels, pool.task)
    no_finding = pool.labels.shape[1]
    share = [float(np.mean(groups[p] != no_finding)) for p in parts]
    assert share[0] > 2 * max(share[1:])  # site-1: mostly rows with a finding, the others mostly none
    rare = np.argsort(pool.labels.sum(axis=0))[:5]  # the five rarest findings
    per_row = [pool.labels[p][:, rare].sum() / len(p) for p in parts]
    assert per_row[0] > 2 * max(per_row[1:])


def test_degraded_large_site_and_a_test_set_mixed_by_size():
    fed = build_federation("degraded-large", num_images=600, size=28, seed=0, test_images=200)
    plain = build_federation("noisy-large", num_images=600, size=28, seed=0)  # same sizes, no shift
    assert fed.sites[0].train.images.std() < 0.75 * plain.sites[0].train.images.std()  # low contrast, blur
    for a, b in zip(fed.sites[1:], plain.sites[1:], strict=True):
        np.testing.assert_array_equal(a.val.images, b.val.images)  # the other sites untouched
    np.testing.assert_array_equal(np.bincount(fed.test.domain), [110, 30, 30, 30])  # 55/15/15/15 % of 200
    degraded = degraded_profile(1.0)
    assert degraded.contrast < 1 and degraded.blur_sigma > 0 and degraded.noise_std > 0
    assert fed.test.images[fed.test.domain == 0].std() < fed.test.images[fed.test.domain == 1].std()


def test_test_mix_equal_draws_each_domain_equally_with_its_label_mix():
    sc = get_scenario("test-mix")
    fed = build_federation(sc, num_images=1000, size=28, seed=0, test_images=400)
    sizes = [len(s.train) + len(s.val) for s in fed.sites]
    assert sizes == [550, 150, 150, 150]
    np.testing.assert_array_equal(np.bincount(fed.test.domain), [100, 100, 100, 100])
    # each domain's test rows follow its site's label mix: the domains of the two sites with the most
    # rows without a finding have the most such test rows (a test set drawn at random would not)
    no_finding = fed.test.labels.shape[1]
    site_share = [np.mean(primary_labels(s.train.labels, "multilabel") == no_finding) for s in fed.sites]
    test_groups = primary_labels(fed.test.labels, "multilabel")
    test_share = [np.mean(test_groups[fed.test.domain == k] == no_finding) for k in range(4)]
    assert set(np.argsort(site_share)[-2:]) == set(np.argsort(test_share)[-2:])
    assert max(test_share) - min(test_share) > 0.3
    assert domain_shares(replace(sc, test_mix="sizes"), sizes).tolist() == [0.55, 0.15, 0.15, 0.15]


def test_prevalence_label_mix_reaches_the_stated_prevalence():
    sc = Scenario(
        name="prev",
        description="",
        num_sites=2,
        partition="sites",
        site_counts=(200, 600),
        site_labels=(
            SiteLabels("prevalence", prevalence=(("cardiomegaly", 0.1), ("effusion", 0.3))),
            SiteLabels(),
        ),
    )
    pool, _ = load_pool("synthcxr", num_images=1000, size=28, seed=0)
    parts = partition_indices(pool.labels, pool.task, sc, 0, pool.class_names)
    assert [len(p) for p in parts] == [200, 600] and len(np.intersect1d(*parts)) == 0  # 200 rows left unused
    prevalence = pool.labels[parts[0]].mean(axis=0)
    assert prevalence[1] == pytest.approx(0.1, abs=0.02) and prevalence[2] == pytest.approx(0.3, abs=0.02)
    bad = replace(sc, site_labels=(SiteLabels("prevalence", prevalence=(("nodules", 0.2),)), SiteLabels()))
    with pytest.raises(
        ValueError, match=r"site site-1: unknown class\(es\) \['nodules'\].*known: atelectasis"
    ):
        partition_indices(pool.labels, pool.task, bad, 0, pool.class_names)


def test_test_images_sets_the_test_set_size_and_keeps_the_pool():
    pool, test = load_pool("synthcxr", num_images=300, size=28, seed=0)
    big_pool, big_test = load_pool("synthcxr", num_images=300, size=28, seed=0, test_images=500)
    assert len(test) == 60 and len(big_test) == 500
    np.testing.assert_array_equal(pool.images, big_pool.images)
    np.testing.assert_array_equal(big_test.images[:60], test.images)  # the same patients first
    _, few = load_pool("digits", size=8, test_images=100)
    assert len(few) == 100
    with pytest.raises(ValueError, match=r"test_images=5000: dataset 'digits' has only 360 test images"):
        load_pool("digits", size=8, test_images=5000)
    with pytest.raises(ValueError, match="test_images must be a positive integer"):
        load_pool("digits", size=8, test_images=0)

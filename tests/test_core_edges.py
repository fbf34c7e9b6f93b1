"""The edges of the core math that a formula test at ordinary inputs does not reach: what each function
refuses and the boundary values it still accepts, the defaults the docs name, the exact
post-processing of a noised release, and the files a site keeps (what they hold, and that they read
back). Written against the mutants of `make mutation` that the other tests left alive
(docs/results/mutation-score/)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedweigh import schedules
from fedweigh.imbalance import (
    check_missing_rule,
    class_level_parameters,
    client_imbalance,
    client_level_parameter,
)
from fedweigh.secure.accountant import (
    AccountantState,
    dp_state_path,
    epsilon_for,
    load_accountant_state,
    save_accountant_state,
)
from fedweigh.secure.dp_config import DPConfig, StatsDPConfig
from fedweigh.secure.gaussian import (
    HistogramRelease,
    analytic_gaussian_sigma,
    classic_gaussian_sigma,
    gaussian_delta,
    gaussian_sigma,
    histogram_sensitivity,
    privatize_histogram,
)


# ----------------------------------------------------------------------------------- schedules
def test_the_deferral_point_and_the_ramp_argument_at_the_last_round():
    """t_d = rho T; (t - t_d) / (T - t_d) reaches 1 exactly at t = T, where beta is 0 for every shape."""
    for shape in schedules.RAMP_SHAPES:
        assert schedules.deferred_anneal(10, 10, 2.0, 0.3, shape, 0.7) == pytest.approx(0.0, abs=1e-12)
        # round 4 of 10 at rho 0.3: x = (4 - 3) / 7
        x = 1 / 7
        assert schedules.deferred_anneal(4, 10, 2.0, 0.3, shape, 0.7) == pytest.approx(
            2.0 * (1 - schedules.ramp(shape, x, 0.7)), rel=1e-12
        )


# ----------------------------------------------------------------------------------- imbalance
def test_imbalance_refuses_what_is_not_a_histogram():
    with pytest.raises(ValueError, match="non-empty vector"):
        client_imbalance(np.zeros((2, 2)), 4)
    with pytest.raises(ValueError, match="non-empty vector"):
        client_imbalance(np.array([]), 3)
    with pytest.raises(ValueError, match="non-negative"):
        client_imbalance(np.array([2, -1]), 5)
    with pytest.raises(ValueError, match="non-negative"):
        client_imbalance(np.array([2, 1]), -1)
    with pytest.raises(ValueError, match="^dafl: missing must be one of"):
        check_missing_rule("none")
    with pytest.raises(ValueError, match="^cbr: missing must be one of"):
        check_missing_rule("none", who="cbr")
    assert check_missing_rule("floor1") == "floor1"


def test_imbalance_accepts_one_class_and_an_empty_site():
    """C = 1 is a histogram; N_k = 0 (no samples) scores every class as missing: t = 2 max(0, C) - 1."""
    assert client_imbalance(np.array([3]), 5) == pytest.approx(2 / 3)
    assert client_imbalance(np.array([0, 0, 0]), 0) == pytest.approx(5.0)
    assert client_imbalance(np.array([0, 0]), 0, missing="floor1") == 0.0


@pytest.mark.parametrize(
    ("missing", "expected"),
    [
        ("half", ((10 - 4) / 4 + 2 * 10 - 1) / 2),
        ("eps", ((10 - 4) / (4 + 1e-6) + 10 / 1e-6) / 2),
        ("floor1", (1.5 + 10) / 2),
    ],
)
def test_the_missing_class_rules(missing, expected):
    assert client_imbalance(np.array([4, 0]), 10, missing=missing) == pytest.approx(expected, rel=1e-12)


def test_client_level_parameter_weights_by_size_and_refuses_no_samples():
    assert client_level_parameter(np.array([1, 3]), np.array([1, 3])) == pytest.approx(2.5)
    assert client_level_parameter([2.0], [1]) == pytest.approx(2.0)  # a single sample counts
    with pytest.raises(ValueError, match="total number of samples"):
        client_level_parameter(np.array([1.0, 2.0]), np.array([0, 0]))


def test_class_level_parameters_of_a_class_held_once():
    np.testing.assert_allclose(class_level_parameters(np.array([1, 0, 4]), 10), [9.0, 0.0, 1.5])


# ----------------------------------------------------------------------------------- the Gaussian mechanism
@pytest.mark.parametrize(
    ("args", "what"),
    [
        ((0.0, 1e-5, 1.0), "epsilon"),
        ((1.0, 1e-5, 1.0), "epsilon"),
        ((0.5, 0.0, 1.0), "delta"),
        ((0.5, 1.0, 1.0), "delta"),
        ((0.5, 1e-5, 0.0), "sensitivity"),
    ],
)
def test_the_classic_bound_refuses_what_it_does_not_cover(args, what):
    with pytest.raises(ValueError, match="classic_gaussian_sigma"):
        classic_gaussian_sigma(*args)


def test_the_classic_bound_just_inside_its_range():
    for eps, delta, sens in ((0.999, 0.999, 1e-3), (1e-3, 1e-9, 2.0)):
        expected = sens * math.sqrt(2 * math.log(1.25 / delta)) / eps
        assert classic_gaussian_sigma(eps, delta, sens) == pytest.approx(expected, rel=1e-12)
        assert gaussian_sigma(eps, delta, sens, "classic") == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="mechanism"):
        gaussian_sigma(0.5, 1e-5, 1.0, "laplace")


@pytest.mark.parametrize(("sigma", "sensitivity"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, -2.0)])
def test_gaussian_delta_refuses_a_non_positive_scale(sigma, sensitivity):
    with pytest.raises(ValueError, match="gaussian_delta"):
        gaussian_delta(sigma, 1.0, sensitivity)


def test_gaussian_delta_at_small_scales_and_its_limits():
    """Phi(D / 2s - e s / D) - e^e Phi(-D / 2s - e s / D) with sigma and Delta below 1; the difference
    is clipped at 0 (a huge sigma) and stays a probability for a tiny one."""
    from scipy.stats import norm

    for sigma, eps, sens in ((0.3, 0.5, 0.7), (0.8, 2.0, 0.4), (0.05, 0.1, 0.9)):
        a, b = sens / (2 * sigma), eps * sigma / sens
        assert gaussian_delta(sigma, eps, sens) == pytest.approx(
            norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b), rel=1e-9
        )
    assert gaussian_delta(1e6, 1.0, 1.0) == 0.0  # clipped at 0, never negative
    assert 0.0 < gaussian_delta(1e-3, 1.0, 1.0) <= 1.0


def test_the_analytic_sigma_refuses_what_it_does_not_cover():
    for args in ((0.0, 1e-5, 1.0), (math.inf, 1e-5, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 1.0), (1.0, 1e-5, 0.0)):
        with pytest.raises(ValueError, match="analytic_gaussian_sigma"):
            analytic_gaussian_sigma(*args)


def test_sensitivities_of_the_released_histogram():
    assert histogram_sensitivity(1, "multilabel") == pytest.approx(math.sqrt(2))
    assert histogram_sensitivity(14, "multilabel") == pytest.approx(math.sqrt(15))
    assert histogram_sensitivity(1, "multiclass") == pytest.approx(math.sqrt(2))
    with pytest.raises(ValueError, match="num_classes"):
        histogram_sensitivity(0, "multilabel")
    with pytest.raises(ValueError, match="task"):
        histogram_sensitivity(3, "regression")


def _draws(seed: int, size: int, sigma: float) -> tuple[np.ndarray, float]:
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, sigma, size=size), float(rng.normal(0.0, sigma))


@pytest.mark.parametrize("mechanism", ("analytic", "classic"))
def test_a_multilabel_release_is_the_documented_post_processing_of_counts_plus_noise(mechanism):
    """n'_i = clip(round(n_i + Z_i), 0, N'), N' = max(round(N + Z_0), 1), Z from the given generator
    (the counts' draws first, then N's), sigma for sensitivity sqrt(C + 1) under the mechanism."""
    counts = np.array([0, 3, 40, 40])
    config = StatsDPConfig(epsilon=0.5, delta=1e-5, mechanism=mechanism)
    sigma = gaussian_sigma(0.5, 1e-5, math.sqrt(5), mechanism)
    for seed in range(6):
        release = privatize_histogram(counts, 40, "multilabel", config, np.random.default_rng(seed))
        z, z0 = _draws(seed, 4, sigma)
        n = max(int(np.rint(40 + z0)), 1)
        np.testing.assert_array_equal(release.class_counts, np.clip(np.rint(counts + z), 0, n))
        assert release.num_samples == n and release.class_counts.dtype == np.int64
        assert (release.sigma, release.sensitivity, release.mechanism, release.task) == (
            sigma,
            math.sqrt(5),
            mechanism,
            "multilabel",
        )
        assert (release.epsilon, release.delta) == (0.5, 1e-5)


def test_a_multiclass_release_sums_to_its_sample_count():
    """n'_i = max(round(n_i + Z_i), 0) with sigma for sqrt(2); N' = max(sum_i n'_i, 1)."""
    counts = np.array([5, 0, 12])
    config = StatsDPConfig(epsilon=1.0)
    sigma = gaussian_sigma(1.0, 1e-5, math.sqrt(2))
    for seed in range(6):
        release = privatize_histogram(counts, 17, "multiclass", config, np.random.default_rng(seed))
        z, _ = _draws(seed, 3, sigma)
        expected = np.maximum(np.rint(counts + z), 0)
        np.testing.assert_array_equal(release.class_counts, expected)
        assert release.class_counts.dtype == np.int64
        assert release.num_samples == max(int(expected.sum()), 1)


def test_an_empty_site_releases_at_least_one_sample():
    config = StatsDPConfig(epsilon=1e4)  # sigma far below 1/2: the rounded noise is 0
    assert (
        privatize_histogram(np.zeros(3), 0, "multilabel", config, np.random.default_rng(1)).num_samples == 1
    )
    release = privatize_histogram(np.zeros(3), 0, "multiclass", config, np.random.default_rng(1))
    assert release.num_samples == 1 and not release.class_counts.any()
    counts = np.array([7, 2])
    exact = privatize_histogram(counts, 9, "multilabel", config, np.random.default_rng(2))
    np.testing.assert_array_equal(exact.class_counts, counts)  # a count of 1 or more stays
    assert exact.num_samples == 9


def test_a_release_at_the_sample_count_is_clipped_to_the_noised_count():
    """Counts equal to N_k get noise too; above the noised N' they are clipped to it."""
    config = StatsDPConfig(epsilon=0.3)
    clipped = 0
    for seed in range(20):
        release = privatize_histogram(
            np.array([50, 50, 50]), 50, "multilabel", config, np.random.default_rng(seed)
        )
        assert release.class_counts.max() <= release.num_samples
        clipped += int((release.class_counts == release.num_samples).sum())
    assert clipped > 0


@pytest.mark.parametrize(
    ("counts", "n"),
    [(np.zeros((2, 2)), 4), (np.array([]), 0), (np.array([1, -1]), 3), (np.array([1, 2]), -1)],
)
def test_privatize_refuses_what_is_not_a_histogram(counts, n):
    with pytest.raises(ValueError, match="privatize_histogram"):
        privatize_histogram(counts, n, "multilabel", StatsDPConfig(epsilon=1.0), np.random.default_rng(0))


def test_privatize_accepts_one_class_and_draws_from_the_os_without_a_generator():
    config = StatsDPConfig(epsilon=1e4)
    assert privatize_histogram(np.array([4]), 6, "multilabel", config).class_counts.tolist() == [4]
    noisy = StatsDPConfig(epsilon=0.2)
    draws = {
        tuple(privatize_histogram(np.array([30, 30]), 60, "multilabel", noisy).class_counts) for _ in range(6)
    }
    assert len(draws) > 1  # fresh noise each time
    seeded = {
        tuple(
            privatize_histogram(
                np.array([30, 30]), 60, "multilabel", noisy, np.random.default_rng(3)
            ).class_counts
        )
        for _ in range(3)
    }
    assert len(seeded) == 1  # a given generator is used, not replaced


def test_a_release_reads_back_from_its_dict():
    release = privatize_histogram(
        np.array([3, 9]),
        12,
        "multilabel",
        StatsDPConfig(epsilon=2.0, mechanism="analytic"),
        np.random.default_rng(4),
    )
    d = json.loads(json.dumps(release.as_dict()))
    assert d["class_counts"] == [int(x) for x in release.class_counts]
    assert set(d) == {
        "class_counts",
        "num_samples",
        "epsilon",
        "delta",
        "sigma",
        "sensitivity",
        "mechanism",
        "task",
    }
    back = HistogramRelease.from_dict(d)
    np.testing.assert_array_equal(back.class_counts, release.class_counts)
    assert back.class_counts.dtype == np.int64
    for field in ("num_samples", "epsilon", "delta", "sigma", "sensitivity", "mechanism", "task"):
        assert getattr(back, field) == getattr(release, field), field
        assert type(getattr(back, field)) is type(getattr(release, field)), field


# ----------------------------------------------------------------------------------- the accountant's file
def test_the_accountant_file_holds_the_account_and_reads_back(tmp_path):
    config = DPConfig(epsilon=3.0, delta=1e-6, max_grad_norm=0.7, accountant="prv")
    state = AccountantState(
        history=[(1.1, 0.02, 40), (1.3, 0.05, 5)],
        noise_multiplier=1.1,
        sample_rate=0.02,
        rounds=[{"steps": 40, "epsilon": 1.2, "mode": "fast"}],
    )
    path = dp_state_path("job/1", "site 1", tmp_path)
    assert path == tmp_path / "fedweigh_dp_sgd_job_1_site_1.json"
    save_accountant_state(path, config, "site 1", state)
    raw = json.loads(path.read_text())
    assert raw == {
        "format": 1,
        "site": "site 1",
        "accountant": "prv",
        "target_epsilon": 3.0,
        "delta": 1e-6,
        "max_grad_norm": 0.7,
        "noise_multiplier": 1.1,
        "sample_rate": 0.02,
        "history": [[1.1, 0.02, 40], [1.3, 0.05, 5]],
        "rounds": [{"steps": 40, "epsilon": 1.2, "mode": "fast"}],
    }
    back = load_accountant_state(path, config, "site 1")
    assert back == state
    assert dp_state_path("j", "s") == dp_state_path("j", "s", ".")


@pytest.mark.parametrize(
    ("other", "what"),
    [
        ({"accountant": "rdp"}, "'prv' accountant"),
        ({"delta": 1e-5}, "delta=1e-06"),
        ({"epsilon": 4.0}, "epsilon=3.0"),
    ],
)
def test_an_account_for_other_settings_is_refused_naming_the_site(tmp_path, other, what):
    config = DPConfig(epsilon=3.0, delta=1e-6, accountant="prv")
    path = tmp_path / "account.json"
    save_accountant_state(path, config, "site-a", AccountantState())
    settings = {"epsilon": 3.0, "delta": 1e-6, "accountant": "prv", **other}
    with pytest.raises(ValueError, match=what):
        load_accountant_state(path, DPConfig(**settings), "site-a")
    with pytest.raises(ValueError, match="^site: "):
        load_accountant_state(path, DPConfig(**settings))


def test_an_old_account_without_rounds_reads_back_empty(tmp_path):
    config = DPConfig(noise_multiplier=1.0)
    path = tmp_path / "account.json"
    save_accountant_state(path, config, "s", AccountantState(history=[(1.0, 0.1, 3)]))
    raw = json.loads(path.read_text())
    del raw["rounds"]
    path.write_text(json.dumps(raw))
    assert load_accountant_state(path, config).rounds == []


def test_epsilon_uses_rdp_by_default():
    history = [(1.0, 0.05, 20)]
    assert epsilon_for(history, 1e-5) == epsilon_for(history, 1e-5, "rdp")
    assert epsilon_for(history, 1e-5) != epsilon_for(history, 1e-5, "prv")
    with pytest.raises(ValueError, match="accountant"):
        epsilon_for(history, 1e-5, "gdp")


def test_a_history_grows_by_merging_only_the_latest_entry_of_the_same_settings():
    from fedweigh.secure.accountant import extend_history

    history = extend_history([], 1.1, 0.02, 30)
    history = extend_history(history, 1.3, 0.02, 10)  # other sigma: a new entry
    history = extend_history(history, 1.3, 0.02, 1)  # one more step merges into the latest
    assert history == [(1.1, 0.02, 30), (1.3, 0.02, 11)]
    assert extend_history(history, 2.0, 0.5, 0) == history  # no step: nothing added, not even an entry
    assert extend_history(history, 1.3, 0.05, 1) == [*history, (1.3, 0.05, 1)]  # other rate: a new entry
    assert extend_history(history, 1.1, 0.02, 4) == [*history, (1.1, 0.02, 4)]  # only the latest merges


def test_the_accountant_keeps_its_largest_order_warning_to_itself():
    """A history whose best Renyi order is the largest one makes Opacus warn; epsilon_for silences
    exactly that warning (its orders are kept on purpose)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = epsilon_for([(50.0, 1.0, 1)], 1e-5)
    assert value > 0
    assert not [w for w in caught if "largest alpha" in str(w.message)]


# ----------------------------------------------------------------------------------- global statistics' JSON form
def test_global_statistics_from_json_accept_the_smallest_valid_values():
    """A class without positives (count 0) and a federation of one sample are valid statistics."""
    from fedweigh.histograms import GlobalStats

    stats = GlobalStats.from_dict(
        {"class_counts": [0, 1], "num_samples": 1, "client_level_parameter": 0}, "f.json"
    )
    assert stats.class_counts.tolist() == [0, 1] and stats.class_counts.dtype == np.int64
    assert stats.num_samples == 1 and stats.client_level_parameter == 0.0


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "class_counts",
            (1, 2),
            "class_counts must be a non-empty list of integers in [0, 2^63), got (1, 2)",
        ),
        (
            "class_counts",
            [1.0, 2],
            "class_counts must be a non-empty list of integers in [0, 2^63), got [1.0, 2]",
        ),
        (
            "class_counts",
            [True, 2],
            "class_counts must be a non-empty list of integers in [0, 2^63), got [True, 2]",
        ),
        ("num_samples", 4.0, "num_samples must be an integer >= 1, got 4.0"),
        ("num_samples", True, "num_samples must be an integer >= 1, got True"),
        ("num_samples", 0, "num_samples must be an integer >= 1, got 0"),
    ],
)
def test_global_statistics_from_json_refuse_what_is_not_a_whole_count(field, value, message):
    """Counts are JSON integers (a float, a bool or a tuple is refused), named with the file."""
    from fedweigh.histograms import GlobalStats

    data = {"class_counts": [1, 2], "num_samples": 4, "client_level_parameter": 0.5, field: value}
    with pytest.raises(ValueError) as refused:
        GlobalStats.from_dict(data, "f.json")
    assert str(refused.value) == f"f.json: {message}"


def test_global_statistics_from_json_name_every_missing_field():
    from fedweigh.histograms import GlobalStats

    with pytest.raises(ValueError) as refused:
        GlobalStats.from_dict({"class_counts": [1]}, "f.json")
    assert str(refused.value) == "f.json: global statistics lack num_samples, client_level_parameter"

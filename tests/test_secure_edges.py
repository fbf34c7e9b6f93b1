"""Edges of the privacy bookkeeping: what a site's DP-SGD account file says when it cannot be used, its
layout, and the released histogram's integer counts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from fedweigh.secure.accountant import AccountantState, load_accountant_state, save_accountant_state
from fedweigh.secure.dp_config import DPConfig, StatsDPConfig
from fedweigh.secure.gaussian import HistogramRelease
from fedweigh.secure.stats_release import HistogramReleaser

CONFIG = DPConfig(epsilon=3.0, delta=1e-6, accountant="prv")


def test_an_unreadable_account_is_refused_naming_the_site_and_the_file(tmp_path):
    path = tmp_path / "account.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"^site-a: cannot read the DP-SGD accountant .*account\.json: "):
        load_accountant_state(path, CONFIG, "site-a")
    with pytest.raises(ValueError, match=r"^site-a: cannot read .*missing\.json"):
        load_accountant_state(tmp_path / "missing.json", CONFIG, "site-a")


def test_an_account_of_another_format_says_which_format_it_holds(tmp_path):
    path = tmp_path / "account.json"
    save_accountant_state(path, CONFIG, "site-a", AccountantState())
    raw = json.loads(path.read_text())
    raw["format"] = 7
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"holds a 'prv' accountant \(format 7\), the job uses 'prv'"):
        load_accountant_state(path, CONFIG, "site-a")


def test_the_account_file_is_indented_json_a_site_can_read(tmp_path):
    """One space per level, as the job's other state files: the site's IT reads its epsilon by eye."""
    path = tmp_path / "account.json"
    save_accountant_state(path, CONFIG, "site-a", AccountantState(history=[(1.1, 0.02, 4)]))
    text = path.read_text()
    assert text.startswith('{\n "format": 1,\n "site": "site-a",')
    assert '\n "history": [\n  [\n   1.1,' in text


def test_a_release_read_from_json_holds_integer_counts_whatever_the_json_wrote():
    release = HistogramRelease.from_dict(
        {
            "class_counts": [3.0, 0.0, 12.0],
            "num_samples": 15,
            "epsilon": 1.0,
            "delta": 1e-5,
            "sigma": 2.0,
            "sensitivity": 2.0,
            "mechanism": "analytic-gaussian",
            "task": "multilabel",
        }
    )
    assert release.class_counts.dtype == np.int64
    assert release.class_counts.tolist() == [3, 0, 12]


def test_a_relaunched_site_says_it_reuses_its_release_naming_site_and_job(tmp_path, caplog):

    config = StatsDPConfig(epsilon=1.0, delta=1e-5)
    counts = np.array([3, 0, 5])
    first = HistogramReleaser(config, "site-a", "job-7", folder=tmp_path).release(counts, 8, "multilabel")
    with caplog.at_level("INFO", logger="fedweigh.secure.stats_release"):
        again = HistogramReleaser(config, "site-a", "job-7", folder=tmp_path).release(counts, 8, "multilabel")
    assert again.class_counts.tolist() == first.class_counts.tolist()
    assert "site-a: reusing the label statistics released earlier in job job-7" in caplog.messages


@pytest.mark.parametrize(
    ("epsilon", "delta", "counts", "asks"),
    [
        (2.0, 1e-5, [3, 0, 5], "(epsilon=2.0, delta=1e-05, 3 classes)"),
        (1.0, 1e-6, [3, 0, 5], "(epsilon=1.0, delta=1e-06, 3 classes)"),
        (1.0, 1e-5, [3, 0, 5, 1], "(epsilon=1.0, delta=1e-05, 4 classes)"),
    ],
)
def test_a_kept_release_is_refused_when_any_one_setting_changed(tmp_path, epsilon, delta, counts, asks):
    """epsilon, delta and the number of classes are each checked on their own: one change is enough."""

    kept = StatsDPConfig(epsilon=1.0, delta=1e-5)
    HistogramReleaser(kept, "site-a", "job-7", folder=tmp_path).release(np.array([3, 0, 5]), 8, "multilabel")
    relaunched = HistogramReleaser(
        StatsDPConfig(epsilon=epsilon, delta=delta), "site-a", "job-7", folder=tmp_path
    )
    message = (
        "site-a: the statistics released earlier in job job-7 used (epsilon=1.0, delta=1e-05, 3 classes), "
        f"the job now asks for {asks}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        relaunched.release(np.array(counts), 9, "multilabel")


def test_a_first_release_uses_the_generator_given_logs_its_mechanism_and_keeps_an_indented_file(
    tmp_path, caplog
):

    config = StatsDPConfig(epsilon=1.0, delta=1e-5)
    counts = np.array([30, 0, 50, 7])
    draws = []
    for job in ("job-1", "job-2"):  # two jobs, one seed: the same draw (OS randomness would differ)
        releaser = HistogramReleaser(config, "site-a", job, folder=tmp_path)
        with caplog.at_level("INFO", logger="fedweigh.secure.stats_release"):
            draws.append(releaser.release(counts, 90, "multilabel", rng=np.random.default_rng(11)))
    assert draws[0].class_counts.tolist() == draws[1].class_counts.tolist()
    assert draws[0].num_samples == draws[1].num_samples
    drawn = releaser.drawn
    assert (
        f"site-a: label statistics noised (Gaussian, sigma={drawn.sigma:.3f}, "
        f"sensitivity={drawn.sensitivity:.3f}, epsilon=1, delta=1e-05)"
    ) in caplog.messages
    text = releaser.path.read_text()  # one space per level, as the site's other state files
    assert text.startswith('{\n "num_samples": ') and '\n "class_counts": [\n  ' in text


def test_the_site_policy_is_asked_before_the_draw_and_told_what_it_spent(tmp_path):

    calls = []

    class Guard:  # the part of fedweigh.site.policy.PrivacyGuard the releaser uses
        def check(self, *args, **kwargs):
            calls.append(("check", args, kwargs))

        def record(self, *args, **kwargs):
            calls.append(("record", args, kwargs))

    config = StatsDPConfig(epsilon=0.5, delta=1e-6)
    releaser = HistogramReleaser(config, "site-a", "job-7", folder=tmp_path, guard=Guard())
    releaser.release(np.array([3, 0, 5]), 8, "multilabel", rng=np.random.default_rng(0))
    assert calls == [
        ("check", ("statistics", 0.5), {"delta": 1e-6, "num_samples": 8}),
        ("record", ("statistics", 0.5, 1e-6), {}),
    ]


def test_epsilon_for_silences_only_opacus_largest_alpha_warning(monkeypatch):
    import warnings

    import fedweigh.secure.accountant as accountant

    class Accountant:
        history: list = []

        def get_epsilon(self, delta):
            warnings.warn(
                "Optimal order is the largest alpha. Please consider expanding the range of alphas",
                stacklevel=2,
            )
            warnings.warn("an unrelated problem worth seeing", stacklevel=2)
            return 1.5

    monkeypatch.setattr(accountant, "make_accountant", lambda name: Accountant())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert accountant.epsilon_for([(1.0, 0.1, 3)], 1e-5) == 1.5
    assert [str(w.message) for w in seen] == ["an unrelated problem worth seeing"]


def test_the_release_file_lives_in_the_working_folder_by_default():

    releaser = HistogramReleaser(StatsDPConfig(epsilon=1.0, delta=1e-5), "site-a", "job-7")
    assert releaser.path == Path(".") / "fedweigh_stats_dp_job-7_site-a.json"

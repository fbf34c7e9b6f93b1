"""The global label statistics travel typed (GlobalStats) from the statistics phase to the loss and the
scheme's client scalars; their JSON form exists only where they cross a file or NVFlare."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from fedweigh.flare.byo import global_statistics, result_meta
from fedweigh.flare.statistics import GLOBAL_STATS_FILE, keep_global_stats, load_cached_global_stats
from fedweigh.histograms import GlobalStats, global_stats_of
from fedweigh.losses import LossContext
from fedweigh.protocol import META_PLAN, META_SCALARS
from fedweigh.weighting import get_scheme
from fedweigh.weighting.base import ScalarContext

SITES = [(np.array([3, 0, 5]), 10), (np.array([1, 4, 2]), 7), (np.array([0, 2, 2]), 4)]


def test_global_stats_round_trip_through_their_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stats = global_stats_of(SITES)
    assert load_cached_global_stats("job-1") is None  # nothing kept before the phase
    path = keep_global_stats(stats, "job-1")
    assert path.name == GLOBAL_STATS_FILE.format(job_id="job-1")
    assert json.loads(path.read_text()) == stats.as_dict()
    for loaded in (load_cached_global_stats("job-1"), global_statistics("job-1")):
        assert isinstance(loaded, GlobalStats)
        np.testing.assert_array_equal(loaded.class_counts, stats.class_counts)
        assert loaded.class_counts.dtype == np.int64
        assert (loaded.num_samples, loaded.client_level_parameter) == (21, stats.client_level_parameter)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "global statistics must be a JSON object, got list"),
        ('{"class_counts": [1], "num_samples": 3}', "global statistics lack client_level_parameter"),
        (
            '{"class_counts": [1, -2], "num_samples": 3, "client_level_parameter": 0.5}',
            r"class_counts must be a non-empty list of integers in \[0, 2\^63\), got \[1, -2\]",
        ),
        (
            '{"class_counts": [1], "num_samples": 0, "client_level_parameter": 0.5}',
            "num_samples must be an integer",
        ),
        (
            '{"class_counts": [1], "num_samples": 3, "client_level_parameter": "x"}',
            "client_level_parameter must be a finite number, got 'x'",
        ),
    ],
)
def test_a_bad_statistics_file_is_one_clear_error_naming_it(tmp_path, monkeypatch, text, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / GLOBAL_STATS_FILE.format(job_id="job-2")).write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_cached_global_stats("job-2")
    assert str(info.value).startswith("fedweigh_global_stats_job-2.json: ")
    assert "\n" not in str(info.value)


def test_the_loss_and_the_scalars_read_the_typed_statistics(exact_statistics_policy):
    stats = global_stats_of(SITES)
    ctx = LossContext.of_site("multilabel", 3, np.array([3, 0, 5]), 10, global_stats=stats)
    np.testing.assert_array_equal(ctx.global_class_counts, [4, 6, 9])
    assert (ctx.global_num_samples, ctx.client_level_parameter) == (21, stats.client_level_parameter)
    assert LossContext.of_site("multilabel", 3, np.array([3, 0, 5]), 10).global_class_counts is None
    # FedDisco against the pooled histogram: a bring-your-own script may pass either form
    scheme = get_scheme("feddisco", target="global")
    expected = scheme.client_scalars(
        ScalarContext(class_counts=np.array([3, 0, 5]), num_samples=10, global_stats=stats)
    )
    plan = {"scheme": "feddisco", "scheme_args": {"target": "global"}, "scalars": ["discrepancy"]}
    task = SimpleNamespace(meta={META_PLAN: plan}, params=None)
    for given in (stats, stats.as_dict()):
        meta = result_meta(task, num_samples=10, num_steps=1, class_counts=[3, 0, 5], global_stats=given)
        assert meta[META_SCALARS] == expected
    with pytest.raises(ValueError, match="result_meta: global_stats: global statistics lack num_samples"):
        result_meta(
            task, num_samples=10, num_steps=1, class_counts=[3, 0, 5], global_stats={"class_counts": [1]}
        )

"""User scenario files (JSON / YAML): equivalence with the catalogue, one-line errors, a bench run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedweigh.bench.cells import settings_hash
from fedweigh.bench.config import make_config
from fedweigh.bench.runner import run_bench
from fedweigh.data.scenario_file import load_scenario_file
from fedweigh.data.scenarios import Scenario, build_federation, get_scenario, partition_indices
from fedweigh.data.synthcxr import sample_synthcxr_labels
from fedweigh.errors import ScenarioFileError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "scenarios"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDWEIGH_CACHE", str(tmp_path / "cache"))


def _write(tmp_path: Path, name: str, data: dict | str) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _same_federation(a, b) -> None:
    assert [s.name for s in a.sites] == [s.name for s in b.sites]
    for x, y in zip(a.sites, b.sites, strict=True):
        for split in ("train", "val"):
            np.testing.assert_array_equal(getattr(x, split).images, getattr(y, split).images)
            np.testing.assert_array_equal(getattr(x, split).labels, getattr(y, split).labels)
    np.testing.assert_array_equal(a.test.images, b.test.images)
    np.testing.assert_array_equal(a.test.labels, b.test.labels)


def test_a_json_file_like_label_a05_gives_its_partition(tmp_path):
    path = _write(tmp_path, "mine.json", {"name": "mine", "partition": "label", "alpha": 0.5, "num_sites": 4})
    mine, catalogue = load_scenario_file(path), get_scenario("label-a0.5")
    labels = sample_synthcxr_labels(1000, seed=0)
    for seed in (0, 3):
        a = partition_indices(labels, "multilabel", mine, seed)
        b = partition_indices(labels, "multilabel", catalogue, seed)
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_yaml_file_like_noisy_large_gives_its_federation(tmp_path):
    text = """
name: my-noisy
sites:
  - {share: 0.55, label_noise: 0.3}
  - {share: 0.15}
  - {share: 0.15}
  - {share: 0.15}
"""
    mine = load_scenario_file(_write(tmp_path, "my-noisy.yaml", text))
    _same_federation(
        build_federation(mine, num_images=300, size=28, seed=1),
        build_federation("noisy-large", num_images=300, size=28, seed=1),
    )


def test_the_label_shift_example_reproduces_the_removed_scenario():
    mine = load_scenario_file(EXAMPLES / "label-shift.yaml")
    former = Scenario(name="x", description="", num_sites=4, partition="label", alpha=0.5, shift=1.0)
    _same_federation(
        build_federation(mine, num_images=300, size=28, seed=0),
        build_federation(former, num_images=300, size=28, seed=0),
    )


def test_the_hospitals_example_names_its_sites_and_mixes_the_test_set_equally():
    sc = load_scenario_file(EXAMPLES / "hospitals.yaml")
    fed = build_federation(sc, num_images=400, size=28, seed=0, test_images=200)
    assert [s.name for s in fed.sites] == ["city-general", "referral-centre", "north-clinic", "south-clinic"]
    assert [len(s.train) + len(s.val) for s in fed.sites] == [200, 40, 80, 80]
    np.testing.assert_array_equal(np.bincount(fed.test.domain), [50, 50, 50, 50])
    assert fed.sites[0].train.meta["label_noise"] == 0.2 and "label_noise" not in fed.sites[1].train.meta


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            {"name": "x", "sites": [{"size": 10}, {"size": 10}, {"size": "64"}]},
            'scenario file bad.json: sites[2].size: expected a positive integer, got "64"',
        ),
        (
            {"name": "x", "sites": [{"size": 10}, {"share": 0.5}]},
            "scenario file bad.json: sites: expected every site with a size or every site with a share",
        ),
        ({"name": "x", "sites": [{"size": 10, "share": 0.5}]}, "sites[0]: expected exactly one of size"),
        (
            {"name": "iid-4", "num_sites": 2, "partition": "iid"},
            "name: expected a name that is not a catalogue",
        ),
        ({"name": "a b", "partition": "iid", "num_sites": 2}, "name: expected a name of letters, digits"),
        ({"name": "x", "partition": "labels", "num_sites": 2}, "partition: expected one of iid, quantity"),
        (
            {"name": "x", "partition": "label", "num_sites": 2},
            "alpha: expected a number in (0, inf), got None",
        ),
        (
            {"name": "x", "sites": [{"share": 1, "labels": {"alpha": -1}}]},
            "sites[0].labels.alpha: expected a number in (0, inf), got -1",
        ),
        (
            {"name": "x", "sites": [{"share": 1, "labels": "rare"}]},
            'sites[0].labels: expected pool, balanced, {alpha: A} or {prevalence: {FINDING: P, ...}}, got "rare"',
        ),
        (
            {"name": "x", "sites": [{"share": 1, "labels": {"prevalence": {"hernia": 1.5}}}]},
            "sites[0].labels.prevalence.hernia: expected a number in [0, 1], got 1.5",
        ),
        (
            {"name": "x", "sites": [{"share": 1, "label_noise": 1}]},
            "sites[0].label_noise: expected a number in [0, 1)",
        ),
        (
            {"name": "x", "sites": [{"share": 1, "shift": "blurry"}]},
            'sites[0].shift: expected a strength >= 0, "degraded"',
        ),
        (
            {"name": "x", "sites": [{"share": 1, "shift": {"contrast": 0}}]},
            "sites[0].shift.contrast: expected a number in (0, inf), got 0",
        ),
        (
            {"name": "x", "sites": [{"share": 1, "scanner": 2}]},
            "sites[0].scanner: expected a known key (name, size",
        ),
        (
            {"name": "x", "sites": [{"share": 1}, {"share": 1}], "test_mix": [1]},
            "test_mix: expected 2 shares (one per site)",
        ),
        (
            {"name": "x", "sites": [{"share": 1}], "test_mix": "random"},
            "test_mix: expected one of pool, equal, sizes",
        ),
        (
            {"name": "x", "partition": "iid", "sites": [{"size": 5}]},
            "sites[0].size: expected no size with partition 'iid'",
        ),
        ({"name": "x", "sites": [{"share": 1}], "shift": -1}, "shift: expected a number in [0, inf), got -1"),
        ("[1, 2]", "scenario file bad.json: expected a mapping of scenario fields, got [1, 2]"),
        ("{", "scenario file bad.json, line 1, column 2: not valid JSON"),
    ],
)
def test_bad_files_give_one_line_errors_naming_file_and_field(tmp_path, content, message):
    path = _write(tmp_path, "bad.json", content)
    with pytest.raises(ScenarioFileError) as err:
        load_scenario_file(path)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "bad.yaml",
            "name: x\nsites:\n  - share: 1\n   - share: 2\n",
            "scenario file bad.yaml, line 4, column 4: not valid YAML: expected <block end>, but found",
        ),
        (
            "bad.yml",
            "name: [x\n",
            "scenario file bad.yml, line 2, column 1: not valid YML: expected ',' or ']'",
        ),
        (
            "bad.json",
            '{"name": "x",\n "sites": }',
            "scenario file bad.json, line 2, column 11: not valid JSON: ",
        ),
    ],
)
def test_a_syntax_error_names_the_file_line_and_column(tmp_path, name, content, message):
    path = _write(tmp_path, name, content)
    with pytest.raises(ScenarioFileError) as err:
        load_scenario_file(path)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ScenarioFileError, match=r"scenario file .*nope.yaml: cannot be read"):
        load_scenario_file(tmp_path / "nope.yaml")


def test_a_file_scenario_runs_in_the_bench_under_its_name(tmp_path):
    path = _write(
        tmp_path,
        "two.yaml",
        "name: two-sites\nsites:\n  - {share: 0.7, label_noise: 0.2}\n  - {share: 0.3}\n",
    )
    config = make_config(
        "smoke",
        "synthcxr",
        methods=["fedavg"],
        rounds=1,
        max_steps=1,
        num_images=120,
        scenario_files=[path],
        test_images=50,
    )
    assert config.scenarios == ("two-sites",)
    result = run_bench(config, tmp_path / "out", progress=False)
    assert result.summary["scenarios"] == ["two-sites"]
    record = json.loads((tmp_path / "out" / "cells" / "two-sites__fedavg__s0.json").read_text())
    assert record["sites"] == ["site-1", "site-2"]
    with np.load(tmp_path / "out" / "cells" / "two-sites__fedavg__s0.npz") as z:
        assert len(z[z.files[0]]) in (1, 50) and 50 in z[z.files[0]].shape  # the 50-image test set
    # the file's definition is in the cell's settings: a changed file reruns the cell
    path.write_text(path.read_text().replace("0.2", "0.3"))
    changed = make_config(
        "smoke",
        "synthcxr",
        methods=["fedavg"],
        rounds=1,
        max_steps=1,
        num_images=120,
        scenario_files=[path],
        test_images=50,
    )
    assert settings_hash(changed, "two-sites", "fedavg", 0) != settings_hash(config, "two-sites", "fedavg", 0)
    named = make_config("smoke", "synthcxr", scenarios=["iid-4"], scenario_files=[path])
    assert named.scenarios == ("iid-4", "two-sites")


def test_test_images_enters_the_digest_only_when_set():
    # the digests of stored smoke cells from before test_images existed (and before the sites' statistics
    # release was the default: those cells ran with exact statistics)
    config = make_config("smoke", "synthcxr", exact_statistics=True)
    assert settings_hash(make_config("smoke", "synthcxr"), "iid-4", "fedavg", 0) != "a9ef3d233575f3a3"
    assert settings_hash(config, "iid-4", "fedavg", 0) == "a9ef3d233575f3a3"
    assert settings_hash(config, "label-a0.5", "feddraw", 0) == "1ca67f86c4abb9c6"
    bigger = replace(config, client=replace(config.client, test_images=1000))
    assert settings_hash(bigger, "iid-4", "fedavg", 0) != "a9ef3d233575f3a3"
    assert make_config("standard", "synthcxr").client.test_images == 10_000
    assert make_config("standard", "digits").client.test_images is None

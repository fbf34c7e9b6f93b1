"""A ``sites`` partition gives each site the label mix it asks for, or says which site ran short."""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import replace

import numpy as np
import pytest

from fedweigh.data import SCENARIOS, Scenario, partition_indices, primary_labels, site_mixes
from fedweigh.data.scenario_file import load_scenario_file, scenario_from_mapping
from fedweigh.data.scenarios import SiteLabels
from fedweigh.data.synthcxr import CHEST_FINDINGS, sample_synthcxr_labels
from fedweigh.errors import ScenarioShortfall

CLASSES = ("a", "b", "c")


def _pool(n: int = 1000, seed: int = 0) -> np.ndarray:
    """Multi-label rows, 56% with no finding (as SynthCXR's pool), the rest one finding each."""
    rng = np.random.default_rng(seed)
    labels = np.zeros((n, 3), dtype=np.float32)
    some = rng.permutation(n)[: n - round(0.56 * n)]
    labels[some, rng.integers(0, 3, size=len(some))] = 1
    return labels


def _skewed_first(shortfall: str = "error") -> Scenario:
    """site-1 (half the pool) takes rows without any finding only; site-2 asks for the pool's mix."""
    return Scenario(
        name="skewed-first",
        description="",
        num_sites=3,
        partition="sites",
        site_shares=(0.5, 0.3, 0.2),
        site_labels=(SiteLabels("prevalence", prevalence=(("a", 0.0), ("b", 0.0), ("c", 0.0))),)
        + (SiteLabels(),) * 2,
        shortfall=shortfall,
    )


def test_a_pool_site_after_a_label_skewed_one_gets_almost_no_no_finding_rows_and_a_warning():
    labels = _pool()
    with pytest.warns(
        UserWarning, match=r"site-2 asked for 56% no finding \(the pool's mix\) \(168 images\)"
    ):
        parts = partition_indices(labels, "multilabel", _skewed_first("warn"), 0, CLASSES)
    groups = primary_labels(labels, "multilabel")
    share = [float(np.mean(groups[p] == 3)) for p in parts]
    assert share[0] == 1.0 and share[1] < 0.2  # the case: far from the pool's 56%
    got = site_mixes(labels, "multilabel", parts, ["site-1", "site-2", "site-3"], CLASSES)
    assert got["site-2"]["images"] == 300 and got["site-2"]["mix"]["no finding"] == pytest.approx(
        share[1], abs=1e-4
    )


def test_by_default_the_shortfall_stops_with_one_line_naming_site_and_group():
    with pytest.raises(ScenarioShortfall) as e:
        partition_indices(_pool(), "multilabel", _skewed_first(), 0, CLASSES)
    message = str(e.value)
    assert "\n" not in message and e.value.field == "site-2"
    assert message.startswith(
        "scenario 'skewed-first': site-2 asked for 56% no finding (the pool's mix) (168 images)"
    )
    assert "remained after site-1" in message and "shortfall: warn" in message


def test_a_balanced_site_short_of_a_group_names_what_remains():
    labels = _pool()
    labels[:, 2] = 0  # class c: no positives left but one
    labels[0, 2] = 1
    sc = Scenario(
        name="b",
        description="",
        num_sites=2,
        partition="sites",
        site_counts=(400, 400),
        site_labels=(SiteLabels("balanced"), SiteLabels()),
    )
    with pytest.raises(
        ScenarioShortfall,
        match=r"^scenario 'b': site-1 asked for 25% c \(100 images\) but only 1 remain in the pool",
    ):
        partition_indices(labels, "multilabel", sc, 0, CLASSES)


def test_a_prevalence_site_short_of_positives_is_named():
    labels = _pool()
    sc = Scenario(
        name="p",
        description="",
        num_sites=2,
        partition="sites",
        site_counts=(300, 300),
        site_labels=(SiteLabels(), SiteLabels("prevalence", prevalence=(("a", 0.9),))),
    )
    with pytest.raises(
        ScenarioShortfall,
        match=r"site-2 asked for 90% positive for a \(270 images\) but only \d+ remain in the pool",
    ):
        partition_indices(labels, "multilabel", sc, 0, CLASSES)


def test_sites_that_fit_raise_nothing():
    labels = _pool()
    sc = replace(_skewed_first(), site_shares=(0.1, 0.3, 0.6))  # site-1 leaves enough no-finding rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parts = partition_indices(labels, "multilabel", sc, 0, CLASSES)
    assert [len(p) for p in parts] == [100, 300, 600]


#: sha1 of the partitions of the catalogue's sites scenarios (2,400 SynthCXR label rows, seeds 0-2),
#: computed before the shortfall check existed: the check must change no partition (cell caches).
PINNED = {
    ("noisy-large", 0): "84c6d42938f7d5ce",
    ("noisy-large", 1): "759135de6777bbdf",
    ("noisy-large", 2): "7e105e8c2aa20ffb",
    ("rare-small", 0): "3af23745f572443d",
    ("rare-small", 1): "18a3c03f8ff72cac",
    ("rare-small", 2): "bb22ac3515516006",
    ("degraded-large", 0): "84c6d42938f7d5ce",
    ("test-mix", 0): "744955576ee57d3c",
    ("test-mix", 1): "c7c87732bb842aa8",
    ("test-mix", 2): "490914367793c60e",
}


def test_catalogue_partitions_are_unchanged_by_the_check():
    labels = sample_synthcxr_labels(2400, seed=0)
    for (name, seed), digest in PINNED.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parts = partition_indices(labels, "multilabel", SCENARIOS[name], seed, tuple(CHEST_FINDINGS))
        got = hashlib.sha1(
            b"".join(np.asarray(p, dtype=np.int64).tobytes() + b"|" for p in parts)
        ).hexdigest()
        assert got[:16] == digest, (name, seed)


def test_catalogue_scenarios_that_cannot_realise_their_mix_say_so():
    assert SCENARIOS["rare-small"].shortfall == "warn" and SCENARIOS["test-mix"].shortfall == "warn"
    assert SCENARIOS["noisy-large"].shortfall == "error"
    labels = sample_synthcxr_labels(2400, seed=0)
    with pytest.warns(UserWarning, match="site-1 asked for 7% hernia"):
        partition_indices(labels, "multilabel", SCENARIOS["rare-small"], 0, tuple(CHEST_FINDINGS))


def test_scenario_file_shortfall_option(tmp_path):
    base = {"name": "x", "sites": [{"share": 0.5}, {"share": 0.5}]}
    assert scenario_from_mapping(base).shortfall == "error"
    assert scenario_from_mapping({**base, "shortfall": "warn"}).shortfall == "warn"
    with pytest.raises(ValueError, match='shortfall: expected one of error, warn, got "maybe"'):
        scenario_from_mapping({**base, "shortfall": "maybe"}, "f.yaml")
    path = tmp_path / "s.yaml"
    path.write_text("name: y\nshortfall: warn\nsites:\n  - share: 1.0\n")
    assert load_scenario_file(path).shortfall == "warn"


def test_shortfall_is_not_part_of_a_cells_settings(tmp_path):
    from fedweigh.bench.cells import settings_hash
    from fedweigh.bench.config import make_config

    hashes = []
    for option in ("error", "warn"):
        (tmp_path / option).mkdir()
        path = tmp_path / option / "two.yaml"
        path.write_text(f"name: two\nshortfall: {option}\nsites:\n  - share: 0.5\n  - share: 0.5\n")
        config = make_config("smoke", "synthcxr", methods=["fedavg"], scenario_files=[path], rounds=1)
        hashes.append(settings_hash(config, "two", "fedavg", 0))
    assert hashes[0] == hashes[1]


def test_a_warned_cell_records_what_each_site_got(tmp_path):
    from fedweigh.bench.config import make_config
    from fedweigh.bench.modes import run_cell

    path = tmp_path / "s.yaml"
    path.write_text(
        "name: skew\nshortfall: warn\nsites:\n"
        "  - share: 0.6\n    labels: {prevalence: {hernia: 0.5}}\n  - share: 0.4\n"
    )
    config = make_config("smoke", "synthcxr", methods=["local"], scenario_files=[path], rounds=1)
    with pytest.warns(UserWarning, match="asked for 50% positive for hernia"):
        record, _, _ = run_cell(config, "skew", "local", 0)
    got = record["realised_sites"]
    assert set(got) == {"site-1", "site-2"} and got["site-1"]["mix"].get("hernia", 0.0) < 0.5
    assert got["site-1"]["images"] > got["site-2"]["images"] > 0

"""A provisioned (or POC) site without local/fedweigh_site.json is warned about, not silently simulated."""

from __future__ import annotations

import json
import logging

from fedweigh.site.args import ClientArgs
from fedweigh.site.data_config import resolve_site_data

ARGS = ClientArgs(dataset="digits", scenario="iid-4", num_images=200)


def _kit(tmp_path, provisioned: bool):
    kit = tmp_path / "site-1"
    (kit / "startup").mkdir(parents=True)
    if provisioned:
        (kit / "startup" / "fed_client.json").write_text("{}")
    return kit


def test_a_provisioned_site_without_a_data_config_is_warned_about(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("FEDWEIGH_SITE_CONFIG", raising=False)
    monkeypatch.chdir(_kit(tmp_path, provisioned=True))
    with caplog.at_level(logging.WARNING, logger="fedweigh.site"):
        site, _, num_sites = resolve_site_data("site-1", ARGS)
    assert num_sites == 4  # the scenario's data, as before, but said
    (record,) = [r for r in caplog.records if r.name == "fedweigh.site"]
    message = record.getMessage()
    assert "site-1: a provisioned site without fedweigh_site.json" in message
    assert "scenario iid-4, dataset digits" in message


def test_the_simulator_site_is_not_warned_and_the_kits_config_is_found_from_the_job_folder(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.delenv("FEDWEIGH_SITE_CONFIG", raising=False)
    monkeypatch.chdir(_kit(tmp_path, provisioned=False))
    with caplog.at_level(logging.WARNING, logger="fedweigh.site"):
        resolve_site_data("site-1", ARGS)
    assert not [r for r in caplog.records if r.name == "fedweigh.site"]
    # a provisioned kit's local/ config is read from a job's app folder below the kit (external process)
    kit = tmp_path / "hospital"
    (kit / "startup").mkdir(parents=True)
    (kit / "startup" / "fed_client.json").write_text("{}")
    (kit / "local").mkdir()
    (kit / "local" / "fedweigh_site.json").write_text(json.dumps({"dataset": "digits", "num_images": 100}))
    app = kit / "job-1" / "app_hospital"
    app.mkdir(parents=True)
    monkeypatch.chdir(app)
    site, _, num_sites = resolve_site_data("hospital", ARGS)
    assert num_sites == 1 and len(site.train) + len(site.val) == 100

"""Smaller defences of a site: a world-writable policy file, checkpoints read from outside the job,
the server-announced budget id in file names, the HE context's trust anchor, the decrypted model's precision."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fedweigh.site.args import ClientArgs
from fedweigh.site.policy import PERMISSIVE_DEFAULT, SitePolicy


def test_a_policy_file_every_user_can_write_is_refused(tmp_path):
    path = tmp_path / "fedweigh_policy.json"
    path.write_text(json.dumps({"require_dp": True}))
    os.chmod(path, 0o644)
    assert SitePolicy.from_file(path).require_dp
    os.chmod(path, 0o666)
    with pytest.raises(PermissionError, match=r"writable by every user.*chmod o-w"):
        SitePolicy.from_file(path)


def test_pretrained_only_from_the_jobs_folder_or_the_sites_read_dirs(tmp_path, monkeypatch):
    job = tmp_path / "job-1"
    job.mkdir()
    monkeypatch.chdir(job)
    strict = SitePolicy(source="test")
    assert strict.job_refusal(ClientArgs(pretrained=str(job / "w.pt"))) is None
    refusal = strict.job_refusal(ClientArgs(pretrained="/data/other_hospital/model.pt"))
    assert "pretrained='/data/other_hospital/model.pt'" in refusal and "read_dirs=[]" in refusal
    assert strict.job_refusal(ClientArgs(pretrained="../job-2/w.pt")) is not None  # .. leaves the job
    listed = SitePolicy.from_dict({"read_dirs": ["/data/other_hospital"]}, "policy.json")
    assert listed.job_refusal(ClientArgs(pretrained="/data/other_hospital/model.pt")) is None
    assert PERMISSIVE_DEFAULT.job_refusal(ClientArgs(pretrained="/anywhere/model.pt")) is None
    with pytest.raises(ValueError, match="read_dirs must be a list of absolute folder paths"):
        SitePolicy.from_dict({"read_dirs": ["relative"]}, "policy.json")


def test_the_budget_id_cannot_name_a_folder(tmp_path, monkeypatch):
    from fedweigh.flare.statistics import global_stats_path, keep_global_stats, load_cached_global_stats
    from fedweigh.histograms import GlobalStats

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    stats = GlobalStats(class_counts=np.array([3.0, 5.0]), num_samples=8, client_level_parameter=0.5)
    written = keep_global_stats(stats, "../../etc/evil")
    assert written.resolve().parent == work.resolve() and "/" not in written.name
    assert global_stats_path("../../etc/evil") == written
    assert load_cached_global_stats("../../etc/evil").num_samples == 8
    assert not list(tmp_path.glob("*.json"))

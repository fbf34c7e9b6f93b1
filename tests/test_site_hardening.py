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


# ------------------------------------------------------------------------------ the HE context's trust anchor
def _root_ca(folder, name: str):
    """A self-signed root CA (key, PEM) as `nvflare provision` makes one."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rootCA.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key


def test_the_context_signature_is_checked_against_the_kits_own_root_ca(tmp_path, monkeypatch):
    """A context folder that brings its own rootCA.pem and signs itself with it is refused; one signed
    by the kit's root CA is used, wherever it lies."""
    from nvflare.lighter.utils import sign_folders

    from fedweigh.flare.keys import load_role_context
    from fedweigh.secure.contexts import CONTEXT_DIR_ENV, make_context, save_context_files

    site = tmp_path / "hospital-a"
    kit_key = _root_ca(site / "startup", "project-root-ca")
    (site / "startup" / "fed_client.json").write_text("{}")
    monkeypatch.chdir(site)

    forged = tmp_path / "forged"
    own_key = _root_ca(forged, "attacker-ca")  # its own rootCA.pem next to the context
    save_context_files(forged, make_context())
    (forged / "rootCA.pem").rename(tmp_path / "ca.pem")  # sign_folders signs every file in the folder
    sign_folders(str(forged), own_key, signature_file="signature.json")
    (tmp_path / "ca.pem").rename(forged / "rootCA.pem")
    monkeypatch.setenv(CONTEXT_DIR_ENV, str(forged))
    with pytest.raises(PermissionError, match="kit's root CA .*invalidSignature"):
        load_role_context("client")

    genuine = tmp_path / "genuine"
    save_context_files(genuine, make_context())
    sign_folders(str(genuine), kit_key, signature_file="signature.json")
    monkeypatch.setenv(CONTEXT_DIR_ENV, str(genuine))
    ctx, location = load_role_context("client")
    assert location.source == "env" and ctx.is_private()

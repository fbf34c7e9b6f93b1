"""A hospital's strict policy holds against a job that brings its own client script, in a provisioned
federation on loopback (the kits of provisioning/project.yml, as tests/test_poc.py runs them).

The kits come with ``local/privacy.json`` (HardenedSiteBuilder: the policy enforcer of
fedweigh.flare.policy_filter at every hospital). hospital-a adds a strict ``local/fedweigh_policy.json``
(DP-SGD required); hospital-b and hospital-c keep the default policy. Every kit turns BYOC on for its
leads, and a lead submits examples/byo_feddraw, whose own Client API script knows nothing of site
policies (one round, two sites needed). hospital-a must refuse it outside the job's code, with the
reason in its log; the server must name hospital-a and the reason, leave its result out, and aggregate
the other two hospitals only.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from poc_utils import (
    PROJECT_YML,
    REPO,
    Federation,
    allow_fedweigh,
    allow_lead_byoc,
    federation_python,
    free_ports,
    loopback_project,
    move_server_storage,
    provision,
    set_admin_message_timeout,
    site_env,
    site_python,
    wait_for_job,
    wait_for_sites,
)

from fedweigh.protocol import METRICS_JSON

SERVER = "server"
HOSPITALS = ("hospital-a", "hospital-b", "hospital-c")
STRICT = "hospital-a"
LEAD = "lead@hospital-a.org"
REASON = "the job runs its own client code"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _export_byo_job(out: Path) -> Path:
    """examples/byo_feddraw as its README exports it: one round, two sites needed."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "custom"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "job.py", "--out", str(out), "--rounds", "1", "--sites", "2"]
    subprocess.run(cmd, cwd=REPO / "examples" / "byo_feddraw", env=env, check=True, timeout=300)
    job = out / "byo_feddraw"
    assert (job / "app" / "custom" / "train.py").is_file()  # the job brings its own client script
    return job


def test_a_job_with_its_own_script_is_refused_at_a_strict_provisioned_site(tmp_path):
    import matplotlib
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    import fedweigh
    from fedweigh.flare.provision import PRIVACY_CONFIG

    start = time.monotonic()
    home = tmp_path / "home"
    home.mkdir()
    mpl_cache = matplotlib.get_cachedir()
    env, cli_env = site_env(home, hide_installed_fedweigh=True), site_env(home)
    for e in (env, cli_env):
        e["MPLCONFIGDIR"] = mpl_cache
    fed_learn_port, admin_port = free_ports(2)
    project = tmp_path / "project.yml"
    loopback_project(PROJECT_YML, project, fed_learn_port, admin_port)
    prod = provision(project, tmp_path / "provisioning", cli_env)
    move_server_storage(prod / SERVER / "local", tmp_path / "server_storage")
    set_admin_message_timeout(prod / LEAD, 60.0)
    for site in HOSPITALS:  # what provisioning gave every hospital: the enforcer, outside any job
        assert json.loads((prod / site / "local" / "privacy.json").read_text()) == PRIVACY_CONFIG
    policy_file = prod / STRICT / "local" / "fedweigh_policy.json"
    policy_file.write_text(json.dumps({"require_dp": True}))
    for kit in (SERVER, *HOSPITALS):
        allow_lead_byoc(prod / kit)
        allow_fedweigh(prod / kit)
    job = _export_byo_job(tmp_path / "jobs")

    python = federation_python(tmp_path / "python", Path(fedweigh.__file__).resolve().parents[1])
    fed = Federation(prod, SERVER, list(HOSPITALS), env, site_python(True, python), tmp_path / "logs")
    session = None
    try:
        fed.start()
        session = new_secure_session(LEAD, str(prod / LEAD), timeout=60)
        wait_for_sites(session, list(HOSPITALS), fed)
        job_id = session.submit_job(str(job))
        meta = wait_for_job(session, job_id, fed, timeout=300)
        result = Path(session.download_job_result(job_id))
    finally:
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()
        fed.stop()
        print(f"wall time {time.monotonic() - start:.0f} s")
    assert not fed.still_running()

    site_logs = {s: (prod / s / job_id / "log.txt").read_text(errors="replace") for s in HOSPITALS}
    server_log = (result / "workspace" / "log.txt").read_text(errors="replace")
    # the strict hospital refused the job outside its code, naming why and the policy it applied
    assert f"{STRICT} refuses this job: {REASON}" in site_logs[STRICT], site_logs[STRICT][-4000:]
    assert f"site policy: {policy_file}" in site_logs[STRICT]
    for site in HOSPITALS[1:]:  # the default policy lets the job run
        assert "refuses this job" not in site_logs[site], site
    # the server names the hospital and its reason, and leaves its result out of the round
    assert f"{STRICT} refuses this job under its site policy: {REASON}" in server_log, server_log[-4000:]
    assert f"skipping result: {STRICT} refused under its site policy" in server_log
    rows = json.loads((result / "workspace" / "app_server" / METRICS_JSON).read_text())["rounds"]
    weights = next(r for r in rows if r["round"] == 1)["weights"]
    assert sorted(weights) == ["hospital-b", "hospital-c"], weights
    assert meta["status"] == "FINISHED:COMPLETED", meta

"""provisioning/project.yml gives no role bring-your-own-code and puts the site-policy enforcement in
every hospital kit's local/privacy.json (fedweigh.flare.provision.HardenedSiteBuilder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from poc_utils import allow_fedweigh

from fedweigh.flare.provision import SITE_AUTHORIZER

REPO = Path(__file__).resolve().parents[1]


def test_the_shipped_project_gives_no_role_byoc_and_every_hospital_the_enforcer(tmp_path):
    workspace = tmp_path / "prov"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "custom"), os.environ.get("PYTHONPATH", "")]),
    }
    nvflare = Path(sys.executable).with_name("nvflare")
    cmd = [str(nvflare), "provision", "-p", str(REPO / "provisioning" / "project.yml"), "-w", str(workspace)]
    subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    project = yaml.safe_load((REPO / "provisioning" / "project.yml").read_text())
    prod = workspace / project["name"] / "prod_00"
    kits = [p["name"] for p in project["participants"] if p["type"] in ("server", "client")]
    hospitals = [p["name"] for p in project["participants"] if p["type"] == "client"]
    assert hospitals
    for kit in kits:
        authz = json.loads((prod / kit / "local" / "authorization.json.default").read_text())["permissions"]
        assert all(isinstance(r, dict) for r in authz.values()), authz  # "any" would include byoc
        assert {role: rights.get("byoc") for role, rights in authz.items()} == {
            "project_admin": "none",
            "org_admin": "none",
            "lead": "none",
            "member": "none",
        }
        assert authz["lead"]["submit_job"] == "any"  # leads still submit jobs without code
    for hospital in hospitals:
        privacy = json.loads((prod / hospital / "local" / "privacy.json").read_text())
        paths = [c["path"] for c in privacy["components"]]
        assert paths == ["fedweigh.flare.policy_filter.SitePolicyEnforcer"]
        assert privacy["default_scope"] == "fedweigh"
        # the kit starts before fedweigh is installed: the parent-process authorizer arrives with the
        # allow-list (provisioning/allow_fedweigh.py), as the site's app deployer after the job launcher
        default = (prod / hospital / "local" / "resources.json.default").read_text()
        assert "fedweigh" not in default
        allow_fedweigh(prod / hospital)
        components = json.loads((prod / hospital / "local" / "resources.json").read_text())["components"]
        ids = [c["id"] for c in components]
        assert components[-1] == SITE_AUTHORIZER
        assert ids.index("process_launcher") < len(ids) - 1
    for server in (p["name"] for p in project["participants"] if p["type"] == "server"):
        allow_fedweigh(prod / server)
        text = (prod / server / "local" / "resources.json").read_text()
        assert "JobPolicyAuthorizer" not in text


def test_hardened_authz_removes_byoc_only():
    from fedweigh.flare.provision import hardened_authz

    default = {
        "format_version": "1.0",
        "permissions": {
            "project_admin": "any",
            "lead": {"submit_job": "any", "byoc": "any", "view": "any"},
            "member": {"view": "any"},
        },
    }
    out = hardened_authz(default)["permissions"]
    assert out["project_admin"] == {"byoc": "none", "submit_job": "any", "view": "any"}
    assert out["lead"] == {"submit_job": "any", "byoc": "none", "view": "any"}
    assert out["member"] == {"view": "any", "byoc": "none"}
    assert default["permissions"]["lead"]["byoc"] == "any"  # the input is left as it was

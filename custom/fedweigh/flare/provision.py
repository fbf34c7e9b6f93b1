"""A provisioning builder for hospitals: no role may submit code, and every site enforces its policy.

``provisioning/project.yml`` lists :class:`HardenedSiteBuilder` after NVFlare's ``StaticFileBuilder``
inputs are set (any position after ``WorkspaceBuilder``). It changes two things in the kits that
``nvflare provision`` writes:

- ``local/authorization.json.default`` of the server and of every site: NVFlare's default policy
  with the ``byoc`` right set to ``none`` for every role, ``project_admin`` included (the default gives
  it to ``project_admin`` and ``lead``). A job with a ``custom/`` folder (bring-your-own-code) is then
  refused by the server and by every site; jobs without code (``fedweigh jobs export --site-installed``)
  run only components the site allow-lists (``provisioning/resources.json``).
- nothing in ``local/resources.json.default``: a kit must start before fedweigh is installed at the
  site. :data:`SITE_AUTHORIZER`, fedweigh's :class:`~fedweigh.flare.site_authorizer.JobPolicyAuthorizer`
  as the site's ``app_deployer`` (in the site's parent process, where no job code runs, it judges every
  deployed job against the hospital's ``local/fedweigh_policy.json``; a refused job never launches
  there), arrives with fedweigh's allow-list: ``provisioning/allow_fedweigh.py`` adds both to the
  site's ``local/resources.json``, read when the site starts.
- ``local/privacy.json`` of every site: the in-job second line of :mod:`fedweigh.flare.policy_filter`
  (a component judging every job and task, and a privacy scope's task result filter). It runs in the
  job's own process, so it holds for jobs without code, not for a job that brings its own (BYOC).

A hospital that wants BYOC for some role edits its own ``local/authorization.json``
(docs/deploy.md says what it then gives away).
"""

from __future__ import annotations

import json
from pathlib import Path

from nvflare.lighter.constants import CtxKey, PropKey
from nvflare.lighter.ctx import ProvisionContext
from nvflare.lighter.entity import Project
from nvflare.lighter.spec import Builder

from fedweigh.io import atomic_write_json

__all__ = [
    "AUTHZ_SECTION",
    "SITE_AUTHORIZER",
    "DEFAULT_AUTHZ_SECTION",
    "PRIVACY_CONFIG",
    "HardenedSiteBuilder",
    "hardened_authz",
]

#: The template section the builder adds (NVFlare's is ``default_authz``).
AUTHZ_SECTION = "fedweigh_authz"
DEFAULT_AUTHZ_SECTION = "default_authz"

#: A site's ``local/privacy.json``: the policy enforcer for every job, and a default scope whose task
#: result filter applies the policy where NVFlare applies scope filters (deployments, not the simulator).
PRIVACY_CONFIG: dict = {
    "scopes": [
        {
            "name": "fedweigh",
            "task_result_filters": [
                {"path": "fedweigh.flare.policy_filter.SitePolicyResultFilter", "args": {}}
            ],
        }
    ],
    "default_scope": "fedweigh",
    "components": [
        {"id": "fedweigh_policy", "path": "fedweigh.flare.policy_filter.SitePolicyEnforcer", "args": {}}
    ],
}


#: The parent-process component a site's ``local/resources.json`` gets with fedweigh's allow-list (its
#: ``app_deployer``; ``provisioning/resources.json`` lists it under ``site_components``).
SITE_AUTHORIZER: dict = {
    "id": "app_deployer",
    "path": "fedweigh.flare.site_authorizer.JobPolicyAuthorizer",
    "args": {},
}


def hardened_authz(default: dict) -> dict:
    """NVFlare's authorization policy ``default`` with ``byoc`` set to ``none`` for every role."""
    policy = json.loads(json.dumps(default))
    permissions = policy["permissions"]
    rights = sorted({right for value in permissions.values() if isinstance(value, dict) for right in value})
    for role, value in permissions.items():
        if value == "any":  # project_admin: every right, spelled out, but bring-your-own-code
            value = {right: "any" for right in rights}
        if isinstance(value, dict):
            value["byoc"] = "none"
        permissions[role] = value
    return policy


class HardenedSiteBuilder(Builder):
    """No role gets BYOC; every site gets the in-job enforcement (module docstring)."""

    def initialize(self, project: Project, ctx: ProvisionContext) -> None:
        default = ctx.json_load_template_section(DEFAULT_AUTHZ_SECTION)  # loaded by WorkspaceBuilder
        ctx[CtxKey.TEMPLATE][AUTHZ_SECTION] = json.dumps(hardened_authz(default), indent=2)
        for participant in [project.get_server(), *project.get_clients()]:
            if participant is not None:
                participant.set_prop(PropKey.AUTHZ_SECTION_KEY, AUTHZ_SECTION)

    def build(self, project: Project, ctx: ProvisionContext) -> None:
        for client in project.get_clients():
            local = Path(ctx.get_local_dir(client))
            atomic_write_json(local / "privacy.json", PRIVACY_CONFIG, indent=2, private=False)

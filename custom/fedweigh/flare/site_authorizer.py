"""The site's policy judged in the site's parent process, before a job launches and where no job code runs.

NVFlare 2.9 runs a site as a parent process (the client daemon, ``ClientEngine``) that receives a
job's apps, deploys them into the site's workspace and launches one job process per job. Components
listed in the site's ``local/resources.json`` are built in that parent process, from the site's own
kit; no job can change them, and no job code runs there. :class:`JobPolicyAuthorizer` is such a
component, and acts at the two points NVFlare gives the parent:

- deployment: listed under the id ``app_deployer`` it is the site's app deployer
  (``SystemComponents.APP_DEPLOYER``, read by ``ClientEngine.deploy_app``). It deploys the app with
  NVFlare's own ``AppDeployer`` (privacy scope, signature and BYOC authorization checks), then judges
  the deployed app with :func:`fedweigh.flare.policy_filter.job_code_refusal` (the client configuration
  as NVFlare resolves it, failing closed). A refused job's run folder is removed and the deployment
  fails with the reason: the server reports the site's refusal, and the job never starts there.
- launch: on ``EventType.BEFORE_JOB_LAUNCH`` (fired by ``JobExecutor.start_app`` through
  ``get_job_launcher`` with the job deployed) it judges the deployed app again and, when the policy
  refuses it, makes the launch fail: the job's launcher is replaced by one that raises the reason, so
  no job process starts. List the component after the site's job launcher (``process_launcher``); listed
  before it, the launch still fails (NVFlare refuses two launchers), with a less telling message.

A site's ``local/resources.json`` ``"components"`` entry::

    {"id": "app_deployer", "path": "fedweigh.flare.site_authorizer.JobPolicyAuthorizer", "args": {}}

The policy is the site's ``local/fedweigh_policy.json`` (or ``FEDWEIGH_SITE_POLICY``), or the file
named by ``policy_file``. A policy file that cannot be read refuses every job (fail closed).
"""

from __future__ import annotations

import shutil

from nvflare.apis.app_deployer_spec import AppDeployerSpec
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.job_def import JobMetaKey
from nvflare.apis.job_launcher_spec import JobHandleSpec, JobLauncherSpec
from nvflare.apis.server_engine_spec import ServerEngineSpec
from nvflare.apis.workspace import Workspace
from nvflare.private.fed.utils.app_deployer import AppDeployer

from fedweigh.flare.policy_filter import job_code_refusal
from fedweigh.site.policy import SitePolicy, load_site_policy

__all__ = ["JobPolicyAuthorizer", "RefusedJobLauncher"]


class RefusedJobLauncher(JobLauncherSpec):
    """The launcher of a job the site refuses: launching it raises the reason, so no process starts."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    def launch_job(self, job_meta: dict, fl_ctx: FLContext) -> JobHandleSpec:
        raise RuntimeError(
            f"the site's policy refuses job {job_meta.get(JobMetaKey.JOB_ID.value)}: {self.reason}"
        )


class JobPolicyAuthorizer(FLComponent, AppDeployerSpec):
    """Judges every job deployed at the site before it launches, in the parent process (module docstring).

    Args:
        policy_file: the policy file (default: the site kit's ``local/fedweigh_policy.json`` or
            ``FEDWEIGH_SITE_POLICY``, where fedweigh's client looks).
    """

    def __init__(self, policy_file: str | None = None) -> None:
        super().__init__()
        self.policy_file = policy_file
        self._deployer = AppDeployer()

    def _policy(self, workspace_root: str) -> SitePolicy:
        # read at every judgement: a hospital that tightens its policy needs no restart
        if self.policy_file:
            return SitePolicy.from_file(self.policy_file)
        return load_site_policy(workspace_root)

    def refusal(self, workspace: Workspace, job_id: str) -> str | None:
        """Why the site's policy refuses the job ``job_id`` deployed in ``workspace``, or None (fails closed)."""
        try:
            policy = self._policy(workspace.get_root_dir())
        except Exception as e:  # noqa: BLE001 - a policy the site cannot read refuses every job
            return f"the site's policy cannot be read ({type(e).__name__}: {e})"
        return job_code_refusal(
            policy,
            workspace.get_app_dir(job_id),
            site_name=workspace.site_name,
            job_id=job_id,
            workspace_root=workspace.get_root_dir(),
        )

    def deploy(
        self,
        workspace: Workspace,
        job_id: str,
        job_meta: dict,
        app_name: str,
        app_data: bytes,
        fl_ctx: FLContext,
    ) -> str:
        """Deploy with NVFlare's ``AppDeployer``, then refuse (remove the run folder, return the reason)
        a job the site's policy refuses. Returns an error message, or "" when deployed."""
        err = self._deployer.deploy(
            workspace=workspace,
            job_id=job_id,
            job_meta=job_meta,
            app_name=app_name,
            app_data=app_data,
            fl_ctx=fl_ctx,
        )
        if err:
            return err
        try:
            reason = self.refusal(workspace, job_id)
        except Exception as e:  # noqa: BLE001 - fail closed
            reason = f"the job cannot be judged ({type(e).__name__}: {e})"
        if not reason:
            return ""
        shutil.rmtree(workspace.get_run_dir(job_id), ignore_errors=True)
        message = f"{workspace.site_name} refuses job {job_id}: {reason}"
        self.log_error(fl_ctx, message)
        return message

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type != EventType.BEFORE_JOB_LAUNCH or isinstance(fl_ctx.get_engine(), ServerEngineSpec):
            return
        job_id = "?"
        try:
            job_meta = fl_ctx.get_prop(FLContextKey.JOB_META) or {}
            job_id = str(job_meta[JobMetaKey.JOB_ID.value])
            workspace = fl_ctx.get_prop(FLContextKey.WORKSPACE_OBJECT)
            if not isinstance(workspace, Workspace):
                workspace = Workspace(
                    str(fl_ctx.get_prop(FLContextKey.WORKSPACE_ROOT)), fl_ctx.get_identity_name()
                )
            reason = self.refusal(workspace, job_id)
        except Exception as e:  # noqa: BLE001 - fail closed: a job the site cannot judge does not launch
            reason = f"the job cannot be judged ({type(e).__name__}: {e})"
        if reason:
            self.log_error(
                fl_ctx, f"{fl_ctx.get_identity_name()} refuses job {job_id}, which will not launch: {reason}"
            )
            fl_ctx.set_prop(
                FLContextKey.JOB_LAUNCHER, [RefusedJobLauncher(reason)], private=True, sticky=False
            )

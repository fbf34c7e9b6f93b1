"""The site's privacy policy enforced by NVFlare at the site, outside the job's code.

fedweigh's own client script applies the site policy (:mod:`fedweigh.site.policy`) itself, which holds
only while the job runs that script unmodified. A job that brings its own client code (a bring-your-
own script, a MONAI Bundle client, a changed ``custom/fedweigh_client.py``) runs whatever it brings.
The components here are configured by the hospital in its own kit, ``local/privacy.json``, which NVFlare
reads for every job at the site and no job can change:

- :class:`SitePolicyEnforcer`, an NVFlare component (``"components"`` of ``privacy.json``; NVFlare
  adds it to every job's client app). At the start of a job it reads the job's client configuration
  as deployed at the site and refuses the job when

  * the job asks for less than the policy (DP settings, ``pretrained`` folder, ...) in the arguments
    of fedweigh's site-installed executor (:meth:`SitePolicy.job_refusal`), or
  * the policy requires DP-SGD or statistics DP and the job runs code the site did not install (any
    ``custom/`` folder, any executor other than
    :class:`~fedweigh.flare.site_executor.InstalledClientExecutor`): such code cannot show that it
    adds the noise, so the site cannot take its word for it.

  Before each task it judges the task as fedweigh's client does (statistics mode, encryption,
  scalars; :func:`fedweigh.flare.client.task_refusal`). After each task it replaces the result of a
  refused job or task with a refusal that carries only the reason (``fedweigh_refused``: the server
  names the site and the reason and leaves it out), and strips from any other result the scalars the
  policy does not let leave.

- :class:`SitePolicyResultFilter`, the same job judgement, replacement and stripping as an NVFlare
  task result filter (it does not see the task, so it cannot judge it), for a privacy scope's ``task_result_filters`` (NVFlare applies a site's scope filters before
  the job's own; ``nvflare simulator`` applies none, the component above works everywhere).

A hospital's ``local/privacy.json``::

    {
      "scopes": [{"name": "fedweigh", "task_result_filters": [
          {"path": "fedweigh.flare.policy_filter.SitePolicyResultFilter", "args": {}}]}],
      "default_scope": "fedweigh",
      "components": [{"id": "fedweigh_policy",
                      "path": "fedweigh.flare.policy_filter.SitePolicyEnforcer", "args": {}}]
    }

Both read the site's policy where fedweigh's client does (``local/fedweigh_policy.json`` of the site's
kit, or ``FEDWEIGH_SITE_POLICY``), or the file named by their ``policy_file`` argument.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.filter import Filter
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.server_engine_spec import ServerEngineSpec
from nvflare.apis.shareable import ReservedHeaderKey, Shareable

from fedweigh.flare.client import task_refusal
from fedweigh.flare.jobs import CLIENT_CONFIG, CONFIG_FOLDER, CUSTOM_FOLDER, INSTALLED_EXECUTOR
from fedweigh.protocol import META_HE, META_PLAN, META_REFUSED, META_REFUSED_JOB, META_SCALARS, TASK_STATS
from fedweigh.site.args import parse_args
from fedweigh.site.policy import SitePolicy, load_site_policy

__all__ = [
    "SitePolicyEnforcer",
    "SitePolicyResultFilter",
    "job_code_refusal",
    "refusal_shareable",
    "strip_result",
]


def _executors(config: dict) -> list[dict]:
    return [entry.get("executor", {}) for entry in config.get("executors", []) if isinstance(entry, dict)]


def job_code_refusal(policy: SitePolicy, app_dir: str | Path) -> str | None:
    """Why the site refuses the job whose client app is deployed in ``app_dir``, or None (module docstring)."""
    app_dir = Path(app_dir)
    config_path = app_dir / CONFIG_FOLDER / CLIENT_CONFIG
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        return f"the job's client configuration {config_path} cannot be read ({e}) (site policy: {policy.source})"
    executors = _executors(config)
    custom = app_dir / CUSTOM_FOLDER
    brings_code = (custom.is_dir() and any(custom.iterdir())) or any(
        e.get("path") != INSTALLED_EXECUTOR for e in executors
    )
    if brings_code and (policy.require_dp or policy.require_statistics_dp):
        needs = [
            n
            for n, on in (("DP-SGD", policy.require_dp), ("statistics DP", policy.require_statistics_dp))
            if on
        ]
        return (
            f"the job runs its own client code ({'custom/ folder' if custom.is_dir() else 'executor'} "
            f"{[e.get('path') for e in executors]}), which cannot show that it applies {' and '.join(needs)}; "
            f"this site requires it and accepts such jobs only with fedweigh's site-installed executor "
            f"(site policy: {policy.source})"
        )
    for executor in executors:
        if executor.get("path") == INSTALLED_EXECUTOR:
            argv = shlex.split(str((executor.get("args") or {}).get("task_script_args", "")))
            try:
                args = parse_args(argv)
            except (SystemExit, ValueError) as e:
                return f"the job's client arguments {argv} are not valid ({e}) (site policy: {policy.source})"
            reason = policy.job_refusal(args)
            if reason:
                return reason
    return None


def refusal_shareable(reason: str, whole_job: bool = True) -> Shareable:
    """A task result that carries no data, only the policy's reason (what fedweigh's client sends)."""
    dxo = DXO(
        data_kind="METRICS",
        data={"fedweigh_refused": 1.0},
        meta={META_REFUSED: reason, META_REFUSED_JOB: whole_job},
    )
    shareable = dxo.to_shareable()
    shareable.set_return_code(ReturnCode.OK)
    return shareable


def strip_result(policy: SitePolicy, result: Shareable) -> list[str]:
    """Remove in place what ``policy`` does not let leave the site: scalars outside ``report_scalars``.
    Returns what was removed."""
    try:
        dxo = from_shareable(result)
    except Exception:  # noqa: BLE001 - no DXO (an error reply): nothing to strip
        return []
    scalars = dxo.meta.get(META_SCALARS)
    if not isinstance(scalars, dict):
        return []
    removed = sorted(str(k) for k in scalars if k not in policy.report_scalars)
    if removed:
        dxo.meta[META_SCALARS] = {k: v for k, v in scalars.items() if k in policy.report_scalars}
        replaced = dxo.update_shareable(result)
        if replaced is not result:  # pragma: no cover - update_shareable works in place
            result.update(replaced)
    return removed


def _replace(result: Shareable, reason: str, whole_job: bool) -> None:
    """Replace ``result`` in place (the object the client runner goes on to filter and send)."""
    headers = {k: result.get_header(k) for k in (ReservedHeaderKey.TASK_NAME, ReservedHeaderKey.TASK_ID)}
    result.clear()
    result.update(refusal_shareable(reason, whole_job))
    for key, value in headers.items():
        if value is not None:
            result.set_header(key, value)


class _PolicyReader:
    def __init__(self, policy_file: str | None) -> None:
        self.policy_file = policy_file
        self._policy: SitePolicy | None = None

    def policy(self, fl_ctx: FLContext) -> SitePolicy:
        if self._policy is None:
            if self.policy_file:
                self._policy = SitePolicy.from_file(self.policy_file)
            else:
                workspace = fl_ctx.get_engine().get_workspace()
                self._policy = load_site_policy(workspace.get_root_dir())
        return self._policy


class SitePolicyEnforcer(FLComponent):
    """The site policy applied around every task of every job (module docstring).

    Args:
        policy_file: the policy file (default: where fedweigh's client looks, from the site's kit).
    """

    def __init__(self, policy_file: str | None = None) -> None:
        super().__init__()
        self._reader = _PolicyReader(policy_file)
        self.job_refusal: str | None = None
        self.task_refusal: str | None = None

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if isinstance(fl_ctx.get_engine(), ServerEngineSpec):  # a server reading the same privacy.json
            return
        if event_type == EventType.START_RUN:
            self._judge_job(fl_ctx)
        elif event_type == EventType.BEFORE_TASK_DATA_FILTER:
            self._judge_task(fl_ctx)
        elif event_type == EventType.BEFORE_TASK_RESULT_FILTER:
            result = fl_ctx.get_prop(FLContextKey.TASK_RESULT)
            if isinstance(result, Shareable):
                self._enforce(result, fl_ctx)

    def _judge_job(self, fl_ctx: FLContext) -> None:
        policy = self._reader.policy(fl_ctx)
        workspace = fl_ctx.get_engine().get_workspace()
        app_dir = fl_ctx.get_prop(FLContextKey.APP_ROOT) or workspace.get_app_dir(fl_ctx.get_job_id())
        self.job_refusal = job_code_refusal(policy, app_dir)
        if self.job_refusal:
            self.log_error(fl_ctx, f"{fl_ctx.get_identity_name()} refuses this job: {self.job_refusal}")

    def _judge_task(self, fl_ctx: FLContext) -> None:
        self.task_refusal = None
        if self.job_refusal:
            return
        data = fl_ctx.get_prop(FLContextKey.TASK_DATA)
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME) or ""
        try:
            meta = dict(from_shareable(data).meta) if isinstance(data, Shareable) else {}
        except Exception:  # noqa: BLE001 - a task without a DXO carries no plan to judge
            meta = {}
        plan = meta.get(META_PLAN) or {}
        he_meta = meta.get(META_HE) if task != TASK_STATS else None
        policy = self._reader.policy(fl_ctx)
        self.task_refusal = task_refusal(policy, task, meta, plan if isinstance(plan, dict) else {}, he_meta)
        if self.task_refusal:
            self.log_error(fl_ctx, f"{fl_ctx.get_identity_name()} refuses this job: {self.task_refusal}")
            self.job_refusal = self.task_refusal  # as fedweigh's client: once refused, every later task is

    def _enforce(self, result: Shareable, fl_ctx: FLContext) -> None:
        reason = self.job_refusal or self.task_refusal
        if reason:
            _replace(result, reason, whole_job=True)
            return
        removed = strip_result(self._reader.policy(fl_ctx), result)
        if removed:
            self.log_warning(
                fl_ctx, f"removed the scalar(s) {removed} from the result: not in report_scalars"
            )


class SitePolicyResultFilter(Filter):
    """The site policy on every task result, as a privacy scope's task result filter (module docstring).

    Args:
        policy_file: the policy file (default: where fedweigh's client looks, from the site's kit).
    """

    def __init__(self, policy_file: str | None = None) -> None:
        super().__init__()
        self._reader = _PolicyReader(policy_file)
        self._job_refusals: dict[str, str | None] = {}

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if isinstance(fl_ctx.get_engine(), ServerEngineSpec):  # a server reading the same privacy.json
            return shareable
        policy = self._reader.policy(fl_ctx)
        job_id = str(fl_ctx.get_job_id())
        if job_id not in self._job_refusals:
            app_dir = fl_ctx.get_prop(FLContextKey.APP_ROOT)
            self._job_refusals[job_id] = job_code_refusal(policy, app_dir) if app_dir else None
        reason = self._job_refusals[job_id]
        if reason:
            self.log_error(fl_ctx, f"{fl_ctx.get_identity_name()} refuses this job: {reason}")
            return refusal_shareable(reason)
        removed = strip_result(policy, shareable)
        if removed:
            self.log_warning(
                fl_ctx, f"removed the scalar(s) {removed} from the result: not in report_scalars"
            )
        return shareable

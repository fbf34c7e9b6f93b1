"""The site's privacy policy judged by NVFlare at the site: the in-job line and the shared judgement.

fedweigh's own client script applies the site policy (:mod:`fedweigh.site.policy`) itself, which holds
only while the job runs that script unmodified. A job that brings its own client code (a bring-your-
own script, a MONAI Bundle client, a changed ``custom/fedweigh_client.py``) runs whatever it brings.

The first line is in the site's parent process, where no job code runs:
:class:`fedweigh.flare.site_authorizer.JobPolicyAuthorizer` (``local/resources.json``) judges every
deployed job with :func:`job_code_refusal` and stops a refused job before it launches. The components
here are the second line, inside the job's own process (``local/privacy.json``, which NVFlare reads
for every job at the site and adds to its client app); a job with its own code (BYOC) runs in the
same process and can undo what they do, so they hold only for jobs without code:

- :func:`job_code_refusal`: the job's client configuration judged as NVFlare resolves it (its own
  configurator: ``{var}`` references, ``@`` items, system variables), failing closed. With
  ``require_dp`` or ``require_statistics_dp`` only fedweigh's site-installed executor
  (:class:`~fedweigh.flare.site_executor.InstalledClientExecutor`, arguments the policy accepts) and
  :data:`INERT_COMPONENTS` pass, and no ``custom/`` folder; otherwise every installed executor the job
  declares is judged by its arguments (:meth:`SitePolicy.job_refusal`).
- :class:`SitePolicyEnforcer`, an NVFlare component (``"components"`` of ``privacy.json``). At the
  start of a job it applies :func:`job_code_refusal`; before each task it judges the task as
  fedweigh's client does (statistics mode, encryption, scalars; :func:`fedweigh.flare.client.task_refusal`).
  After each task it replaces the result of a refused job or task with a refusal that carries only the
  reason (``fedweigh_refused``: the server names the site and the reason and leaves it out), and
  strips from any other result the scalars the policy does not let leave (:func:`strip_result`:
  every meta key, nested DXO, METRICS data and header).
- :class:`SitePolicyResultFilter`, the same job judgement, replacement and stripping as an NVFlare
  task result filter (it does not see the task, so it cannot judge it), for a privacy scope's
  ``task_result_filters`` (NVFlare applies a site's scope filters before the job's own; ``nvflare
  simulator`` applies none, the component above works everywhere).

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

import copy
import shlex
from pathlib import Path
from types import SimpleNamespace

from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.filter import Filter
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.server_engine_spec import ServerEngineSpec
from nvflare.apis.shareable import ReservedHeaderKey, Shareable
from nvflare.fuel.utils.json_scanner import Node
from nvflare.private.fed.client.client_json_config import ClientJsonConfigurator
from nvflare.private.fed_json_config import FedJsonConfigurator
from nvflare.private.json_configer import ConfigContext, ConfigError

from fedweigh.flare.client import task_refusal
from fedweigh.flare.jobs import (
    CLIENT_CONFIG,
    CONFIG_FOLDER,
    CUSTOM_FOLDER,
    INSTALLED_EXECUTOR,
    INSTALLED_EXECUTOR_ARGS,
)
from fedweigh.protocol import META_HE, META_PLAN, META_REFUSED, META_REFUSED_JOB, META_SCALARS, TASK_STATS
from fedweigh.site.args import parse_args
from fedweigh.site.policy import SitePolicy, load_site_policy
from fedweigh.weighting.base import KNOWN_SCALARS

__all__ = [
    "INERT_COMPONENTS",
    "SitePolicyEnforcer",
    "SitePolicyResultFilter",
    "job_code_refusal",
    "refusal_shareable",
    "resolved_components",
    "strip_result",
]


#: NVFlare classes a job without code may declare beside fedweigh's executor at a site whose policy
#: requires DP: they only forward events and hold no task data (fedweigh's own jobs declare this one).
INERT_COMPONENTS: frozenset[str] = frozenset(
    {"nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent"}
)


class _Declared:
    """Stands in for every component the job declares: the judge builds nothing, so no job code runs."""


class _DeclaredExecutor(_Declared, Executor, Filter):
    def execute(self, task_name, shareable, fl_ctx, abort_signal):  # pragma: no cover - never run
        raise RuntimeError("a declared component of a judged job is never run")

    def process(self, shareable, fl_ctx):  # pragma: no cover - never run
        raise RuntimeError("a declared component of a judged job is never run")


class _AppPaths:
    """The two folders of a deployed app that NVFlare's client configurator asks its workspace for."""

    def __init__(self, app_dir: Path) -> None:
        self.app_dir = app_dir

    def get_app_custom_dir(self, job_id: str) -> str:
        return str(self.app_dir / CUSTOM_FOLDER)

    def get_app_config_dir(self, job_id: str) -> str:
        return str(self.app_dir / CONFIG_FOLDER)


class _ResolvingConfigurator(ClientJsonConfigurator):
    """NVFlare's own client-app configurator (what the job process runs), recording instead of building.

    ``{var}`` references, ``@`` parameterized items, system variables (``{SITE_NAME}``, ``{JOB_ID}``...)
    and the config file formats (``.json``, ``.conf``, ``.yml``) resolve exactly as when the job process
    builds its client app; every component, executor and filter the job declares (nested ones in
    arguments included) is recorded as ``(config path, class path, resolved config)`` through NVFlare's
    component-build authorizer hook, and none is built.
    """

    def __init__(self, app_dir: Path, site_name: str, job_id: str, workspace_root: str) -> None:
        args = SimpleNamespace(
            sp_scheme="grpc",
            sp_target="judged:0",
            client_name=site_name,
            job_id=job_id,
            workspace=workspace_root,
            set=[],
        )
        super().__init__(
            workspace_obj=_AppPaths(app_dir),
            config_file_name=str(app_dir / CONFIG_FOLDER / CLIENT_CONFIG),
            args=args,
            app_root=str(app_dir),
            kv_list=[],
        )
        self.declared: list[tuple[str, str, dict]] = []
        self.set_component_build_authorizer(self._record)

    def _record(self, config_dict: dict, config_ctx: ConfigContext, node: Node) -> str:
        path = self.get_class_path(config_dict)  # resolves "name" as NVFlare does; raises if it cannot
        self.declared.append((node.path(), path, copy.deepcopy(config_dict)))
        return ""

    def _build_component(self, config_dict: dict) -> _Declared:
        return _DeclaredExecutor()

    def finalize_config(self, config_ctx: ConfigContext) -> None:
        # NVFlare's checks of the whole app (format_version, filter tables) without
        # ClientJsonConfigurator's set-up of the process-wide ConfigService
        FedJsonConfigurator.finalize_config(self, config_ctx)
        if not self.executors:
            raise ConfigError("executors are not specified")


def resolved_components(
    app_dir: str | Path, site_name: str = "site", job_id: str | None = None, workspace_root: str | None = None
) -> list[tuple[str, str, dict]]:
    """Every component the client app in ``app_dir`` declares, as NVFlare resolves its configuration.

    Returns ``(config path, class path, resolved config)`` per executor, component and filter (nested
    components in arguments included). Raises whatever NVFlare's configurator raises on a config it
    would not build (unreadable file, unresolved reference, missing executors, wrong format_version).
    """
    app_dir = Path(app_dir).resolve()
    job_id = job_id or app_dir.parent.name
    workspace_root = workspace_root or str(app_dir.parent.parent)
    configurator = _ResolvingConfigurator(app_dir, site_name, job_id, workspace_root)
    configurator.configure()
    return configurator.declared


def _needs(policy: SitePolicy) -> list[str]:
    return [
        n for n, on in (("DP-SGD", policy.require_dp), ("statistics DP", policy.require_statistics_dp)) if on
    ]


def _installed_refusal(policy: SitePolicy, where: str, config: dict) -> str | None:
    """Why fedweigh's installed executor declared at ``where`` with ``config`` is refused, or None."""
    source = f"(site policy: {policy.source})"
    args = config.get("args") or {}
    if not isinstance(args, dict):
        return f"{where}: the arguments of {INSTALLED_EXECUTOR} are {type(args).__name__}, not a mapping {source}"
    unknown = sorted(set(args) - INSTALLED_EXECUTOR_ARGS)
    if unknown:
        return f"{where}: {INSTALLED_EXECUTOR} takes no argument(s) {unknown} {source}"
    script_args = args.get("task_script_args", "")
    if not isinstance(script_args, str):
        return f"{where}: task_script_args must be a string, got {type(script_args).__name__} {source}"
    argv = shlex.split(script_args)
    try:
        parsed = parse_args(argv)
    except (SystemExit, ValueError) as e:
        return f"{where}: the job's client arguments {argv} are not valid ({e}) {source}"
    return policy.job_refusal(parsed)


def job_code_refusal(
    policy: SitePolicy,
    app_dir: str | Path,
    site_name: str = "site",
    job_id: str | None = None,
    workspace_root: str | None = None,
) -> str | None:
    """Why the site refuses the job whose client app is deployed in ``app_dir``, or None.

    The client configuration is judged as NVFlare resolves it (:func:`resolved_components`), and the
    judgement fails closed: any error reading, resolving or judging it refuses the job with the error.
    With ``require_dp`` or ``require_statistics_dp`` the job may declare only fedweigh's installed
    executor (with arguments :class:`~fedweigh.flare.site_executor.InstalledClientExecutor` takes and
    the policy accepts) and :data:`INERT_COMPONENTS`, and bring no ``custom/`` folder; otherwise every
    declared installed executor is judged by its arguments (:meth:`SitePolicy.job_refusal`).
    """
    app_dir = Path(app_dir)
    config_path = app_dir / CONFIG_FOLDER / CLIENT_CONFIG
    try:
        declared = resolved_components(app_dir, site_name, job_id, workspace_root)
    except Exception as e:  # noqa: BLE001 - fail closed: a config the site cannot judge is refused
        return (
            f"the job's client configuration {config_path} cannot be read or resolved as NVFlare would "
            f"({type(e).__name__}: {e}) (site policy: {policy.source})"
        )
    try:
        custom = app_dir / CUSTOM_FOLDER
        needs = _needs(policy)
        if needs:
            foreign = [
                f"{where}: {path}"
                for where, path, _ in declared
                if path != INSTALLED_EXECUTOR and path not in INERT_COMPONENTS
            ]
            brings_custom = custom.exists() and (not custom.is_dir() or any(custom.iterdir()))
            if brings_custom or foreign:
                what = (["its own custom/ folder"] if brings_custom else []) + foreign
                return (
                    f"the job runs its own client code ({'; '.join(what)}), which cannot show that it applies "
                    f"{' and '.join(needs)}; this site requires it and accepts such jobs only with fedweigh's "
                    f"site-installed executor {INSTALLED_EXECUTOR} (site policy: {policy.source})"
                )
            if not any(path == INSTALLED_EXECUTOR for _, path, _ in declared):
                return (
                    f"the job declares no {INSTALLED_EXECUTOR}, the only executor this site runs where it "
                    f"requires {' and '.join(needs)} (site policy: {policy.source})"
                )
        for where, path, config in declared:
            if path == INSTALLED_EXECUTOR:
                reason = _installed_refusal(policy, where, config)
                if reason:
                    return reason
    except Exception as e:  # noqa: BLE001 - fail closed
        return (
            f"the job's client configuration {config_path} cannot be judged ({type(e).__name__}: {e}) "
            f"(site policy: {policy.source})"
        )
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


#: How deep :func:`strip_result` follows nested mappings, lists and DXOs before it gives up.
MAX_STRIP_DEPTH = 64


def _strip(
    value: object, policy: SitePolicy, forbidden: frozenset[str], where: str, removed: list[str], depth: int
) -> None:
    if depth > MAX_STRIP_DEPTH:
        raise ValueError(
            f"the result nests deeper than {MAX_STRIP_DEPTH} levels at {where}; it cannot be checked"
        )
    if isinstance(value, DXO):
        _strip(value.meta, policy, forbidden, f"{where}.meta", removed, depth + 1)
        _strip(value.data, policy, forbidden, f"{where}.data", removed, depth + 1)
    elif isinstance(value, dict):
        for key in list(value):
            item = value[key]
            if key == META_SCALARS and isinstance(item, dict):
                for name in [n for n in item if n not in policy.report_scalars]:
                    del item[name]
                    removed.append(f"{where}.{key}.{name}")
            elif isinstance(key, str) and key in forbidden:
                del value[key]
                removed.append(f"{where}.{key}")
            else:
                _strip(item, policy, forbidden, f"{where}.{key}", removed, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _strip(item, policy, forbidden, f"{where}[{i}]", removed, depth + 1)


def strip_result(policy: SitePolicy, result: Shareable) -> list[str]:
    """Remove in place every scalar ``policy`` does not let leave the site; returns where each was.

    Wherever the result carries it (headers, any meta key, nested mappings and lists, the data of any
    DXO, the DXOs of a COLLECTION): every key ``fedweigh_scalars`` keeps only the names in
    ``report_scalars``, and every other key named like a known fedweigh scalar
    (:data:`fedweigh.weighting.base.KNOWN_SCALARS`) outside ``report_scalars`` is removed. Raises
    ValueError on a result nested deeper than :data:`MAX_STRIP_DEPTH` (the caller refuses it).
    """
    forbidden = frozenset(KNOWN_SCALARS) - frozenset(policy.report_scalars)
    removed: list[str] = []
    _strip(result, policy, forbidden, "result", removed, 0)
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
    """The site policy applied around every task, inside the job's process (module docstring; the
    parent-process :class:`~fedweigh.flare.site_authorizer.JobPolicyAuthorizer` is the first line).

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
        self.job_refusal = job_code_refusal(
            policy,
            app_dir,
            site_name=fl_ctx.get_identity_name(),
            job_id=str(fl_ctx.get_job_id()),
            workspace_root=workspace.get_root_dir(),
        )
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
        try:
            removed = strip_result(self._reader.policy(fl_ctx), result)
        except ValueError as e:  # fail closed: a result that cannot be checked does not leave
            _replace(result, str(e), whole_job=False)
            return
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
            self._job_refusals[job_id] = (
                job_code_refusal(policy, app_dir, site_name=fl_ctx.get_identity_name(), job_id=job_id)
                if app_dir
                else None
            )
        reason = self._job_refusals[job_id]
        if reason:
            self.log_error(fl_ctx, f"{fl_ctx.get_identity_name()} refuses this job: {reason}")
            return refusal_shareable(reason)
        try:
            removed = strip_result(policy, shareable)
        except ValueError as e:  # fail closed: a result that cannot be checked does not leave
            return refusal_shareable(str(e), whole_job=False)
        if removed:
            self.log_warning(
                fl_ctx, f"removed the scalar(s) {removed} from the result: not in report_scalars"
            )
        return shareable

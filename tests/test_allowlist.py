"""The class allow-list a provisioned site adds for fedweigh (provisioning/resources.json) names exact
component classes: NVFlare's own authorizer admits every component of fedweigh's jobs without code,
and refuses every other callable of the package, such as the function that writes key files."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import pkgutil
from pathlib import Path

import pytest
from nvflare.apis.fl_exception import UnsafeComponentError
from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST
from nvflare.app_common.widgets.component_path_authorizer import ComponentPathAuthorizer

import fedweigh

REPO = Path(__file__).resolve().parents[1]
FRAGMENT = json.loads((REPO / "provisioning" / "resources.json").read_text())["class_allow_list"]


class _Workspace:
    """What the authorizer asks of NVFlare's workspace object: where the site's resources.json is."""

    def __init__(self, path: Path):
        self.path = path

    def get_resources_file_path(self) -> str:
        return str(self.path)


def _authorizer(tmp_path: Path, allow_list: list[str]):
    """NVFlare's ComponentPathAuthorizer reading a site's local/resources.json with ``allow_list``
    (after provisioning/allow_fedweigh.py: the default list plus the fragment)."""
    resources = tmp_path / "resources.json"
    resources.write_text(json.dumps({"class_allow_list": allow_list}))
    authorizer = ComponentPathAuthorizer()
    workspace = _Workspace(resources)

    def allowed(path: str) -> bool:
        try:
            authorizer.authorize_component_config({"path": path, "args": {}}, workspace=workspace)
            return True
        except UnsafeComponentError:
            return False

    return allowed


#: Packages a fedweigh module may need that fedweigh does not install (the tracking receivers').
OPTIONAL_PACKAGES = ("mlflow", "wandb")


def _defined_names(module_name: str) -> dict[str, str]:
    """The classes and functions a fedweigh module defines (name -> "class" or "function"); a module
    that needs an optional package absent here is read from its source instead of imported."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in OPTIONAL_PACKAGES:
            raise
        spec = importlib.util.find_spec(module_name)
        tree = ast.parse(Path(spec.origin).read_text())
        kinds = {ast.ClassDef: "class", ast.FunctionDef: "function", ast.AsyncFunctionDef: "function"}
        return {node.name: kinds[type(node)] for node in tree.body if type(node) in kinds}
    return {
        attr: "class" if inspect.isclass(value) else "function"
        for attr, value in vars(module).items()
        if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ == module.__name__
    }


def _package_callables() -> set[str]:
    """Every class and function defined in a fedweigh module, as a component path would name it."""
    names: set[str] = set()
    for info in pkgutil.walk_packages(fedweigh.__path__, "fedweigh."):
        if info.name.endswith("fedweigh_client"):  # the client entry script runs main() on import
            continue
        names |= {f"{info.name}.{attr}" for attr in _defined_names(info.name)}
    for attr, value in vars(fedweigh).items():
        if callable(value):
            names.add(f"fedweigh.{attr}")
    return names


def _component_paths(node) -> set[str]:
    """Every ``path``/``class_path`` in a job configuration, nested ones included."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key in ("path", "class_path"):
            if isinstance(node.get(key), str) and "." in node[key]:
                found.add(node[key])
        for value in node.values():
            found |= _component_paths(value)
    elif isinstance(node, list):
        for value in node:
            found |= _component_paths(value)
    return found


def test_the_fragment_names_exact_classes_only():
    assert FRAGMENT and all(not entry.endswith(".") for entry in FRAGMENT)
    for entry in FRAGMENT:
        module, _, name = entry.rpartition(".")
        assert _defined_names(module).get(name) == "class", entry


def test_every_component_of_fedweighs_jobs_without_code_is_admitted(tmp_path):
    from fedweigh.flare.jobs import JOB_CATALOGUE, export_recipe

    allowed = _authorizer(tmp_path, [*DEFAULT_CLASS_ALLOW_LIST, *FRAGMENT])
    paths: set[str] = set()
    for name in ("synthcxr_feddraw", "synthcxr_feddraw_he", "synthcxr_fedbb"):
        job = export_recipe(JOB_CATALOGUE[name](name), tmp_path / "jobs", site_installed=True)
        for config in job.rglob("config_fed_*.json"):
            paths |= _component_paths(json.loads(config.read_text()))
    assert "fedweigh.flare.controller.FedweighController" in paths
    assert "fedweigh.flare.site_executor.InstalledClientExecutor" in paths
    assert "fedweigh.models.base.FedweighNet" in paths
    refused = sorted(p for p in paths if not allowed(p))
    assert not refused


def test_the_stock_fedavg_aggregator_is_admitted(tmp_path):
    allowed = _authorizer(tmp_path, [*DEFAULT_CLASS_ALLOW_LIST, *FRAGMENT])
    assert allowed("fedweigh.flare.aggregator.FedweighAggregator")


def test_every_other_callable_of_the_package_is_refused(tmp_path):
    allowed = _authorizer(tmp_path, [*DEFAULT_CLASS_ALLOW_LIST, *FRAGMENT])
    callables = _package_callables()
    assert len(callables) > 300  # the whole package was walked
    # the two a test job got past the old prefix "fedweigh.": one writes key files where it is told
    for name in ("fedweigh.secure.contexts.save_context_files", "fedweigh.cli.run_simulator"):
        assert name in callables and not allowed(name)
    admitted = sorted(name for name in callables if allowed(name))
    assert admitted == sorted(FRAGMENT)
    # a name that only extends an admitted class path cannot be built into anything else either
    assert allowed("fedweigh.models.base.FedweighNet.__init__") is True  # NVFlare's rule: "<entry>." prefixes
    with pytest.raises(Exception):  # noqa: B017 - NVFlare cannot build it: no such module
        importlib.import_module("fedweigh.models.base.FedweighNet")


def test_a_package_prefix_would_admit_them(tmp_path):
    """What the allow-list used to say, for contrast: the prefix admits the key-writing function."""
    allowed = _authorizer(tmp_path, [*DEFAULT_CLASS_ALLOW_LIST, "fedweigh."])
    assert allowed("fedweigh.secure.contexts.save_context_files")


def test_allow_fedweigh_removes_the_old_package_prefix(tmp_path):
    import subprocess
    import sys

    kit = tmp_path / "hospital-x"
    (kit / "local").mkdir(parents=True)
    old = {"class_allow_list": ["nvflare.app_common.workflows.fedavg.FedAvg", "fedweigh."]}
    (kit / "local" / "resources.json").write_text(json.dumps(old))
    script = REPO / "provisioning" / "allow_fedweigh.py"
    proc = subprocess.run([sys.executable, str(script), str(kit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "removed the package prefix 'fedweigh.'" in proc.stdout
    written = json.loads((kit / "local" / "resources.json").read_text())["class_allow_list"]
    assert written == ["nvflare.app_common.workflows.fedavg.FedAvg", *FRAGMENT]

"""The committed job folders under ``jobs/``, each defined once here and exported from its recipe.

``fedweigh jobs export`` rewrites ``jobs/`` from this catalogue; a test keeps the committed folders
equal to a fresh export.

How the fedweigh code reaches the sites (docs/deploy.md):

- default: the job ships only the client entry script in ``custom/``; the sites have fedweigh
  installed. What the simulator runs and what ``jobs/`` holds.
- ``bundle=True``: the whole fedweigh package goes into every app's ``custom/`` folder, so sites
  need only fedweigh's dependencies. A job with ``custom/`` is bring-your-own-code (BYOC) for
  NVFlare: its submitter needs the ``byoc`` right (project_admin or lead in the default policy).
- ``site_installed=True``: the job carries no code at all; its client executor is
  :class:`~fedweigh.flare.site_executor.InstalledClientExecutor`. A provisioned site runs it only
  when fedweigh's component classes are in the site's ``class_allow_list``
  (provisioning/resources.json names each one).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from nvflare.app_common.executors.client_api_executor import ClientAPIExecutor

import fedweigh
from fedweigh.flare.recipes import MethodRecipe
from fedweigh.flare.site_executor import CLIENT_SCRIPT_NAME, InstalledClientExecutor
from fedweigh.io import atomic_write_text
from fedweigh.methods import FEDERATED_METHODS
from fedweigh.site.args import ClientArgs

#: Settings of the SynthCXR jobs: 4 hospitals with quantity skew and acquisition shift, compact DenseNet.
SYNTHCXR_CLIENT = ClientArgs(dataset="synthcxr", scenario="quantity-shift", num_images=12000, epochs=1)
SYNTHCXR_ROUNDS = 5
SYNTHCXR_SITES = 4

#: Real-data jobs read the user's data from the path in these environment variables (expanded at the
#: site) and train MONAI DenseNet121 at the data's full size: 224 px, CheXpert's images decoded to it,
#: ChestMNIST's MedMNIST+ file ``chestmnist_224.npz`` (a folder holding the per-size files resolves to
#: it; a single smaller file is upsampled).
REAL_DATA_ARCH = "densenet121"
REAL_DATA_SIZE = 224
CHESTMNIST_CLIENT = ClientArgs(
    dataset="chestmnist",
    scenario="quantity-shift",
    data_path="$FEDWEIGH_CHESTMNIST",
    size=REAL_DATA_SIZE,
    arch=REAL_DATA_ARCH,
)
CHEXPERT_CLIENT = ClientArgs(
    dataset="chexpert",
    scenario="quantity-shift",
    data_path="$FEDWEIGH_CHEXPERT",
    size=REAL_DATA_SIZE,
    arch=REAL_DATA_ARCH,
)


#: What ``fedweigh jobs export`` may change in a catalogue job: the recipe's rounds and the client
#: script's scenario, architecture and image size (checked by the recipe like any other setting).
EXPORT_OPTIONS = ("num_rounds", "scenario", "arch", "size")


def _job(method: str, client: ClientArgs, rounds: int, sites: int, **recipe_options) -> Callable:
    def make(
        name: str,
        bundle: bool = False,
        min_clients: int | None = None,
        num_rounds: int | None = None,
        scenario: str | None = None,
        arch: str | None = None,
        size: int | None = None,
    ) -> MethodRecipe:
        changed = {k: v for k, v in (("scenario", scenario), ("arch", arch), ("size", size)) if v is not None}
        return MethodRecipe(
            method=method,
            name=name,
            num_rounds=rounds if num_rounds is None else num_rounds,
            min_clients=sites if min_clients is None else min_clients,
            client=replace(client, **changed),
            bundle=bundle,
            **recipe_options,
        )

    return make


#: The ViT job's client: DAFL's paper trains a ViT; 32 px (an 8 x 8 grid of 4-px patches) keeps it a
#: CPU run, and ``fedweigh explain`` draws its attention maps.
SYNTHCXR_VIT_CLIENT = replace(SYNTHCXR_CLIENT, arch="vit", size=32)


#: The methods with one SynthCXR job each: every method of the catalogue.
METHODS = FEDERATED_METHODS

#: job folder name -> factory(name, bundle=False, min_clients=None) -> Recipe
JOB_CATALOGUE: dict[str, Callable] = {
    **{f"synthcxr_{m}": _job(m, SYNTHCXR_CLIENT, SYNTHCXR_ROUNDS, SYNTHCXR_SITES) for m in METHODS},
    # privacy-hardened variants: FedDRAW with encrypted model updates (the sites report their
    # similarity), DAFL with DP-SGD at the sites (epsilon 8 over the whole job) and DP noise on the
    # label statistics its loss is built from (epsilon 1)
    "synthcxr_feddraw_he": _job("feddraw", SYNTHCXR_CLIENT, SYNTHCXR_ROUNDS, SYNTHCXR_SITES, he=True),
    "synthcxr_dafl_dp": _job(
        "dafl",
        replace(SYNTHCXR_CLIENT, norm="group", dp_epsilon=8.0, stats_dp_epsilon=1.0),
        SYNTHCXR_ROUNDS,
        SYNTHCXR_SITES,
    ),
    "synthcxr_dafl_vit": _job("dafl", SYNTHCXR_VIT_CLIENT, SYNTHCXR_ROUNDS, SYNTHCXR_SITES),
    "chestmnist_feddraw": _job("feddraw", CHESTMNIST_CLIENT, 10, 4),
    "chexpert_feddraw": _job("feddraw", CHEXPERT_CLIENT, 10, 4),
}


#: NVFlare's job folders: an app is a folder with a config/ folder; its code lives in custom/.
CONFIG_FOLDER = "config"
CUSTOM_FOLDER = "custom"
CLIENT_CONFIG = "config_fed_client.json"
CLIENT_API_EXECUTOR = f"{ClientAPIExecutor.__module__}.{ClientAPIExecutor.__qualname__}"
INSTALLED_EXECUTOR = f"{InstalledClientExecutor.__module__}.{InstalledClientExecutor.__qualname__}"
#: ClientAPIExecutor arguments that InstalledClientExecutor takes over unchanged (all it takes).
INSTALLED_EXECUTOR_ARGS = frozenset(
    {
        "task_script_args",
        "params_exchange_format",
        "server_expected_format",
        "params_transfer_type",
        "memory_gc_rounds",
        "cuda_empty_cache",
    }
)
_INSTALLED_EXECUTOR_ARGS = INSTALLED_EXECUTOR_ARGS


def app_folders(job_dir: str | Path) -> list[Path]:
    """The app folders of an exported job (``app/`` or per-site ``app_server/``, ``app_site-1/``...)."""
    apps = sorted(p for p in Path(job_dir).iterdir() if (p / CONFIG_FOLDER).is_dir())
    if not apps:
        raise FileNotFoundError(
            f"{job_dir} is not an NVFlare job folder: no app folder with a config/ folder"
        )
    return apps


def bundle_package(job_dir: str | Path) -> None:
    """Put the whole fedweigh package into every app's ``custom/`` folder.

    NVFlare's exporter copies only the modules it finds by static import tracing (no package
    ``__init__`` files, none of the modules imported inside functions or by name), which is not a
    package a site without fedweigh can import; the complete package replaces it.
    """
    package = Path(fedweigh.__file__).resolve().parent
    for app in app_folders(job_dir):
        target = app / CUSTOM_FOLDER / package.name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def make_site_installed(job_dir: str | Path) -> None:
    """Turn an exported job into one without code, for sites that installed and allow-listed fedweigh.

    Every client executor running the fedweigh client script becomes
    :class:`~fedweigh.flare.site_executor.InstalledClientExecutor` with the same arguments, and the
    apps' ``custom/`` folders are removed (a job with ``custom/`` is bring-your-own-code for NVFlare).
    """
    for app in app_folders(job_dir):
        config_path = app / CONFIG_FOLDER / CLIENT_CONFIG
        if config_path.is_file():
            config = json.loads(config_path.read_text())
            for entry in config.get("executors", []):
                executor = entry.get("executor", {})
                args = executor.get("args", {})
                if executor.get("path") != CLIENT_API_EXECUTOR:
                    continue
                if Path(str(args.get("task_script_path", ""))).name != CLIENT_SCRIPT_NAME:
                    continue
                if args.get("execution_mode", "in_process") != "in_process":
                    raise ValueError(
                        f"{config_path}: the fedweigh client executor runs in mode "
                        f"{args.get('execution_mode')!r}; only 'in_process' can run from the installed package"
                    )
                unknown = sorted(
                    set(args) - _INSTALLED_EXECUTOR_ARGS - {"execution_mode", "task_script_path"}
                )
                if unknown:
                    raise ValueError(
                        f"{config_path}: executor argument(s) {unknown} have no counterpart in "
                        f"{INSTALLED_EXECUTOR}"
                    )
                executor["path"] = INSTALLED_EXECUTOR
                executor["args"] = {k: v for k, v in args.items() if k in _INSTALLED_EXECUTOR_ARGS}
            atomic_write_text(config_path, json.dumps(config, indent=4), private=False)
        if (app / CUSTOM_FOLDER).exists():
            shutil.rmtree(app / CUSTOM_FOLDER)


def export_recipe(recipe, out_dir: str | Path, *, bundle: bool = False, site_installed: bool = False) -> Path:
    """Export ``recipe`` to ``out_dir/<recipe name>`` (replaced whole) with the chosen code deployment.

    ``bundle`` ships the whole package in the job (the recipe should have been built with
    ``bundle=True``); ``site_installed`` ships no code. Returns the job folder.
    """
    if bundle and site_installed:
        raise ValueError("choose one code deployment: bundle=True or site_installed=True, not both")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        recipe.export(tmp)
        exported = Path(tmp) / recipe.name
        if bundle:
            bundle_package(exported)
        if site_installed:
            make_site_installed(exported)
        target = out_dir / recipe.name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(exported, target)
    return target


def export_jobs(
    out_dir: str | Path = "jobs",
    names: list[str] | None = None,
    bundle: bool = False,
    site_installed: bool = False,
    min_clients: int | None = None,
    **changes: object,
) -> list[Path]:
    """Export the catalogue's jobs into ``out_dir`` (each folder replaced whole).

    ``changes``: any of :data:`EXPORT_OPTIONS` (``num_rounds``, ``scenario``, ``arch``, ``size``)
    set in every exported job; the recipe checks them (a misspelt scenario is a ConfigError).

    ``bundle=True`` writes bring-your-own-code jobs with the whole fedweigh package under each app's
    ``custom/``; ``site_installed=True`` writes jobs without code for allow-listed sites.
    ``min_clients`` sets the sites each job waits for and needs per round (default: the catalogue's,
    sized for the simulation), e.g. 3 for the three hospitals of ``provisioning/project.yml``.
    """
    if bundle and site_installed:
        raise ValueError("choose one code deployment: bundle=True or site_installed=True, not both")
    if min_clients is not None and (
        isinstance(min_clients, bool) or not isinstance(min_clients, int) or min_clients < 1
    ):
        raise ValueError(f"min_clients must be an integer >= 1, got {min_clients!r}")
    unknown_options = sorted(set(changes) - set(EXPORT_OPTIONS))
    if unknown_options:
        raise TypeError(
            f"export_jobs: unknown option(s) {unknown_options}; known: {', '.join(EXPORT_OPTIONS)}"
        )
    changes = {k: v for k, v in changes.items() if v is not None}
    names = names or sorted(JOB_CATALOGUE)
    unknown = [n for n in names if n not in JOB_CATALOGUE]
    if unknown:
        raise KeyError(f"unknown job(s) {unknown}; known: {sorted(JOB_CATALOGUE)}")
    return [
        export_recipe(
            JOB_CATALOGUE[name](name, bundle=bundle, min_clients=min_clients, **changes),
            out_dir,
            bundle=bundle,
            site_installed=site_installed,
        )
        for name in names
    ]

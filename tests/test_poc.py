"""End to end on loopback: provision from provisioning/project.yml, run a server and three hospitals,
submit fedweigh jobs as their users would, check the downloaded results.

One federation serves every check (module fixture ``poc``), in this order:

1. ``nvflare provision`` of provisioning/project.yml with the server moved to localhost and free ports;
   each hospital gets its own data through ``local/fedweigh_site.json`` (SynthCXR, 200/300/400 images,
   seeds 1/2/3: 180/270/360 training images);
2. the server and the three hospitals start from their kits as processes owned by the test, in a Python
   whose installed fedweigh is the code under test (``poc_utils.federation_python``) but which keeps it
   off the import path of the server and site processes themselves (``poc_utils.site_python``);
3. a job without code (``fedweigh jobs export --site-installed``) is submitted before any site has
   allow-listed fedweigh: NVFlare must refuse to build it;
4. ``provisioning/allow_fedweigh.py`` adds provisioning/resources.json to the server's and every
   hospital's allow-list; a hospital's org_admin tries to submit (refused);
5. the same three-round FedDRAW job runs three times at once, each with the PNB loss and therefore a
   secure label-statistics phase under the HE contexts HEBuilder put in the kits:
   - whole package bundled in the job (bring-your-own-code), submitted by a hospital lead through
     the FLARE API session, monitored, downloaded;
   - no code in the job, for the installed and allow-listed package, with ``nvflare job submit``,
     ``nvflare job wait`` and ``nvflare job download``; the two deployments must give the same
     records and the same global model, bit for bit;
   - installed, with encrypted model updates (``he=True``) under the kits' contexts, submitted with
     ``submit_job`` in the admin console: the server aggregates ciphertexts and every hospital
     decrypts the same global model;
   then hospital-a adds a strict ``local/fedweigh_policy.json`` (DP-SGD required) and its lead submits
   examples/byo_feddraw, whose own Client API script knows nothing of site policies (one round, two
   sites needed): hospital-a must refuse it outside the job's code (the ``privacy.json`` every kit got
   from provisioning), the server must name hospital-a and the reason and aggregate the other two;
6. the admin console shows the connected hospitals and the jobs, then shuts the sites and the
   server down (docs/deploy.md); every process of the federation must end by itself.

Expected values, by hand: every hospital trains one epoch with batch 18, so its sample count is its
training-set size, N = (180, 270, 360) of 810. FedDRAW (beta_max 1, three rounds) gives w = N_k / N in
round 1 (lambda 0, beta 1) = (2/9, 1/3, 4/9), 1/K = 1/3 in its last round (beta 0), and in round 2 the
tempered mix of the size prior and the spread similarities, whose least similar site gets 0. The global
histogram every hospital decrypts is the sum of the three training histograms.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from poc_utils import (
    JOB_COMPLETED,
    PROJECT_YML,
    REPO,
    Federation,
    admin_console,
    allow_fedweigh,
    allow_lead_byoc,
    federation_python,
    free_ports,
    loopback_project,
    move_server_storage,
    nvflare_json,
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
PROJECT_ADMIN = "admin@coordinator.org"
LEAD = "lead@hospital-a.org"
STRICT = "hospital-a"  # the hospital whose policy refuses a job that runs its own client code
ORG_ADMIN = "it@hospital-a.org"
#: Each hospital's local data (docs/deploy.md, "Site data"): 90 % of num_images train, 10 % validate.
SITE_DATA = {
    "hospital-a": {"dataset": "synthcxr", "num_images": 200, "seed": 1},
    "hospital-b": {"dataset": "synthcxr", "num_images": 300, "seed": 2},
    "hospital-c": {"dataset": "synthcxr", "num_images": 400, "seed": 3},
}
TRAIN_SIZES = {"hospital-a": 180, "hospital-b": 270, "hospital-c": 360}
ROUNDS = 3
JOB_TIMEOUT = 600
# the federation's set-up, three jobs and its shutdown run in the first test that uses it
pytestmark = pytest.mark.timeout(1500)


@dataclass
class PocRun:
    """What the federation did, for the tests to check."""

    prod: Path
    root: Path
    refused: dict = field(default_factory=dict)
    org_admin_error: str = ""
    jobs: dict[str, dict] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    console: dict[str, str] = field(default_factory=dict)  # what the admin console printed, by step
    still_running_after_shutdown: list[str] = field(default_factory=list)
    sites_running_after_shutdown: list[str] = field(default_factory=list)


def _export_jobs(out: Path) -> dict[str, Path]:
    """The job folders, by the ``fedweigh jobs export`` code paths (bundle / site-installed), tiny settings."""
    from fedweigh.flare.jobs import export_recipe
    from fedweigh.flare.recipes import FedDRAWRecipe
    from fedweigh.site.args import ClientArgs

    # The job's scenario is not used: every hospital has a local/fedweigh_site.json. The PNB loss uses
    # the global label histogram, so the job starts with the secure statistics phase.
    client = ClientArgs(dataset="synthcxr", num_images=300, batch_size=18, threads=1, loss="pnb")

    def feddraw(name: str, bundle: bool = False, he: bool = False):
        return FedDRAWRecipe(
            name=name,
            num_rounds=ROUNDS,
            min_clients=len(HOSPITALS),
            client=client,
            statistics="secure",
            bundle=bundle,
            he=he,
        )

    byo_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "custom"), os.environ.get("PYTHONPATH", "")]),
    }
    byo = [sys.executable, "job.py", "--out", str(out), "--rounds", "1", "--sites", "2"]
    subprocess.run(byo, cwd=REPO / "examples" / "byo_feddraw", env=byo_env, check=True, timeout=300)
    assert (out / "byo_feddraw" / "app" / "custom" / "train.py").is_file()  # it brings its own script
    return {
        "byo": out / "byo_feddraw",
        "refused": export_recipe(feddraw("feddraw_refused"), out, site_installed=True),
        "bundle": export_recipe(feddraw("feddraw_bundle", bundle=True), out, bundle=True),
        "installed": export_recipe(feddraw("feddraw_installed"), out, site_installed=True),
        "he": export_recipe(feddraw("feddraw_he", he=True), out, site_installed=True),
    }


def _result(folder: Path) -> dict:
    """Metrics rows and server log of a downloaded job result."""
    server_app = folder / "workspace" / "app_server"
    metrics = server_app / METRICS_JSON
    return {
        "folder": folder,
        "rows": json.loads(metrics.read_text())["rounds"] if metrics.is_file() else None,
        "log": (folder / "workspace" / "log.txt").read_text(errors="replace"),
        "server_app": server_app,
    }


@pytest.fixture(scope="module")
def poc(tmp_path_factory):
    import matplotlib
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    start = time.monotonic()
    root = tmp_path_factory.mktemp("poc")
    home = root / "home"
    home.mkdir()
    mpl_cache = matplotlib.get_cachedir()  # before HOME moves: the font cache is built once, not per process
    env = site_env(home, hide_installed_fedweigh=True)
    cli_env = site_env(home)
    for e in (env, cli_env):
        e["MPLCONFIGDIR"] = mpl_cache
        e["NVFLARE_POC_WORKSPACE"] = str(root / "poc_workspace")  # never the user's default POC folder

    fed_learn_port, admin_port = free_ports(2)
    project = root / "project.yml"
    loopback_project(PROJECT_YML, project, fed_learn_port, admin_port)
    prod = provision(project, root / "provisioning", cli_env)
    move_server_storage(prod / SERVER / "local", root / "server_storage")
    for admin_kit in (PROJECT_ADMIN, LEAD, ORG_ADMIN):
        set_admin_message_timeout(prod / admin_kit, 60.0)
    for site, config in SITE_DATA.items():
        (prod / site / "local" / "fedweigh_site.json").write_text(json.dumps(config))
    # the shipped project gives no role BYOC; this run compares a bundled job with an installed one,
    # so each kit opts in for its leads (docs/deploy.md)
    for kit in (SERVER, *HOSPITALS):
        allow_lead_byoc(prod / kit)
    jobs = _export_jobs(root / "jobs")
    run = PocRun(prod=prod, root=root)
    run.wall["provision_and_export"] = time.monotonic() - start

    import fedweigh

    python = federation_python(root / "python", Path(fedweigh.__file__).resolve().parents[1])
    fed = Federation(prod, SERVER, list(HOSPITALS), env, site_python(True, python), root / "logs")
    sessions = []
    try:
        fed.start()
        admin = new_secure_session(PROJECT_ADMIN, str(prod / PROJECT_ADMIN), timeout=60)
        sessions.append(admin)
        wait_for_sites(admin, list(HOSPITALS), fed)
        run.wall["started"] = time.monotonic() - start

        # 3. no site has allow-listed fedweigh yet: a job without code must be refused
        job_id = admin.submit_job(str(jobs["refused"]))
        meta = wait_for_job(admin, job_id, fed, timeout=JOB_TIMEOUT)
        folder = Path(admin.download_job_result(job_id))
        run.refused = {"meta": meta, **_result(folder)}

        # 4. allow-list fedweigh everywhere; an org_admin may not submit
        for kit in (SERVER, *HOSPITALS):
            allow_fedweigh(prod / kit)
        org_admin = new_secure_session(ORG_ADMIN, str(prod / ORG_ADMIN), timeout=60)
        sessions.append(org_admin)
        try:
            org_admin.submit_job(str(jobs["bundle"]))
        except Exception as e:
            run.org_admin_error = f"{type(e).__name__}: {e}"
        run.wall["refusals"] = time.monotonic() - start

        # 5. the same job three ways at once: the package installed (plaintext updates, `nvflare job
        # submit`) and bundled (plaintext, the FLARE API as a hospital lead), and installed with encrypted
        # updates, submitted in the admin console
        run.console["submit"] = admin_console(
            prod / PROJECT_ADMIN, PROJECT_ADMIN, [f"submit_job {jobs['he']}"], cli_env
        )
        he_id = re.search(r"Submitted job: ([0-9a-f-]{36})", run.console["submit"]).group(1)
        submitted = nvflare_json(
            ["job", "submit", "-j", str(jobs["installed"])], prod / PROJECT_ADMIN, cli_env, root
        )
        assert submitted["exit_code"] == 0, submitted
        installed_id = submitted["data"]["job_id"]
        run.wall["cli_submitted"] = time.monotonic() - start
        lead = new_secure_session(LEAD, str(prod / LEAD), timeout=60)
        sessions.append(lead)
        bundle_id = lead.submit_job(str(jobs["bundle"]))
        run.wall["submitted"] = time.monotonic() - start
        run.console["status"] = admin_console(
            prod / PROJECT_ADMIN, PROJECT_ADMIN, ["check_status client", "list_jobs"], cli_env
        )

        monitored = lead.monitor_job(bundle_id, timeout=JOB_TIMEOUT, poll_interval=2.0)
        meta = wait_for_job(lead, bundle_id, fed, timeout=60)
        folder = Path(lead.download_job_result(bundle_id))
        run.jobs["bundle"] = {"job_id": bundle_id, "meta": meta, "monitor": str(monitored), **_result(folder)}
        run.wall["bundle_done"] = time.monotonic() - start
        waited = nvflare_json(
            ["job", "wait", installed_id, "--timeout", str(JOB_TIMEOUT)], prod / PROJECT_ADMIN, cli_env, root
        )
        downloaded = nvflare_json(
            ["job", "download", installed_id, "-o", str(root / "downloads")],
            prod / PROJECT_ADMIN,
            cli_env,
            root,
        )
        assert downloaded["exit_code"] == 0, downloaded
        run.jobs["installed"] = {
            "job_id": installed_id,
            "meta": admin.get_job_meta(installed_id),
            "wait": waited,
            **_result(Path(downloaded["data"]["download_path"])),
        }
        meta = wait_for_job(admin, he_id, fed, timeout=JOB_TIMEOUT)
        run.jobs["he"] = {"job_id": he_id, "meta": meta, **_result(Path(admin.download_job_result(he_id)))}
        run.wall["jobs"] = time.monotonic() - start

        # 5b. a strict hospital and a job with its own client script: refused outside the job's code
        policy_file = prod / STRICT / "local" / "fedweigh_policy.json"
        policy_file.write_text(json.dumps({"require_dp": True}))
        byo_id = lead.submit_job(str(jobs["byo"]))
        meta = wait_for_job(lead, byo_id, fed, timeout=JOB_TIMEOUT)
        run.jobs["strict"] = {
            "job_id": byo_id,
            "meta": meta,
            "policy_file": policy_file,
            "site_logs": {h: (prod / h / byo_id / "log.txt").read_text(errors="replace") for h in HOSPITALS},
            **_result(Path(lead.download_job_result(byo_id))),
        }
        policy_file.unlink()
        run.wall["strict"] = time.monotonic() - start

        # 6. stop the federation from the admin console (docs/deploy.md, "Stop"): every site, then the server
        for sess in sessions:
            with contextlib.suppress(Exception):
                sess.close()
        sessions.clear()
        # the server refuses `shutdown server` while a site is still connected ("There are still active
        # clients"), so the operator waits for the sites to go (docs/deploy.md) before the second command
        clients = admin_console(
            prod / PROJECT_ADMIN, PROJECT_ADMIN, ["shutdown client", PROJECT_ADMIN], cli_env
        )
        run.sites_running_after_shutdown = fed.wait_until_ended(timeout=90, sites_only=True)
        for _ in range(6):  # as docs/deploy.md says: repeated while the server still counts a site
            server = admin_console(
                prod / PROJECT_ADMIN, PROJECT_ADMIN, ["shutdown server", PROJECT_ADMIN], cli_env
            )
            if "There are still active clients" not in server:
                break
            time.sleep(5.0)
        run.console["shutdown"], run.console["shutdown server"] = clients + server, server
        run.still_running_after_shutdown = fed.wait_until_ended(timeout=90)
        run.wall["shut_down"] = time.monotonic() - start
        yield run
    finally:
        for sess in sessions:
            with contextlib.suppress(Exception):  # the processes are ended below in any case
                sess.close()
        ended = fed.stop()
        left = fed.still_running()
        print(f"POC wall times (s): {run.wall}; ended {ended}")
        assert not left, f"processes still running after stop: {left}"


# ---------------------------------------------------------------------------------------- helpers
def _weights(rows: list[dict], round_index: int) -> dict[str, float]:
    row = next(r for r in rows if r["round"] == round_index)
    return row["weights"]


def _assert_feddraw_weights(rows: list[dict]) -> None:
    """FedDRAW's weights by hand: N_k / N in round 1 (lambda 0, beta 1), 1/K in the last round (beta 0), and
    in round 2 r = (1 - lambda) p + lambda s~ tempered by beta, where s~ is the spread similarity
    bounded by the size prior (the default prior_factor c = 2: p_k / c <= s~_k <= c p_k, summing to one)."""
    total = sum(TRAIN_SIZES.values())
    p = np.array([TRAIN_SIZES[s] / total for s in HOSPITALS])
    assert _weights(rows, 1) == pytest.approx(dict(zip(HOSPITALS, p, strict=True)), abs=1e-12)
    assert _weights(rows, ROUNDS) == pytest.approx({s: 1 / 3 for s in HOSPITALS}, abs=1e-12)
    second = next(r for r in rows if r["round"] == 2)
    lam, beta = second["lambda"], second["beta"]
    assert 0.0 < lam < 1.0 and 0.0 < beta < 1.0
    w = np.array([second["weights"][s] for s in HOSPITALS])
    r = w ** (1.0 / beta) / np.sum(w ** (1.0 / beta))
    s_tilde = (r - (1.0 - lam) * p) / lam
    assert s_tilde.sum() == pytest.approx(1.0, abs=1e-9)
    assert (s_tilde >= p / 2 - 1e-9).all() and (s_tilde <= 2 * p + 1e-9).all()
    assert np.max(np.abs(s_tilde - p)) > 0.01  # the similarities moved the weights away from the size prior
    assert np.max(np.abs(w - p)) > 1e-3 and np.max(np.abs(w - 1 / 3)) > 1e-3


def _initial_model() -> dict[str, np.ndarray]:
    """The jobs' initial global model, as the server's persistor builds it."""
    from dataclasses import asdict

    from fedweigh.flare.recipes import ModelSpec
    from fedweigh.models import FedweighNet

    return {k: v.numpy() for k, v in FedweighNet(**asdict(ModelSpec(seed=0))).state_dict().items()}


def _train_histograms() -> dict[str, np.ndarray]:
    """Each hospital's training label histogram, from its fedweigh_site.json (as the site loads it)."""
    from fedweigh.site.data_config import SiteDataConfig, load_site_from_config

    return {
        site: load_site_from_config(site, SiteDataConfig(**cfg))[0].train.label_histogram()
        for site, cfg in SITE_DATA.items()
    }


def _assert_completed(job: dict) -> None:
    assert job["meta"]["status"] == JOB_COMPLETED, f"{job['meta']}\n{job['log'][-4000:]}"
    rows = job["rows"]
    assert rows is not None, f"no {METRICS_JSON} in the downloaded result {job['folder']}"
    assert [r["round"] for r in rows] == list(range(ROUNDS + 1))
    for r in rows:
        assert 0.0 <= r["test_auc"] <= 1.0 and math.isfinite(r["test_auc"]), r
        assert math.isfinite(r["val_loss"]), r


# ------------------------------------------------------- fast checks of the deployment artefacts
def test_project_yml_runs_hebuilder_before_signaturebuilder():
    import yaml

    project = yaml.safe_load(PROJECT_YML.read_text())
    builders = [b["path"].rsplit(".", 1)[-1] for b in project["builders"]]
    assert builders.index("HEBuilder") < builders.index("SignatureBuilder")
    by_type: dict[str, list[str]] = {}
    for p in project["participants"]:
        by_type.setdefault(p["type"], []).append(p["name"])
    assert by_type["server"] == [SERVER] and by_type["client"] == list(HOSPITALS)
    roles = {p["name"]: p.get("role") for p in project["participants"] if p["type"] == "admin"}
    assert (
        roles[PROJECT_ADMIN] == "project_admin" and roles[LEAD] == "lead" and roles[ORG_ADMIN] == "org_admin"
    )
    assert list(roles.values()).count("project_admin") == 1


def test_bundle_export_ships_an_importable_package(tmp_path):
    """The bundled job alone (no installed fedweigh) provides every fedweigh module, __init__ files included."""
    import sysconfig

    import fedweigh
    from fedweigh.flare.jobs import export_recipe
    from fedweigh.flare.recipes import FedDRAWRecipe

    job = export_recipe(FedDRAWRecipe(name="b", min_clients=3, bundle=True), tmp_path, bundle=True)
    package = Path(fedweigh.__file__).parent
    custom = job / "app" / "custom"
    shipped = {str(f.relative_to(custom / "fedweigh")) for f in (custom / "fedweigh").rglob("*.py")}
    assert shipped == {str(f.relative_to(package)) for f in package.rglob("*.py")}
    assert not list(custom.rglob("__pycache__"))
    paths = sysconfig.get_paths()
    probe = "import fedweigh, fedweigh.flare.controller, fedweigh.weighting.feddraw, fedweigh.losses; print(fedweigh.__file__)"
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        env={"PYTHONPATH": os.pathsep.join([paths["purelib"], paths["platlib"], str(custom)]), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert Path(out.stdout.strip()) == custom / "fedweigh" / "__init__.py"


def test_site_installed_export_carries_no_code(tmp_path):
    from fedweigh.flare.jobs import INSTALLED_EXECUTOR, export_recipe
    from fedweigh.flare.recipes import FedDRAWRecipe
    from fedweigh.site.args import ClientArgs

    client = ClientArgs(num_images=300, batch_size=18)
    default = export_recipe(FedDRAWRecipe(name="j", min_clients=3, client=client), tmp_path / "default")
    job = export_recipe(
        FedDRAWRecipe(name="j", min_clients=3, client=client), tmp_path / "i", site_installed=True
    )
    assert (default / "app" / "custom").is_dir()  # the default export ships the entry script: BYOC
    assert not list(job.rglob("custom")) and not list(job.rglob("*.py"))
    config = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    executors = [e["executor"] for e in config["executors"]]
    assert executors == [
        {
            "path": INSTALLED_EXECUTOR,
            "args": {"task_script_args": client.to_argv(), "params_exchange_format": "pytorch"},
        }
    ]
    server = "app/config/config_fed_server.json"
    assert (job / server).read_text() == (default / server).read_text()


def test_installed_client_executor_runs_the_installed_script():
    from fedweigh.flare.site_executor import InstalledClientExecutor

    executor = InstalledClientExecutor(task_script_args="--max-steps 2")
    script = Path(executor._task_script_path)
    assert script.is_absolute() and script.is_file()
    assert script.parts[-3:] == ("fedweigh", "flare", "fedweigh_client.py")
    assert executor._execution_mode == "in_process" and executor._task_script_args == "--max-steps 2"


def test_export_modes_exclude_each_other(tmp_path):
    from fedweigh.cli import main
    from fedweigh.flare.jobs import export_jobs

    with pytest.raises(ValueError, match="choose one code deployment"):
        export_jobs(tmp_path, ["synthcxr_fedavg"], bundle=True, site_installed=True)
    with pytest.raises(SystemExit):
        main(["jobs", "export", "synthcxr_fedavg", "--bundle", "--site-installed", "--out", str(tmp_path)])
    assert main(["jobs", "export", "synthcxr_fedavg", "--bundle", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "synthcxr_fedavg" / "app" / "custom" / "fedweigh" / "__init__.py").is_file()


def test_allow_fedweigh_extends_the_sites_list_once(tmp_path):
    kit = tmp_path / "hospital-x"
    (kit / "local").mkdir(parents=True)
    default = {
        "format_version": 2,
        "class_allow_list": ["nvflare.app_common.workflows.fedavg.FedAvg"],
        "components": [{"id": "process_launcher", "path": "some.Launcher", "args": {}}],
    }
    (kit / "local" / "resources.json.default").write_text(json.dumps(default))
    fragment = json.loads((REPO / "provisioning" / "resources.json").read_text())["class_allow_list"]
    assert "fedweigh.flare.controller.FedweighController" in fragment and "fedweigh." not in fragment
    for _ in range(2):
        allow_fedweigh(kit)
    written = json.loads((kit / "local" / "resources.json").read_text())
    assert written["class_allow_list"] == default["class_allow_list"] + fragment
    assert written["components"] == default["components"]
    # a resources.json that exists (e.g. with the server's storage paths) is the one extended
    (kit / "local" / "resources.json").write_text(json.dumps({**default, "snapshot": "mine"}))
    allow_fedweigh(kit)
    written = json.loads((kit / "local" / "resources.json").read_text())
    assert written["snapshot"] == "mine" and written["class_allow_list"][-len(fragment) :] == fragment


# ------------------------------------------------------------------------- the running federation
@pytest.mark.slow
def test_kits_hold_signed_he_contexts(poc):
    """HEBuilder runs before SignatureBuilder: the contexts are in the kits and in their signatures."""
    server_startup = poc.prod / SERVER / "startup"
    assert (server_startup / "server_context.tenseal").is_file()
    assert "server_context.tenseal" in json.loads((server_startup / "signature.json").read_text())
    assert not (server_startup / "client_context.tenseal").exists()  # the secret key stays at the sites
    for site in HOSPITALS:
        startup = poc.prod / site / "startup"
        assert (startup / "client_context.tenseal").is_file()
        assert "client_context.tenseal" in json.loads((startup / "signature.json").read_text())


@pytest.mark.slow
def test_job_without_code_is_refused_until_sitesallow_fedweigh(poc):
    refused = poc.refused
    assert refused["meta"]["status"] != JOB_COMPLETED
    assert refused["rows"] is None
    assert "'fedweigh.flare.controller.FedweighController'" in refused["log"]
    assert "is not in allow_list" in refused["log"]


@pytest.mark.slow
def test_org_admin_may_not_submit(poc):
    assert "AuthorizationError" in poc.org_admin_error and "submit_job" in poc.org_admin_error


@pytest.mark.slow
def test_feddraw_bundled_job_through_the_flare_api(poc):
    job = poc.jobs["bundle"]
    _assert_completed(job)
    assert job["monitor"].endswith("FINISHED")
    assert job["meta"]["submitter_name"] == LEAD and job["meta"]["submitter_role"] == "lead"
    assert job["meta"].get("byoc") is True
    _assert_feddraw_weights(job["rows"])
    # the server and every hospital imported fedweigh from the job (bytecode next to the bundled copy)
    assert (job["server_app"] / "custom" / "fedweigh" / "__pycache__").is_dir()
    for site in HOSPITALS:
        site_copy = poc.prod / site / job["job_id"] / f"app_{site}" / "custom" / "fedweigh" / "flare"
        assert (site_copy / "__pycache__").is_dir(), f"{site} did not import the bundled fedweigh"


@pytest.mark.slow
def test_feddraw_site_installed_job_with_nvflare_job_submit(poc):
    job = poc.jobs["installed"]
    _assert_completed(job)
    assert job["wait"]["exit_code"] == 0 and job["wait"]["data"]["status"] == JOB_COMPLETED, job["wait"]
    assert job["meta"]["submitter_name"] == PROJECT_ADMIN and not job["meta"].get("byoc")
    assert not (job["server_app"] / "custom").exists()
    _assert_feddraw_weights(job["rows"])


@pytest.mark.slow
def test_both_code_deployments_train_the_same_model(poc):
    """Same data, seeds and code: the bundled and the installed package give the same records and the
    same global model, to the last bit, although the two jobs ran at the same time at every site."""
    from simulation import saved_float_params

    bundle, installed = poc.jobs["bundle"], poc.jobs["installed"]
    _assert_completed(bundle)
    _assert_completed(installed)
    server_only = ("round_seconds", "server_rss_mb", "server_peak_rss_mb")
    for mine, theirs in zip(installed["rows"], bundle["rows"], strict=True):
        assert {k: v for k, v in mine.items() if k not in server_only} == {
            k: v for k, v in theirs.items() if k not in server_only
        }, mine["round"]
    a = saved_float_params(bundle["server_app"] / "FL_global_model.pt")
    b = saved_float_params(installed["server_app"] / "FL_global_model.pt")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    initial = _initial_model()
    assert max(float(np.max(np.abs(a[k] - initial[k]))) for k in a) > 1e-2  # three rounds moved it


@pytest.mark.slow
def test_he_model_updates_with_the_kits_contexts(poc):
    from fedweigh.flare.client import HE_SITE_MODEL_FILE

    job = poc.jobs["he"]
    _assert_completed(job)
    _assert_feddraw_weights(job["rows"])
    # the server aggregated ciphertexts: it holds no plaintext global model, each hospital the decrypted one
    assert not (job["server_app"] / "FL_global_model.pt").exists()
    assert not (job["server_app"] / "fedweigh_global.npz").exists()
    assert (job["server_app"] / "fedweigh_he_global.npz").is_file()
    models = {}
    for site in HOSPITALS:
        found = list((poc.prod / site).rglob(HE_SITE_MODEL_FILE.format(job_id=job["job_id"])))
        assert len(found) == 1, (site, found)
        with np.load(found[0]) as z:
            models[site] = {k: z[k] for k in z.files}
    first, *others = models.values()
    for other in others:  # every hospital decrypted the same ciphertext with the same key: the same model
        assert other.keys() == first.keys()
        for key in first:
            np.testing.assert_array_equal(other[key], first[key], err_msg=key)
    assert all(np.isfinite(v).all() for v in first.values())
    initial = _initial_model()
    floats = [k for k in initial if initial[k].dtype.kind == "f"]
    assert max(float(np.max(np.abs(first[k] - initial[k]))) for k in floats) > 1e-2  # three rounds moved it


@pytest.mark.slow
def test_admin_console_commands_of_the_deployment_guide(poc):
    """docs/deploy.md: `submit_job`, `check_status client`, `list_jobs`, `shutdown client`, `shutdown
    server` and `bye` in the admin console (typed into startup/fl_admin.sh)."""
    submitted = poc.console["submit"]
    assert f"Submitted job: {poc.jobs['he']['job_id']}" in submitted
    status = poc.console["status"]
    for site in HOSPITALS:
        assert re.search(rf"\|\s*{site}\s*\|", status), status[-3000:]
    for name in ("bundle", "installed", "he"):  # list_jobs lists every job submitted before it ran
        assert poc.jobs[name]["job_id"] in status
    # shutting the sites and then the server down from the console ended every process of the federation
    assert "Confirm with User Name" in poc.console["shutdown"]
    assert poc.sites_running_after_shutdown == [], poc.console["shutdown"][-3000:]
    assert "There are still active clients" not in poc.console["shutdown server"]  # its last answer
    assert poc.still_running_after_shutdown == [], poc.console["shutdown"][-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("job_name", ["bundle", "installed", "he"])
def test_secure_statistics_with_the_kits_he_contexts(poc, job_name):
    from fedweigh.flare.statistics import GLOBAL_STATS_FILE

    job = poc.jobs[job_name]
    _assert_completed(job)
    histograms = _train_histograms()
    assert {s: int(h.sum()) > 0 and len(h) == 14 for s, h in histograms.items()} == {
        s: True for s in HOSPITALS
    }
    # under the default policy of a provisioned site (statistics_epsilon 1.0) each hospital released its
    # histogram once through the Gaussian mechanism and kept the release in its working folder; every
    # hospital decrypted the sum of the releases, summed by the server under encryption
    from fedweigh.secure.dp_config import job_site_path
    from fedweigh.secure.gaussian import HistogramRelease
    from fedweigh.secure.stats_release import STATS_RELEASE_FILE

    releases = {
        s: HistogramRelease.from_dict(
            json.loads(job_site_path(STATS_RELEASE_FILE, job["job_id"], s, poc.prod / s).read_text())
        )
        for s in HOSPITALS
    }
    assert {s: (r.epsilon, r.delta) for s, r in releases.items()} == {s: (1.0, 1e-5) for s in HOSPITALS}
    assert any(not np.array_equal(releases[s].class_counts, histograms[s]) for s in HOSPITALS)  # noised
    expected_global = [int(x) for x in sum(r.class_counts for r in releases.values())]
    for site in HOSPITALS:
        stats = json.loads((poc.prod / site / GLOBAL_STATS_FILE.format(job_id=job["job_id"])).read_text())
        assert stats["class_counts"] == expected_global, site
        assert stats["num_samples"] == sum(r.num_samples for r in releases.values())
    # with the kits' contexts: the server's (no secret key) and each hospital's own file
    assert f"{SERVER}/startup/server_context.tenseal" in job["log"]
    for site in HOSPITALS:
        site_log = (poc.prod / site / job["job_id"] / "log.txt").read_text(errors="replace")
        assert f"{site}/startup/client_context.tenseal" in site_log, site
        # no local/fedweigh_policy.json: the hospitals ran under the default policy of a provisioned site
        assert "site policy from default policy of a provisioned site" in site_log, site


@pytest.mark.slow
def test_downloads_land_where_asked(poc):
    assert poc.jobs["bundle"]["folder"].parent == poc.prod / LEAD / "transfer"
    assert poc.jobs["installed"]["folder"].is_relative_to(poc.root / "downloads")
    assert poc.jobs["he"]["folder"].parent == poc.prod / PROJECT_ADMIN / "transfer"


@pytest.mark.slow
def test_a_job_with_its_own_script_is_refused_at_a_strict_site(poc):
    """Step 5b: the enforcer from the kit's privacy.json, not the job's code, applies hospital-a's policy."""
    from fedweigh.flare.provision import PRIVACY_CONFIG

    reason = "the job runs its own client code"
    for site in HOSPITALS:  # what provisioning gave every hospital: the enforcer, outside any job
        assert json.loads((poc.prod / site / "local" / "privacy.json").read_text()) == PRIVACY_CONFIG
    job = poc.jobs["strict"]
    logs, server_log = job["site_logs"], job["log"]
    # the strict hospital refused the job outside its code, naming why and the policy it applied
    assert f"{STRICT} refuses this job: {reason}" in logs[STRICT], logs[STRICT][-4000:]
    assert f"site policy: {job['policy_file']}" in logs[STRICT]
    for site in HOSPITALS[1:]:  # the default policy lets the job run
        assert "refuses this job" not in logs[site], site
    # the server names the hospital and its reason, and leaves its result out of the round
    assert f"{STRICT} refuses this job under its site policy: {reason}" in server_log, server_log[-4000:]
    assert f"skipping result: {STRICT} refused under its site policy" in server_log
    weights = next(r for r in job["rows"] if r["round"] == 1)["weights"]
    assert sorted(weights) == ["hospital-b", "hospital-c"], weights
    assert job["meta"]["status"] == JOB_COMPLETED, job["meta"]

"""A provisioned NVFlare federation on loopback for the end-to-end test: provision, run, submit.

The federation is provisioned from ``provisioning/project.yml`` with only the server's address and
ports changed (``localhost`` and free ports chosen here), so the test exercises the same startup
kits, admin roles and HE contexts a deployment gets. Every process is started by
:class:`Federation` in its own session; :meth:`Federation.stop` ends them, and every job process
they launched, by process id.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
PROJECT_YML = REPO / "provisioning" / "project.yml"

#: Where provisioning writes the kits: <workspace>/<project name>/prod_00/<participant>.
PROD_FOLDER = "prod_00"
#: Status of a job that ran to its end without error (``get_job_meta(job_id)["status"]``).
JOB_COMPLETED = "FINISHED:COMPLETED"


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 (held together while chosen, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def loopback_project(src: Path, dst: Path, fed_learn_port: int, admin_port: int) -> dict:
    """Copy of the project file ``src`` whose server listens on the given ports and is reached at localhost.

    The server keeps its name (its certificate's identity); ``default_host`` tells clients and admins
    to connect to ``localhost`` instead of resolving that name.
    """
    project = yaml.safe_load(src.read_text())
    servers = [p for p in project["participants"] if p["type"] == "server"]
    if len(servers) != 1:
        raise ValueError(f"{src}: expected one server participant, found {len(servers)}")
    servers[0].update(
        {"default_host": "localhost", "fed_learn_port": fed_learn_port, "admin_port": admin_port}
    )
    dst.write_text(yaml.safe_dump(project, sort_keys=False))
    return project


def site_env(home: Path, *, hide_installed_fedweigh: bool = False) -> dict[str, str]:
    """Environment of the federation's processes and of the NVFlare commands.

    ``HOME`` is ``home`` (the NVFlare CLI keeps its settings in ~/.nvflare); the virtual
    environment's bin folder comes first on PATH. With ``hide_installed_fedweigh`` the processes
    started with :func:`site_python` see the site-packages but not the fedweigh package of this
    checkout, so a bring-your-own-code job has to bring all of fedweigh itself.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["HOME"] = str(home)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    if hide_installed_fedweigh:
        paths = sysconfig.get_paths()
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    return env


def site_python(hide_installed_fedweigh: bool, python: str | Path = sys.executable) -> list[str]:
    """The interpreter command of the server and sites.

    ``-S`` skips the site module in these parent processes only: they then import from PYTHONPATH
    (the site-packages, :func:`site_env`) but not from the ``.pth`` file that installs fedweigh.
    NVFlare starts each job process with ``PYTHONPATH = <parent sys.path> + <job custom/>``, so a job's
    bundled fedweigh comes before the installed one, appended later by the ``.pth``.
    """
    return [str(python), "-S"] if hide_installed_fedweigh else [str(python)]


def federation_python(folder: Path, package_src: Path) -> Path:
    """The Python of the federation's processes, with ``package_src`` (the code under test) as the
    installed fedweigh.

    A virtual environment without packages of its own whose ``.pth`` file adds this environment's
    site-packages and then ``package_src``. The environment running the tests may have fedweigh
    installed from another checkout (an editable install elsewhere): a site-installed job would then
    run that code while a bundled job runs the code under test, and the two would train differently.
    The ``.pth`` files of this environment's site-packages (that editable install) are not read here.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    (site_packages,) = folder.glob("lib/python*/site-packages")
    paths = sysconfig.get_paths()
    entries = dict.fromkeys([paths["purelib"], paths["platlib"], str(package_src)])
    (site_packages / "fedweigh_under_test.pth").write_text("\n".join(entries) + "\n")
    python = folder / "bin" / "python"
    probe = subprocess.run(
        [str(python), "-c", "import fedweigh; print(fedweigh.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")},
    )
    installed = Path(probe.stdout.strip())
    if probe.returncode != 0 or installed != package_src / "fedweigh" / "__init__.py":
        raise AssertionError(
            f"the federation's Python imports fedweigh from {installed}: {probe.stderr[-2000:]}"
        )
    return python


def allow_lead_byoc(kit: Path) -> None:
    """What a hospital that turns BYOC on for its leads writes: local/authorization.json, the
    provisioned default with the lead's ``byoc`` right set to ``any``."""
    authz = json.loads((kit / "local" / "authorization.json.default").read_text())
    assert authz["permissions"]["lead"]["byoc"] == "none", "the shipped project must give no role byoc"
    authz["permissions"]["lead"]["byoc"] = "any"
    (kit / "local" / "authorization.json").write_text(json.dumps(authz, indent=2))


def allow_fedweigh(kit: Path) -> str:
    """Run provisioning/allow_fedweigh.py on ``kit`` as a site's IT would."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "provisioning" / "allow_fedweigh.py"), str(kit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def run_cli(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``nvflare <args>`` as a child process; raises with its output when it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "nvflare.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"`nvflare {' '.join(args)}` failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def nvflare_json(args: list[str], kit: Path, env: dict[str, str], cwd: Path, timeout: float = 600) -> dict:
    """``nvflare --format json <args> --startup-kit <kit>``: the parsed JSON envelope, with ``exit_code``.

    The connect timeout is raised from NVFlare's 5 s: on a loaded CI machine the server answers the
    admin's challenge late while jobs start.
    """
    cmd = [sys.executable, "-m", "nvflare.cli", "--connect-timeout", "60", "--format", "json", *args]
    proc = subprocess.run(
        [*cmd, "--startup-kit", str(kit)], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    try:
        envelope = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise AssertionError(
            f"`nvflare {' '.join(args)}` printed no JSON ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        ) from None
    envelope.setdefault("exit_code", proc.returncode)
    return envelope


def admin_console(kit: Path, user: str, lines: list[str], env: dict[str, str], timeout: float = 300) -> str:
    """Type ``user`` and then ``lines`` into the admin console of ``kit`` (``startup/fl_admin.sh``, as an
    operator does), end the session, and return everything it printed."""
    proc = subprocess.run(
        ["bash", str(kit / "startup" / "fl_admin.sh")],
        input="\n".join([user, *lines, "bye"]) + "\n",
        cwd=kit,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.stdout + proc.stderr


def provision(project_yml: Path, workspace: Path, env: dict[str, str]) -> Path:
    """``nvflare provision -p project_yml -w workspace``; returns the folder holding the kits."""
    run_cli(["provision", "-p", str(project_yml), "-w", str(workspace)], env, cwd=workspace.parent)
    name = yaml.safe_load(project_yml.read_text())["name"]
    prod = workspace / name / PROD_FOLDER
    if not prod.is_dir():
        raise AssertionError(f"provisioning wrote no kits at {prod}")
    return prod


def start_command(kit: Path, python: list[str]) -> list[str]:
    """The command the kit's ``startup/sub_start.sh`` runs (``exec python3 -u -m ...``), for ``kit``."""
    script = (kit / "startup" / "sub_start.sh").read_text()
    lines = [ln.strip() for ln in script.splitlines() if ln.strip().startswith("exec python3 ")]
    if len(lines) != 1:
        raise AssertionError(
            f"{kit}/startup/sub_start.sh: expected one 'exec python3' line, found {len(lines)}"
        )
    argv = shlex.split(lines[0].replace('"$WORKSPACE"', shlex.quote(str(kit))))
    return [*python, *argv[2:]]


def move_server_storage(local_dir: Path, storage_root: Path) -> dict:
    """Write the server's ``local/resources.json`` with its job and snapshot storage under ``storage_root``.

    Provisioning puts both under ``/tmp/nvflare/`` (``resources.json.default``), a folder every
    federation on the machine would share.
    """
    resources = json.loads((local_dir / "resources.json.default").read_text())
    resources["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"] = str(storage_root / "snapshot")
    for comp in resources["components"]:
        if comp["id"] == "job_manager":
            comp["args"]["uri_root"] = str(storage_root / "jobs")
    (local_dir / "resources.json").write_text(json.dumps(resources, indent=2))
    return resources


def set_admin_message_timeout(kit: Path, seconds: float) -> None:
    """Raise the admin kit's ``authenticate_msg_timeout`` (``startup/fed_admin.json``, default 5 s).

    An admin client (the FLARE API session, the admin console, ``nvflare job ...``) challenges the
    server when it connects and gives up when the answer takes longer; a server busy starting jobs on
    a loaded machine can take that long.
    """
    path = kit / "startup" / "fed_admin.json"
    config = json.loads(path.read_text())
    config["admin"]["authenticate_msg_timeout"] = seconds
    path.write_text(json.dumps(config, indent=2))


@dataclass
class _Owned:
    """A process this federation started or one its processes launched (pid + start time: no reuse)."""

    pid: int
    create_time: float
    name: str

    def alive(self) -> psutil.Process | None:
        """The process if it still runs (an ended child the test has not reaped yet counts as ended)."""
        try:
            p = psutil.Process(self.pid)
            if p.create_time() != self.create_time or not p.is_running():
                return None
            return None if p.status() == psutil.STATUS_ZOMBIE else p
        except psutil.NoSuchProcess:
            return None


@dataclass
class Federation:
    """The server and sites of a provisioned project, run as local processes owned by the test."""

    prod: Path
    server: str
    sites: list[str]
    env: dict[str, str]
    python: list[str]
    logs: Path
    owned: dict[int, _Owned] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)

    def kit(self, name: str) -> Path:
        return self.prod / name

    def start(self) -> None:
        """Start the server, then every site, each in its own session, from its kit folder.

        A background thread records the job processes they launch every second until :meth:`stop`.
        """
        self.logs.mkdir(parents=True, exist_ok=True)
        for name in [self.server, *self.sites]:
            with open(self.logs / f"{name}.out", "w") as out:
                proc = subprocess.Popen(
                    start_command(self.kit(name), self.python),
                    cwd=self.kit(name),
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            with self._lock:
                self.owned[proc.pid] = _Owned(proc.pid, psutil.Process(proc.pid).create_time(), name)
            if name == self.server:
                time.sleep(1.0)
        threading.Thread(target=self._watch, name="federation-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.wait(1.0):
            self.track()

    def track(self) -> None:
        """Record the processes the server and sites launched (job processes start their own sessions)."""
        with self._lock:
            self._track()

    def _track(self) -> None:
        for own in list(self.owned.values()):
            proc = own.alive()
            if proc is None:
                continue
            try:
                children = proc.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for child in children:
                try:
                    self.owned.setdefault(
                        child.pid, _Owned(child.pid, child.create_time(), f"{own.name}/job")
                    )
                except psutil.NoSuchProcess:
                    pass

    def stop(self, grace: float = 5.0) -> list[str]:
        """End every owned process by pid (SIGTERM, then SIGKILL after ``grace`` seconds).

        Returns the names of processes that were still alive when the test ended them.
        """
        self._stopping.set()
        self.track()
        with self._lock:
            alive = [(own, p) for own in self.owned.values() if (p := own.alive()) is not None]
        for _, p in alive:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, survivors = psutil.wait_procs([p for _, p in alive], timeout=grace)
        for p in survivors:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(survivors, timeout=grace)
        return [own.name for own, _ in alive]

    def wait_until_ended(self, timeout: float, sites_only: bool = False) -> list[str]:
        """Wait up to ``timeout`` seconds for every owned process (``sites_only``: every process of a site
        and its jobs) to end by itself; the names still alive."""
        deadline = time.monotonic() + timeout
        while True:
            self.track()
            with self._lock:
                alive = [
                    own.name
                    for own in self.owned.values()
                    if own.alive() is not None and not (sites_only and own.name.split("/")[0] == self.server)
                ]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(1.0)

    def still_running(self) -> list[int]:
        """Pids of owned processes that are alive."""
        with self._lock:
            return [own.pid for own in self.owned.values() if own.alive() is not None]

    def log_tail(self, chars: int = 3000) -> str:
        """The end of every log of the federation (for failure messages)."""
        parts = []
        for path in sorted(self.logs.glob("*.out")) + sorted(self.prod.rglob("log.txt")):
            text = path.read_text(errors="replace")
            parts.append(f"----- {path}\n{text[-chars:]}")
        return "\n".join(parts)


def wait_for_sites(session, sites: list[str], federation: Federation, timeout: float = 120) -> None:
    """Wait until every site is connected to the server (``session.get_system_info()``)."""
    deadline = time.monotonic() + timeout
    connected: set[str] = set()
    while time.monotonic() < deadline:
        connected = {c.name for c in session.get_system_info().client_info}
        if set(sites) <= connected:
            return
        time.sleep(1.0)
    raise AssertionError(
        f"sites {sorted(set(sites) - connected)} did not connect within {timeout} s\n{federation.log_tail()}"
    )


def wait_for_job(session, job_id: str, federation: Federation, timeout: float = 300) -> dict:
    """Poll ``get_job_meta`` until the job has finished."""
    deadline = time.monotonic() + timeout
    meta: dict = {}
    while time.monotonic() < deadline:
        meta = session.get_job_meta(job_id)
        if str(meta.get("status", "")).startswith("FINISHED"):
            return meta
        time.sleep(1.0)
    raise AssertionError(
        f"job {job_id} did not finish within {timeout} s (meta {meta})\n{federation.log_tail()}"
    )

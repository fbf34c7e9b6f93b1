"""TenSEAL CKKS contexts: how they are made and serialised, and where a process finds its keys.

The context files are those of NVFlare's ``HEBuilder`` (nvflare.lighter.impl.he): CKKS,
poly_modulus_degree 8192, coeff_mod_bit_sizes [60, 40, 40], scale 2^40, symmetric encryption,
``server_context.tenseal`` without secret key and ``client_context.tenseal`` with it, in each
startup kit. The server only ever holds the public context: it can add ciphertexts but not decrypt
them (the sum protocol is in :mod:`fedweigh.secure.vectors`).

:func:`locate_context` finds a role's file (``FEDWEIGH_HE_CONTEXT_DIR``, then the ``startup/``
folder of the site's workspace), and in the NVFlare simulator, whose workspaces have no HE context,
creates a simulation-only key pair shared by the simulated server and clients
(:func:`simulation_keys`). Simulation key files start with :data:`SIMULATION_HEADER`, so they stay
marked wherever they are copied; they are refused in a provisioned workspace. Checking a kit file's
signature needs NVFlare and lives in :mod:`fedweigh.flare.keys`.

References: Cheon, Kim, Kim & Song, "Homomorphic encryption for arithmetic of approximate numbers"
(ASIACRYPT 2017); TenSEAL (Benaissa et al., 2021).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from fedweigh.errors import ContextNotFoundError, SimulationKeysRefused
from fedweigh.io import atomic_write_bytes, atomic_write_text

__all__ = [
    "CLIENT_CONTEXT_FILE",
    "COEFF_MOD_BIT_SIZES",
    "CONTEXT_DIR_ENV",
    "CONTEXT_FILES",
    "MAX_LEVELS_UP",
    "POLY_MODULUS_DEGREE",
    "PROVISIONED_MARKERS",
    "SCALE_BITS",
    "SERVER_CONTEXT_FILE",
    "SIMULATION_DIR",
    "SIMULATION_HEADER",
    "SIMULATION_MARKER",
    "SIMULATOR_JOB_FOLDER",
    "STARTUP_FOLDER",
    "ContextLocation",
    "ContextNotFoundError",
    "SimulationKeysRefused",
    "context_from_bytes",
    "find_site_root",
    "is_provisioned",
    "is_public",
    "is_simulation_key_data",
    "is_simulator_site",
    "load_context",
    "locate_context",
    "make_context",
    "save_context_files",
    "serialize_context",
    "simulation_keys",
]

if TYPE_CHECKING:  # TenSEAL is imported where a context is made or read: plaintext runs never load it
    import tenseal as ts

#: Environment variable naming a folder with ``server_context.tenseal`` / ``client_context.tenseal``.
CONTEXT_DIR_ENV = "FEDWEIGH_HE_CONTEXT_DIR"
#: File names written by NVFlare's HEBuilder (nvflare.lighter.constants.ProvFileName).
SERVER_CONTEXT_FILE = "server_context.tenseal"
CLIENT_CONTEXT_FILE = "client_context.tenseal"
CONTEXT_FILES = {"server": SERVER_CONTEXT_FILE, "client": CLIENT_CONTEXT_FILE}
#: Startup-kit folder of an NVFlare workspace (WorkspaceConstants.STARTUP_FOLDER_NAME).
STARTUP_FOLDER = "startup"
#: Files that only a provisioned (or POC) startup kit holds; the simulator's startup/ is empty.
PROVISIONED_MARKERS = ("fed_server.json", "fed_client.json", "rootCA.pem")
#: The simulator's fixed job folder in each simulated site (SimulatorConstants.JOB_NAME).
SIMULATOR_JOB_FOLDER = "simulate_job"
#: Folder (under the simulator workspace root) holding the simulation key pair, and its marker file.
SIMULATION_DIR = "fedweigh_simulation_keys"
SIMULATION_MARKER = "fedweigh_simulation_keys.json"
#: First bytes of every simulation key file; the TenSEAL context follows.
SIMULATION_HEADER = b"FEDWEIGH-SIMULATION-KEYS-NOT-FOR-DEPLOYMENT-v1\n"

#: HEBuilder's defaults.
POLY_MODULUS_DEGREE = 8192
COEFF_MOD_BIT_SIZES = (60, 40, 40)
SCALE_BITS = 40

#: How many folders above the start folder may hold the site's startup/ (app dir -> job dir -> site).
MAX_LEVELS_UP = 3


# ------------------------------------------------------------------------------------------ contexts
def make_context(
    poly_modulus_degree: int = POLY_MODULUS_DEGREE,
    coeff_mod_bit_sizes: Sequence[int] = COEFF_MOD_BIT_SIZES,
    scale_bits: int = SCALE_BITS,
) -> ts.Context:
    """A fresh CKKS context with secret key, built as NVFlare's HEBuilder builds it."""
    import tenseal as ts

    ctx = ts.context(
        ts.SCHEME_TYPE.CKKS,
        poly_modulus_degree=poly_modulus_degree,
        coeff_mod_bit_sizes=list(coeff_mod_bit_sizes),
        encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC,
    )
    ctx.generate_relin_keys()
    ctx.global_scale = 2.0**scale_bits
    return ctx


def serialize_context(ctx: ts.Context, *, with_secret_key: bool) -> bytes:
    """HEBuilder's serialisation: the client file keeps the secret key, the server file does not."""
    if with_secret_key and not ctx.has_secret_key():
        raise ValueError("cannot write a client context from a context without secret key")
    return ctx.serialize(
        save_public_key=with_secret_key,
        save_secret_key=with_secret_key,
        save_galois_keys=False,
        save_relin_keys=True,
    )


def is_public(ctx: ts.Context) -> bool:
    """True when ``ctx`` holds no secret key (what the server may hold)."""
    return not ctx.has_secret_key()


def save_context_files(
    directory: str | Path, ctx: ts.Context | None = None, *, simulation: bool = False
) -> tuple[Path, Path]:
    """Write ``server_context.tenseal`` (no secret key) and ``client_context.tenseal`` (with it).

    ``simulation=True`` prefixes both files with :data:`SIMULATION_HEADER`. Returns
    (server_path, client_path).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ctx = ctx if ctx is not None else make_context()
    header = SIMULATION_HEADER if simulation else b""
    server_path, client_path = directory / SERVER_CONTEXT_FILE, directory / CLIENT_CONTEXT_FILE
    atomic_write_bytes(server_path, header + serialize_context(ctx, with_secret_key=False))
    atomic_write_bytes(client_path, header + serialize_context(ctx, with_secret_key=True))
    return server_path, client_path


def is_simulation_key_data(data: bytes) -> bool:
    """True when ``data`` (a context file's content) starts with :data:`SIMULATION_HEADER`."""
    return data.startswith(SIMULATION_HEADER)


def context_from_bytes(data: bytes, *, role: str | None = None, origin: str = "<bytes>") -> ts.Context:
    """Deserialise a context file's content (simulation header removed) and check it fits ``role``.

    role "server": the context must hold no secret key; role "client": it must hold one.
    """
    import tenseal as ts

    if role not in (None, "server", "client"):
        raise ValueError(f"role must be 'server' or 'client', got {role!r}")
    if is_simulation_key_data(data):
        data = data[len(SIMULATION_HEADER) :]
    try:
        ctx = ts.context_from(data)
    except Exception as e:  # TenSEAL raises plain ValueError/RuntimeError on bad protobuf
        raise ValueError(f"{origin}: not a TenSEAL context ({e})") from None
    if role == "server" and ctx.has_secret_key():
        raise ValueError(
            f"{origin}: this context holds a SECRET KEY; the server may only hold the public context "
            f"({SERVER_CONTEXT_FILE} as written by HEBuilder). Refusing to use it."
        )
    if role == "client" and not ctx.has_secret_key():
        raise ValueError(f"{origin}: this context holds no secret key; sites need {CLIENT_CONTEXT_FILE}")
    return ctx


def load_context(path: str | Path, role: str | None = None) -> ts.Context:
    """Read a context file (plain or simulation-marked); see :func:`context_from_bytes` for ``role``."""
    path = Path(path)
    return context_from_bytes(path.read_bytes(), role=role, origin=str(path))


# ---------------------------------------------------------------------------------- where keys live
def find_site_root(start: str | Path | None = None, max_levels_up: int = MAX_LEVELS_UP) -> Path | None:
    """The nearest folder at or above ``start`` (default: cwd) that has a ``startup/`` folder.

    NVFlare runs a site's job process in the site's workspace root and an external client script in
    ``<root>/<job_id>/app_<site>``, hence the search upwards.
    """
    here = Path(start if start is not None else Path.cwd()).resolve()
    for candidate in [here, *here.parents][: max_levels_up + 1]:
        if (candidate / STARTUP_FOLDER).is_dir():
            return candidate
    return None


def is_provisioned(startup_dir: str | Path) -> bool:
    """True when ``startup_dir`` belongs to a provisioned (or POC) kit: it has fed_*.json or rootCA.pem."""
    startup_dir = Path(startup_dir)
    return any((startup_dir / name).exists() for name in PROVISIONED_MARKERS)


def is_simulator_site(site_root: str | Path) -> bool:
    """True for a site folder of ``nvflare simulator``: no provisioned kit, a ``simulate_job/`` folder."""
    site_root = Path(site_root)
    return (site_root / SIMULATOR_JOB_FOLDER).is_dir() and not is_provisioned(site_root / STARTUP_FOLDER)


def simulation_keys(root: str | Path) -> Path:
    """The simulation-only key folder under ``root``, created on first use (race-safe).

    The key pair is written into a private temporary folder that is then renamed into place
    (atomic, so a visible folder is always complete): concurrent callers (the simulated server and
    clients) all end up with the same pair. Both files carry :data:`SIMULATION_HEADER`;
    :data:`SIMULATION_MARKER` describes them.
    """
    root = Path(root)
    final = root / SIMULATION_DIR
    if not (final / SIMULATION_MARKER).is_file() and not (final.exists() and any(final.iterdir())):
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{SIMULATION_DIR}."))
        try:
            save_context_files(tmp, simulation=True)
            marker = {
                "purpose": "nvflare simulator only",
                "warning": "generated automatically for a simulated federation; never use in a deployment",
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "scheme": "CKKS",
                "poly_modulus_degree": POLY_MODULUS_DEGREE,
                "coeff_mod_bit_sizes": list(COEFF_MOD_BIT_SIZES),
                "scale_bits": SCALE_BITS,
                "files": [SERVER_CONTEXT_FILE, CLIENT_CONTEXT_FILE],
            }
            atomic_write_text(tmp / SIMULATION_MARKER, json.dumps(marker, indent=2) + "\n", private=False)
            try:
                if final.exists():  # an empty folder: rename can only replace it once removed
                    final.rmdir()
                os.rename(tmp, final)
            except OSError:  # lost the race: another process' complete pair is in place
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not (final / SIMULATION_MARKER).is_file():
        raise RuntimeError(
            f"{final} exists but has no {SIMULATION_MARKER}: it is not a fedweigh simulation key folder; "
            f"remove it or set {CONTEXT_DIR_ENV}"
        )
    return final


@dataclass(frozen=True)
class ContextLocation:
    """Where a role's context file was found and what kind of setting this process runs in."""

    path: Path
    role: str
    source: str  # "env" | "kit" | "simulation"
    simulation: bool  # the file carries the simulation header
    provisioned: bool  # this process belongs to a provisioned (or POC) workspace
    startup_dir: Path | None  # the site's startup/ folder, if found


def _file_is_simulation(path: Path) -> bool:
    with open(path, "rb") as f:
        return is_simulation_key_data(f.read(len(SIMULATION_HEADER)))


def locate_context(
    role: str, start: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> ContextLocation:
    """Find the context file of ``role`` ("server" or "client") for this process.

    Order: 1. ``$FEDWEIGH_HE_CONTEXT_DIR/<file>``; 2. ``<site root>/startup/<file>`` where the site
    root is the nearest folder at or above ``start`` (default: cwd) with a ``startup/`` folder;
    3. in an ``nvflare simulator`` workspace only: the simulation key pair under the simulator's
    workspace root (the site root's parent), created on first use.
    Raises :class:`SimulationKeysRefused` when the file found is a simulation key in a provisioned
    workspace, and :class:`ContextNotFoundError` naming every place searched when none is found.
    """
    if role not in CONTEXT_FILES:
        raise ValueError(f"role must be 'server' or 'client', got {role!r}")
    name = CONTEXT_FILES[role]
    environ = os.environ if environ is None else environ
    start_dir = Path(start if start is not None else Path.cwd()).resolve()
    site_root = find_site_root(start_dir)
    startup = site_root / STARTUP_FOLDER if site_root is not None else None
    provisioned = startup is not None and is_provisioned(startup)

    def found(path: Path, source: str) -> ContextLocation:
        simulation = _file_is_simulation(path)
        if simulation and provisioned:
            raise SimulationKeysRefused(
                f"{path} holds fedweigh SIMULATION keys, but this process runs in a provisioned workspace "
                f"({startup} has {', '.join(n for n in PROVISIONED_MARKERS if (startup / n).exists())}). "
                "Simulation keys are shared in clear on one machine and must never protect a deployment: "
                f"provision HE contexts with NVFlare's HEBuilder (e.g. `nvflare poc prepare --he`) "
                f"or point {CONTEXT_DIR_ENV} at real keys."
            )
        return ContextLocation(path, role, source, simulation, provisioned, startup)

    env_dir = environ.get(CONTEXT_DIR_ENV)
    if env_dir:
        path = Path(env_dir) / name
        if not path.is_file():
            raise ContextNotFoundError(f"{CONTEXT_DIR_ENV}={env_dir} is set but {path} does not exist")
        return found(path, "env")
    if startup is not None and (startup / name).is_file():
        return found(startup / name, "kit")
    if provisioned:
        raise ContextNotFoundError(
            f"the startup kit {startup} has no {name}: secure statistics need HE contexts. Provision them "
            "with NVFlare's HEBuilder (project.yml builders, or `nvflare poc prepare --he`), or set "
            f"{CONTEXT_DIR_ENV}."
        )
    if site_root is not None and is_simulator_site(site_root):
        return found(simulation_keys(site_root.parent) / name, "simulation")
    looked = [f"${CONTEXT_DIR_ENV} (not set)"]
    if startup is not None:
        looked.append(f"{startup / name} (missing; {site_root} is not an nvflare simulator site)")
    else:
        looked.append(
            f"<dir>/{STARTUP_FOLDER}/{name} for {start_dir} and up to {MAX_LEVELS_UP} parent folders "
            f"(no {STARTUP_FOLDER}/ folder)"
        )
    raise ContextNotFoundError(f"no {role} TenSEAL context ({name}) found; looked at: " + "; ".join(looked))

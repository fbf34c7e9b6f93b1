"""HE contexts in an NVFlare process: find, signature-check and load a role's TenSEAL context.

Where the contexts come from (:func:`fedweigh.secure.contexts.locate_context`):
``FEDWEIGH_HE_CONTEXT_DIR``; else the ``startup/`` folder of the NVFlare workspace the process runs
in (the server's or site's kit, written by NVFlare's HEBuilder, e.g. ``nvflare poc prepare --he``);
else, in ``nvflare simulator`` workspaces only, a simulation key pair created under the simulator
workspace root. Kit files are checked against the kit's ``signature.json`` with NVFlare's own
verifier (``SecurityContentManager``), as NVFlare's HE components do in secure mode.

:func:`role_context_provider` is what :class:`fedweigh.secure.exchange.SecureExchange` takes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from nvflare.fuel.sec.security_content_service import LoadResult, SecurityContentManager

from fedweigh.secure.contexts import ContextLocation, context_from_bytes, locate_context
from fedweigh.secure.exchange import ContextProvider

__all__ = ["SIGNATURE_FILE", "load_role_context", "read_verified_context", "role_context_provider"]

if TYPE_CHECKING:  # TenSEAL is loaded by the first context read (fedweigh.secure.contexts), not on import
    import tenseal as ts

logger = logging.getLogger("fedweigh.flare.keys")

SIGNATURE_FILE = "signature.json"

_cache_lock = threading.Lock()
_context_cache: dict[tuple[str, str], ts.Context] = {}


def read_verified_context(location: ContextLocation) -> bytes:
    """The bytes of a context file, signature-checked when it comes from a provisioned kit.

    Uses NVFlare's ``SecurityContentManager`` (the verifier behind ``load_tenseal_context_from_workspace``):
    in a provisioned kit the file must carry a valid root-CA signature in ``startup/signature.json``;
    files named by ``FEDWEIGH_HE_CONTEXT_DIR`` are checked when their folder holds a signature.json.
    """
    folder = location.path.parent
    must_be_signed = location.source == "kit" and location.provisioned
    signed_folder = (folder / SIGNATURE_FILE).is_file() and (folder / "rootCA.pem").is_file()
    if not (must_be_signed or signed_folder):
        return location.path.read_bytes()
    data, result = SecurityContentManager(str(folder)).load_content(location.path.name)
    if result == LoadResult.OK:
        return data
    if result == LoadResult.NOT_SIGNED and not must_be_signed:
        return location.path.read_bytes()
    raise PermissionError(
        f"{location.path}: signature check failed ({result.value}); HE context files in a provisioned kit must be "
        f"signed by the project's root CA (HEBuilder before SignatureBuilder in project.yml). Refusing to use it."
    )


def load_role_context(role: str, start: str | Path | None = None) -> tuple[ts.Context, ContextLocation]:
    """Locate, verify and load the context of ``role``.

    The file is read and verified on every call; only the deserialisation is cached (by content hash).
    """
    location = locate_context(role, start=start)
    data = read_verified_context(location)
    key = (role, hashlib.sha256(data).hexdigest())
    with _cache_lock:
        ctx = _context_cache.get(key)
    if ctx is None:
        ctx = context_from_bytes(data, role=role, origin=str(location.path))
        with _cache_lock:
            _context_cache[key] = ctx
        if location.simulation:
            logger.warning(
                "secure statistics use SIMULATION-ONLY keys %s (nvflare simulator: every simulated party "
                "reads the same folder; never use them in a deployment)",
                location.path,
            )
        else:
            logger.info("secure statistics: %s context from %s (%s)", role, location.path, location.source)
    return ctx, location


def role_context_provider(start_dir: str | Path | None = None) -> ContextProvider:
    """``role -> context`` through :func:`load_role_context`, for :class:`~fedweigh.secure.exchange.SecureExchange`.

    ``start_dir`` replaces the working directory as the place to search for the workspace's
    ``startup/`` folder (the default suits NVFlare's server and client processes).
    """

    def provide(role: str) -> ts.Context:
        ctx, _ = load_role_context(role, start=start_dir)
        return ctx

    return provide

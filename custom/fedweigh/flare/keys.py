"""HE contexts in an NVFlare process: find, signature-check and load a role's TenSEAL context.

Where the contexts come from (:func:`fedweigh.secure.contexts.locate_context`):
``FEDWEIGH_HE_CONTEXT_DIR``; else the ``startup/`` folder of the NVFlare workspace the process runs
in (the server's or site's kit, written by NVFlare's HEBuilder, e.g. ``nvflare poc prepare --he``);
else, in ``nvflare simulator`` workspaces only, a simulation key pair created under the simulator
workspace root. Kit files are checked against the kit's ``signature.json`` with NVFlare's own
verifier (``SecurityContentManager``) against the kit's own root certificate, as NVFlare's HE
components do in secure mode.

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

__all__ = [
    "ROOT_CERT_FILE",
    "SIGNATURE_FILE",
    "kit_root_certificate",
    "load_role_context",
    "read_verified_context",
    "role_context_provider",
]

if TYPE_CHECKING:  # TenSEAL is loaded by the first context read (fedweigh.secure.contexts), not on import
    import tenseal as ts

logger = logging.getLogger("fedweigh.flare.keys")

SIGNATURE_FILE = "signature.json"
#: The root CA certificate in a provisioned kit's startup/ folder.
ROOT_CERT_FILE = "rootCA.pem"

_cache_lock = threading.Lock()
_context_cache: dict[tuple[str, str], ts.Context] = {}


def kit_root_certificate(location: ContextLocation) -> Path | None:
    """The root CA certificate of the kit this process runs in (``<site root>/startup/rootCA.pem``),
    the only certificate a context's signature is checked against; None outside a provisioned kit."""
    if not location.provisioned or location.startup_dir is None:
        return None
    cert = Path(location.startup_dir) / ROOT_CERT_FILE
    return cert if cert.is_file() else None


def read_verified_context(location: ContextLocation) -> bytes:
    """The bytes of a context file, signature-checked whenever this process runs in a provisioned kit.

    Uses NVFlare's ``SecurityContentManager`` (the verifier behind ``load_tenseal_context_from_workspace``)
    with the trust anchor fixed to the kit's own root certificate (:func:`kit_root_certificate`): the
    context's folder must hold a ``signature.json`` that this root CA signed, wherever the file comes from
    (the kit's ``startup/`` or ``FEDWEIGH_HE_CONTEXT_DIR``). A ``rootCA.pem`` lying next to the context
    is not trusted: whoever can write the context can write that too. Outside a provisioned kit
    (simulation, tests) there is no root CA to check against and the file is read as it is.
    """
    folder = location.path.parent
    if not location.provisioned:
        return location.path.read_bytes()
    cert = kit_root_certificate(location)
    if cert is None:
        raise PermissionError(
            f"{location.path}: this process runs in a provisioned kit but its startup folder "
            f"{location.startup_dir} holds no {ROOT_CERT_FILE} to check the context's signature against. "
            "Refusing to use it."
        )
    data, result = SecurityContentManager(str(folder), root_cert=str(cert.resolve())).load_content(
        location.path.name
    )
    if result == LoadResult.OK:
        return data
    raise PermissionError(
        f"{location.path}: signature check against the kit's root CA {cert} failed ({result.value}); HE "
        "context files must be signed by the project's root CA (HEBuilder before SignatureBuilder in "
        "project.yml). Refusing to use it."
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

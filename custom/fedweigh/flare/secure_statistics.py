"""The ``secure`` statistics exchange: sites send Enc(v_k), the server returns sum_k Enc(v_k).

Client (``encode``/``decode``): loads ``client_context.tenseal`` (with secret key), encrypts its
statistics vector v_k, later decrypts the summed vector. Server (``check``/``sum``): loads only
``server_context.tenseal``, refuses a context that holds a secret key, checks that every site sent
one CKKS ciphertext of the expected size, and adds them. Everything the server receives from a site
in this phase is: the ciphertext (base64 text), the vector length, the sample count N_k (already
sent by stock FedAvg) and the encoding name.

Where the contexts come from (:func:`fedweigh.secure.locate_context`): ``FEDWEIGH_HE_CONTEXT_DIR``;
else the ``startup/`` folder of the NVFlare workspace the process runs in (the server's or site's
kit, written by NVFlare's HEBuilder, e.g. ``nvflare poc prepare --he``); else, in ``nvflare
simulator`` workspaces only, a simulation key pair created under the simulator workspace root.
Kit files are checked against the kit's ``signature.json`` with NVFlare's own verifier, as NVFlare's
HE components do in secure mode.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import threading
from pathlib import Path

import numpy as np
import tenseal as ts

from fedweigh.flare.statistics import StatisticsExchange
from fedweigh.secure import (
    ContextLocation,
    ciphertext_size,
    context_from_bytes,
    decrypt_vector,
    encrypt_vector,
    locate_context,
    sum_encrypted,
)

logger = logging.getLogger("fedweigh.secure_statistics")

META_CIPHERTEXT = "fedweigh_stats_ciphertext"
META_ENCODING = "fedweigh_stats_encoding"
META_NUM_CONTRIBUTIONS = "fedweigh_stats_num_contributions"
META_LENGTH = "fedweigh_stats_length"
#: CKKS, each entry split in two slots (B = 2^20) plus one count slot (fedweigh.secure).
ENCODING = "ckks-split20-count-v1"
SIGNATURE_FILE = "signature.json"

_cache_lock = threading.Lock()
_context_cache: dict[tuple[str, str], ts.Context] = {}


def read_verified_context(location: ContextLocation) -> bytes:
    """The bytes of a context file, signature-checked when it comes from a provisioned kit.

    Uses NVFlare's ``SecurityContentManager`` (the verifier behind ``load_tenseal_context_from_workspace``):
    in a provisioned kit the file must carry a valid root-CA signature in ``startup/signature.json``;
    files named by ``FEDWEIGH_HE_CONTEXT_DIR`` are checked when their folder holds a signature.json.
    """
    from nvflare.fuel.sec.security_content_service import LoadResult, SecurityContentManager

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


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(site: str, value: object) -> bytes:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{site}: {META_CIPHERTEXT} must be a non-empty base64 string")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError(f"{site}: {META_CIPHERTEXT} is not valid base64") from None


class SecureExchange(StatisticsExchange):
    """Statistics summed under CKKS encryption; the server holds no secret key.

    ``start_dir`` replaces the working directory as the place to search for the workspace's
    ``startup/`` folder (the default suits NVFlare's server and client processes).
    """

    mode = "secure"

    def __init__(self, start_dir: str | Path | None = None):
        self.start_dir = start_dir
        #: contexts this object has loaded, by role (the server side only ever loads "server")
        self.contexts: dict[str, ts.Context] = {}

    def _context(self, role: str) -> ts.Context:
        if role not in self.contexts:
            self.contexts[role], _ = load_role_context(role, start=self.start_dir)
        return self.contexts[role]

    # ----------------------------------------------------------------------------------- client
    def encode(self, vector: np.ndarray) -> dict:
        vec = np.asarray(vector, dtype=np.float64)
        ctx = self._context("client")
        data = encrypt_vector(ctx, vec)
        # catch parameter problems here rather than as a wrong global sum at every site
        check = decrypt_vector(ctx, data, vec.size, num_contributions=1)
        if not np.allclose(check, vec, rtol=1e-9, atol=1e-4):
            raise RuntimeError(
                "CKKS round trip of the statistics vector failed: unsuitable context parameters"
            )
        return {META_CIPHERTEXT: _b64(data), META_ENCODING: ENCODING}

    def decode(self, payload: dict) -> np.ndarray:
        if payload.get(META_ENCODING) != ENCODING:
            raise ValueError(
                f"secure statistics: unknown encoding {payload.get(META_ENCODING)!r}, expected {ENCODING}"
            )
        length = payload.get(META_LENGTH)
        count = payload.get(META_NUM_CONTRIBUTIONS)
        if not isinstance(length, int) or not isinstance(count, int) or count < 1:
            raise ValueError(
                f"secure statistics: the server's sum lacks {META_LENGTH} or {META_NUM_CONTRIBUTIONS}"
            )
        data = _unb64("server", payload.get(META_CIPHERTEXT))
        return decrypt_vector(self._context("client"), data, length, num_contributions=count)

    # ----------------------------------------------------------------------------------- server
    def check(self, site: str, payload: dict, length: int) -> None:
        if payload.get(META_ENCODING) != ENCODING:
            raise ValueError(f"{site}: statistics encoding {payload.get(META_ENCODING)!r} is not {ENCODING}")
        data = _unb64(site, payload.get(META_CIPHERTEXT))
        try:
            size = ciphertext_size(self._context("server"), data)
        except ValueError as e:
            raise ValueError(f"{site}: {e}") from None
        if size != 2 * length + 1:
            raise ValueError(
                f"{site}: ciphertext has {size} slots, expected {2 * length + 1} for length {length}"
            )

    def sum(self, site_payloads: dict[str, dict], length: int) -> dict:
        if not site_payloads:
            raise ValueError("secure statistics: no valid contribution to sum")
        ctx = self._context("server")
        if ctx.has_secret_key():  # context_from_bytes already refuses this; never let it pass silently
            raise PermissionError("the server's TenSEAL context holds a secret key")
        ciphertexts = [_unb64(site, p.get(META_CIPHERTEXT)) for site, p in sorted(site_payloads.items())]
        total = sum_encrypted(ctx, ciphertexts)
        return {
            META_CIPHERTEXT: _b64(total),
            META_ENCODING: ENCODING,
            META_NUM_CONTRIBUTIONS: len(ciphertexts),
            META_LENGTH: int(length),
        }


__all__ = [
    "ENCODING",
    "META_CIPHERTEXT",
    "META_ENCODING",
    "META_LENGTH",
    "META_NUM_CONTRIBUTIONS",
    "SecureExchange",
    "load_role_context",
    "read_verified_context",
]

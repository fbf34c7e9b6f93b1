"""The ``secure`` statistics exchange: sites send Enc(v_k), the server returns sum_k Enc(v_k).

Client (``encode``/``decode``): uses the client context (with secret key), encrypts its statistics
vector v_k (:func:`fedweigh.secure.vectors.encrypt_vector`), later decrypts the summed vector.
Server (``check``/``sum``): uses only the server context, refuses a context that holds a secret
key, checks that every site sent one fresh CKKS ciphertext of the expected size (at the context's
scale and first level, so that one contribution cannot make the sum fail), and adds them. A site
decrypts a sum only when it holds at least ``min_contributions`` contributions (its site policy's
minimum), checked against the encrypted count slot.
Everything the server receives from a site in this phase is: the ciphertext (base64 text), the
vector length, the sample count N_k (already sent by stock FedAvg) and the encoding name.

No NVFlare import: the contexts come from a *context provider*, a callable ``role -> context``
given to :class:`SecureExchange`. In an NVFlare process that is
:func:`fedweigh.flare.keys.role_context_provider`, which finds the kit's files
(:func:`fedweigh.secure.contexts.locate_context`) and checks their signature.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from fedweigh.histograms import META_LENGTH, META_NUM_CONTRIBUTIONS, StatisticsExchange
from fedweigh.protocol import ABSOLUTE_MIN
from fedweigh.secure.precision import precision_bits_for
from fedweigh.secure.vectors import (
    check_fresh_ciphertext,
    decrypt_vector,
    encrypt_vector,
    load_ckks_vector,
    sum_encrypted,
)

__all__ = [
    "ENCODING",
    "META_CIPHERTEXT",
    "META_ENCODING",
    "META_LENGTH",
    "META_NUM_CONTRIBUTIONS",
    "ContextProvider",
    "SecureExchange",
]

if TYPE_CHECKING:  # the contexts come from the provider; importing this module does not load TenSEAL
    import tenseal as ts

META_CIPHERTEXT = "fedweigh_stats_ciphertext"
META_ENCODING = "fedweigh_stats_encoding"
# META_LENGTH (the vector length, sent by every site and with the sum) and META_NUM_CONTRIBUTIONS
# (the number of contributions in a sum) are fedweigh.histograms' own.

#: CKKS, each entry split in two slots (B = 2^20) plus one count slot (fedweigh.secure.vectors).
ENCODING = "ckks-split20-count-v1"

#: ``role -> context`` for role "server" (public context) or "client" (with secret key).
ContextProvider = Callable[[str], "ts.Context"]


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

    Args:
        context_provider: ``role -> tenseal.Context``; called at most once per role and object
            (the server side only ever asks for ``"server"``, the client side for ``"client"``).
        min_contributions: the fewest contributions a sum may hold for this party to decrypt it.
        precision_bits: the fractional bits the federation rounds decrypted values to
            (:mod:`fedweigh.secure.precision`; None: the default for the context's scale).
    """

    mode = "secure"

    def __init__(
        self,
        context_provider: ContextProvider,
        min_contributions: int = ABSOLUTE_MIN,
        precision_bits: int | None = None,
    ) -> None:
        self.context_provider = context_provider
        self.min_contributions = int(min_contributions)
        self.precision_bits = precision_bits
        #: contexts this object has obtained, by role
        self.contexts: dict[str, ts.Context] = {}

    def _context(self, role: str) -> ts.Context:
        if role not in self.contexts:
            self.contexts[role] = self.context_provider(role)
        return self.contexts[role]

    # ----------------------------------------------------------------------------------- client
    def encode(self, vector: np.ndarray) -> dict:
        vec = np.asarray(vector, dtype=np.float64)
        ctx = self._context("client")
        data = encrypt_vector(ctx, vec)
        # catch parameter problems here rather than as a wrong global sum at every site
        check = decrypt_vector(ctx, data, vec.size, 1, self.precision_bits)
        step = 2.0 ** -precision_bits_for(ctx, self.precision_bits)
        if not np.allclose(check, vec, rtol=1e-9, atol=1e-4 + step / 2):
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
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"secure statistics: the server's sum lacks a valid {META_LENGTH}")
        # before anything is decrypted; decrypt_vector then checks the count against the count slot
        count = self.check_quorum(payload)
        data = _unb64("server", payload.get(META_CIPHERTEXT))
        return decrypt_vector(self._context("client"), data, length, count, self.precision_bits)

    # ----------------------------------------------------------------------------------- server
    def check(self, site: str, payload: dict, length: int) -> None:
        if payload.get(META_ENCODING) != ENCODING:
            raise ValueError(f"{site}: statistics encoding {payload.get(META_ENCODING)!r} is not {ENCODING}")
        data = _unb64(site, payload.get(META_CIPHERTEXT))
        ctx = self._context("server")
        try:
            vec = load_ckks_vector(ctx, data)
        except ValueError as e:
            raise ValueError(f"{site}: {e}") from None
        check_fresh_ciphertext(ctx, vec, site)
        size = vec.size()
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

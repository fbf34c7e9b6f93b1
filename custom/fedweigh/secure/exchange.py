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

Binding. Every contribution carries :data:`TAG_SLOTS` more entries after v_k, its *binding tag*
t_k = HMAC-SHA256(K, [job id, exchange id, site]) cut into three 20-bit integers, where the key
K = HMAC-SHA256(client context with its secret key, "fedweigh statistics binding v1") is known to
every site and not to the server (it holds only the public context). A site decodes a sum only when
its tag entries equal sum_k t_k over the members the server announces, for the job and the exchange
id the site contributed to: a sum of an earlier job or exchange (replayed), a sum whose member list
is misstated, or one site's ciphertext passed off as a sum of several (its count slot forged by
adding a plaintext) is refused. Without the secret key the server cannot compute a tag for a new
exchange; a random match has probability 2^-60. Tags below 2^20 stay exact in the slot encoding
for sums of up to thousands of sites (:mod:`fedweigh.secure.vectors`).

No NVFlare import: the contexts come from a *context provider*, a callable ``role -> context``
given to :class:`SecureExchange`. In an NVFlare process that is
:func:`fedweigh.flare.keys.role_context_provider`, which finds the kit's files
(:func:`fedweigh.secure.contexts.locate_context`) and checks their signature.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from fedweigh.histograms import (
    META_LENGTH,
    META_MEMBERS,
    META_NUM_CONTRIBUTIONS,
    ExchangeBinding,
    StatisticsExchange,
)
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
    "TAG_BITS",
    "TAG_SLOTS",
    "ContextProvider",
    "SecureExchange",
    "binding_key",
    "binding_tag",
]

if TYPE_CHECKING:  # the contexts come from the provider; importing this module does not load TenSEAL
    import tenseal as ts

META_CIPHERTEXT = "fedweigh_stats_ciphertext"
META_ENCODING = "fedweigh_stats_encoding"
# META_LENGTH (the vector length, sent by every site and with the sum) and META_NUM_CONTRIBUTIONS
# (the number of contributions in a sum) are fedweigh.histograms' own.

#: CKKS, each entry split in two slots (B = 2^20) plus one count slot (fedweigh.secure.vectors); v_k is
#: followed by its TAG_SLOTS binding-tag entries (module docstring).
ENCODING = "ckks-split20-tag3-count-v2"
#: Binding tag: TAG_SLOTS integers of TAG_BITS bits each, from one HMAC-SHA256 (module docstring).
TAG_SLOTS = 3
TAG_BITS = 20
_BINDING_LABEL = b"fedweigh statistics binding v1"

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


def binding_key(ctx: ts.Context) -> bytes:
    """K = HMAC-SHA256(the context's deterministic serialisation with its secret key, label): the same at
    every site of one provisioning (or simulation key pair), unknown to a holder of the public context."""
    from fedweigh.secure.contexts import serialize_context

    if not ctx.has_secret_key():
        raise ValueError("the binding key needs the client context (with secret key)")
    return hmac.new(serialize_context(ctx, with_secret_key=True), _BINDING_LABEL, hashlib.sha256).digest()


def binding_tag(key: bytes, job_id: str, exchange_id: str, site: str) -> np.ndarray:
    """t_k: HMAC-SHA256(key, JSON [job id, exchange id, site]) cut into TAG_SLOTS integers below 2^TAG_BITS."""
    message = json.dumps([str(job_id), str(exchange_id), str(site)]).encode()
    bits = int.from_bytes(hmac.new(key, message, hashlib.sha256).digest()[:8], "big")
    mask = (1 << TAG_BITS) - 1
    return np.array([(bits >> (TAG_BITS * i)) & mask for i in range(TAG_SLOTS)], dtype=np.float64)


def _members(payload: dict, count: int) -> list[str]:
    """The members the server announces with a sum: ``count`` distinct site names."""
    members = payload.get(META_MEMBERS)
    if (
        not isinstance(members, list)
        or not all(isinstance(m, str) and m for m in members)
        or len(set(members)) != len(members)
    ):
        raise ValueError(
            f"secure statistics: the server's sum lacks a valid {META_MEMBERS} (distinct site names), got {members!r}"
        )
    if len(members) != count:
        raise ValueError(
            f"secure statistics: the server announces {len(members)} member(s) {members} for a sum of {count} "
            "contribution(s)"
        )
    return members


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
        self._keys: dict[str, bytes] = {}

    def _context(self, role: str) -> ts.Context:
        if role not in self.contexts:
            self.contexts[role] = self.context_provider(role)
        return self.contexts[role]

    # ----------------------------------------------------------------------------------- client
    def _binding_key(self) -> bytes:
        if "binding" not in self._keys:
            self._keys["binding"] = binding_key(self._context("client"))
        return self._keys["binding"]

    def encode(self, vector: np.ndarray, binding: ExchangeBinding | None = None) -> dict:
        """Enc([v_k, t_k]): the statistics vector followed by its binding tag (zeros without ``binding``)."""
        ctx = self._context("client")
        tag = np.zeros(TAG_SLOTS)
        if binding is not None:
            tag = binding_tag(self._binding_key(), binding.job_id, binding.exchange_id, binding.site)
        vec = np.concatenate([np.asarray(vector, dtype=np.float64), tag])
        data = encrypt_vector(ctx, vec)
        # catch parameter problems here rather than as a wrong global sum at every site
        check = decrypt_vector(ctx, data, vec.size, 1, self.precision_bits)
        step = 2.0 ** -precision_bits_for(ctx, self.precision_bits)
        if not np.allclose(check, vec, rtol=1e-9, atol=1e-4 + step / 2):
            raise RuntimeError(
                "CKKS round trip of the statistics vector failed: unsuitable context parameters"
            )
        return {META_CIPHERTEXT: _b64(data), META_ENCODING: ENCODING}

    def decode(self, payload: dict, binding: ExchangeBinding | None = None) -> np.ndarray:
        """sum_k v_k from the server's sum; with ``binding``, only when the sum's tag entries equal
        sum_k t_k over the members the server announces for this site's job and exchange."""
        self.check_exchange(payload, binding)
        if payload.get(META_ENCODING) != ENCODING:
            raise ValueError(
                f"secure statistics: unknown encoding {payload.get(META_ENCODING)!r}, expected {ENCODING}"
            )
        length = payload.get(META_LENGTH)
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"secure statistics: the server's sum lacks a valid {META_LENGTH}")
        # before anything is decrypted; decrypt_vector then checks the count against the count slot
        count = self.check_quorum(payload)
        members = _members(payload, count) if binding is not None else []
        data = _unb64("server", payload.get(META_CIPHERTEXT))
        ctx = self._context("client")
        total = decrypt_vector(ctx, data, length + TAG_SLOTS, count, self.precision_bits)
        if binding is not None:
            key = self._binding_key()
            expected = sum(binding_tag(key, binding.job_id, binding.exchange_id, m) for m in members)
            if not np.array_equal(np.rint(total[length:]), expected):
                raise ValueError(
                    "secure statistics: the sum is not of this exchange (a stale or foreign sum): its binding "
                    f"tags do not equal those of the members the server announces {members} for exchange "
                    f"{binding.exchange_id!r} of job {binding.job_id!r} (a sum of another job or exchange, "
                    "a misstated member list, or contributions passed off as others')"
                )
        return total[:length]

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
        expected = 2 * (length + TAG_SLOTS) + 1
        if size != expected:
            raise ValueError(
                f"{site}: ciphertext has {size} slots, expected {expected} for length {length} "
                f"(with {TAG_SLOTS} binding-tag entries)"
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

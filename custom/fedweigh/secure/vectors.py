"""Encrypted sums of statistics vectors with TenSEAL CKKS: the slot encoding, encryption, sum, decryption.

Protocol (secure aggregation of the label statistics, docs/privacy.md): every site encrypts its
vector v_k with the shared CKKS secret key; the server, which holds only the public context (no
secret key), adds the ciphertexts, Enc(sum_k v_k) = sum_k Enc(v_k); the sites decrypt the sum.
The contexts and where they come from are in :mod:`fedweigh.secure.contexts`.

Encoding. CKKS encodes real numbers approximately and its error grows with the largest slot of a
vector (double-precision FFT in the encoder: about 1e-16 x max|slot|). To keep counts exact next
to large values such as N_k c_k (up to N_k^2), every entry x is split into two slots,
``hi = floor(x / B)`` and ``lo = x - hi * B`` with B = 2^20, so that every slot stays below about
2^30 even for |x| up to 2^50. One more slot holds 1.0, so the sum carries the number of
contributions, which decryption checks (a mismatch means a site used another key). Slot layout::

    [lo_1, ..., lo_L, hi_1, ..., hi_L, 1.0]

After decryption the hi sums are rounded to integers (they are sums of integers) and the lo sums
to the federation's precision 2^-b (:mod:`fedweigh.secure.precision`; b = 16 by default, a step of
1.5e-5, well above the CKKS noise of about 1e-9 here), so no raw CKKS decryption noise is used or
passed on (a mitigation of key-recovery attacks on CKKS decryptions, Li & Micciancio, EUROCRYPT
2021).

References: Cheon, Kim, Kim & Song, "Homomorphic encryption for arithmetic of approximate numbers"
(ASIACRYPT 2017); TenSEAL (Benaissa et al., 2021).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from fedweigh.secure.precision import precision_bits_for, round_decrypted

__all__ = [
    "COUNT_TOLERANCE",
    "LIMB_BASE",
    "MAX_ABS_VALUE",
    "check_fresh_ciphertext",
    "ciphertext_size",
    "decrypt_vector",
    "encrypt_vector",
    "load_ckks_vector",
    "sum_encrypted",
]

if TYPE_CHECKING:  # TenSEAL is imported where a ciphertext is made or read: plaintext runs never load it
    import tenseal as ts

#: Split base and range of the slot encoding (module docstring).
LIMB_BASE = 2.0**20
MAX_ABS_VALUE = 2.0**50
#: Tolerance on the decrypted contribution-count slot.
COUNT_TOLERANCE = 0.01


def _slots(vector: np.ndarray) -> list[float]:
    """[lo_1..lo_L, hi_1..hi_L, 1.0] with hi = floor(x / B), lo = x - hi * B."""
    hi = np.floor(vector / LIMB_BASE)
    lo = vector - hi * LIMB_BASE
    return [*lo.tolist(), *hi.tolist(), 1.0]


def encrypt_vector(ctx: ts.Context, vector: np.ndarray | Sequence[float]) -> bytes:
    """Enc(v) as serialised CKKS ciphertext bytes (slot layout in the module docstring)."""
    import tenseal as ts

    vec = np.asarray(vector, dtype=np.float64)
    if vec.ndim != 1 or vec.size == 0:
        raise ValueError(f"expected a non-empty 1-D vector, got shape {vec.shape}")
    if not np.isfinite(vec).all():
        raise ValueError("cannot encrypt a vector with NaN or infinite entries")
    if np.abs(vec).max() >= MAX_ABS_VALUE:
        raise ValueError(
            f"entry {float(np.abs(vec).max()):.3g} is too large for an exact CKKS sum (limit 2^50 ~ 1.1e15)"
        )
    if not ctx.has_secret_key():  # HEBuilder contexts use symmetric encryption: it needs the secret key
        raise ValueError("encrypting needs the client context (with secret key)")
    return ts.ckks_vector(ctx, _slots(vec)).serialize()


def load_ckks_vector(ctx: ts.Context, data: bytes) -> ts.CKKSVector:
    """A serialised CKKS vector read with ``ctx`` (raises ValueError if it is not one for ``ctx``)."""
    import tenseal as ts

    try:
        return ts.ckks_vector_from(ctx, data)
    except Exception as e:  # TenSEAL raises plain ValueError/RuntimeError on bad protobuf
        raise ValueError(f"not a CKKS ciphertext for this context ({e})") from None


def check_fresh_ciphertext(ctx: ts.Context, vec: ts.CKKSVector, who: str) -> None:
    """Raise ValueError naming ``who`` unless every ciphertext of ``vec`` is as a site's encryption
    leaves it: two polynomials, at the context's scale and at its first data level (no
    multiplication or rescaling applied). A ciphertext at another scale or level cannot be added to
    the others (SEAL refuses), so one such contribution would otherwise fail the whole sum."""
    scale = float(ctx.global_scale)
    first = ctx.data.seal_context().first_parms_id()
    for c in vec.ciphertext():
        if c.size() != 2:
            raise ValueError(f"{who}: a ciphertext has {c.size()} polynomials, a fresh encryption has 2")
        if c.parms_id() != first:
            raise ValueError(
                f"{who}: a ciphertext is at another CKKS level ({c.coeff_modulus_size()} primes left) than a "
                "fresh encryption under this context"
            )
        if not math.isclose(float(c.scale), scale, rel_tol=1e-9):
            raise ValueError(
                f"{who}: a ciphertext is at CKKS scale 2^{math.log2(c.scale):.2f}, the context's scale is "
                f"2^{math.log2(scale):.2f}"
            )
        if c.is_transparent():
            raise ValueError(f"{who}: a ciphertext is transparent (it encrypts nothing)")


def ciphertext_size(ctx: ts.Context, data: bytes) -> int:
    """Number of slots of a serialised CKKS vector (raises ValueError if it is not one for ``ctx``)."""
    return load_ckks_vector(ctx, data).size()


def sum_encrypted(public_ctx: ts.Context, ciphertexts: Sequence[bytes]) -> bytes:
    """sum_k Enc(v_k), computed with a context that needs (and should have) no secret key."""
    import tenseal as ts

    if not ciphertexts:
        raise ValueError("no ciphertexts to sum")
    total = None
    for i, data in enumerate(ciphertexts):
        try:
            vec = ts.ckks_vector_from(public_ctx, data)
        except Exception as e:
            raise ValueError(f"ciphertext #{i} is not a CKKS vector for this context ({e})") from None
        if total is None:
            total = vec
        elif vec.size() != total.size():
            raise ValueError(f"ciphertext #{i} has {vec.size()} slots, the first has {total.size()}")
        else:
            total += vec
    return total.serialize()


def decrypt_vector(
    secret_ctx: ts.Context,
    data: bytes,
    length: int,
    num_contributions: int,
    precision_bits: int | None = None,
) -> np.ndarray:
    """Decrypt a (summed) ciphertext back into the length-``length`` vector sum_k v_k.

    hi sums are rounded to integers, lo sums to the federation's precision 2^-b
    (:func:`fedweigh.secure.precision.round_decrypted`; ``precision_bits`` None: the default for the
    context's scale). The count slot must equal ``num_contributions`` (the server's announced count, or 1
    for a site's own round trip); otherwise a site forged its count slot or the sites did not share
    one key.
    """
    import tenseal as ts

    if not secret_ctx.has_secret_key():
        raise ValueError("decrypting needs the client context (with secret key)")
    bits = precision_bits_for(secret_ctx, precision_bits)
    try:
        enc = ts.ckks_vector_from(secret_ctx, data)
    except Exception as e:
        raise ValueError(f"not a CKKS ciphertext for this context ({e})") from None
    if enc.size() != 2 * length + 1:
        raise ValueError(f"ciphertext has {enc.size()} slots, expected {2 * length + 1} for length {length}")
    slots = np.asarray(enc.decrypt(), dtype=np.float64)
    count = slots[-1]
    expected = num_contributions
    if not math.isfinite(count) or abs(count - expected) > COUNT_TOLERANCE:
        if np.isfinite(slots).all() and float(np.abs(slots).max()) < MAX_ABS_VALUE:
            # every slot within the encoding's range (valid slots stay below 2^30 per contribution; another
            # key's ciphertext decrypts to values near the modulus): the key matches, a slot was forged
            raise ValueError(
                f"forged count slot: the encrypted sum's count slot decrypts to {count:.6g}, the server summed "
                f"{expected} contribution(s), and the other slots decrypt within range (the keys match): a "
                "site sent a contribution whose count slot is not 1 (or the server announced a wrong count)"
            )
        raise ValueError(
            f"the encrypted sum does not decrypt consistently (count slot {count:.6g}, expected {expected}): "
            "the contributions were encrypted with different keys (startup kits from different "
            "provisionings, or simulation keys mixed with kit keys) or were corrupted"
        )
    lo = round_decrypted(slots[:length], bits)
    hi = np.rint(slots[length : 2 * length])
    return hi * LIMB_BASE + lo

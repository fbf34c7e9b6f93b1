"""The precision at which the sites keep what they decrypt: every decrypted CKKS value rounded to 2^-b.

A CKKS decryption is the encrypted value plus the decryption noise, and the noise is a function of
the secret key: whoever sees full-precision decryptions can recover the key (Li & Micciancio, "On the
security of homomorphic encryption on approximate numbers", EUROCRYPT 2021). The mitigation used here,
short of noise flooding, is to round every decrypted value to a precision coarser than
the noise before anything stores, evaluates, logs or sends it,

    round_b(x) = rint(x * 2^b) / 2^b,

with ``b`` fractional bits agreed by the whole federation (``he_precision_bits`` of a job: every
site applies the same ``b``, so every site keeps the same global model). Rounding to a power of two
is exact in float64 and, for |x| < 2^(24 - b), in the float32 arrays a model stores.

Default and bounds, from the CKKS scale 2^s (s = 40, NVFlare's HEBuilder): the noise of a decrypted
aggregate was measured at about 2^(s - 65) per value after one round of weighted sums, growing with
the rounds (2^(s - 63.3) after 20 rounds; benchmarks/bench_he_precision.py, docs/privacy.md). ``b``
must leave at least :data:`MIN_HEADROOM_BITS` bits between the rounding step and the scale (step
2^-20 for s = 40, ten times the noise after 20 rounds); the default :data:`HEADROOM_BITS` leaves 24
(step 2^-16 ~ 1.5e-5, a change of at most 7.6e-6 per value). Below :data:`MIN_PRECISION_BITS`
(step 2^-8 ~ 0.004) the rounding would wipe out local updates.

What rounding does not remove: a value whose noise carries it across a rounding boundary still rounds
differently (measured: 0.07 % of the values on average over 20 rounds at the default): this is a
mitigation, not the noise flooding that would make decryptions provably safe to share.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from fedweigh.secure.contexts import SCALE_BITS

__all__ = [
    "DEFAULT_PRECISION_BITS",
    "HEADROOM_BITS",
    "MAX_PRECISION_BITS",
    "MIN_HEADROOM_BITS",
    "MIN_PRECISION_BITS",
    "check_precision_bits",
    "context_scale_bits",
    "precision_bits_for",
    "round_decrypted",
]

if TYPE_CHECKING:  # TenSEAL is imported where a ciphertext is made or read
    import tenseal as ts

#: Bits between the CKKS scale and the rounding step: by default, and at the least (module docstring).
HEADROOM_BITS = 24
MIN_HEADROOM_BITS = 20
#: The coarsest precision accepted.
MIN_PRECISION_BITS = 8
#: Default and finest precision for NVFlare's HEBuilder contexts (scale 2^40): 16 and 20 bits.
DEFAULT_PRECISION_BITS = SCALE_BITS - HEADROOM_BITS
MAX_PRECISION_BITS = SCALE_BITS - MIN_HEADROOM_BITS


def check_precision_bits(bits: object, scale_bits: int = SCALE_BITS, what: str = "he_precision_bits") -> int:
    """``bits`` as an int in [MIN_PRECISION_BITS, scale_bits - MIN_HEADROOM_BITS]; ValueError naming
    ``what``, the value and the bounds otherwise."""
    top = int(scale_bits) - MIN_HEADROOM_BITS
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise ValueError(f"{what} must be a whole number of fractional bits, got {bits!r}")
    if not MIN_PRECISION_BITS <= int(bits) <= top:
        raise ValueError(
            f"{what}={int(bits)} is outside [{MIN_PRECISION_BITS}, {top}]: decrypted values are rounded to "
            f"2^-{int(bits)}; a step finer than 2^-{top} is within {MIN_HEADROOM_BITS} bits of the CKKS scale "
            f"2^{int(scale_bits)} and keeps the decryption noise (which reveals the secret key), one coarser "
            f"than 2^-{MIN_PRECISION_BITS} wipes out model updates"
        )
    return int(bits)


def context_scale_bits(ctx: ts.Context) -> int:
    """log2 of the context's CKKS scale, rounded to an integer."""
    return int(round(math.log2(float(ctx.global_scale))))


def precision_bits_for(ctx: ts.Context, bits: int | None = None) -> int:
    """The fractional bits a site rounds to with context ``ctx``: ``bits`` (checked against the context's
    scale) or, when None, the default scale bits - :data:`HEADROOM_BITS`."""
    scale = context_scale_bits(ctx)
    return check_precision_bits(scale - HEADROOM_BITS if bits is None else bits, scale)


def round_decrypted(values: np.ndarray, bits: int) -> np.ndarray:
    """round_b(x) = rint(x * 2^b) / 2^b over a float64 array (non-finite values stay as they are)."""
    step = 2.0**bits
    arr = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.rint(arr * step) / step

"""Homomorphically encrypted model updates (CKKS) that keep the server-side weighting schemes.

Protocol (docs/privacy.md, "Encrypted model updates"). Round t = 1..T, site k, weights w_k:

1. Site k decrypts the global model it receives (round 1: the server's plaintext initial model),
   trains, and sends Enc(Delta_k) with Delta_k = theta_k - theta_g^{t-1} (CKKS, the parameters
   flattened and cut into chunks of ``slots`` values, one ciphertext each), plus N_k, its local
   steps and the scalars its scheme needs (FedDRAW: the cosine similarity, which the site computes
   because it holds theta_k and theta_g).
2. The server computes w from those scalars only (``scheme.weights`` with no parameters) and forms,
   without any secret key,

       Enc(theta_g^t) = Enc(theta_g^{t-1}) + sum_k w_k * Enc(Delta_k)

   (ciphertext x plaintext scalar, then ciphertext additions; in round 1 Enc(theta_g^0) is replaced
   by the plaintext theta_g^0, added as a plaintext). It keeps Enc(theta_g^t) and sends it with the
   next task; every site decrypts it. So the server never sees an update nor, after round 1, the
   global model. Each site checks the model it decrypts and keeps the last good one
   (:mod:`fedweigh.site.he_guard`): the server cannot look into an update, the sites can look at the
   sum.

Every update ends with one check slot holding 1, so the encrypted global model carries the sum of
all weights applied so far; the server announces that sum in clear and each site compares it after
decryption, which exposes a contribution encrypted under another key (the server cannot tell).

CKKS levels: with HEBuilder's parameters (poly modulus 8192, coefficient moduli [60, 40, 40] bits,
scale 2^40) the product w_k * Enc(Delta_k) uses the only multiplicative level; the running global
ciphertext sits at that same level and is only ever added to, so rounds do not consume levels.
The remaining 60-bit modulus with scale 2^40 holds values of magnitude below 2^19: encrypted
parameters and updates are refused above :data:`MAX_ABS_VALUE` (2^17). Each round adds CKKS noise
of about 1e-7 absolute to the global model (measured; it adds up over rounds). A site rounds what it
decrypts to the precision the federation agreed on (:mod:`fedweigh.secure.precision`, 2^-16 by
default) before it stores or uses it.

Selective encryption (``layers``): only the floating-point arrays chosen by glob patterns on the
parameter names (and the selectors ``first:N``, ``last:N``, ``largest:N`` over the floating-point
arrays in state-dict order) are encrypted; all other arrays, integer buffers such as BatchNorm's
``num_batches_tracked`` included, travel in clear and are aggregated in plaintext by the scheme's
own ``aggregate`` with the same weights (integer buffers follow the scheme's ``integer_buffers``
rule, as in the plaintext path).

Schemes that need plaintext client models at the server (``he_compatible = False``: IDA, FedAWA,
FedAdp, FedDRAW with similarity="delta") are refused by ``WeightingScheme.check_he`` when the round
step is built with this backend.

References: Cheon, Kim, Kim & Song, "Homomorphic encryption for arithmetic of approximate numbers"
(ASIACRYPT 2017); TenSEAL (Benaissa et al., 2021); NVFlare's HE FedAvg (nvflare.app_opt.he), where
instead the sites pre-multiply their own weights, which cannot express weights that depend on all
sites' scalars.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import tenseal as ts

from fedweigh.arrays import check_same_layout, to_numpy
from fedweigh.protocol import ZERO_WEIGHT
from fedweigh.secure.precision import precision_bits_for, round_decrypted
from fedweigh.secure.vectors import check_fresh_ciphertext

__all__ = [
    "CHECK_TOLERANCE",
    "DEFAULT_SLOTS",
    "ENCODING",
    "GLOBAL_PREFIX",
    "HELayout",
    "MAX_ABS_VALUE",
    "UPDATE_PREFIX",
    "DecryptedGlobal",
    "clip_update",
    "decode_global",
    "decrypt_global",
    "decrypt_chunks",
    "encode_update",
    "encrypt_chunks",
    "load_chunks",
    "pack_chunks",
    "select_encrypted_keys",
    "unpack_chunks",
    "weighted_sum",
]

#: Name of this encoding (flattened float64 vector, chunked, one CKKS vector per chunk).
ENCODING = "ckks-chunked-delta-v1"
#: Values per ciphertext: the slot count of HEBuilder's contexts (poly_modulus_degree / 2).
DEFAULT_SLOTS = 4096
#: Largest |value| accepted in an encrypted update or encrypted global model (module docstring).
MAX_ABS_VALUE = 2.0**17
#: Tolerance (relative to max(1, |expected|)) on the decrypted check slot.
CHECK_TOLERANCE = 1e-3
#: Parameter-dict keys that carry ciphertext chunks (uint8 arrays), by direction. Distinct prefixes
#: keep NVFlare's Client API from reshaping a received chunk to the shape of a sent one.
UPDATE_PREFIX = "fedweigh_he_update/"
GLOBAL_PREFIX = "fedweigh_he_global/"

_SELECTOR = re.compile(r"^(first|last|largest):(\d+)$")


# ------------------------------------------------------------------------------------------ layout
def _is_float(value: np.ndarray) -> bool:
    return np.issubdtype(np.asarray(value).dtype, np.floating)


def select_encrypted_keys(params: Mapping[str, np.ndarray], layers: Sequence[str] | None = None) -> list[str]:
    """The floating-point arrays of ``params`` to encrypt, in ``params`` order.

    ``layers`` None or empty: all of them. Otherwise the union of: glob patterns matched against
    the parameter names (``fnmatch``, case-sensitive, e.g. ``"features.conv0.*"``, ``"class_layers.*"``),
    and the selectors ``first:N`` / ``last:N`` (the first / last N floating-point arrays in
    state-dict order) and ``largest:N`` (the N largest by number of values). A pattern that matches
    no floating-point array is an error (it names the pattern), so a typo never silently leaves a
    layer in clear.
    """
    floats = [k for k, v in params.items() if _is_float(v)]
    if not floats:
        raise ValueError("the model has no floating-point parameters to encrypt")
    if not layers:
        return floats
    if isinstance(layers, str):
        raise ValueError(f"he_layers must be a list of patterns, got the string {layers!r}")
    chosen: set[str] = set()
    for pattern in layers:
        m = _SELECTOR.match(pattern)
        if m:
            kind, n = m.group(1), int(m.group(2))
            if n < 1:
                raise ValueError(f"he_layers selector {pattern!r}: N must be >= 1")
            if kind == "first":
                hits = floats[:n]
            elif kind == "last":
                hits = floats[-n:]
            else:
                hits = sorted(floats, key=lambda k: (-int(np.size(params[k])), floats.index(k)))[:n]
        else:
            hits = [k for k in floats if fnmatch.fnmatchcase(k, pattern)]
        if not hits:
            raise ValueError(
                f"he_layers pattern {pattern!r} matches no floating-point parameter "
                f"(e.g. {', '.join(floats[:3])}, ... of {len(floats)})"
            )
        chosen.update(hits)
    return [k for k in floats if k in chosen]


@dataclass(frozen=True)
class HELayout:
    """Which arrays are encrypted, their shapes, and how their values are cut into ciphertexts.

    The encrypted vector is the concatenation of the arrays ``keys`` (row-major, float64) in this
    order followed by one check slot, cut into chunks of ``slots`` values (the last one shorter).
    """

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    slots: int = DEFAULT_SLOTS

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.shapes):
            raise ValueError(f"HELayout: {len(self.keys)} keys but {len(self.shapes)} shapes")
        if not self.keys:
            raise ValueError("HELayout: no arrays to encrypt")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("HELayout: duplicate keys")
        if self.slots < 1:
            raise ValueError(f"HELayout: slots must be >= 1, got {self.slots}")

    @classmethod
    def build(
        cls, params: Mapping[str, np.ndarray], keys: Sequence[str] | None = None, slots: int = DEFAULT_SLOTS
    ) -> HELayout:
        """The layout of ``keys`` (default: every floating-point array) with the shapes in ``params``."""
        keys = list(keys) if keys is not None else select_encrypted_keys(params)
        missing = [k for k in keys if k not in params]
        if missing:
            raise ValueError(f"HELayout: the model has no parameter {missing[0]!r}")
        bad = [k for k in keys if not _is_float(params[k])]
        if bad:
            raise ValueError(
                f"HELayout: parameter {bad[0]!r} is not floating-point; integer buffers travel in clear"
            )
        return cls(tuple(keys), tuple(tuple(int(d) for d in np.shape(params[k])) for k in keys), int(slots))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @property
    def num_values(self) -> int:
        return int(sum(self.sizes))

    @property
    def vector_size(self) -> int:
        """Encrypted slots: the layout's values and one check slot (:func:`encode_update`)."""
        return self.num_values + 1

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.vector_size / self.slots)

    def chunk_sizes(self) -> list[int]:
        """Slots in each ciphertext: ``slots`` each, the last one the remainder."""
        n, s = self.vector_size, self.slots
        return [min(s, n - i * s) for i in range(self.num_chunks)]

    @property
    def fingerprint(self) -> str:
        """sha256 over encoding, slots, keys and shapes: both ends must agree on it."""
        text = json.dumps([ENCODING, self.slots, list(self.keys), [list(s) for s in self.shapes]])
        return hashlib.sha256(text.encode()).hexdigest()

    def clear_keys(self, params: Mapping[str, np.ndarray]) -> list[str]:
        """The keys of ``params`` that travel in clear (not in the layout), in ``params`` order."""
        encrypted = set(self.keys)
        return [k for k in params if k not in encrypted]

    def flatten(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        """The encrypted arrays of ``params`` as one float64 vector (layout order, row-major)."""
        parts = []
        for key, shape in zip(self.keys, self.shapes, strict=True):
            if key not in params:
                raise ValueError(f"parameter {key!r} (encrypted under HE) is missing")
            arr = np.asarray(params[key])
            if arr.shape != shape:
                raise ValueError(f"parameter {key!r} has shape {arr.shape}, the HE layout has {shape}")
            parts.append(arr.astype(np.float64, copy=False).ravel())
        return np.concatenate(parts)

    def unflatten(self, vector: np.ndarray, like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Arrays of the layout from ``vector``, each in the dtype of ``like[key]``."""
        vector = np.asarray(vector)
        if vector.shape != (self.num_values,):
            raise ValueError(f"expected a vector of {self.num_values} values, got shape {vector.shape}")
        out, start = {}, 0
        for key, shape, size in zip(self.keys, self.shapes, self.sizes, strict=True):
            dtype = np.asarray(like[key]).dtype if key in like else np.dtype(np.float32)
            out[key] = vector[start : start + size].reshape(shape).astype(dtype)
            start += size
        return out

    def to_meta(self) -> dict:
        """What the server tells the sites (travels in clear: names only, no values)."""
        return {
            "encoding": ENCODING,
            "keys": list(self.keys),
            "slots": self.slots,
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_meta(cls, meta: Mapping, params: Mapping[str, np.ndarray]) -> HELayout:
        """The layout the server announced, with shapes from the site's own ``params``; the
        fingerprint must match (same keys, shapes, order and chunking at both ends)."""
        if not isinstance(meta, Mapping) or meta.get("encoding") != ENCODING:
            got = meta.get("encoding") if isinstance(meta, Mapping) else meta
            raise ValueError(f"HE: unknown update encoding {got!r}, expected {ENCODING}")
        layout = cls.build(params, list(meta.get("keys") or []), int(meta.get("slots") or 0))
        if layout.fingerprint != meta.get("fingerprint"):
            raise ValueError(
                "HE: this site's model does not match the server's HE layout (parameter names, shapes or "
                "order differ): the site and the server run different model definitions"
            )
        return layout


# ------------------------------------------------------------------------------------- ciphertexts
def _check_magnitude(vector: np.ndarray, what: str) -> None:
    if not np.isfinite(vector).all():
        raise ValueError(f"{what} holds NaN or infinite values; refusing to encrypt")
    peak = float(np.abs(vector).max()) if vector.size else 0.0
    if peak >= MAX_ABS_VALUE:
        raise ValueError(
            f"{what} has a value of magnitude {peak:.3g}, above the CKKS limit {MAX_ABS_VALUE:.3g} "
            "of this encoding (HEBuilder parameters)"
        )


def encrypt_chunks(ctx: ts.Context, vector: np.ndarray, slots: int = DEFAULT_SLOTS) -> list[bytes]:
    """Enc of ``vector`` as serialised CKKS vectors of at most ``slots`` values each (needs the secret key:
    HEBuilder contexts use symmetric encryption)."""
    if not ctx.has_secret_key():
        raise ValueError("encrypting needs the client context (with secret key)")
    vector = np.asarray(vector, dtype=np.float64)
    _check_magnitude(vector, "the update")
    return [
        ts.ckks_vector(ctx, vector[i : i + slots].tolist()).serialize() for i in range(0, vector.size, slots)
    ]


def load_chunks(
    ctx: ts.Context, chunks: Sequence[bytes], layout: HELayout, who: str, *, fresh: bool = False
) -> list[ts.CKKSVector]:
    """Deserialise and check ciphertext chunks: count and sizes must match ``layout``; with ``fresh``
    (a site's update) every chunk must also be at the context's scale and first level
    (:func:`fedweigh.secure.vectors.check_fresh_ciphertext`), or the weighted sum would fail.

    Raises ValueError naming ``who`` (a site, or "server") and the chunk.
    """
    sizes = layout.chunk_sizes()
    if len(chunks) != len(sizes):
        raise ValueError(f"{who}: {len(chunks)} ciphertext chunk(s), the HE layout has {len(sizes)}")
    out = []
    for i, (data, size) in enumerate(zip(chunks, sizes, strict=True)):
        try:
            vec = ts.ckks_vector_from(ctx, data)
        except Exception as e:  # TenSEAL raises plain ValueError/RuntimeError on bad protobuf
            raise ValueError(f"{who}: chunk {i} is not a CKKS vector for this context ({e})") from None
        if vec.size() != size:
            raise ValueError(f"{who}: chunk {i} holds {vec.size()} values, expected {size}")
        if fresh:
            check_fresh_ciphertext(ctx, vec, f"{who}: chunk {i}")
        out.append(vec)
    return out


def decrypt_chunks(
    ctx: ts.Context, chunks: Sequence[bytes], layout: HELayout, precision_bits: int | None = None
) -> np.ndarray:
    """The float64 vector that ``chunks`` encrypt (needs the secret key), rounded to the federation's
    precision 2^-b (:func:`fedweigh.secure.precision.round_decrypted`; ``precision_bits`` None: the
    default for the context's scale), so that no raw decryption noise leaves this function."""
    if not ctx.has_secret_key():
        raise ValueError("decrypting needs the client context (with secret key)")
    bits = precision_bits_for(ctx, precision_bits)
    vectors = load_chunks(ctx, chunks, layout, "the encrypted global model")
    return round_decrypted(np.concatenate([np.asarray(v.decrypt(), dtype=np.float64) for v in vectors]), bits)


def weighted_sum(
    updates: Sequence[Sequence[ts.CKKSVector]],
    weights: Sequence[float],
    base: Sequence[ts.CKKSVector] | np.ndarray,
    slots: int = DEFAULT_SLOTS,
) -> list[ts.CKKSVector] | None:
    """base + sum_k w_k * updates_k, chunk by chunk, with no secret key.

    ``base`` is the encrypted global model (CKKS vectors) or, before the first aggregation, the
    plaintext vector theta_g^0 (added as plaintext). Weights with |w_k| < :data:`ZERO_WEIGHT` are
    skipped. Returns the serialised chunks, or None when every weight is zero (nothing to add: the
    global model is unchanged, and a plaintext base cannot be encrypted by the server).
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(updates),):
        raise ValueError(f"{w.size} weight(s) for {len(updates)} update(s)")
    if not np.isfinite(w).all():
        raise ValueError(f"weights are not all finite: {w.tolist()}")
    active = [(u, float(wk)) for u, wk in zip(updates, w, strict=True) if abs(wk) >= ZERO_WEIGHT]
    if not active:
        return None
    plain = isinstance(base, np.ndarray)
    if plain:
        _check_magnitude(np.asarray(base), "the initial global model")
    num_chunks = len(active[0][0])
    if any(len(u) != num_chunks for u, _ in active):
        raise ValueError("updates have different numbers of chunks")
    out = []
    for i in range(num_chunks):
        acc = None
        for update, wk in active:
            term = update[i] * wk
            acc = term if acc is None else acc + term
        assert acc is not None
        if plain:
            acc = acc + np.asarray(base)[i * slots : (i + 1) * slots].tolist()
        else:
            acc = acc + base[i]  # type: ignore[index]
        out.append(acc)
    return out


def pack_chunks(chunks: Sequence[bytes], prefix: str) -> dict[str, np.ndarray]:
    """Chunks as ``{prefix + index: uint8 array}`` entries of a parameter dict (NVFlare sends arrays)."""
    return {f"{prefix}{i:06d}": np.frombuffer(c, dtype=np.uint8).copy() for i, c in enumerate(chunks)}


def unpack_chunks(params: Mapping, prefix: str) -> tuple[list[bytes], dict[str, np.ndarray]]:
    """(chunks under ``prefix`` in index order, the other entries as numpy arrays)."""
    entries = sorted(k for k in params if k.startswith(prefix))
    chunks = []
    for i, key in enumerate(entries):
        if key != f"{prefix}{i:06d}":
            raise ValueError(f"HE: ciphertext entries are not numbered 0..{len(entries) - 1} (found {key!r})")
        arr = to_numpy(params[key])
        if arr.dtype != np.uint8 or arr.ndim != 1:
            raise ValueError(f"HE: {key!r} must be a 1-D uint8 array, got {arr.dtype} {arr.shape}")
        chunks.append(arr.tobytes())
    rest = {k: to_numpy(v) for k, v in params.items() if not k.startswith(prefix)}
    return chunks, rest


# ------------------------------------------------------------------------------------------- site
@dataclass(frozen=True)
class DecryptedGlobal:
    """What a site decrypted: the global model (``params``, in the site's order and dtypes), its HE
    layout, and the check slot as decrypted next to the value the server announced (both NaN for
    a plaintext model, which has no check slot)."""

    params: dict[str, np.ndarray]
    layout: HELayout
    encrypted: bool
    check: float = math.nan
    expected_check: float = math.nan
    #: largest |value| of the decrypted vector (0 for a plaintext model)
    peak: float = 0.0

    @property
    def check_problem(self) -> str | None:
        """Why the check slot is wrong (None: it matches, or the model was sent in clear).

        A vector whose values are all within the encoding's range (:data:`MAX_ABS_VALUE`) decrypted
        with the right key: a wrong check slot then means a site put another value than 1 in the check
        slot of its update (forged). Values beyond that range are what another key's ciphertext
        decrypts to (startup kits of different provisionings, or simulation keys mixed with kit keys)."""
        if not self.encrypted:
            return None
        got, expected = self.check, self.expected_check
        if abs(got - expected) <= CHECK_TOLERANCE * max(1.0, abs(expected)):
            return None
        if math.isfinite(got) and self.peak < MAX_ABS_VALUE:
            return (
                f"HE: forged check slot: the encrypted global model's check slot decrypts to {got:.6g}, the "
                f"server announced the sum of the weights applied, {expected:.6g}; the other values decrypt "
                "within range, so the keys match: a site sent an update whose check slot is not 1"
            )
        return (
            f"HE: the encrypted global model does not decrypt consistently (check slot {got:.6g}, "
            f"expected {expected:.6g}, values up to {self.peak:.3g}): a contribution was encrypted with "
            "another key (startup kits from different provisionings, or simulation keys mixed with kit keys)"
        )


def decrypt_global(
    ctx: ts.Context,
    received: Mapping,
    he_meta: Mapping,
    reference: Mapping[str, np.ndarray],
    min_contributions: int = 1,
    precision_bits: int | None = None,
) -> DecryptedGlobal:
    """Decrypt the global model a site received, without judging its check slot (:func:`decode_global`
    does; :class:`fedweigh.site.he_guard.HEModelGuard` repairs a forged one).

    ``reference``: the site's own model parameters (names, shapes, dtypes). A plaintext model
    (round 1) is returned as it is, checked for completeness. An encrypted one is decrypted only
    when its last aggregation summed at least ``min_contributions`` updates (the site policy's
    minimum; :mod:`fedweigh.server.quorum`), else ValueError saying so. Its values are rounded to the
    federation's ``precision_bits`` (:func:`decrypt_chunks`).
    """
    layout = HELayout.from_meta(he_meta, reference)
    chunks, clear = unpack_chunks(received, GLOBAL_PREFIX)
    if not chunks:
        values = {k: clear.pop(k) for k in layout.keys if k in clear}
        merged = check_same_layout(
            "HE: the received global model", {**clear, **values}, reference, finite=False
        )
        return DecryptedGlobal(merged, layout, encrypted=False)
    count = he_meta.get("contributions")
    if not isinstance(count, int) or isinstance(count, bool) or count < min_contributions:
        raise ValueError(
            f"HE: the encrypted global model's last aggregation summed {count!r} update(s); this site's "
            f"policy decrypts a secure sum only with at least {min_contributions} contributions"
        )
    vector = decrypt_chunks(ctx, chunks, layout, precision_bits)
    finite = vector[np.isfinite(vector)]
    peak = float(np.abs(finite).max()) if finite.size else math.inf
    if finite.size < vector.size:
        peak = math.inf
    with np.errstate(over="ignore", invalid="ignore"):
        values = layout.unflatten(vector[:-1], reference)
    merged = check_same_layout("HE: the received global model", {**clear, **values}, reference, finite=False)
    expected = float(he_meta.get("check", math.nan))
    return DecryptedGlobal(merged, layout, True, float(vector[-1]), expected, peak)


def decode_global(
    ctx: ts.Context,
    received: Mapping,
    he_meta: Mapping,
    reference: Mapping[str, np.ndarray],
    min_contributions: int = 1,
    precision_bits: int | None = None,
) -> tuple[dict[str, np.ndarray], HELayout]:
    """The plaintext global model a site received: decrypted chunks + clear arrays, in ``reference``
    order and dtypes (:func:`decrypt_global`); ValueError when its check slot is wrong, naming a forged
    check slot or a key mismatch (:attr:`DecryptedGlobal.check_problem`)."""
    decrypted = decrypt_global(ctx, received, he_meta, reference, min_contributions, precision_bits)
    problem = decrypted.check_problem
    if problem:
        raise ValueError(problem)
    return decrypted.params, decrypted.layout


def encode_update(
    ctx: ts.Context,
    params: Mapping[str, np.ndarray],
    global_params: Mapping[str, np.ndarray],
    layout: HELayout,
    check: float = 1.0,
) -> dict[str, np.ndarray]:
    """What a site sends: Enc([theta_k - theta_g, check]) for the layout's arrays (chunks under
    :data:`UPDATE_PREFIX`) and its other arrays in clear (``check`` is 1 except in a site's repair of a
    forged check slot, :class:`fedweigh.site.he_guard.HEModelGuard`).

    The last slot holds 1, so the encrypted global model carries the sum of all weights applied so
    far, which the server announces in clear (``check`` in :meth:`EncryptedGlobalModel.meta`): a
    site detects a contribution encrypted under another key (or a corrupted sum) at decryption.
    """
    theta_k = layout.flatten(params)
    _check_magnitude(theta_k, "the trained model")
    delta = theta_k - layout.flatten(global_params)
    vector = np.append(delta, float(check))  # check slot: the aggregate carries sum_k w_k there
    out = pack_chunks(encrypt_chunks(ctx, vector, layout.slots), UPDATE_PREFIX)
    for key in layout.clear_keys(params):
        out[key] = np.asarray(params[key])
    return out


def clip_update(
    params: Mapping[str, np.ndarray],
    base: Mapping[str, np.ndarray],
    keys: Sequence[str],
    max_norm: float | None,
) -> tuple[dict[str, np.ndarray], float]:
    """``params`` with the update of the arrays ``keys`` scaled down to L2 norm ``max_norm``:
    theta' = theta_b + (theta - theta_b) * min(1, C / ||theta - theta_b||) over those arrays (float64
    norm, other arrays unchanged; ``max_norm`` None: no clipping), and the norm before clipping.

    The per-update clipping of DP-FedAvg (McMahan et al., ICLR 2018) without the noise: it bounds what
    one site's update can add to a sum the server cannot read.
    """
    deltas = {k: np.asarray(params[k], np.float64) - np.asarray(base[k], np.float64) for k in keys}
    norm = float(math.sqrt(sum(float(np.sum(d * d)) for d in deltas.values())))
    if max_norm is None or not math.isfinite(norm) or norm <= max_norm:
        return dict(params), norm
    scale = max_norm / norm
    out = dict(params)
    for k, d in deltas.items():
        out[k] = (np.asarray(base[k], np.float64) + scale * d).astype(np.asarray(params[k]).dtype)
    return out, norm

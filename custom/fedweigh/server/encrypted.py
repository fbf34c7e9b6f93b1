"""The server's global model under homomorphic encryption: the CKKS backend of the round step.

The protocol, the layout and the site's side (encode the update, decode the global model) are in
:mod:`fedweigh.secure.updates`; this module is the server's part: it checks each site's encrypted
update and forms Enc(theta_g^t) = Enc(theta_g^{t-1}) + sum_k w_k Enc(Delta_k) without any secret key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import tenseal as ts

from fedweigh.arrays import Params, check_same_layout
from fedweigh.io import atomic_write_npz
from fedweigh.protocol import META_HE, ZERO_WEIGHT
from fedweigh.secure.updates import (
    DEFAULT_SLOTS,
    GLOBAL_PREFIX,
    UPDATE_PREFIX,
    HELayout,
    load_chunks,
    pack_chunks,
    select_encrypted_keys,
    unpack_chunks,
    weighted_sum,
)
from fedweigh.server.rounds import AggregationBackend
from fedweigh.weighting.base import ClientReport, WeightingScheme

__all__ = ["EncryptedContribution", "EncryptedGlobalModel", "weighted_median_steps"]


def weighted_median_steps(steps: Sequence[int], weights: Sequence[float]) -> int:
    """The weighted median of the sites' local step counts: the smallest tau_k whose cumulative weight
    (sites sorted by tau) reaches half the total. One site that reports a huge count moves it only
    if it holds half the weight, which the weight cap prevents from three sites on."""
    pairs = sorted((int(t), float(w)) for t, w in zip(steps, weights, strict=True) if abs(w) >= ZERO_WEIGHT)
    total = sum(w for _, w in pairs)
    acc = 0.0
    for tau, w in pairs:
        acc += w
        if acc >= total / 2:
            return tau
    return 0


@dataclass
class EncryptedContribution:
    """One site's checked result under HE: its encrypted update and its clear arrays."""

    site: str
    update: list[ts.CKKSVector]
    clear: dict[str, np.ndarray]


class EncryptedGlobalModel(AggregationBackend):
    """The server's global model under HE: clear arrays in plaintext, the layout's arrays encrypted.

    Before the first aggregation the encrypted part is still the plaintext initial model (the
    server created it). ``public_ctx`` must hold no secret key; the object never decrypts.

    Args:
        public_ctx: the server's TenSEAL context (``server_context.tenseal``).
        global_params: the initial global model theta_g^0 (all arrays, plaintext).
        layers: selective encryption patterns (:func:`select_encrypted_keys`); None = all float arrays.
        slots: values per ciphertext.
    """

    encrypted = True

    def __init__(
        self,
        public_ctx: ts.Context,
        global_params: Mapping[str, np.ndarray],
        layers: Sequence[str] | None = None,
        slots: int = DEFAULT_SLOTS,
    ):
        if public_ctx.has_secret_key():
            raise PermissionError(
                "the server's TenSEAL context holds a SECRET KEY; under HE the server may hold only the "
                "public context (server_context.tenseal)"
            )
        self.ctx = public_ctx
        reference = {k: np.asarray(v) for k, v in global_params.items()}
        self.layout = HELayout.build(reference, select_encrypted_keys(reference, layers), slots)
        #: dtypes and shapes of every array (for checking results; values are not kept for encrypted keys)
        self.spec = {k: (v.shape, v.dtype) for k, v in reference.items()}
        self.clear: dict[str, np.ndarray] = {k: reference[k] for k in self.layout.clear_keys(reference)}
        self._initial: np.ndarray | None = np.append(self.layout.flatten(reference), 0.0)
        #: sum of all weights applied so far: the value of the check slot of the encrypted model
        self.check_value = 0.0
        #: updates summed by the last aggregation (sites refuse to decrypt below their policy's minimum)
        self.contributions = 0
        #: the weighted median of the local step counts the last aggregation summed (the sites scale
        #: their own update by it when they judge the model, :mod:`fedweigh.site.he_guard`); 0: none yet
        self.round_steps = 0
        self._initial_values = {k: reference[k] for k in self.layout.keys}
        self.chunks: list[bytes] | None = None
        self._vectors: list[ts.CKKSVector] | None = None

    @property
    def holds_ciphertext(self) -> bool:
        """True once the global model's layout arrays exist only as ciphertext at the server."""
        return self.chunks is not None

    def task_params(self) -> dict[str, np.ndarray]:
        """The model to send: plaintext before the first aggregation, else ciphertext + clear arrays."""
        if self.chunks is None:
            return {
                k: self._initial_values[k] if k in self._initial_values else self.clear[k] for k in self.spec
            }
        return {**self.clear, **pack_chunks(self.chunks, GLOBAL_PREFIX)}

    def meta(self) -> dict:
        """The layout and the expected check slot (both in clear: names and a sum of weights)."""
        return {
            **self.layout.to_meta(),
            "check": self.check_value,
            "contributions": self.contributions,
            "steps": self.round_steps,
        }

    def task_meta(self) -> dict:
        """The task meta that tells a site to decrypt: {META_HE: layout and check value}."""
        return {META_HE: self.meta()}

    def check_params(self, site: str, params: Mapping | None) -> EncryptedContribution:
        """A site's result: the right number of ciphertexts of the right sizes, and clear arrays
        with the global model's keys and shapes (finite). ValueError naming the site otherwise."""
        if not params:
            raise ValueError(f"{site}: result holds no parameters")
        chunks, rest = unpack_chunks(params, UPDATE_PREFIX)
        if not chunks:
            raise ValueError(f"{site}: result holds no encrypted update (plaintext parameters under HE?)")
        leaked = [k for k in rest if k in self.layout.keys]
        if leaked:
            raise ValueError(f"{site}: sent encrypted-layout parameter {leaked[0]!r} in clear; refusing it")
        reference = {k: np.empty(self.spec[k][0], dtype=self.spec[k][1]) for k in self.clear}
        clear = check_same_layout(site, rest, reference)
        return EncryptedContribution(
            site, load_chunks(self.ctx, chunks, self.layout, site, fresh=True), clear
        )

    def weigh(
        self,
        scheme: WeightingScheme,
        reports: Sequence[ClientReport],
        contributions: Sequence[EncryptedContribution],
        t: int,
        T: int,
    ) -> np.ndarray:
        """The scheme's weights from scalars only: it sees no parameters and no global model."""
        blind = [replace(r, params=None) for r in reports]
        return np.asarray(scheme.weights(blind, None, t, T), dtype=np.float64)

    def aggregate(
        self,
        scheme: WeightingScheme,
        reports: Sequence[ClientReport],
        contributions: Sequence[EncryptedContribution],
        weights: np.ndarray,
    ) -> Params:
        """Enc(theta_g) += sum_k w_k Enc(Delta_k), and the clear arrays by ``scheme.aggregate`` with the
        same weights. Returns the clear arrays. ValueError (nothing changed) on a mismatch."""
        names = [r.name for r in reports]
        if names != [c.site for c in contributions]:
            raise ValueError(f"reports {names} and contributions {[c.site for c in contributions]} differ")
        w = np.asarray(weights, dtype=np.float64)
        new_clear = dict(self.clear)
        if self.clear:
            with_clear = [replace(r, params=c.clear) for r, c in zip(reports, contributions, strict=True)]
            new_clear = {k: np.asarray(v) for k, v in scheme.aggregate(self.clear, with_clear, w).items()}
        base = self._initial if self._vectors is None else self._vectors
        summed = weighted_sum([c.update for c in contributions], w, base, self.layout.slots)  # type: ignore[arg-type]
        if summed is not None:
            self.check_value += float(sum(wk for wk in w if abs(wk) >= ZERO_WEIGHT))
            self.contributions = int(sum(1 for wk in w if abs(wk) >= ZERO_WEIGHT))
            self.round_steps = weighted_median_steps([r.num_steps for r in reports], w)
            self._vectors = summed
            self.chunks = [v.serialize() for v in summed]
            self._initial, self._initial_values = None, {}
        self.clear = new_clear
        return dict(new_clear)

    # -- persistence (ciphertext only: the server never writes a plaintext model after round 1) -------
    def save(self, path: str | Path) -> None:
        """Write clear arrays, ciphertext chunks (or, before round 1 ends, the plaintext initial
        values) and the layout fingerprint to an ``.npz`` file (atomically)."""
        path = Path(path)
        arrays: dict[str, np.ndarray] = {f"clear/{k}": v for k, v in self.clear.items()}
        if self.chunks is not None:
            arrays.update(
                {f"enc/{i:06d}": np.frombuffer(c, dtype=np.uint8) for i, c in enumerate(self.chunks)}
            )
        else:
            arrays.update({f"plain/{k}": v for k, v in self._initial_values.items()})
        arrays["layout_fingerprint"] = np.array(self.layout.fingerprint)
        arrays["check_value"] = np.array(self.check_value)
        arrays["contributions"] = np.array(self.contributions)
        arrays["round_steps"] = np.array(self.round_steps)
        atomic_write_npz(path, **arrays)

    def load(self, path: str | Path) -> None:
        """Restore what :meth:`save` wrote (the layout must be the same)."""
        with np.load(Path(path)) as npz:
            files = list(npz.files)
            if str(npz["layout_fingerprint"]) != self.layout.fingerprint:
                raise ValueError(f"{path}: saved under another HE layout (model or he_layers changed)")
            self.clear = {f[len("clear/") :]: npz[f] for f in files if f.startswith("clear/")}
            self.check_value = float(npz["check_value"])
            self.contributions = int(npz["contributions"]) if "contributions" in files else 0
            self.round_steps = int(npz["round_steps"]) if "round_steps" in files else 0
            enc = sorted(f for f in files if f.startswith("enc/"))
            if enc:
                self.chunks = [npz[f].tobytes() for f in enc]
                self._vectors = load_chunks(self.ctx, self.chunks, self.layout, str(path))
                self._initial, self._initial_values = None, {}
            else:
                self._initial_values = {f[len("plain/") :]: npz[f] for f in files if f.startswith("plain/")}
                self._initial = np.append(self.layout.flatten(self._initial_values), 0.0)
                self.chunks, self._vectors = None, None

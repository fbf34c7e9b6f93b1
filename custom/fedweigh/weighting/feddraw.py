"""FedDRAW: Federated Dual Reputation Annealing Weighting.

Seed paper (abstract only): "FedDRAW: Federated Dual Reputation Annealing Weighting for Heterogeneous
Multi-Institutional Chest Radiograph Classification", arXiv:2609.05223 (2026). A data-size prior and
the cosine similarity between client and global parameters are mixed under two coupled schedules.
Everything below the abstract's wording is a READING (docs/methods.md), every knob selectable:

    p_k      = N_k / N                                                  size prior
    s_k      = cos(theta_k, theta_g)        (similarity="params", the abstract's literal reading)
             | mean_l cos(theta_k,l, theta_g,l)                        (similarity="layer")
             | cos(Delta_k, sum_j p_j Delta_j)                         (similarity="delta")
             | cos(Delta_k, theta_g^t - theta_g^{t-1})                 (similarity="direction", default)
             | none: s~ = p, so r = p                                  (similarity="off": prior and schedules only)
    s^_k     = (s_k - min s) / (max s - min s), then / sum             (spread="minmax")
             | softmax_k(z_k / tau),  z = (s - mean s) / std s         (spread="softmax", default; tau = temperature)
             (all s equal -> 1/K in both)
    s~_k     = (1 - m) s^_k + m p_k, the smallest m in [0, 1] with
               p_k / c <= s~_k <= c p_k for every k                    (prior_factor = c, default 2; None: s~ = s^)
    lambda_t = ramp_inner((t - 1) / (T - 1))                           inner schedule, 0 -> 1
    r_k      = (1 - lambda_t) p_k + lambda_t s~_k                      reputation, sums to 1
    beta_t   = deferred_anneal(t, T, beta_max, rho, outer)             outer schedule, -> 0 at T
    w_k      = r_k^beta_t / sum_j r_j^beta_t                           (form="log", default)
             | softmax_k(beta_t K r_k)                                 (form="plain")

with r floored at ``eps``. Round 1 with beta_max = 1 gives w = p (FedAvg); the last round gives 1/K.
Cosines are taken over the trainable parameters (``geometry="trainable"``, default; ``"all"``: every
floating-point array, BatchNorm's running statistics included), :mod:`fedweigh.weighting.geometry`.

Mode "direction" measures the data, not how far a site trained: Delta_k = theta_k - theta_g^t is
compared with the previous global update, so a site that took ten times the steps in the same
direction keeps its similarity, whereas cos(theta_k, theta_g) falls with every step taken. Before
any global update is known (round 1, or a global model that did not move) every s_k is 0. The scheme
keeps theta_g^{t-1} as state (``previous_global``, saved by ``state_dict``).

Under homomorphic encryption the server cannot compute s_k: each client computes it with the same
functions (:func:`fedweigh.weighting.geometry.model_similarity`,
:func:`~fedweigh.weighting.geometry.direction_similarity`; for "direction" it holds theta_g^t and
the global model it received in its previous round) and reports the scalar "similarity"; whenever
the server holds plaintext parameters it computes the similarity itself and ignores any reported
value. Mode "delta" needs every client's delta, so only the server can compute it.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np

from fedweigh import schedules
from fedweigh.weighting.base import (
    ClientReport,
    ScalarContext,
    WeightingScheme,
    check_reports,
    check_round,
    softmax,
)
from fedweigh.weighting.geometry import (
    ParameterGeometry,
    check_geometry,
    delta_gram,
    direction_similarity,
    model_similarity,
)

SimilarityMode = Literal["params", "delta", "layer", "direction", "off"]
SpreadMode = Literal["minmax", "softmax"]
WeightForm = Literal["log", "plain"]
SIMILARITY_MODES: tuple[str, ...] = ("params", "delta", "layer", "direction", "off")
SPREAD_MODES: tuple[str, ...] = ("minmax", "softmax")


def spread_similarity(similarity: np.ndarray) -> np.ndarray:
    """Min-max scale to [0, 1], then divide by the sum; uniform 1/K when all values are equal.

    The min-max span cancels in the division: (s - min s) / sum_j (s_j - min s).
    """
    s = np.asarray(similarity, dtype=np.float64)
    shifted = s - s.min()
    total = float(shifted.sum())
    if total <= 0.0:
        return np.full(s.size, 1.0 / s.size)
    return shifted / total


def softmax_spread(similarity: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """softmax_k(z_k / tau) with z = (s - mean s) / std s (population std); uniform 1/K when all s are equal.

    Standardising makes the spread independent of the cosines' scale (raw-parameter cosines differ
    in the fourth decimal, update directions by tenths); tau sets how sharply the most similar site
    is preferred: at tau = 1 a site one standard deviation above the mean gets e times the share of
    one at the mean, whereas min-max always gives the least similar site 0 and the most similar the
    largest share, however small their difference.
    """
    s = np.asarray(similarity, dtype=np.float64)
    span = float(s.max() - s.min())
    if span <= 0.0:
        return np.full(s.size, 1.0 / s.size)
    s = (s - s.min()) / span  # z is unchanged by this; it keeps std from underflowing to 0 (NaN weights)
    z = (s - s.mean()) / s.std()
    return softmax(z / temperature)


def bound_by_prior(share: np.ndarray, prior: np.ndarray, factor: float) -> tuple[np.ndarray, float]:
    """(s~, m): s~ = (1 - m) s^ + m p with the smallest m in [0, 1] such that p_k / c <= s~_k <= c p_k.

    With d_k = s^_k - p_k, 1 - m = min(1, min_{d_k > 0} (c - 1) p_k / d_k, min_{d_k < 0} (1 - 1/c) p_k / -d_k).
    s~ still sums to 1 and keeps the order of s^; the bound holds for the reputation
    r = (1 - lambda) p + lambda s~ as well (a mixture of two vectors that satisfy it). c = 1 gives s~ = p.
    """
    s_hat = np.asarray(share, dtype=np.float64)
    p = np.asarray(prior, dtype=np.float64)
    d = s_hat - p
    keep = 1.0
    above = d > 0  # only non-zero differences divide
    if above.any():
        keep = min(keep, float(np.min((factor - 1.0) * p[above] / d[above])))
    below = d < 0
    if below.any():
        keep = min(keep, float(np.min((1.0 - 1.0 / factor) * p[below] / -d[below])))
    keep = max(keep, 0.0)
    return keep * s_hat + (1.0 - keep) * p, 1.0 - keep


def _encode_arrays(arrays: Mapping[str, np.ndarray]) -> str:
    """Arrays as one base64 text (an .npz archive), for the JSON state."""
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _decode_arrays(text: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(base64.b64decode(text.encode("ascii"), validate=True)), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def tempered_weights(
    reputation: np.ndarray, beta: float, form: str = "log", eps: float = 1e-12
) -> np.ndarray:
    """form "log": r^beta / sum r^beta = softmax(beta log r); form "plain": softmax(beta K r); r >= eps."""
    r = np.maximum(np.asarray(reputation, dtype=np.float64), eps)
    if form == "log":
        return softmax(beta * np.log(r))
    if form == "plain":
        return softmax(beta * r.size * r)
    raise ValueError(f"feddraw: form must be 'log' or 'plain', got {form!r}")


@dataclass(kw_only=True)
class FedDRAWWeights(ParameterGeometry, WeightingScheme):
    """Size prior and spread cosine similarity under an inner and a deferred outer schedule.

    Defaults (``similarity="direction"``, ``spread="softmax"``, ``prior_factor=2``) are the best of
    the multi-seed sensitivity study on the converged ``standard`` profile
    (``benchmarks/feddraw_sensitivity.py``, docs/results/feddraw-sensitivity/); the abstract's literal
    reading is ``similarity="params", spread="minmax", prior_factor=None``. docs/methods.md explains
    each option.
    """

    name: ClassVar[str] = "feddraw"
    he_client_scalars: ClassVar[tuple[str, ...]] = ("similarity",)
    he_refusal: ClassVar[str] = (
        "FedDRAW with similarity='delta' compares each update with the weighted mean of all "
        "updates, which only the server could compute from plaintext updates; use similarity='params', "
        "'layer' or 'direction', which each site computes itself"
    )

    similarity: SimilarityMode = "direction"
    spread: SpreadMode = "softmax"
    temperature: float = 1.0
    prior_factor: float | None = 2.0
    inner: str = "linear"
    outer: str = "cosine"
    beta_max: float = 1.0
    rho: float = 0.6
    form: WeightForm = "log"
    eps: float = 1e-12
    rate: float = 5.0
    #: theta_g^{t-1}: the global model of the previous round over the compared arrays (the server's
    #: state under similarity="direction"; a site passes its own in ``ScalarContext.previous_global``).
    previous_global: dict[str, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_geometry(self.geometry, scheme="feddraw")
        if self.similarity not in SIMILARITY_MODES:
            raise ValueError(
                f"feddraw: similarity must be one of {', '.join(map(repr, SIMILARITY_MODES))}, got {self.similarity!r}"
            )
        if self.spread not in SPREAD_MODES:
            raise ValueError(f"feddraw: spread must be 'minmax' or 'softmax', got {self.spread!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature <= 0
        ):
            raise ValueError(f"feddraw: temperature must be a positive number, got {self.temperature!r}")
        if self.prior_factor is not None and (
            isinstance(self.prior_factor, bool)
            or not isinstance(self.prior_factor, (int, float))
            or not math.isfinite(self.prior_factor)
            or self.prior_factor < 1.0
        ):
            raise ValueError(
                f"feddraw: prior_factor must be None (off) or a finite number >= 1, got {self.prior_factor!r}"
            )
        for label, shape in (("inner", self.inner), ("outer", self.outer)):
            if shape not in schedules.RAMP_SHAPES:
                raise ValueError(
                    f"feddraw: {label} schedule must be one of {', '.join(schedules.RAMP_SHAPES)}, got {shape!r}"
                )
        if self.form not in ("log", "plain"):
            raise ValueError(f"feddraw: form must be 'log' or 'plain', got {self.form!r}")
        if not math.isfinite(self.beta_max) or self.beta_max < 0:
            raise ValueError(f"feddraw: beta_max must be a finite number >= 0, got {self.beta_max!r}")
        if not math.isfinite(self.rho) or not 0.0 <= self.rho <= 1.0:
            raise ValueError(f"feddraw: rho must lie in [0, 1], got {self.rho!r}")
        if not math.isfinite(self.eps) or self.eps <= 0:
            raise ValueError(f"feddraw: eps must be a positive number, got {self.eps!r}")
        if not math.isfinite(self.rate) or self.rate <= 0:
            raise ValueError(f"feddraw: rate must be a positive number, got {self.rate!r}")
        # Mode "delta" needs all deltas at the server: plaintext only.
        self.he_compatible = self.similarity != "delta"  # type: ignore[misc]

    def scalars(self, *, encrypted: bool = False) -> tuple[str, ...]:
        """Nothing with similarity "off" (no site computes one); else as every scheme."""
        return () if self.similarity == "off" else super().scalars(encrypted=encrypted)

    @property
    def needs_previous_global(self) -> bool:
        """Whether the similarity compares with the previous global model (a site then passes the
        global model it received in its previous round as ``ScalarContext.previous_global``)."""
        return self.similarity == "direction"

    def client_scalars(self, ctx: ScalarContext) -> dict[str, float]:
        """{"similarity": s_k} computed by the client (modes "params", "layer" and "direction"; for
        "direction" against ``ctx.previous_global``, the global model the site received in its
        previous training round, 0 when it is None).

        Mode "delta" compares each delta with the mean of all deltas, which no client can compute:
        the client reports nothing and the server computes the similarity from the parameters.
        """
        if self.similarity in ("delta", "off"):
            return {}
        params, global_params = ctx.models(self.name)
        return {"similarity": self._similarity_of(params, global_params, "client", ctx.previous_global)}

    def _similarity_of(
        self,
        params: Mapping[str, np.ndarray],
        global_params: Mapping[str, np.ndarray],
        name: str,
        previous_global: Mapping[str, np.ndarray] | None,
    ) -> float:
        """s_k of one client from its parameters (modes "params", "layer", "direction"; the last
        against ``previous_global``: the server's theta_g^{t-1}, or what the site received before)."""
        keys = self.compared_keys(global_params)
        if self.similarity == "direction":
            return direction_similarity(params, global_params, previous_global, name=name, keys=keys)
        return model_similarity(params, global_params, self.similarity, name=name, keys=keys)

    def _similarities(
        self, reports: Sequence[ClientReport], global_params: dict[str, np.ndarray] | None, p: np.ndarray
    ) -> np.ndarray:
        if self.similarity == "delta":
            for rep in reports:
                if rep.params is None:
                    raise ValueError(
                        f"feddraw: client {rep.name!r} sent no parameters; similarity='delta' needs every "
                        "client's parameters at the server"
                    )
            if global_params is None:
                raise ValueError("feddraw: similarity='delta' needs the global parameters")
            gram = delta_gram(
                global_params,
                [r.params for r in reports],  # type: ignore[misc]
                [r.name for r in reports],
                keys=self.compared_keys(global_params),
            )
            return gram.delta_cosines(p)
        s = np.empty(len(reports))
        for i, rep in enumerate(reports):
            # the server's own computation wins: a site could report any value in [-1, 1]
            if rep.params is not None and global_params is not None:
                s[i] = self._similarity_of(rep.params, global_params, rep.name, self.previous_global)
            elif "similarity" in rep.scalars:
                s[i] = float(rep.scalars["similarity"])
            else:
                raise ValueError(
                    f"feddraw: client {rep.name!r} reported no 'similarity' scalar and the server has no "
                    "plaintext parameters to compute it"
                )
        return s

    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        check_round(round_index, num_rounds)
        n = check_reports(reports, scheme=self.name)
        p = n / n.sum()
        if self.similarity == "off":  # the ablation: the size prior under the two schedules only
            return self._prior_only(p, round_index, num_rounds)
        s = self._similarities(reports, global_params, p)
        if self.similarity == "direction" and global_params is not None:
            # theta_g^t becomes theta_g^{t-1} of the next round (under HE the sites keep it instead)
            self.previous_global = {
                k: np.array(global_params[k], copy=True) for k in self.compared_keys(global_params)
            }
        if self.spread == "softmax":
            s_hat = softmax_spread(s, self.temperature)
        else:
            s_hat = spread_similarity(s)
        share, mixed = (
            (s_hat, 0.0) if self.prior_factor is None else bound_by_prior(s_hat, p, self.prior_factor)
        )
        lam = schedules.ramp(self.inner, schedules.progress(round_index, num_rounds), self.rate)
        r = (1.0 - lam) * p + lam * share
        beta = schedules.deferred_anneal(
            round_index, num_rounds, self.beta_max, self.rho, self.outer, self.rate
        )
        w = tempered_weights(r, beta, self.form, self.eps)
        self.last_details = {
            "size_prior": p.tolist(),
            "similarity": s.tolist(),
            "spread_similarity": s_hat.tolist(),
            "lambda": lam,
            **(
                {"similarity_share": share.tolist(), "prior_mix": mixed}
                if self.prior_factor is not None
                else {}
            ),
            "reputation": r.tolist(),
            "beta": beta,
        }
        return w

    def _prior_only(self, p: np.ndarray, round_index: int, num_rounds: int) -> np.ndarray:
        """similarity "off": r = p (the inner schedule mixes p with itself), w_k = tempered(p, beta_t)."""
        lam = schedules.ramp(self.inner, schedules.progress(round_index, num_rounds), self.rate)
        beta = schedules.deferred_anneal(
            round_index, num_rounds, self.beta_max, self.rho, self.outer, self.rate
        )
        self.last_details = {"size_prior": p.tolist(), "lambda": lam, "reputation": p.tolist(), "beta": beta}
        return tempered_weights(p, beta, self.form, self.eps)

    def state_dict(self) -> dict:
        """{"previous_global": base64 .npz of theta_g^{t-1}} in mode "direction" once a round was
        weighted with plaintext parameters; {} otherwise."""
        if self.previous_global is None:
            return {}
        return {"previous_global": _encode_arrays(self.previous_global)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        text = state.get("previous_global")
        if text is None:
            self.previous_global = None
            return
        try:
            self.previous_global = _decode_arrays(str(text))
        except (ValueError, OSError, binascii.Error, zipfile.BadZipFile) as exc:
            raise ValueError(f"feddraw: malformed state 'previous_global': {exc}") from None

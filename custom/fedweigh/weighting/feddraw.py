"""FedDRAW: Federated Dual Reputation Annealing Weighting.

Seed paper (abstract only): "FedDRAW: Federated Dual Reputation Annealing Weighting for Heterogeneous
Multi-Institutional Chest Radiograph Classification", arXiv:2609.05223 (2026). A data-size prior and
the cosine similarity between client and global parameters are mixed under two coupled schedules.
Everything below the abstract's wording is a READING (docs/methods.md), every knob selectable:

    p_k      = N_k / N                                                  size prior
    s_k      = cos(theta_k, theta_g)        (similarity="params", default)
             | mean_l cos(theta_k,l, theta_g,l)                        (similarity="layer")
             | cos(Delta_k, sum_j p_j Delta_j)                         (similarity="delta")
    s^_k     = (s_k - min s) / (max s - min s), then / sum             spread (all equal -> 1/K)
    lambda_t = ramp_inner((t - 1) / (T - 1))                           inner schedule, 0 -> 1
    r_k      = (1 - lambda_t) p_k + lambda_t s^_k                      reputation, sums to 1
    beta_t   = deferred_anneal(t, T, beta_max, rho, outer)             outer schedule, -> 0 at T
    w_k      = r_k^beta_t / sum_j r_j^beta_t                           (form="log", default)
             | softmax_k(beta_t K r_k)                                 (form="plain")

with r floored at ``eps``. Round 1 with beta_max = 1 gives w = p (FedAvg); the last round gives 1/K.

Under homomorphic encryption the server cannot compute s_k: each client computes it with
:func:`fedweigh.weighting.geometry.model_similarity` (it holds theta_k and theta_g) and reports the
scalar "similarity"; whenever the server holds plaintext parameters it computes the similarity itself
with the same function and ignores any reported value. Mode "delta" needs every client's delta, so
only the server can compute it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from fedweigh import schedules
from fedweigh.weighting.base import ClientReport, WeightingScheme, check_reports, check_round, softmax
from fedweigh.weighting.geometry import delta_gram, model_similarity

SimilarityMode = Literal["params", "delta", "layer"]
WeightForm = Literal["log", "plain"]


def spread_similarity(similarity: np.ndarray) -> np.ndarray:
    """Min-max scale to [0, 1], then divide by the sum; uniform 1/K when all values are equal."""
    s = np.asarray(similarity, dtype=np.float64)
    span = float(s.max() - s.min())
    if span <= 0.0:
        return np.full(s.size, 1.0 / s.size)
    scaled = (s - s.min()) / span
    return scaled / scaled.sum()


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
class FedDRAWWeights(WeightingScheme):
    """Size prior and spread cosine similarity under an inner and a deferred outer schedule.

    Defaults are provisional (docs/methods.md explains them) until the sensitivity study fixes them.
    """

    name: ClassVar[str] = "feddraw"
    he_client_scalars: ClassVar[tuple[str, ...]] = ("similarity",)
    he_refusal: ClassVar[str] = (
        "FedDRAW with similarity='delta' compares each update with the weighted mean of all "
        "updates, which only the server could compute from plaintext updates; use similarity='params' "
        "or 'layer', which each site computes itself"
    )

    similarity: SimilarityMode = "params"
    inner: str = "linear"
    outer: str = "cosine"
    beta_max: float = 1.0
    rho: float = 0.6
    form: WeightForm = "log"
    eps: float = 1e-12
    rate: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.similarity not in ("params", "delta", "layer"):
            raise ValueError(
                f"feddraw: similarity must be 'params', 'delta' or 'layer', got {self.similarity!r}"
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

    def client_scalars(
        self,
        *,
        class_counts: np.ndarray | None = None,
        num_samples: int | None = None,
        global_class_counts: np.ndarray | None = None,
        global_num_samples: int | None = None,
        params: dict[str, np.ndarray] | None = None,
        global_params: dict[str, np.ndarray] | None = None,
    ) -> dict[str, float]:
        """{"similarity": s_k} computed by the client (modes "params" and "layer").

        Mode "delta" compares each delta with the mean of all deltas, which no client can compute:
        the client reports nothing and the server computes the similarity from the parameters.
        """
        if self.similarity == "delta":
            return {}
        if params is None or global_params is None:
            raise ValueError(
                "feddraw: the client needs its trained and the global parameters for its similarity"
            )
        return {"similarity": model_similarity(params, global_params, self.similarity)}

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
            gram = delta_gram(global_params, [r.params for r in reports], [r.name for r in reports])  # type: ignore[misc]
            return gram.delta_cosines(p)
        s = np.empty(len(reports))
        for i, rep in enumerate(reports):
            # the server's own computation wins: a site could report any value in [-1, 1]
            if rep.params is not None and global_params is not None:
                s[i] = model_similarity(rep.params, global_params, self.similarity, name=rep.name)
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
        s = self._similarities(reports, global_params, p)
        s_hat = spread_similarity(s)
        lam = schedules.ramp(self.inner, schedules.progress(round_index, num_rounds), self.rate)
        r = (1.0 - lam) * p + lam * s_hat
        beta = schedules.deferred_anneal(
            round_index, num_rounds, self.beta_max, self.rho, self.outer, self.rate
        )
        w = tempered_weights(r, beta, self.form, self.eps)
        self.last_details = {
            "size_prior": p.tolist(),
            "similarity": s.tolist(),
            "spread_similarity": s_hat.tolist(),
            "lambda": lam,
            "reputation": r.tolist(),
            "beta": beta,
        }
        return w

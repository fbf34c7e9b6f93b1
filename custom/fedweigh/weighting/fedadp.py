"""FedAdp aggregation weights.

Wu and Wang, IEEE TCCN 2021, "Fast-Convergent Federated Learning with Adaptive Weighting".
With p_k = N_k / N and the round's size-weighted update Delta = sum_k p_k Delta_k:

    a_k          = arccos cos(Delta_k, Delta)                          (radians)
    a~_k(n)      = ((n - 1) / n) a~_k(n - 1) + a_k / n                 (a~_k(1) = a_k)
    f(a~)        = alpha (1 - exp(-exp(-alpha (a~ - 1)))),  alpha = 5  (Gompertz)
    w_k          = N_k exp(f(a~_k)) / sum_j N_j exp(f(a~_j))

READING: n counts the rounds in which client k took part (it equals the round index t under full
participation, as in the paper), so a client joining late starts from its own first angle. The
client's local update is used for its "gradient": the cosine is the same for -Delta_k / lr.
Zero-vector convention for the cosine: cos(0, 0) = 1, cos(0, v) = 0. Deltas are taken over the
trainable parameters (``geometry="trainable"``, default: the paper's gradients exist for parameters
only; buffers such as BatchNorm's running statistics have none); ``geometry="all"`` includes every
floating-point array (:mod:`fedweigh.weighting.geometry`).

State (JSON): {"smoothed_angle": {site: a~}, "participations": {site: n}}.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from fedweigh.weighting.base import ClientReport, WeightingScheme, check_reports, check_round
from fedweigh.weighting.geometry import ParameterGeometry, check_geometry, delta_gram


def gompertz(angle: np.ndarray, alpha: float = 5.0) -> np.ndarray:
    """f(a) = alpha (1 - exp(-exp(-alpha (a - 1))))."""
    a = np.asarray(angle, dtype=np.float64)
    return alpha * (1.0 - np.exp(-np.exp(-alpha * (a - 1.0))))


@dataclass(kw_only=True)
class FedAdpWeights(ParameterGeometry, WeightingScheme):
    """Size times exp(Gompertz(smoothed angle to the mean update)), normalised."""

    name: ClassVar[str] = "fedadp"
    he_compatible: ClassVar[bool] = False
    he_refusal: ClassVar[str] = (
        "FedAdp weights each client by the angle between its update and the round's mean "
        "update, which the server computes from plaintext client updates"
    )

    alpha: float = 5.0
    smoothed_angle: dict[str, float] = field(default_factory=dict, init=False)
    participations: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_geometry(self.geometry, scheme="fedadp")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"fedadp: alpha must be a positive number, got {self.alpha!r}")

    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        """Advances the smoothed angles: call once per round."""
        check_round(round_index, num_rounds)
        n = check_reports(reports, scheme=self.name, params=True)
        if global_params is None:
            raise ValueError("fedadp: the global parameters are required")
        p = n / n.sum()
        gram = delta_gram(
            global_params,
            [r.params for r in reports],  # type: ignore[misc]
            [r.name for r in reports],
            keys=self.compared_keys(global_params),
        )
        angles = np.arccos(gram.delta_cosines(p))
        smoothed = np.empty_like(angles)
        for i, rep in enumerate(reports):
            count = self.participations.get(rep.name, 0) + 1
            prev = self.smoothed_angle.get(rep.name, 0.0)
            smoothed[i] = ((count - 1) / count) * prev + angles[i] / count
            self.participations[rep.name] = count
            self.smoothed_angle[rep.name] = float(smoothed[i])
        f = gompertz(smoothed, self.alpha)
        logits = np.log(n) + f
        w = np.exp(logits - logits.max())
        w /= w.sum()
        self.last_details = {
            "angle": angles.tolist(),
            "smoothed_angle": smoothed.tolist(),
            "gompertz": f.tolist(),
        }
        return w

    def state_dict(self) -> dict:
        return {"smoothed_angle": dict(self.smoothed_angle), "participations": dict(self.participations)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        try:
            angles = {str(k): float(v) for k, v in state.get("smoothed_angle", {}).items()}
            counts = {str(k): int(v) for k, v in state.get("participations", {}).items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"fedadp: malformed state: {exc}") from None
        if set(angles) != set(counts):
            raise ValueError("fedadp: state 'smoothed_angle' and 'participations' name different sites")
        self.smoothed_angle = angles
        self.participations = counts

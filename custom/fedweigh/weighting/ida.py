"""Inverse Distance Aggregation (IDA).

Yeganeh et al., MICCAI DCL workshop 2020, "Inverse Distance Aggregation for Federated Learning with
Non-IID Data". With theta_avg = (1/K) sum_k theta_k, the plain mean of the round's client models:

    w_k = ||theta_avg - theta_k||^-1 / sum_j ||theta_avg - theta_j||^-1

over the trainable parameters (``geometry="trainable"``, default: BatchNorm's running statistics and
other buffers excluded, :mod:`fedweigh.weighting.geometry`; ``geometry="all"``: every floating-point
array of the state dict, the paper's "model weights" read as the whole state dict). Guard: distances are floored at ``eps``, so if every distance
is at most ``eps`` (one client, or identical clients) the weights are uniform 1/K. Needs the clients'
plaintext models, so it cannot run under homomorphic encryption.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedweigh.weighting.base import ClientReport, WeightingScheme, check_reports, check_round
from fedweigh.weighting.geometry import ParameterGeometry, check_geometry, delta_gram


@dataclass(kw_only=True)
class IDAWeights(ParameterGeometry, WeightingScheme):
    """Inverse distance of each client model to the plain mean of the client models."""

    name: ClassVar[str] = "ida"
    he_compatible: ClassVar[bool] = False
    he_refusal: ClassVar[str] = (
        "IDA weights each client by the inverse distance between its model and the mean of the "
        "round's client models, which the server computes from plaintext client models"
    )

    eps: float = 1e-12

    def __post_init__(self) -> None:
        super().__post_init__()
        check_geometry(self.geometry, scheme="ida")
        if not math.isfinite(self.eps) or self.eps <= 0:
            raise ValueError(f"ida: eps must be a positive number, got {self.eps!r}")

    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        check_round(round_index, num_rounds)
        check_reports(reports, scheme=self.name, params=True)
        if global_params is None:
            raise ValueError("ida: the global parameters are required")
        k = len(reports)
        gram = delta_gram(
            global_params,
            [r.params for r in reports],  # type: ignore[misc]
            [r.name for r in reports],
            keys=self.compared_keys(global_params),
        )
        dist = gram.distances_to_mix(np.full(k, 1.0 / k))
        inv = 1.0 / np.maximum(dist, self.eps)  # every distance <= eps (identical updates): uniform
        w = inv / inv.sum()
        self.last_details = {"distance": dist.tolist()}
        return w

"""FedAvg and FedProx aggregation weights.

FedAvg (McMahan et al., AISTATS 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data"): w_k = N_k / N over the round's clients.

FedProx (Li et al., MLSys 2020, "Federated Optimization in Heterogeneous Networks") keeps FedAvg's
weights; its proximal term (mu / 2) ||theta - theta_g||^2 is added by the client to its local loss,
reading ``client_mu`` from the scheme. Default 0.01: chosen from {0.001, 0.01, 0.1, 1} by validation
AUC on short SynthCXR runs with the clients' Adam (docs/methods.md, FedProx); 0.001 (FedBB's setting)
is within noise of FedAvg under Adam.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedweigh.weighting.base import ClientReport, WeightingScheme, check_reports, check_round


@dataclass(kw_only=True)
class FedAvgWeights(WeightingScheme):
    """w_k = N_k / N."""

    name: ClassVar[str] = "fedavg"

    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        check_round(round_index, num_rounds)
        n = check_reports(reports, scheme=self.name)
        w = n / n.sum()
        self.last_details = {"size_prior": w.tolist()}
        return w


@dataclass(kw_only=True)
class FedProxWeights(FedAvgWeights):
    """FedAvg weights; clients add (client_mu / 2) ||theta - theta_g||^2 to their loss."""

    name: ClassVar[str] = "fedprox"
    client_mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not math.isfinite(self.client_mu) or self.client_mu < 0:
            raise ValueError(f"fedprox: client_mu must be a finite number >= 0, got {self.client_mu!r}")

    @property
    def fedprox_mu(self) -> float:
        """mu = ``client_mu``: the clients' proximal coefficient."""
        return float(self.client_mu)

"""FedNova aggregation weights, vanilla-SGD form.

Wang et al., NeurIPS 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization". With tau_k local SGD steps, p_k = N_k / N and tau_eff = sum_k p_k tau_k:

    theta_g^t = theta_g - tau_eff * sum_k p_k (theta_g - theta_k) / tau_k

i.e. weights on deltas w_k = tau_eff p_k / tau_k. They do not sum to 1 unless all tau_k are equal
(then w_k = p_k, FedAvg). tau_k is the report's ``num_steps``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedweigh.weighting.base import ClientReport, WeightingScheme, check_reports, check_round


@dataclass(kw_only=True)
class FedNovaWeights(WeightingScheme):
    """w_k = tau_eff p_k / tau_k with tau_eff = sum_j p_j tau_j."""

    name: ClassVar[str] = "fednova"

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
        tau = np.array([float(r.num_steps) for r in reports])
        tau_eff = float(p @ tau)
        w = tau_eff * p / tau
        self.last_details = {"size_prior": p.tolist(), "tau": tau.tolist(), "tau_eff": tau_eff}
        return w

"""FedNova aggregation weights with the normaliser of the clients' local optimizer.

Wang et al., NeurIPS 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization". A client's update is Delta_k = -eta G_k a_k, where the vector a_k holds the
coefficients of its tau_k local gradients; with ||a_k||_1 its sum, p_k = N_k / N and
tau_eff = sum_k p_k ||a_k||_1:

    theta_g^t = theta_g - tau_eff * sum_k p_k (theta_g - theta_k) / ||a_k||_1

i.e. weights on deltas w_k = tau_eff p_k / ||a_k||_1 (they do not sum to 1 unless all ||a_k||_1 are
equal; then w_k = p_k, FedAvg). tau_k is the report's ``num_steps``. ``local_optimizer=``:

- ``"sgd"``: SGD with heavy-ball momentum rho = ``momentum`` (paper, Sec. 5 / App.):
  ||a_k||_1 = [tau_k - rho (1 - rho^tau_k) / (1 - rho)] / (1 - rho); rho = 0 gives plain SGD, tau_k.
- ``"adam"`` (default, the clients' default optimizer): Adam's step is divided by running moment
  estimates, so its coefficients have no closed form; the normaliser is taken as tau_k (every step
  counted once, as for plain SGD). This is an approximation: for the paper's normaliser run the
  clients with SGD and set ``local_optimizer="sgd"`` with their momentum (the method label
  ``fednova:optim=sgd`` does both: :func:`fedweigh.methods.method_spec`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from fedweigh.weighting.base import ClientReport, WeightingScheme, check_reports, check_round

LOCAL_OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")


def momentum_normaliser(num_steps: np.ndarray, momentum: float) -> np.ndarray:
    """||a||_1 = [tau - rho (1 - rho^tau) / (1 - rho)] / (1 - rho) for SGD with momentum rho (tau when rho = 0)."""
    tau = np.asarray(num_steps, dtype=np.float64)
    rho = float(momentum)
    if not 0.0 <= rho < 1.0:  # at rho = 1 the sum diverges (the formula divides by 0)
        raise ValueError(f"fednova: momentum must lie in [0, 1), got {momentum!r}")
    if rho == 0.0:
        return tau
    return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)


@dataclass(kw_only=True)
class FedNovaWeights(WeightingScheme):
    """w_k = tau_eff p_k / ||a_k||_1 with tau_eff = sum_j p_j ||a_j||_1."""

    name: ClassVar[str] = "fednova"

    local_optimizer: Literal["adam", "sgd"] = "adam"
    momentum: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local_optimizer not in LOCAL_OPTIMIZERS:
            raise ValueError(
                f"fednova: local_optimizer must be one of {LOCAL_OPTIMIZERS}, got {self.local_optimizer!r}"
            )
        if not math.isfinite(self.momentum) or not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"fednova: momentum must lie in [0, 1), got {self.momentum!r}")

    def normaliser(self, num_steps: np.ndarray) -> np.ndarray:
        """||a_k||_1 for each client's tau_k under ``local_optimizer``."""
        if self.local_optimizer == "sgd":
            return momentum_normaliser(num_steps, self.momentum)
        return np.asarray(num_steps, dtype=np.float64)

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
        a = self.normaliser(tau)
        tau_eff = float(p @ a)
        w = tau_eff * p / a
        self.last_details = {
            "size_prior": p.tolist(),
            "tau": tau.tolist(),
            "normaliser": a.tolist(),
            "tau_eff": tau_eff,
        }
        return w

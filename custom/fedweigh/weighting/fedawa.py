"""FedAWA: adaptive aggregation weights from client vectors.

Shi et al., CVPR 2025, "FedAWA: Adaptive Optimization of Aggregation Weights in Federated Learning
Using Client Vectors". Server logits T (one per site), lambda = softmax(T) over the round's clients,
client vectors tau_k = Delta_k = theta_k - theta_g. Objective:

    L(T) = sum_k lambda_k (1 - cos(theta_g, theta_k)) + sum_k lambda_k ||tau_k - sum_j lambda_j tau_j||_2

Server iterations (the authors' code, ChanglongShi/FedAWA ``server_funct.fedawa``): each round runs
``server_iters`` Adam steps on T (lr 1e-3, betas (0.5, 0.999), eps 1e-8; torch.optim.Adam's update
rule) over the round's client vectors, and aggregates with the lambda of the last iteration, taken
before its step; T carries over to the next round.

- ``adam_state="round"`` (default, the code: the optimizer is built inside every round's call):
  Adam's moments and step count start at zero each round. ``"persistent"``: they are kept per site
  across rounds (the earlier reading).
- ``server_iters`` (default 20; the code's ``--server_epochs`` defaults to 1): Adam moves a logit by
  at most about lr per step, so one step per round moves it by at most 0.05 in 50 rounds and the
  weights cannot leave FedAvg's neighbourhood. The objective's second term is 0 at every vertex of
  the simplex, so unbounded optimisation would collapse onto one client; 20 steps of 1e-3 let a
  logit move by up to 1.0 over 50 rounds.
- ``init="log_size"`` (default): a new site starts at T_k = log(N_k / N), so the first iteration's
  lambda is FedAvg's. ``"size"`` (the code): T_k = N_k / N, so lambda starts at softmax(N_k / N),
  between FedAvg and uniform.

The gradient is exact and needs only inner products (G = Gram matrix of the tau's, m = sum lambda tau,
e_k = ||tau_k - m||, c_k = 1 - cos(theta_g, theta_k)):

    dL/dlambda_i = c_i + e_i - sum_k lambda_k (G_ki - (G lambda)_i) / e_k      (terms with e_k = 0 drop)
    dL/dT_j      = lambda_j (dL/dlambda_j - sum_i lambda_i dL/dlambda_i)

READING for partial participation: logits (and, with ``adam_state="persistent"``, Adam moments and
step counts) are kept per site name; a site seen for the first time starts from its round's N_k / N;
a site that skips a round keeps its state untouched. Needs plaintext client models (not HE).
Client vectors and cosines are taken over the trainable parameters (``geometry="trainable"``,
default; ``"all"``: every floating-point array, buffers included; :mod:`fedweigh.weighting.geometry`).

State (JSON): {"logits", "exp_avg", "exp_avg_sq", "steps"}, each {site: value}.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np

from fedweigh.weighting.base import ClientReport, WeightingScheme, check_reports, check_round, softmax
from fedweigh.weighting.geometry import DeltaGram, ParameterGeometry, check_geometry, delta_gram


def fedawa_objective_and_grad(logits: np.ndarray, gram: DeltaGram) -> tuple[float, np.ndarray]:
    """L(T) and dL/dT for the FedAWA objective, from the round's inner products."""
    lam = softmax(logits)
    g = gram.gram
    cos_term = 1.0 - gram.param_cosines()
    e = gram.distances_to_mix(lam)
    glam = g @ lam
    objective = float(lam @ cos_term + lam @ e)
    safe = np.where(e > 0, e, 1.0)
    coeff = np.where(e > 0, lam / safe, 0.0)  # lambda_k / e_k
    # sum_k coeff_k (G_ki - (G lambda)_i)
    cross = g.T @ coeff - glam * coeff.sum()
    d_lam = cos_term + e - cross
    d_logits = lam * (d_lam - lam @ d_lam)
    return objective, d_logits


@dataclass(kw_only=True)
class FedAWAWeights(ParameterGeometry, WeightingScheme):
    """lambda = softmax(T); ``server_iters`` Adam steps on T per round, aggregation with the last pre-step lambda."""

    name: ClassVar[str] = "fedawa"
    he_compatible: ClassVar[bool] = False
    he_refusal: ClassVar[str] = (
        "FedAWA optimises its weights on the client vectors Delta_k (their Gram matrix and "
        "cosines with the global model), which the server computes from plaintext client models"
    )

    lr: float = 1e-3
    betas: tuple[float, float] = (0.5, 0.999)
    adam_eps: float = 1e-8
    server_iters: int = 20
    adam_state: Literal["round", "persistent"] = "round"
    init: Literal["log_size", "size"] = "log_size"
    logits: dict[str, float] = field(default_factory=dict, init=False)
    exp_avg: dict[str, float] = field(default_factory=dict, init=False)
    exp_avg_sq: dict[str, float] = field(default_factory=dict, init=False)
    steps: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_geometry(self.geometry, scheme="fedawa")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ValueError(f"fedawa: lr must be a positive number, got {self.lr!r}")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"fedawa: betas must lie in [0, 1), got {self.betas!r}")
        if not math.isfinite(self.adam_eps) or self.adam_eps <= 0:
            raise ValueError(f"fedawa: adam_eps must be a positive number, got {self.adam_eps!r}")
        if (
            isinstance(self.server_iters, bool)
            or not isinstance(self.server_iters, int)
            or self.server_iters < 1
        ):
            raise ValueError(f"fedawa: server_iters must be an integer >= 1, got {self.server_iters!r}")
        if self.adam_state not in ("round", "persistent"):
            raise ValueError(f"fedawa: adam_state must be 'round' or 'persistent', got {self.adam_state!r}")
        if self.init not in ("log_size", "size"):
            raise ValueError(f"fedawa: init must be 'log_size' or 'size', got {self.init!r}")

    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        """Runs the round's server iterations and returns the last iteration's pre-step lambda: call once per round."""
        check_round(round_index, num_rounds)
        n = check_reports(reports, scheme=self.name, params=True)
        if global_params is None:
            raise ValueError("fedawa: the global parameters are required")
        names = [r.name for r in reports]
        gram = delta_gram(
            global_params,
            [r.params for r in reports],  # type: ignore[misc]
            names,
            keys=self.compared_keys(global_params),
        )
        p = n / n.sum()
        for name, pk in zip(names, p, strict=True):
            if name not in self.logits:
                self.logits[name] = float(math.log(pk)) if self.init == "log_size" else float(pk)
                self.exp_avg[name] = 0.0
                self.exp_avg_sq[name] = 0.0
                self.steps[name] = 0
        logits = np.array([self.logits[nm] for nm in names])
        if self.adam_state == "round":
            m = np.zeros(len(names))
            v = np.zeros(len(names))
            step = np.zeros(len(names))
        else:
            m = np.array([self.exp_avg[nm] for nm in names])
            v = np.array([self.exp_avg_sq[nm] for nm in names])
            step = np.array([float(self.steps[nm]) for nm in names])
        b1, b2 = self.betas
        first_lam = softmax(logits)
        objectives: list[float] = []
        lam = first_lam
        for _ in range(self.server_iters):
            lam = softmax(logits)
            objective, grad = fedawa_objective_and_grad(logits, gram)
            objectives.append(objective)
            step = step + 1.0
            m = b1 * m + (1.0 - b1) * grad
            v = b2 * v + (1.0 - b2) * grad * grad
            m_hat = m / (1.0 - b1**step)
            v_hat = v / (1.0 - b2**step)
            logits = logits - self.lr * m_hat / (np.sqrt(v_hat) + self.adam_eps)
        for k, name in enumerate(names):
            self.logits[name] = float(logits[k])
            self.exp_avg[name] = float(m[k])
            self.exp_avg_sq[name] = float(v[k])
            self.steps[name] = int(step[k])
        self.last_details = {
            "objective_first": objectives[0],
            "objective_last": objectives[-1],
            "lambda_first": first_lam.tolist(),
            "lambda": lam.tolist(),
        }
        return lam

    def state_dict(self) -> dict:
        return {
            "logits": dict(self.logits),
            "exp_avg": dict(self.exp_avg),
            "exp_avg_sq": dict(self.exp_avg_sq),
            "steps": dict(self.steps),
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        try:
            logits = {str(k): float(v) for k, v in state.get("logits", {}).items()}
            m = {str(k): float(v) for k, v in state.get("exp_avg", {}).items()}
            v = {str(k): float(x) for k, x in state.get("exp_avg_sq", {}).items()}
            steps = {str(k): int(x) for k, x in state.get("steps", {}).items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"fedawa: malformed state: {exc}") from None
        if not (set(logits) == set(m) == set(v) == set(steps)):
            raise ValueError("fedawa: state entries name different sites")
        self.logits, self.exp_avg, self.exp_avg_sq, self.steps = logits, m, v, steps

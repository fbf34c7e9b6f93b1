"""DAFL: distribution-aware statistics and aggregation (seed 003; authors' code AIPMLab/ViT-FLDAF).

The statistics (client imbalance c_k, the client- and class-level parameters) are in
:mod:`fedweigh.imbalance`, shared with the client loss :mod:`fedweigh.losses.dafl`.

Aggregation (:class:`DAFLWeights`, ``mode=``; the paper's Sec. 3.4-3.5: "clients with relatively
balanced data (i.e., lower c_k) receive higher aggregation weights", "assigning lower weights (w_k)
to clients with high internal skew (c_k)"; the May 2026 code's Eq. (wk)-(omega)):

- ``"inverse_imbalance"`` (default): w_k = (c_k + eps)^-1 / sum_j (c_j + eps)^-1 over the round's clients
- ``"size_inverse_imbalance"``: w_k proportional to (N_k / N) (c_k + eps)^-1 (a reading of the text's
  "adaptive regulation based on data volumes and client-specific characteristics")
- ``"size"``: w_k = N_k / N (the Dec 2025 code and its README)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from fedweigh.imbalance import MissingRule, check_missing_rule, client_imbalance
from fedweigh.weighting.base import (
    ClientReport,
    ScalarContext,
    WeightingScheme,
    check_reports,
    check_round,
    scalar_vector,
)

MODES: tuple[str, ...] = ("inverse_imbalance", "size_inverse_imbalance", "size")


@dataclass(kw_only=True)
class DAFLWeights(WeightingScheme):
    """Distribution-aware weights w_k proportional to (c_k + eps)^-1 (default), optionally times N_k, or size weights.

    c_k is computed by each client from its own histogram and reported as the scalar ``imbalance``
    (:meth:`client_scalars`); the weights are normalised over the clients of each round. The DAFL
    loss additionally needs the global histogram (c_class); that is the loss's business, so
    ``needs_global_histogram`` stays False here.
    """

    name: ClassVar[str] = "dafl"

    mode: Literal["inverse_imbalance", "size_inverse_imbalance", "size"] = "inverse_imbalance"
    missing: MissingRule = "half"
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"dafl: mode must be one of {MODES}, got {self.mode!r}")
        check_missing_rule(self.missing)
        if not math.isfinite(self.eps) or self.eps <= 0:
            raise ValueError(f"dafl: eps must be a positive number, got {self.eps!r}")
        self.required_scalars = ("imbalance",) if self.mode != "size" else ()  # type: ignore[misc]

    def client_scalars(self, ctx: ScalarContext) -> dict[str, float]:
        """{"imbalance": c_k} from the client's own histogram (:func:`client_imbalance`, rule ``missing``)."""
        class_counts, num_samples = ctx.counts(self.name)
        return {"imbalance": client_imbalance(class_counts, num_samples, self.missing)}

    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        check_round(round_index, num_rounds)
        n = check_reports(reports, scheme=self.name, scalars=self.required_scalars)
        p = n / n.sum()
        if self.mode == "size":
            self.last_details = {"size_prior": p.tolist()}
            return p
        c = scalar_vector(reports, "imbalance", scheme=self.name, nonnegative=True)
        raw = 1.0 / (c + self.eps)
        if self.mode == "size_inverse_imbalance":
            raw = raw * p
        w = raw / raw.sum()
        self.last_details = {"size_prior": p.tolist(), "imbalance": c.tolist()}
        return w

"""Uniform averaging: every client of the round counts the same, w_k = 1 / K.

The attribution control for the reweighting schemes: a scheme's gain is credited to its mechanism
only when it beats equal weights as well as FedAvg's size weights (FedDRAW's outer schedule anneals
every weight to 1/K by its last round, CBR's weights are often close to uniform). Sizes are read
only to check the reports; the weights do not depend on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fedweigh.weighting.base import ClientReport, WeightingScheme, check_reports, check_round

__all__ = ["UniformWeights"]


@dataclass(kw_only=True)
class UniformWeights(WeightingScheme):
    """w_k = 1 / K over the round's K clients."""

    name: ClassVar[str] = "uniform"

    def weights(
        self,
        reports: Sequence[ClientReport],
        global_params: dict[str, np.ndarray] | None,
        round_index: int,
        num_rounds: int,
    ) -> np.ndarray:
        check_round(round_index, num_rounds)
        n = check_reports(reports, scheme=self.name)
        w = np.full(n.size, 1.0 / n.size)
        self.last_details = {"size_prior": (n / n.sum()).tolist()}
        return w

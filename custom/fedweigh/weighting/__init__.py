"""Server-side client-weighting schemes, one module per scheme, and their registry.

    get_scheme("feddraw", beta_max=2.0)  ->  FedDRAWWeights(beta_max=2.0)

Every scheme maps one round's :class:`ClientReport` list to one weight per client, acting on deltas:
theta_g <- theta_g + sum_k w_k (theta_k - theta_g).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedweigh.errors import HEIncompatibleScheme
from fedweigh.weighting.base import ClientReport, ScalarContext, WeightingScheme, he_capable_schemes
from fedweigh.weighting.cbr import CBRWeights, imbalance_cv
from fedweigh.weighting.dafl import DAFLWeights
from fedweigh.weighting.fedadp import FedAdpWeights
from fedweigh.weighting.fedavg import FedAvgWeights, FedProxWeights
from fedweigh.weighting.fedawa import FedAWAWeights
from fedweigh.weighting.feddisco import FedDiscoWeights
from fedweigh.weighting.feddraw import FedDRAWWeights
from fedweigh.weighting.fednova import FedNovaWeights
from fedweigh.weighting.ida import IDAWeights
from fedweigh.weighting.uniform import UniformWeights

__all__ = [
    "SCHEMES",
    "CBRWeights",
    "ClientReport",
    "DAFLWeights",
    "FedAWAWeights",
    "FedAdpWeights",
    "FedAvgWeights",
    "FedDRAWWeights",
    "FedDiscoWeights",
    "FedNovaWeights",
    "FedProxWeights",
    "HEIncompatibleScheme",
    "IDAWeights",
    "ScalarContext",
    "UniformWeights",
    "WeightingScheme",
    "get_scheme",
    "he_capable_schemes",
    "imbalance_cv",
]

SCHEMES: dict[str, type[WeightingScheme]] = {
    cls.name: cls
    for cls in (
        FedAvgWeights,
        UniformWeights,
        FedProxWeights,
        FedNovaWeights,
        FedAdpWeights,
        IDAWeights,
        FedDiscoWeights,
        FedAWAWeights,
        FedDRAWWeights,
        CBRWeights,
        DAFLWeights,
    )
}


def get_scheme(name: str, **options: Any) -> WeightingScheme:
    """Instantiate the scheme registered as ``name`` with ``options`` as constructor keywords.

    Raises KeyError listing the known names for an unknown scheme, and TypeError naming the scheme's
    options for an unknown option.
    """
    try:
        cls = SCHEMES[name]
    except KeyError:
        raise KeyError(f"unknown weighting scheme {name!r}; known: {', '.join(sorted(SCHEMES))}") from None
    try:
        return cls(**options)
    except TypeError as exc:
        known = sorted(f.name for f in dataclasses.fields(cls) if f.init)
        raise TypeError(f"{name}: {exc}; options: {', '.join(known)}") from None

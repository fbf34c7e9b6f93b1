"""fedweigh: client-weighting schemes and imbalance-aware losses for NVIDIA FLARE.

Core modules (``weighting``, ``losses``, ``schedules``, ``stats``, ``metrics``) never import
NVFlare; the NVFlare wiring lives in :mod:`fedweigh.flare`.
"""

__version__ = "0.1.0"

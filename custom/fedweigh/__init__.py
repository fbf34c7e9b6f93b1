"""fedweigh: client-weighting schemes and imbalance-aware losses for NVIDIA FLARE.

One direction of dependency (README, "Layout"): the core modules (``weighting``, ``losses``,
``methods``, ``rounds``, ``validation``, ``records``, ``label_stats``, ``schedules``, ``metrics``),
``data``, ``models``, ``train``/``site`` and ``secure`` never import NVFlare; the NVFlare wiring lives
in :mod:`fedweigh.flare` and the in-process benchmark in :mod:`fedweigh.bench`, and neither of the two
imports the other.
"""

__version__ = "0.1.0"

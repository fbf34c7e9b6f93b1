"""Attention-rollout heatmaps for the ViT global model (``fedweigh explain``; docs/explain.md).

- :mod:`~fedweigh.explain.rollout`: attention rollout (Abnar & Zuidema, ACL 2020) and its
  class-specific, gradient-weighted form (Chefer, Gur & Wolf, ICCV 2021), read with forward hooks on
  MONAI's self-attention blocks;
- :mod:`~fedweigh.explain.figure`: the PNG grid of inputs and heatmaps;
- :mod:`~fedweigh.explain.checkpoint`: the server's global model loaded and checked against the ViT;
- :mod:`~fedweigh.explain.command`: the ``fedweigh explain`` sub-command.

Importing the package loads neither torch nor MONAI (the CLI builds its parser from it).
"""

from fedweigh.explain.checkpoint import load_global_model
from fedweigh.explain.command import add_explain_parser, main_explain
from fedweigh.explain.figure import explain_grid
from fedweigh.explain.rollout import HEAD_FUSIONS, HeadFusion, attention_rollout, gradient_attention_rollout

__all__ = [
    "HEAD_FUSIONS",
    "HeadFusion",
    "add_explain_parser",
    "attention_rollout",
    "explain_grid",
    "gradient_attention_rollout",
    "load_global_model",
    "main_explain",
]

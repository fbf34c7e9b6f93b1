"""Pretrained weights from a checkpoint file the user provides: reading it, fitting its tensors to a
network and loading them, naming every missing, unexpected or mismatched key.

Nothing is downloaded. :func:`read_checkpoint` accepts a plain state dict or one under a key of
:data:`CHECKPOINT_STATE_KEYS` (MONAI ``CheckpointSaver``, NVFlare persistor files); each architecture
of :mod:`fedweigh.models` maps the checkpoint's key names to its network's and fits what standard
practice fits (an RGB stem summed over its channels for a grayscale network, ViT position embeddings
interpolated to another token grid).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from fedweigh.errors import PretrainedCheckpointError

__all__ = ["CHECKPOINT_STATE_KEYS", "load_network_weights", "read_checkpoint", "summed_rgb_stem"]

#: Keys under which checkpoint files keep their state dict (MONAI CheckpointSaver, NVFlare persistor).
CHECKPOINT_STATE_KEYS: tuple[str, ...] = ("state_dict", "model", "network", "net")

#: ``fit(key, checkpoint tensor, network tensor)``: the checkpoint's tensor fitted to the network's, or None.
TensorFit = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor | None]


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in ``path``: a plain state dict, or one under a key of
    :data:`CHECKPOINT_STATE_KEYS` (MONAI ``CheckpointSaver``, NVFlare persistor files); a
    ``module.`` prefix (DataParallel) is dropped. Read with ``weights_only=True`` (no code runs).
    Environment variables and ``~`` in ``path`` are expanded (as in a job's data paths)."""
    path = Path(os.path.expanduser(os.path.expandvars(str(path))))
    if not path.is_file():
        raise FileNotFoundError(f"pretrained checkpoint {str(path)!r}: no such file")
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a file that is not a checkpoint
        raise PretrainedCheckpointError(
            f"pretrained checkpoint {str(path)!r}: not a PyTorch state dict file ({exc})"
        ) from exc
    if isinstance(content, dict):
        for key in CHECKPOINT_STATE_KEYS:
            if isinstance(content.get(key), dict):
                content = content[key]
                break
    if (
        not isinstance(content, dict)
        or not content
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in content.items())
    ):
        raise PretrainedCheckpointError(
            f"pretrained checkpoint {str(path)!r}: expected a state dict (parameter name -> tensor), "
            f"plain or under one of the keys {CHECKPOINT_STATE_KEYS}"
        )
    return {k.removeprefix("module."): v for k, v in content.items()}


def summed_rgb_stem(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """An RGB stem convolution (out, 3, kh, kw) summed over its channels for a grayscale network's
    (out, 1, kh, kw); None when the shapes differ otherwise."""
    if value.dim() == 4 and value.shape[1] == 3 and target.shape[1] == 1:
        if value.shape[0] == target.shape[0] and value.shape[2:] == target.shape[2:]:
            return value.sum(dim=1, keepdim=True)
    return None


def _listed(keys: list[str], limit: int = 8) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def load_network_weights(
    net: nn.Module,
    checkpoint: dict[str, torch.Tensor],
    *,
    head_prefixes: tuple[str, ...],
    fit: TensorFit,
    source: str,
    described: str,
) -> None:
    """Load every tensor of ``net`` but its classification head (keys under ``head_prefixes``) from
    ``checkpoint`` (``net``'s key names), each passed through ``fit``; raise
    :class:`PretrainedCheckpointError` naming ``source``, the network (``described``) and the missing,
    unexpected and mismatched keys."""
    wanted = {k: v for k, v in net.state_dict().items() if not k.startswith(head_prefixes)}
    missing = sorted(set(wanted) - set(checkpoint))
    unexpected = sorted(set(checkpoint) - set(wanted))
    mismatched, fitted = [], {}
    for key in sorted(set(wanted) & set(checkpoint)):
        value = fit(key, checkpoint[key], wanted[key])
        if value is None:
            mismatched.append(f"{key} {tuple(checkpoint[key].shape)} vs {tuple(wanted[key].shape)}")
        else:
            fitted[key] = value.to(wanted[key].dtype)
    problems = [
        f"{what} ({len(keys)}): {_listed(keys)}"
        for what, keys in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("mismatched shapes, checkpoint vs network", mismatched),
        )
        if keys
    ]
    if problems:
        raise PretrainedCheckpointError(
            f"pretrained checkpoint {source!r} does not fit {described}: " + "; ".join(problems)
        )
    net.load_state_dict(fitted, strict=False)

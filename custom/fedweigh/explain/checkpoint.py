"""The global model of an NVFlare run, checked against the architecture it is loaded into."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and MONAI are imported where used
    import torch
    from torch import Tensor

    from fedweigh.models import FedweighNet

__all__ = ["load_global_model"]

#: Prefixes that wrappers add to state-dict keys (Opacus' GradSampleModule, DataParallel / DDP).
_WRAPPER_PREFIXES: tuple[str, ...] = ("_module.", "module.")


def _strip_wrapper_prefix(key: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _sample(keys: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(list(keys)[:limit])
    return f"{shown}, ... ({len(keys)} in all)" if len(keys) > limit else shown


def _architecture_of(
    weights: dict, asked: str, num_classes: int, in_channels: int, img_size: int, norm: str
) -> str | None:
    """The other architecture of :data:`fedweigh.models.ARCHITECTURES` whose parameter names are exactly
    the checkpoint's (shapes aside), or None."""
    from fedweigh.models import ARCHITECTURES, FedweighNet

    for name in ARCHITECTURES:
        if name == asked:
            continue
        try:
            keys = (
                FedweighNet(
                    arch=name, num_classes=num_classes, in_channels=in_channels, img_size=img_size, norm=norm
                )
                .state_dict()
                .keys()
            )
        except Exception:  # noqa: BLE001 - an architecture these settings cannot build is not the one
            continue
        if set(keys) == set(weights):
            return name
    return None


def load_global_model(
    path: str | Path,
    arch: str = "vit",
    num_classes: int = 14,
    img_size: int = 32,
    in_channels: int = 1,
    norm: str = "batch",
    map_location: str | torch.device = "cpu",
) -> FedweighNet:
    """A :class:`FedweighNet` with the weights of an NVFlare PyTorch persistor checkpoint.

    ``path`` is e.g. the server's ``FL_global_model.pt``: a dict ``{"model": state_dict, ...}`` as
    NVFlare's ``PTFileModelPersistor`` writes it, or a raw state dict;
    ``_module.`` / ``module.`` prefixes (Opacus, DDP) are stripped. Loaded with ``weights_only=True``.
    Raises ``FileNotFoundError`` / ``ValueError`` naming the file when it is missing, unreadable, or its
    keys or shapes do not match the model built from (arch, num_classes, img_size, in_channels, norm).
    """
    import torch

    from fedweigh.models import FedweighNet

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model checkpoint not found: {path}")
    try:
        data = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # unpickling errors come in many types
        raise ValueError(f"{path}: cannot read a PyTorch checkpoint ({type(err).__name__}: {err})") from err
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        state = data["model"]
    elif isinstance(data, dict):
        state = data
    else:
        raise ValueError(
            f"{path}: expected a state dict or a dict with a 'model' state dict, got {type(data).__name__}"
        )
    weights: dict[str, Tensor] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
        weights[_strip_wrapper_prefix(str(key))] = value

    model = FedweighNet(
        arch=arch, num_classes=num_classes, in_channels=in_channels, img_size=img_size, norm=norm
    )
    expected = model.state_dict()
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    mismatched = [
        f"{k} {tuple(weights[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if missing or unexpected:
        found = _architecture_of(weights, arch, num_classes, in_channels, img_size, norm)
        if found is not None:
            raise ValueError(
                f"{path}: the checkpoint holds a FedweighNet of arch={found!r}, and this needs arch={arch!r}: "
                f"use a checkpoint of a job trained with arch={arch!r}"
            )
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"missing keys: {_sample(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {_sample(unexpected)}")
        if mismatched:
            problems.append(f"shape mismatches (checkpoint vs model): {_sample(mismatched)}")
        hint = ""
        head = weights.get("net.head.weight")
        if head is not None and head.ndim == 2 and head.shape[0] != num_classes:
            hint = f"; the checkpoint's head has {head.shape[0]} outputs (use num_classes={head.shape[0]})"
        raise ValueError(
            f"{path}: checkpoint does not match FedweighNet(arch={arch!r}, num_classes={num_classes}, "
            f"img_size={img_size}, in_channels={in_channels}): " + "; ".join(problems) + hint
        )
    model.load_state_dict(weights)
    return model.to(map_location).eval()

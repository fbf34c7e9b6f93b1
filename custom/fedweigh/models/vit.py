"""``vit``: a Vision Transformer built from MONAI's ``ViT`` encoder, usable with Opacus DP-SGD.

The encoder's patch embedding, transformer blocks and final LayerNorm with a class token and a linear
head: equivalent to MONAI's ``ViT(classification=True, post_activation=None)``. The class token and
the head live in their own leaf modules so that Opacus can compute per-sample gradients (MONAI's ViT
keeps the class token as a direct parameter of the module whose forward returns a tuple, which
Opacus cannot handle). Randomly initialised it is small (width 192, 4 blocks, 3 heads, patches of
``img_size // 8``); from a ``pretrained`` checkpoint it has the checkpoint's size (e.g. ViT-S/16:
width 384, 12 blocks).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from monai.networks.nets import ViT
from torch import nn

from fedweigh.errors import PretrainedCheckpointError
from fedweigh.models.base import FedweighNet

__all__ = ["VIT_HEAD_WIDTH", "ViTNet", "vit_dims_from_checkpoint", "vit_patch_size"]

_VIT = {"hidden_size": 192, "mlp_dim": 384, "num_layers": 4, "num_heads": 3}
#: Width of one attention head of a ViT read from a checkpoint (ViT-Ti/S/B/L all use 64):
#: num_heads = hidden_size / VIT_HEAD_WIDTH. The state dict holds no head count.
VIT_HEAD_WIDTH = 64
_POSITIONS_KEY = "patch_embedding.position_embeddings"


def vit_patch_size(img_size: int) -> int:
    """Patch side for the ``vit`` architecture: ``max(4, img_size // 8)`` (an 8x8 token grid at 32 px+)."""
    return max(4, img_size // 8)


def vit_dims_from_checkpoint(state: dict[str, torch.Tensor], source: str) -> dict[str, int | bool]:
    """The ViT's shape from its state dict (network key names): hidden_size, mlp_dim, num_layers,
    num_heads (hidden_size / :data:`VIT_HEAD_WIDTH`), patch_size, in_channels, qkv_bias."""
    stem = state.get(ViTNet.stem_key)
    if stem is None or stem.dim() != 4:
        raise PretrainedCheckpointError(
            f"pretrained checkpoint {source!r}: no convolutional patch embedding "
            "('patch_embedding.patch_embeddings.weight', 4-D) found; a MONAI ViT with proj_type='conv' "
            "or a FedweighNet ViT checkpoint is expected"
        )
    hidden, channels, patch = int(stem.shape[0]), int(stem.shape[1]), int(stem.shape[-1])
    layers = {int(m.group(1)) for k in state if (m := re.match(r"^blocks\.(\d+)\.", k))}
    mlp = state.get("blocks.0.mlp.linear1.weight")
    if not layers or mlp is None:
        raise PretrainedCheckpointError(
            f"pretrained checkpoint {source!r}: no transformer blocks ('blocks.N.mlp.linear1.weight') found"
        )
    if hidden % VIT_HEAD_WIDTH:
        raise PretrainedCheckpointError(
            f"pretrained checkpoint {source!r}: hidden size {hidden} is not a multiple of the head width "
            f"{VIT_HEAD_WIDTH}, so the number of attention heads cannot be derived"
        )
    return {
        "hidden_size": hidden,
        "mlp_dim": int(mlp.shape[0]),
        "num_layers": max(layers) + 1,
        "num_heads": hidden // VIT_HEAD_WIDTH,
        "patch_size": patch,
        "in_channels": channels,
        "qkv_bias": "blocks.0.attn.qkv.bias" in state,
    }


def _interpolated_positions(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """Position embeddings (1, g*g, D) of another token grid interpolated (bicubic) to ``target``'s."""
    if value.dim() != 3 or value.shape[-1] != target.shape[-1]:
        return None
    side, target_side = math.isqrt(value.shape[1]), math.isqrt(target.shape[1])
    if side * side != value.shape[1] or target_side * target_side != target.shape[1]:
        return None
    grid = value.reshape(1, side, side, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(target_side, target_side), mode="bicubic", align_corners=False)
    return grid.permute(0, 2, 3, 1).reshape(1, target_side * target_side, -1)


class _ClassToken(nn.Module):
    """Prepends a learnable class token: (B, T, D) -> (B, T + 1, D)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.zeros(1, 1, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.token.expand(x.shape[0], -1, -1), x), dim=1)


class ViTNet(FedweighNet, arch="vit"):
    """The ViT classifier (module docstring); ``net`` holds ``patch_embedding``, ``cls_token``,
    ``blocks``, ``norm`` and ``head``. ``vit_dims``: its shape (from the checkpoint when one is given,
    else the compact default)."""

    head_prefixes = ("head.", "classification_head.")
    stem_key = "patch_embedding.patch_embeddings.weight"
    vit_dims: dict[str, int | bool]

    def _configure(self, checkpoint: dict[str, torch.Tensor] | None) -> None:
        self.min_input_size = self.img_size
        self.vit_dims = (
            vit_dims_from_checkpoint(checkpoint, str(self.pretrained))
            if checkpoint is not None
            else {**_VIT, "patch_size": vit_patch_size(self.img_size), "qkv_bias": False}
        )

    def _build_net(self) -> nn.Module:
        dims = self.vit_dims
        patch = int(dims["patch_size"])
        if self.img_size % patch:
            source = f"the checkpoint {self.pretrained!r}'s" if self.pretrained else "the"
            raise ValueError(
                f"FedweighNet(arch='vit'): img_size {self.img_size} is not divisible by {source} patch size "
                f"{patch}; use a multiple of {patch}"
            )
        hidden = int(dims["hidden_size"])
        encoder = ViT(
            in_channels=self.in_channels,
            img_size=self.img_size,
            patch_size=patch,
            hidden_size=hidden,
            mlp_dim=int(dims["mlp_dim"]),
            num_layers=int(dims["num_layers"]),
            num_heads=int(dims["num_heads"]),
            qkv_bias=bool(dims["qkv_bias"]),
            spatial_dims=2,
            classification=False,
            dropout_rate=0.0,
            save_attn=self.save_attn,
        )
        for block in encoder.blocks:
            # Unused without cross-attention; its parameters would never get a gradient (Opacus rejects that).
            block.norm_cross_attn = nn.Identity()
        return nn.ModuleDict(
            {
                "patch_embedding": encoder.patch_embedding,
                "cls_token": _ClassToken(hidden),
                "blocks": encoder.blocks,
                "norm": encoder.norm,
                "head": nn.Linear(hidden, self.num_classes),
            }
        )

    def _input_size(self, h: int, w: int) -> tuple[int, int]:
        return (self.img_size, self.img_size)

    def _network_key(self, key: str) -> str | None:
        """MONAI ViT names: its ``cls_token`` parameter is ours ``cls_token.token``; the unused
        cross-attention norms are dropped."""
        if key == "cls_token":
            return "cls_token.token"
        if re.match(r"^blocks\.\d+\.norm_cross_attn\.", key):
            return None
        return key

    def _fit_tensor(self, key: str, value: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """As :meth:`FedweighNet._fit_tensor`, and position embeddings of another token grid
        interpolated (bicubic) to this one."""
        fitted = super()._fit_tensor(key, value, target)
        if fitted is None and key == _POSITIONS_KEY:
            return _interpolated_positions(value, target)
        return fitted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes) from the class token after the last block's norm."""
        t = self.net["patch_embedding"](self._resize(x))
        t = self.net["cls_token"](t)
        for block in self.net["blocks"]:
            t = block(t)
        t = self.net["norm"](t)
        return self.net["head"](t[:, 0])

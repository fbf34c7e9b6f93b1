"""MONAI classification networks chosen by name, all usable with Opacus DP-SGD.

Three architectures (``ARCHITECTURES``):

- ``densenet_compact``: a small MONAI ``DenseNet`` (init_features 16, growth 12, blocks (4, 8, 6);
  0.17M parameters with 14 outputs) for fast CPU runs at 28-64 px.
- ``densenet121``: MONAI ``DenseNet121`` (7.0M parameters), randomly initialised.
- ``vit``: a small Vision Transformer built from MONAI's ``ViT`` encoder (patch embedding, transformer
  blocks, final LayerNorm) with a class token and a linear head, equivalent to MONAI's
  ``ViT(classification=True, post_activation=None)``. The class token and the head live in their own
  leaf modules so that Opacus can compute per-sample gradients (MONAI's ViT keeps the class token as a
  direct parameter of the module whose forward returns a tuple, which Opacus cannot handle).

Every activation is created with ``inplace=False`` (in-place ReLU breaks Opacus' backward hooks).
No pretrained weights are downloaded. The wrapper stores each constructor argument as an attribute of
the same name, so NVFlare's Job API can serialise and re-create it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from monai.networks.nets import DenseNet, DenseNet121, ViT
from torch import nn

ARCHITECTURES: tuple[str, ...] = ("densenet_compact", "densenet121", "vit")
NORMS: tuple[str, ...] = ("batch", "group", "instance")

_COMPACT = {"init_features": 16, "growth_rate": 12, "block_config": (4, 8, 6)}
_DENSENET121_BLOCKS = (6, 12, 24, 16)
_RELU = ("relu", {"inplace": False})
_VIT = {"hidden_size": 192, "mlp_dim": 384, "num_layers": 4, "num_heads": 3}


def vit_patch_size(img_size: int) -> int:
    """Patch side for the ``vit`` architecture: ``max(4, img_size // 8)`` (an 8x8 token grid at 32 px+)."""
    return max(4, img_size // 8)


def densenet_min_input_size(num_blocks: int, norm: str) -> int:
    """Smallest input side a MONAI DenseNet with ``num_blocks`` dense blocks accepts.

    The stem halves the side twice (stride-2 conv, stride-2 max-pool) and each of the
    ``num_blocks - 1`` transitions halves it again, so the last feature map has side
    ``H / 2**(num_blocks + 1)``. It must be at least 1 px, and 2 px for instance norm (which needs
    more than one spatial element per channel): DenseNet121 needs 32 px (64 px with instance norm).
    """
    last_side = 2 if norm == "instance" else 1
    return last_side * 2 ** (num_blocks + 1)


class _ClassToken(nn.Module):
    """Prepends a learnable class token: (B, T, D) -> (B, T + 1, D)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.zeros(1, 1, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.token.expand(x.shape[0], -1, -1), x), dim=1)


def _batch_to_group_norm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm by ``GroupNorm(gcd(32, C), C)``, the grouping Opacus' own fixer uses."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return nn.GroupNorm(math.gcd(32, module.num_features), module.num_features, affine=module.affine)
    for name, child in module.named_children():
        setattr(module, name, _batch_to_group_norm(child))
    return module


class FedweighNet(nn.Module):
    """Image classifier returning logits of shape (B, num_classes).

    Args:
        arch: one of ``ARCHITECTURES``.
        num_classes: number of findings (multi-label) or classes (multi-class).
        in_channels: image channels (1 for chest X-rays).
        img_size: expected input side. The ViT is built for it and resizes other inputs to it
            (bilinear); the DenseNets accept any size but upsample inputs smaller than
            ``min_input_size`` (e.g. 28 px MedMNIST images for DenseNet121) instead of failing.
        norm: ``"batch"``, ``"group"`` (BatchNorm replaced by ``GroupNorm(gcd(32, C), C)``) or
            ``"instance"`` (affine, no running statistics). Group and instance are DP-SGD safe.
            Ignored by the ViT, which always uses LayerNorm.
        save_attn: ViT only: keep each block's attention matrix in ``block.attn.att_mat``
            (shape (B, heads, T + 1, T + 1), token 0 is the class token) for attention rollout.
        seed: when given, the initial weights are drawn from this seed (without touching the global
            random state), so the server's initial global model is reproducible; None = global RNG.
    """

    def __init__(
        self,
        arch: str = "densenet_compact",
        num_classes: int = 14,
        in_channels: int = 1,
        img_size: int = 32,
        norm: str = "batch",
        save_attn: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if arch not in ARCHITECTURES:
            raise ValueError(f"FedweighNet: unknown arch {arch!r}; expected one of {ARCHITECTURES}")
        if norm not in NORMS:
            raise ValueError(f"FedweighNet: unknown norm {norm!r}; expected one of {NORMS}")
        if num_classes < 1 or in_channels < 1 or img_size < 1:
            raise ValueError(
                f"FedweighNet: num_classes ({num_classes}), in_channels ({in_channels}) and "
                f"img_size ({img_size}) must be positive"
            )
        self.arch = arch
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.img_size = img_size
        self.norm = norm
        self.save_attn = save_attn
        self.seed = seed

        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self._build()

    def _build(self) -> None:
        if self.arch == "vit":
            self.min_input_size = self.img_size
            self.net = self._build_vit()
        else:
            compact = self.arch == "densenet_compact"
            num_blocks = len(_COMPACT["block_config"] if compact else _DENSENET121_BLOCKS)
            self.min_input_size = densenet_min_input_size(num_blocks, self.norm)
            self.net = self._build_densenet()

    def _build_densenet(self) -> nn.Module:
        monai_norm: str | tuple = ("instance", {"affine": True}) if self.norm == "instance" else "batch"
        common = {
            "spatial_dims": 2,
            "in_channels": self.in_channels,
            "out_channels": self.num_classes,
            "act": _RELU,
            "norm": monai_norm,
        }
        if self.arch == "densenet_compact":
            net: nn.Module = DenseNet(**common, **_COMPACT)
        else:
            net = DenseNet121(**common, pretrained=False)
        return _batch_to_group_norm(net) if self.norm == "group" else net

    def _build_vit(self) -> nn.Module:
        patch = vit_patch_size(self.img_size)
        if self.img_size % patch:
            raise ValueError(
                f"FedweighNet(arch='vit'): img_size {self.img_size} is not divisible by the patch size "
                f"{patch}; use a multiple of {patch} (e.g. 28, 32, 64)"
            )
        encoder = ViT(
            in_channels=self.in_channels,
            img_size=self.img_size,
            patch_size=patch,
            spatial_dims=2,
            classification=False,
            dropout_rate=0.0,
            save_attn=self.save_attn,
            **_VIT,
        )
        for block in encoder.blocks:
            # Unused without cross-attention; its parameters would never get a gradient (Opacus rejects that).
            block.norm_cross_attn = nn.Identity()
        return nn.ModuleDict(
            {
                "patch_embedding": encoder.patch_embedding,
                "cls_token": _ClassToken(_VIT["hidden_size"]),
                "blocks": encoder.blocks,
                "norm": encoder.norm,
                "head": nn.Linear(_VIT["hidden_size"], self.num_classes),
            }
        )

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if self.arch == "vit":
            size = (self.img_size, self.img_size)
        else:
            size = (max(h, self.min_input_size), max(w, self.min_input_size))
        if (h, w) == size:
            return x
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes) for images (B, in_channels, H, W)."""
        x = self._resize(x)
        if self.arch != "vit":
            return self.net(x)
        t = self.net["patch_embedding"](x)
        t = self.net["cls_token"](t)
        for block in self.net["blocks"]:
            t = block(t)
        t = self.net["norm"](t)
        return self.net["head"](t[:, 0])


def build_model(
    arch: str,
    num_classes: int,
    in_channels: int = 1,
    img_size: int = 32,
    norm: str = "batch",
    save_attn: bool = False,
    seed: int | None = None,
) -> FedweighNet:
    """A randomly initialised :class:`FedweighNet` (from ``seed`` when given, else the global RNG)."""
    return FedweighNet(
        arch=arch,
        num_classes=num_classes,
        in_channels=in_channels,
        img_size=img_size,
        norm=norm,
        save_attn=save_attn,
        seed=seed,
    )


def make_opacus_compatible(model: nn.Module) -> nn.Module:
    """A copy of ``model`` that Opacus' ``ModuleValidator`` accepts (no BatchNorm).

    A :class:`FedweighNet` with ``norm="batch"`` is rebuilt with ``norm="group"`` (so its stored
    constructor arguments stay true) and keeps every tensor whose name and shape still match
    (convolutions, linear layers, normalisation affine weights); BatchNorm running statistics are
    dropped. Any other module goes through ``opacus.validators.ModuleValidator.fix``.
    Raises ``ValueError`` listing what Opacus still rejects.
    """
    from opacus.validators import ModuleValidator

    if isinstance(model, FedweighNet):
        if model.norm == "batch" and model.arch != "vit":
            fixed = FedweighNet(
                arch=model.arch,
                num_classes=model.num_classes,
                in_channels=model.in_channels,
                img_size=model.img_size,
                norm="group",
                save_attn=model.save_attn,
            )
            target = fixed.state_dict()
            kept = {k: v for k, v in model.state_dict().items() if k in target and v.shape == target[k].shape}
            fixed.load_state_dict(kept, strict=False)
        else:
            fixed = FedweighNet(
                arch=model.arch,
                num_classes=model.num_classes,
                in_channels=model.in_channels,
                img_size=model.img_size,
                norm=model.norm,
                save_attn=model.save_attn,
            )
            fixed.load_state_dict(model.state_dict())
        fixed.to(next(model.parameters()).device)
    else:
        fixed = ModuleValidator.fix(model)
    errors = ModuleValidator.validate(fixed, strict=False)
    if errors:
        raise ValueError(f"make_opacus_compatible: Opacus still rejects the model: {errors}")
    return fixed


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

"""MONAI classification networks chosen by name, all usable with Opacus DP-SGD.

Three architectures (``ARCHITECTURES``):

- ``densenet_compact``: a small MONAI ``DenseNet`` (init_features 16, growth 12, blocks (4, 8, 6);
  0.17M parameters with 14 outputs) for fast CPU runs at 28-64 px.
- ``densenet121``: MONAI ``DenseNet121`` (7.0M parameters), randomly initialised or from a
  ``pretrained`` checkpoint (MONAI or torchvision layout).
- ``vit``: a Vision Transformer built from MONAI's ``ViT`` encoder (patch embedding, transformer
  blocks, final LayerNorm) with a class token and a linear head, equivalent to MONAI's
  ``ViT(classification=True, post_activation=None)``. The class token and the head live in their own
  leaf modules so that Opacus can compute per-sample gradients (MONAI's ViT keeps the class token as a
  direct parameter of the module whose forward returns a tuple, which Opacus cannot handle).
  Randomly initialised it is small (width 192, 4 blocks, 3 heads, patches of ``img_size // 8``); from
  a ``pretrained`` checkpoint it has the checkpoint's size (e.g. ViT-S/16: width 384, 12 blocks).

Every activation is created with ``inplace=False`` (in-place ReLU breaks Opacus' backward hooks).
Nothing is downloaded: ``pretrained`` names a checkpoint file the user provides
(:func:`load_pretrained`: the network's weights from it, the classification head re-initialised for
the dataset's classes; a ViT takes its size from it). The wrapper stores each constructor argument as
an attribute of the same name, so NVFlare's Job API can serialise and re-create it.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from monai.networks.nets import DenseNet, DenseNet121, ViT
from torch import nn

from fedweigh.errors import PretrainedCheckpointError

ARCHITECTURES: tuple[str, ...] = ("densenet_compact", "densenet121", "vit")
NORMS: tuple[str, ...] = ("batch", "group", "instance")

_COMPACT = {"init_features": 16, "growth_rate": 12, "block_config": (4, 8, 6)}
_DENSENET121_BLOCKS = (6, 12, 24, 16)
_RELU = ("relu", {"inplace": False})
_VIT = {"hidden_size": 192, "mlp_dim": 384, "num_layers": 4, "num_heads": 3}
#: Width of one attention head of a ViT read from a checkpoint (ViT-Ti/S/B/L all use 64):
#: num_heads = hidden_size / VIT_HEAD_WIDTH. The state dict holds no head count.
VIT_HEAD_WIDTH = 64
#: Keys under which checkpoint files keep their state dict (MONAI CheckpointSaver, NVFlare persistor).
CHECKPOINT_STATE_KEYS: tuple[str, ...] = ("state_dict", "model", "network", "net")
#: The input stem, whose weights are summed over RGB channels for a grayscale model.
_STEM_KEYS = ("features.conv0.weight", "patch_embedding.patch_embeddings.weight")
_HEAD_PREFIXES = {"vit": ("head.", "classification_head."), "densenet": ("class_layers.out.", "classifier.")}
#: torchvision DenseNet layer names (``denselayer1.norm1`` or ``denselayer1.norm.1``) -> MONAI's.
_TORCHVISION_DENSELAYER = re.compile(
    r"^(.*denselayer\d+)\.(norm|relu|conv)\.?([12])\.(weight|bias|running_mean|running_var|num_batches_tracked)$"
)
_BATCHNORM_STATS = (".running_mean", ".running_var", ".num_batches_tracked")


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


def _network_keys(state: dict[str, torch.Tensor], arch: str, norm: str) -> dict[str, torch.Tensor]:
    """``state`` with the key names of the MONAI network inside :class:`FedweighNet` (its ``net``),
    without the classification head and without tensors the network has no use for.

    Accepted layouts: a FedweighNet state dict (``net.`` prefix), MONAI ``ViT`` (``cls_token``,
    ``classification_head``, the unused cross-attention norms), MONAI ``DenseNet121`` and torchvision
    ``densenet121`` (layer names remapped as MONAI's own loader does; ``classifier`` head). BatchNorm
    running statistics are dropped for a GroupNorm or InstanceNorm network.
    """
    family = "vit" if arch == "vit" else "densenet"
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix("net.")
        if key.startswith(_HEAD_PREFIXES[family]):
            continue
        if family == "vit":
            if key == "cls_token":
                key = "cls_token.token"
            if re.match(r"^blocks\.\d+\.norm_cross_attn\.", key):
                continue
        else:
            key = _TORCHVISION_DENSELAYER.sub(r"\1.layers.\2\3.\4", key)
            if norm != "batch" and key.endswith(_BATCHNORM_STATS):
                continue
        out[key] = value
    return out


def vit_dims_from_checkpoint(state: dict[str, torch.Tensor], source: str) -> dict[str, int | bool]:
    """The ViT's shape from its state dict (network key names): hidden_size, mlp_dim, num_layers,
    num_heads (hidden_size / :data:`VIT_HEAD_WIDTH`), patch_size, in_channels, qkv_bias."""
    stem = state.get("patch_embedding.patch_embeddings.weight")
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


def _fit_tensor(key: str, value: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """``value`` reshaped for ``target`` where that is standard practice, else None: the stem of an
    RGB network summed over its channels for a grayscale one; ViT position embeddings of another
    token grid interpolated (bicubic) to this one."""
    if value.shape == target.shape:
        return value
    if key in _STEM_KEYS and value.dim() == 4 and value.shape[1] == 3 and target.shape[1] == 1:
        if value.shape[0] == target.shape[0] and value.shape[2:] == target.shape[2:]:
            return value.sum(dim=1, keepdim=True)
    if (
        key == "patch_embedding.position_embeddings"
        and value.dim() == 3
        and value.shape[-1] == target.shape[-1]
    ):
        side, target_side = math.isqrt(value.shape[1]), math.isqrt(target.shape[1])
        if side * side == value.shape[1] and target_side * target_side == target.shape[1]:
            grid = value.reshape(1, side, side, -1).permute(0, 3, 1, 2)
            grid = F.interpolate(grid, size=(target_side, target_side), mode="bicubic", align_corners=False)
            return grid.permute(0, 2, 3, 1).reshape(1, target_side * target_side, -1)
    return None


def _listed(keys: list[str], limit: int = 8) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


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
        pretrained: path of a checkpoint file with the network's weights (:func:`read_checkpoint`
            lists the accepted files and layouts): every tensor but the classification head's is
            loaded from it, the head is initialised for ``num_classes`` (from ``seed``). A ViT takes
            its size (width, depth, MLP width, patch side, attention bias) from the checkpoint and
            interpolates its position embeddings to ``img_size``; an RGB stem is summed over its
            channels for grayscale input. Raises :class:`PretrainedCheckpointError` naming the file
            and the missing, unexpected or mismatched keys. None: random initial weights.
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
        pretrained: str | None = None,
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
        self.pretrained = pretrained

        checkpoint = None
        if pretrained is not None:
            checkpoint = _network_keys(read_checkpoint(pretrained), arch, norm)
        #: the ViT's shape: from the checkpoint when one is given, else the compact default
        self.vit_dims: dict[str, int | bool] = (
            vit_dims_from_checkpoint(checkpoint, str(pretrained))
            if arch == "vit" and checkpoint is not None
            else {**_VIT, "patch_size": vit_patch_size(img_size), "qkv_bias": False}
        )
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self._build()
        if checkpoint is not None:
            self._load_network(checkpoint, str(pretrained))

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

    def _load_network(self, checkpoint: dict[str, torch.Tensor], source: str) -> None:
        """Load every tensor of the network but the head from ``checkpoint`` (network key names)."""
        head = _HEAD_PREFIXES["vit" if self.arch == "vit" else "densenet"]
        wanted = {k: v for k, v in self.net.state_dict().items() if not k.startswith(head)}
        missing = sorted(set(wanted) - set(checkpoint))
        unexpected = sorted(set(checkpoint) - set(wanted))
        mismatched, fitted = [], {}
        for key in sorted(set(wanted) & set(checkpoint)):
            value = _fit_tensor(key, checkpoint[key], wanted[key])
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
                f"pretrained checkpoint {source!r} does not fit FedweighNet(arch={self.arch!r}, "
                f"in_channels={self.in_channels}, img_size={self.img_size}, norm={self.norm!r}): "
                + "; ".join(problems)
            )
        self.net.load_state_dict(fitted, strict=False)

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
    pretrained: str | None = None,
) -> FedweighNet:
    """A :class:`FedweighNet`: random initial weights (from ``seed`` when given, else the global RNG),
    or the network's from the ``pretrained`` checkpoint file with a freshly initialised head."""
    return FedweighNet(
        arch=arch,
        num_classes=num_classes,
        in_channels=in_channels,
        img_size=img_size,
        norm=norm,
        save_attn=save_attn,
        seed=seed,
        pretrained=pretrained,
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
                pretrained=model.pretrained,
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
                pretrained=model.pretrained,
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

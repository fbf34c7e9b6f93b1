"""The DenseNets: MONAI ``DenseNet`` classifiers of two sizes, both usable with Opacus DP-SGD.

- ``densenet_compact`` (:class:`DenseNetCompactNet`): a small MONAI ``DenseNet`` (init_features 16,
  growth 12, blocks (4, 8, 6); 0.17M parameters with 14 outputs) for fast CPU runs at 28-64 px.
- ``densenet121`` (:class:`DenseNet121Net`): MONAI ``DenseNet121`` (7.0M parameters), randomly
  initialised or from a ``pretrained`` checkpoint (MONAI or torchvision layout).

Every activation is created with ``inplace=False`` (in-place ReLU breaks Opacus' backward hooks);
``norm="group"`` replaces every BatchNorm by ``GroupNorm(gcd(32, C), C)``.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import torch
from monai.networks.nets import DenseNet, DenseNet121
from torch import nn

from fedweigh.models.base import FedweighNet

__all__ = ["DenseNet121Net", "DenseNetCompactNet", "densenet_min_input_size"]

_RELU = ("relu", {"inplace": False})
#: torchvision DenseNet layer names (``denselayer1.norm1`` or ``denselayer1.norm.1``) -> MONAI's.
_TORCHVISION_DENSELAYER = re.compile(
    r"^(.*denselayer\d+)\.(norm|relu|conv)\.?([12])\.(weight|bias|running_mean|running_var|num_batches_tracked)$"
)
_BATCHNORM_STATS = (".running_mean", ".running_var", ".num_batches_tracked")


def densenet_min_input_size(num_blocks: int, norm: str) -> int:
    """Smallest input side a MONAI DenseNet with ``num_blocks`` dense blocks accepts.

    The stem halves the side twice (stride-2 conv, stride-2 max-pool) and each of the
    ``num_blocks - 1`` transitions halves it again, so the last feature map has side
    ``H / 2**(num_blocks + 1)``. It must be at least 1 px, and 2 px for instance norm (which needs
    more than one spatial element per channel): DenseNet121 needs 32 px (64 px with instance norm).
    """
    last_side = 2 if norm == "instance" else 1
    return last_side * 2 ** (num_blocks + 1)


def _batch_to_group_norm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm by ``GroupNorm(gcd(32, C), C)``, the grouping Opacus' own fixer uses."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return nn.GroupNorm(math.gcd(32, module.num_features), module.num_features, affine=module.affine)
    for name, child in module.named_children():
        setattr(module, name, _batch_to_group_norm(child))
    return module


class _DenseNetFamily(FedweighNet):
    """What the DenseNets share: the MONAI network's common arguments, the norm variants, inputs
    up-sampled to ``min_input_size``, and checkpoints in MONAI's or torchvision's layout."""

    head_prefixes = ("class_layers.out.", "classifier.")
    stem_key = "features.conv0.weight"
    #: Dense blocks of the network (sets the smallest input side).
    num_blocks: ClassVar[int]

    def _monai_densenet(self, **common: Any) -> nn.Module:
        """The MONAI network of this size, built with the ``common`` arguments."""
        raise NotImplementedError

    def _configure(self, checkpoint: dict[str, torch.Tensor] | None) -> None:
        self.min_input_size = densenet_min_input_size(self.num_blocks, self.norm)

    def _build_net(self) -> nn.Module:
        monai_norm: str | tuple = ("instance", {"affine": True}) if self.norm == "instance" else "batch"
        net = self._monai_densenet(
            spatial_dims=2,
            in_channels=self.in_channels,
            out_channels=self.num_classes,
            act=_RELU,
            norm=monai_norm,
        )
        return _batch_to_group_norm(net) if self.norm == "group" else net

    def _input_size(self, h: int, w: int) -> tuple[int, int]:
        return (max(h, self.min_input_size), max(w, self.min_input_size))

    def _network_key(self, key: str) -> str | None:
        """torchvision's dense-layer names remapped as MONAI's own loader does; BatchNorm running
        statistics dropped for a GroupNorm or InstanceNorm network."""
        key = _TORCHVISION_DENSELAYER.sub(r"\1.layers.\2\3.\4", key)
        if self.norm != "batch" and key.endswith(_BATCHNORM_STATS):
            return None
        return key


class DenseNetCompactNet(_DenseNetFamily, arch="densenet_compact"):
    """A small MONAI ``DenseNet``: init_features 16, growth 12, blocks (4, 8, 6)."""

    init_features: ClassVar[int] = 16
    growth_rate: ClassVar[int] = 12
    block_config: ClassVar[tuple[int, ...]] = (4, 8, 6)
    num_blocks = len(block_config)

    def _monai_densenet(self, **common: Any) -> nn.Module:
        return DenseNet(
            **common,
            init_features=self.init_features,
            growth_rate=self.growth_rate,
            block_config=self.block_config,
        )


class DenseNet121Net(_DenseNetFamily, arch="densenet121"):
    """MONAI's ``DenseNet121`` (blocks (6, 12, 24, 16))."""

    num_blocks = 4

    def _monai_densenet(self, **common: Any) -> nn.Module:
        return DenseNet121(**common, pretrained=False)

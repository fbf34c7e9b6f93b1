"""``FedweighNet``: the image classifier every architecture of :mod:`fedweigh.models` is a thin subclass of.

The base class holds what the architectures share: the constructor arguments (stored as attributes
of the same name, so NVFlare's Job API can serialise and re-create the model), initial weights drawn
from a ``seed`` without touching the global random state, pretrained weights from a checkpoint file
(:mod:`fedweigh.models.checkpoints`) and inputs resized to what the network accepts. A subclass names
its architecture (``class ViTNet(FedweighNet, arch="vit")``, which registers it in
:data:`ARCHITECTURES`) and builds its MONAI network as ``self.net``, as MONAI's ``DenseNet121`` fixes
the sizes of its ``DenseNet``.

``FedweighNet(arch=name, ...)`` builds the registered class of ``name``: the one class path a job's
persistor and a site's allow-list name for every architecture.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fedweigh.models.checkpoints import load_network_weights, read_checkpoint, summed_rgb_stem

__all__ = ["ARCHITECTURES", "DEFAULT_ARCH", "NORMS", "FedweighNet"]

#: Architecture name -> its class (each registers itself by subclassing ``FedweighNet`` with ``arch=``).
ARCHITECTURES: dict[str, type[FedweighNet]] = {}
#: What ``FedweighNet()`` builds when no ``arch`` is named.
DEFAULT_ARCH = "densenet_compact"
NORMS: tuple[str, ...] = ("batch", "group", "instance")


class FedweighNet(nn.Module):
    """Image classifier returning logits of shape (B, num_classes).

    Args:
        arch: one of :data:`ARCHITECTURES`; ``FedweighNet(arch=name)`` builds that architecture's
            class. None: the class's own (``densenet_compact`` for ``FedweighNet`` itself).
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

    #: The architecture's name in :data:`ARCHITECTURES` (set by ``arch=`` in the class statement).
    arch: ClassVar[str]
    #: Key prefixes of the classification head: the network's own, then a foreign checkpoint's.
    head_prefixes: ClassVar[tuple[str, ...]]
    #: The input stem's weight, summed over RGB channels for a grayscale network.
    stem_key: ClassVar[str]
    #: Smallest input side the network accepts; smaller inputs are up-sampled to it.
    min_input_size: int

    def __init_subclass__(cls, *, arch: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if arch is not None:
            if arch in ARCHITECTURES:
                raise ValueError(f"architecture {arch!r} is already {ARCHITECTURES[arch].__qualname__}")
            cls.arch = arch
            ARCHITECTURES[arch] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> FedweighNet:
        if cls is FedweighNet:
            arch = args[0] if args else kwargs.get("arch")
            arch = DEFAULT_ARCH if arch is None else arch
            if arch not in ARCHITECTURES:
                raise ValueError(
                    f"FedweighNet: unknown arch {arch!r}; expected one of {tuple(ARCHITECTURES)}"
                )
            cls = ARCHITECTURES[arch]
        return super().__new__(cls)

    def __init__(
        self,
        arch: str | None = None,
        num_classes: int = 14,
        in_channels: int = 1,
        img_size: int = 32,
        norm: str = "batch",
        save_attn: bool = False,
        seed: int | None = None,
        pretrained: str | None = None,
    ) -> None:
        super().__init__()
        if arch is not None and arch != self.arch:
            raise ValueError(f"{type(self).__name__}: arch {arch!r}, but this class builds {self.arch!r}")
        if norm not in NORMS:
            raise ValueError(f"FedweighNet: unknown norm {norm!r}; expected one of {NORMS}")
        if num_classes < 1 or in_channels < 1 or img_size < 1:
            raise ValueError(
                f"FedweighNet: num_classes ({num_classes}), in_channels ({in_channels}) and "
                f"img_size ({img_size}) must be positive"
            )
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.img_size = img_size
        self.norm = norm
        self.save_attn = save_attn
        self.seed = seed
        self.pretrained = pretrained

        checkpoint = None
        if pretrained is not None:
            checkpoint = self._network_weights(read_checkpoint(pretrained))
        self._configure(checkpoint)
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self.net = self._build_net()
        if checkpoint is not None:
            load_network_weights(
                self.net,
                checkpoint,
                head_prefixes=self.head_prefixes,
                fit=self._fit_tensor,
                source=str(pretrained),
                described=f"FedweighNet(arch={self.arch!r}, in_channels={self.in_channels}, "
                f"img_size={self.img_size}, norm={self.norm!r})",
            )

    # ------------------------------------------------------------------ what an architecture defines

    def _configure(self, checkpoint: dict[str, torch.Tensor] | None) -> None:
        """Settle the network's shape (``min_input_size``; a ViT's size) before it is built;
        ``checkpoint`` (network key names) when ``pretrained`` names one."""
        raise NotImplementedError

    def _build_net(self) -> nn.Module:
        """The MONAI network (``self.net``), drawn from the current random state."""
        raise NotImplementedError

    def _input_size(self, h: int, w: int) -> tuple[int, int]:
        """The side the network is given for an input of side (h, w)."""
        raise NotImplementedError

    def _network_key(self, key: str) -> str | None:
        """A checkpoint key (``net.`` prefix and head removed) as the network names it; None: unused."""
        return key

    def _fit_tensor(self, key: str, value: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """``value`` reshaped for ``target`` where that is standard practice, else None (the stem of an
        RGB network is summed over its channels for a grayscale one)."""
        if value.shape == target.shape:
            return value
        if key == self.stem_key:
            return summed_rgb_stem(value, target)
        return None

    # ------------------------------------------------------------------ shared

    def _network_weights(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` with the key names of ``self.net``, without the classification head and without
        tensors the network has no use for (a FedweighNet state dict's ``net.`` prefix is dropped)."""
        out: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            key = key.removeprefix("net.")
            if key.startswith(self.head_prefixes):
                continue
            name = self._network_key(key)
            if name is not None:
                out[name] = value
        return out

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        size = self._input_size(h, w)
        if (h, w) == size:
            return x
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes) for images (B, in_channels, H, W)."""
        return self.net(self._resize(x))
